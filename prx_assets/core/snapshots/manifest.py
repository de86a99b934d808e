"""The snapshot manifest file: what one training snapshot froze, readable without the lab.

``<shards root>/snapshots/<snapshot id>.json`` (format ``prx-training-snapshot`` v1),
written once, atomically (tmp + fsync + rename), never changed; retiring a snapshot adds
``<snapshot id>.retired`` beside it.

Two steps, so that the file a loader reads never exists before the snapshot is committed:
the manifest is first *staged* as ``.<snapshot id>.json.staged`` (atomic, durable), then
the ``training_snapshots`` row is committed (the commit point, what ``snapshot list``,
compliance and retirement read), then the staged file is *published*: renamed to
``<snapshot id>.json``. The loader (``read_snapshot``) reads only the published name and
refuses a staged one with a clear error, so a kill after the file is written but before
the row can never leave a snapshot that trains but that nothing lists, retires or counts
in compliance. A kill after the row leaves a listed snapshot the loader still refuses
(fail closed) until ``snapshot create <id>`` is rerun, which publishes it. Payload::

    {"format": "prx-training-snapshot", "version": 1, "snapshot_id": "run-a",
     "created_at": "2026-12-01T12:00:00+00:00",
     "lab_versions": {"skip_audit": 12, ...},
     "fingerprints": {"policy": [...], "captioner": [...], "classifier": [...], "code": "..."},
     "directories": [{"relative_dir": "mds/512/512x512/src.001",
                      "index_sha256": "...", "generation": "<skiplists.json self-hash>",
                      "shards": [{"shard": ..., "sidecar": ..., "sha256": ...,
                                  "samples": ..., "skipped": ...}, ...],
                      "samples": 40, "kept_samples": 31}, ...],
     "sha256": "<hex of the canonical JSON of every other key>"}

A directory's ``shards`` are its pinned ``skiplists.json`` entries, so the exact manifest
bytes can be rebuilt (``encode_manifest``) and checked against ``generation``. The
``sha256`` self-hash makes an edited manifest detectable (the loader refuses it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prx_assets.core.durable import fsync_path
from prx_assets.core.skiplists.sidecars import (
    ManifestEntry,
    atomic_write_bytes,
    canonical_json,
)
from prx_assets.core.snapshots.pins import check_snapshot_id

SNAPSHOT_FORMAT = "prx-training-snapshot"
SNAPSHOT_VERSION = 1
SNAPSHOTS_DIRNAME = "snapshots"


class SnapshotError(RuntimeError):
    """A snapshot that cannot be made, found or trusted."""


@dataclass(frozen=True)
class PinnedDirectory:
    """One bucket x batch directory as a snapshot froze it."""

    relative_dir: str  # "mds/<tier>/<H>x<W>/<batch>"
    index_sha256: str
    generation: str
    shards: tuple[ManifestEntry, ...]
    samples: int
    kept_samples: int

    @property
    def partition(self) -> str:
        """``<tier>/<H>x<W>/<batch>``: the relpath discovery uses."""
        return self.relative_dir.split("/", 1)[1]

    def as_dict(self) -> dict[str, Any]:
        return {
            "relative_dir": self.relative_dir,
            "index_sha256": self.index_sha256,
            "generation": self.generation,
            "shards": [
                {
                    "shard": e.shard,
                    "sidecar": e.sidecar,
                    "sha256": e.sha256,
                    "samples": e.samples,
                    "skipped": e.skipped,
                }
                for e in self.shards
            ],
            "samples": self.samples,
            "kept_samples": self.kept_samples,
        }


@dataclass(frozen=True)
class SnapshotManifest:
    """A parsed, self-consistent snapshot manifest."""

    snapshot_id: str
    created_at: str
    lab_versions: dict[str, int]
    fingerprints: dict[str, Any]
    directories: tuple[PinnedDirectory, ...]
    sha256: str

    @property
    def samples(self) -> int:
        return sum(d.samples for d in self.directories)

    @property
    def kept_samples(self) -> int:
        return sum(d.kept_samples for d in self.directories)


def snapshots_dir(shards_root: str | os.PathLike[str]) -> Path:
    return Path(shards_root) / SNAPSHOTS_DIRNAME


def manifest_path(shards_root: str | os.PathLike[str], snapshot_id: str) -> Path:
    return snapshots_dir(shards_root) / f"{check_snapshot_id(snapshot_id)}.json"


def staged_path(shards_root: str | os.PathLike[str], snapshot_id: str) -> Path:
    """Where the manifest waits, written but not committed (hidden: never a snapshot id)."""
    return snapshots_dir(shards_root) / f".{check_snapshot_id(snapshot_id)}.json.staged"


def retired_marker(shards_root: str | os.PathLike[str], snapshot_id: str) -> Path:
    return snapshots_dir(shards_root) / f"{check_snapshot_id(snapshot_id)}.retired"


def encode_snapshot(
    snapshot_id: str,
    created_at: str,
    lab_versions: dict[str, int],
    fingerprints: dict[str, Any],
    directories: list[PinnedDirectory],
) -> bytes:
    payload = {
        "format": SNAPSHOT_FORMAT,
        "version": SNAPSHOT_VERSION,
        "snapshot_id": check_snapshot_id(snapshot_id),
        "created_at": created_at,
        "lab_versions": {k: int(v) for k, v in sorted(lab_versions.items())},
        "fingerprints": fingerprints,
        "directories": [d.as_dict() for d in directories],
    }
    payload["sha256"] = hashlib.sha256(canonical_json(payload)).hexdigest()
    return canonical_json(payload) + b"\n"


def parse_snapshot(data: bytes, source: str) -> SnapshotManifest:
    """Validate manifest bytes (format, version, self-hash, entry shapes)."""
    try:
        obj = json.loads(data)
        if obj.get("format") != SNAPSHOT_FORMAT or obj.get("version") != SNAPSHOT_VERSION:
            raise SnapshotError(f"{source}: not a {SNAPSHOT_FORMAT} v{SNAPSHOT_VERSION} manifest")
        claimed = obj["sha256"]
        actual = hashlib.sha256(
            canonical_json({k: v for k, v in obj.items() if k != "sha256"})
        ).hexdigest()
        if claimed != actual:
            raise SnapshotError(
                f"{source}: content hash mismatch: the snapshot manifest was edited or damaged"
            )
        dirs = tuple(
            PinnedDirectory(
                relative_dir=str(d["relative_dir"]),
                index_sha256=str(d["index_sha256"]),
                generation=str(d["generation"]),
                shards=tuple(
                    ManifestEntry(
                        str(e["shard"]),
                        str(e["sidecar"]),
                        str(e["sha256"]),
                        None if e.get("samples") is None else int(e["samples"]),
                        None if e.get("skipped") is None else int(e["skipped"]),
                    )
                    for e in d["shards"]
                ),
                samples=int(d["samples"]),
                kept_samples=int(d["kept_samples"]),
            )
            for d in obj["directories"]
        )
        for d in dirs:
            parts = d.relative_dir.split("/")
            if len(parts) != 4 or parts[0] != "mds" or any(p in ("", ".", "..") for p in parts):
                raise SnapshotError(f"{source}: directory {d.relative_dir[:200]!r} is not mds/…")
        return SnapshotManifest(
            snapshot_id=check_snapshot_id(obj["snapshot_id"]),
            created_at=str(obj["created_at"]),
            lab_versions={str(k): int(v) for k, v in obj["lab_versions"].items()},
            fingerprints=dict(obj["fingerprints"]),
            directories=dirs,
            sha256=actual,
        )
    except SnapshotError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"{source}: malformed snapshot manifest ({exc})") from None


def read_snapshot(
    shards_root: str | os.PathLike[str], snapshot_id: str, *, uncommitted: bool = False
) -> SnapshotManifest:
    """The published manifest of ``snapshot_id``, verified; ``SnapshotError`` when absent or
    bad, and when only its staged copy exists (a ``snapshot create`` interrupted before it
    committed: no reader may train on it). ``uncommitted=True`` falls back to the staged
    copy (the runner completing or retiring an interrupted snapshot; never the loader)."""
    path = manifest_path(shards_root, snapshot_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        staged = staged_path(shards_root, snapshot_id)
        if not staged.is_file():
            raise SnapshotError(
                f"no training snapshot {snapshot_id!r} ({path} is absent)"
            ) from None
        if not uncommitted:
            raise SnapshotError(
                f"snapshot {snapshot_id!r} was never committed (only its staged manifest "
                f"{staged.name} exists: a `snapshot create {snapshot_id}` was interrupted); "
                f"rerun `snapshot create {snapshot_id}` to finish it before training on it"
            ) from None
        path, data = staged, staged.read_bytes()
    manifest = parse_snapshot(data, str(path))
    if manifest.snapshot_id != snapshot_id:
        raise SnapshotError(f"{path} holds snapshot {manifest.snapshot_id!r}")
    return manifest


def stage_snapshot_file(shards_root: str | os.PathLike[str], snapshot_id: str, data: bytes) -> Path:
    """Write the manifest under its staged name (atomic, durable), before the lab row.

    A published manifest with other content is never replaced (snapshots are immutable)."""
    path = manifest_path(shards_root, snapshot_id)
    if path.exists() and path.read_bytes() != data:
        raise SnapshotError(f"{path} exists with other content: snapshots are immutable")
    staged = staged_path(shards_root, snapshot_id)
    staged.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(staged, data)
    return staged


def publish_snapshot_file(shards_root: str | os.PathLike[str], snapshot_id: str) -> Path:
    """Rename the staged manifest to its published name (after the lab row is committed).

    Idempotent: a manifest already published with the same bytes just loses its staged copy.
    """
    path = manifest_path(shards_root, snapshot_id)
    staged = staged_path(shards_root, snapshot_id)
    if path.exists():
        if staged.exists():
            if staged.read_bytes() != path.read_bytes():
                raise SnapshotError(f"{path} exists with other content: snapshots are immutable")
            staged.unlink()
        return path
    os.rename(staged, path)
    fsync_path(path.parent)
    return path


def is_retired(shards_root: str | os.PathLike[str], snapshot_id: str) -> bool:
    return retired_marker(shards_root, snapshot_id).exists()


def mark_retired(shards_root: str | os.PathLike[str], snapshot_id: str, when: str) -> None:
    atomic_write_bytes(
        retired_marker(shards_root, snapshot_id), canonical_json({"retired_at": when})
    )


def list_snapshot_ids(shards_root: str | os.PathLike[str]) -> list[str]:
    d = snapshots_dir(shards_root)
    if not d.is_dir():
        return []
    return sorted(
        p.name[:-5] for p in d.iterdir() if p.name.endswith(".json") and not p.name.startswith(".")
    )
