"""Train on a pinned training snapshot: exactly the directories and skip-lists it froze.

``discover_streams(root, snapshot="run-a")`` reads ``<root>/snapshots/run-a.json``
(core/snapshots/manifest.py) instead of listing ``<root>/mds``: directories added since are
not read, and every pinned directory must still be exactly what the snapshot froze, its
``index.json`` (sha256) and its live skip-list generation (the manifest's self-hash, whose
sidecars the dataset verifies byte for byte). Anything else stops the loader with
``SnapshotChanged`` naming what changed (a new skip-list generation after an opt-out, a
rewritten directory after a captioner swap, a deleted directory): training on a frozen set
that the platform has since corrected would silently bring excluded images back.

``pinned_changes="reproduce-UNSAFE"`` is the explicit way to rerun the frozen set anyway (to
reproduce run A): the pinned generation is rebuilt from the snapshot and read from the
sidecars the pins kept, a rewritten directory from its retained copy, and a
``SnapshotChangedWarning`` names every changed directory on every construction. Files that
are gone or differ from their digests stop it even then. A retired snapshot is refused, and
so is one whose manifest is only staged (its ``snapshot create`` was killed before it
published the manifest: core/snapshots/manifest.py), pointing at the rerun.

The snapshot id travels in ``state_dict`` (``ShapeBatchedLoader`` and ``SkipListDataset``);
resuming under another snapshot, or none, raises ``SnapshotChanged``.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prx_assets.core.skiplists.sidecars import (
    MANIFEST_BASENAME,
    PartitionCounts,
    SkipList,
    check_manifest_matches_index,
    current_generation,
    encode_manifest,
    parse_manifest,
    verify_sidecar,
)
from prx_assets.core.snapshots.manifest import (
    PinnedDirectory,
    SnapshotError,
    is_retired,
    read_snapshot,
)
from prx_assets.core.snapshots.pins import retained_dir
from prx_assets.loader.dataset import (
    REQUIRE_SKIPLISTS,
    SkipListStream,
    SnapshotChanged,
    check_resume_snapshot,
    snapshot_of,
)
from prx_assets.loader.streams import (
    BucketStream,
    PartitionFilter,
    natural_order,
    parse_shape,
    repeat_for,
)

__all__ = ["SnapshotChanged", "check_resume_snapshot", "snapshot_of", "snapshot_streams"]

REFUSE_CHANGES = "refuse"
REPRODUCE_UNSAFE = "reproduce-UNSAFE"
MAX_NAMED = 20


class SnapshotChangedWarning(UserWarning):
    """Reading a snapshot whose pinned files changed, on purpose (``reproduce-UNSAFE``)."""


@dataclass(frozen=True)
class PinnedBucketStream(BucketStream):
    """A ``BucketStream`` of one directory of a snapshot, read exactly as pinned."""

    snapshot: str | None = None
    pinned: PinnedDirectory | None = None
    reproduce: bool = False

    def to_stream(self, skiplists: str = REQUIRE_SKIPLISTS) -> SkipListStream:
        if skiplists != REQUIRE_SKIPLISTS:
            raise ValueError("a snapshot is read with its skip-lists; skiplists must be 'require'")
        assert self.pinned is not None and self.snapshot is not None
        return PinnedSkipListStream(
            local=self.local,
            repeat=self.repeat,
            pinned=self.pinned,
            snapshot_id=self.snapshot,
            reproduce=self.reproduce,
        )


class PinnedSkipListStream(SkipListStream):
    """A ``SkipListStream`` that reads only its pinned ``index.json`` and generation."""

    def __init__(
        self,
        *,
        pinned: PinnedDirectory,
        snapshot_id: str,
        reproduce: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pinned = pinned
        self.snapshot_id = snapshot_id
        self.reproduce = reproduce

    @classmethod
    def from_stream(cls, stream: Any, skiplists: str = REQUIRE_SKIPLISTS) -> SkipListStream:
        if not isinstance(stream, PinnedSkipListStream):
            return SkipListStream.from_stream(stream, skiplists)
        return cls(
            local=stream.local,
            repeat=stream._repeat,
            pinned=stream.pinned,
            snapshot_id=stream.snapshot_id,
            reproduce=stream.reproduce,
        )

    def _load_skiplists(self, readers: list[Any], index_raw: bytes) -> tuple[str, list[SkipList]]:
        where = f"{self.local_dir} (snapshot {self.snapshot_id!r})"
        if hashlib.sha256(index_raw).hexdigest() != self.pinned.index_sha256:
            raise SnapshotChanged(f"{where}: index.json differs from the pinned one")
        if not self.reproduce:
            generation, out = super()._load_skiplists(readers, index_raw)
            if generation != self.pinned.generation:
                raise SnapshotChanged(
                    f"{where}: skip-list generation {generation[:12]}… is live, the snapshot "
                    f"pinned {self.pinned.generation[:12]}…"
                )
            return generation, out
        data = encode_manifest(self.pinned.index_sha256, list(self.pinned.shards))
        source = f"{where}: pinned {MANIFEST_BASENAME}"
        manifest = parse_manifest(data, source)
        if manifest.generation != self.pinned.generation:
            raise SnapshotError(f"{source} does not rebuild to its recorded generation")
        check_manifest_matches_index(manifest, index_raw, source)
        out = []
        for entry, reader in zip(manifest.entries, readers, strict=True):
            sidecar, path = self._fetch(entry.sidecar)
            if sidecar is None:
                raise SnapshotError(f"{path}: a pinned sidecar is gone; cannot reproduce")
            out.append(verify_sidecar(entry, sidecar, path, reader.samples))
        return manifest.generation, out


def _directory_change(root: Path, d: PinnedDirectory) -> str | None:
    """What differs between the live directory and the pinned one (None: nothing)."""
    live = root / d.relative_dir
    try:
        index_sha = hashlib.sha256((live / "index.json").read_bytes()).hexdigest()
    except FileNotFoundError:
        return "directory removed"
    if index_sha != d.index_sha256:
        return "directory rewritten (index.json changed)"
    try:
        generation = current_generation(live)
    except ValueError as exc:
        return f"skip-list manifest unreadable ({str(exc)[:160]})"
    if generation != d.generation:
        return "new skip-list generation (sidecars changed)"
    return None


def snapshot_streams(
    root: str | os.PathLike[str],
    snapshot: str,
    tiers: Collection[str | int] | None = None,
    shapes: Collection[str | tuple[int, int]] | None = None,
    batches: Collection[str] | None = None,
    weights: Mapping[str, float] | None = None,
    *,
    pinned_changes: str = REFUSE_CHANGES,
) -> list[PinnedBucketStream]:
    """The streams of snapshot ``snapshot`` under local shards root ``root`` (see module doc);
    filters and ``weights`` as for ``discover_streams``; sorted by tier, shape, batch."""
    if pinned_changes not in (REFUSE_CHANGES, REPRODUCE_UNSAFE):
        raise ValueError(
            f"pinned_changes={pinned_changes!r}: use {REFUSE_CHANGES!r} (default) or "
            f"{REPRODUCE_UNSAFE!r} to read a changed snapshot on purpose"
        )
    base = Path(os.fspath(root))
    manifest = read_snapshot(base, snapshot)
    if is_retired(base, snapshot):
        raise SnapshotError(f"snapshot {snapshot!r} is retired: its files may be gone")
    wanted = PartitionFilter.of(tiers, shapes, batches)
    chosen = [d for d in manifest.directories if wanted.selects(*d.partition.split("/"))]
    if not chosen:
        raise ValueError(f"no directory of snapshot {snapshot!r} matches the filters")
    changes = {d.relative_dir: c for d in chosen if (c := _directory_change(base, d)) is not None}
    if changes and pinned_changes != REPRODUCE_UNSAFE:
        named = "; ".join(f"{rel}: {why}" for rel, why in list(changes.items())[:MAX_NAMED])
        raise SnapshotChanged(
            f"{len(changes)} of {len(chosen)} directories of snapshot {snapshot!r} changed since "
            f"it was made ({named}{'; …' if len(changes) > MAX_NAMED else ''}): make a new "
            f"snapshot, or pass pinned_changes={REPRODUCE_UNSAFE!r} to read the frozen set anyway"
        )
    if changes:
        warnings.warn(
            f"snapshot {snapshot!r}: reading {len(changes)} changed directories as they were "
            f"pinned (pinned_changes={REPRODUCE_UNSAFE!r}); the live skip-lists may exclude "
            f"samples this reads (opt-outs included): {sorted(changes)[:MAX_NAMED]}",
            SnapshotChangedWarning,
            stacklevel=3,
        )
    out = []
    for d in chosen:
        tier, shape_name, batch = d.partition.split("/")
        local = base / d.relative_dir
        if changes.get(d.relative_dir, "").startswith("directory "):
            local = retained_dir(base, d.relative_dir, d.index_sha256)
            if not (local / "index.json").is_file():
                raise SnapshotError(f"{d.relative_dir}: changed and no retained copy at {local}")
        h, w = parse_shape(shape_name)
        out.append(
            PinnedBucketStream(
                relpath=d.partition,
                tier=tier,
                height=h,
                width=w,
                batch=batch,
                local=str(local),
                repeat=repeat_for(d.partition, weights),
                counts=PartitionCounts(d.samples, d.kept_samples, len(d.shards), len(d.shards)),
                snapshot=snapshot,
                pinned=d,
                reproduce=d.relative_dir in changes,
            )
        )
    empty = [b for b in out if b.counts is not None and b.counts.kept_samples == 0]
    for b in empty:
        warnings.warn(f"{b.local}: all samples are skipped; partition left out", stacklevel=3)
    out = [b for b in out if b not in empty]
    out.sort(key=lambda b: (natural_order(b.tier), b.height, b.width, natural_order(b.batch)))
    return out
