"""The live skip-list generation of a directory, as the loader reads it: local or ``s3://``.

Why this exists: ``skip_audit`` records what a ``skip_lists`` run decided, but training obeys
the generation a directory's manifest names, and the two are committed one after the other
(the generations flip first, the audit rows follow; a kill in between leaves them apart).
Anything that tells a person whether a sample trains (the audit, the browser's audit panel,
compliance) reads the verdict from here, the same verified files the loader reads, and uses
``skip_audit`` only for what the files do not hold (times, lists, keepers).

``LiveGenerations`` reads each directory once per instance (an audit or a report looks at a
few directories many times). A directory whose generation cannot be read or verified is an
``Unreadable`` entry with the reason, never "nothing skipped": the loader refuses such a
directory, so no sample of it trains.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prx_assets.core.shards.mds import list_partition_dirs
from prx_assets.core.shards.remote import RemoteShardTree, mirror_generation, read_live
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    Generation,
    SkipListError,
    load_generation,
)
from prx_assets.core.storage import StorageError, is_remote, open_store


@dataclass(frozen=True)
class Unreadable:
    """A directory the loader would refuse, and why."""

    relative_dir: str
    reason: str


@dataclass(frozen=True)
class SlotDecision:
    """What the live generation says of one sample slot."""

    skipped: bool
    reasons: tuple[str, ...]  # the sidecar's reason codes (empty when kept)
    generation: str  # the directory's live generation id (manifest self-hash)


class LiveGenerations:
    """Verified live generations of a shard tree, read on demand and cached per directory."""

    def __init__(self, shards_root: str) -> None:
        self.shards_root = str(shards_root)
        self._cache: dict[str, Generation | Unreadable] = {}
        self._trees: dict[str, dict[str, str] | Unreadable] = {}

    def batch_tree(self, batch: str) -> dict[str, str] | Unreadable:
        """relative_dir -> sha256 of its index, for every live directory of ``batch``: what
        the loader would find, to compare with what ``shard_samples`` recorded."""
        if batch not in self._trees:
            try:
                if is_remote(self.shards_root):
                    with RemoteShardTree(self.shards_root, batch) as tree:
                        found = {d.relative_dir: d.index_sha256 for d in tree.live_dirs()}
                else:
                    found = {
                        d.relative_dir: hashlib.sha256(
                            (d.path / INDEX_BASENAME).read_bytes()
                        ).hexdigest()
                        for d in list_partition_dirs(self.shards_root, batch)
                    }
                self._trees[batch] = found
            except (StorageError, OSError, ValueError) as exc:
                self._trees[batch] = Unreadable(batch, f"{type(exc).__name__}: {exc}")
        return self._trees[batch]

    def generation(self, relative_dir: str) -> Generation | Unreadable:
        if relative_dir not in self._cache:
            self._cache[relative_dir] = self._load(relative_dir)
        return self._cache[relative_dir]

    def slot(self, relative_dir: str, shard: str, index: int) -> SlotDecision | Unreadable:
        """The live decision about sample ``index`` of ``shard`` in ``relative_dir``."""
        gen = self.generation(relative_dir)
        if isinstance(gen, Unreadable):
            return gen
        skiplist = gen.skiplists.get(shard)
        if skiplist is None:
            return Unreadable(relative_dir, f"its live generation has no shard {shard}")
        reasons = skiplist.as_mapping().get(int(index))
        return SlotDecision(reasons is not None, tuple(reasons or ()), gen.generation)

    def _load(self, relative_dir: str) -> Generation | Unreadable:
        if ".." in Path(relative_dir).parts or relative_dir.startswith("/"):
            return Unreadable(relative_dir, "not a relative directory of the shard tree")
        try:
            if not is_remote(self.shards_root):
                path = Path(self.shards_root) / relative_dir
                if not path.is_dir():
                    return Unreadable(relative_dir, f"{path} does not exist")
                return load_generation(path)
            store = open_store(self.shards_root)
            live = read_live(store, relative_dir)
            if live is None:
                return Unreadable(relative_dir, "no live version on the object store")
            with tempfile.TemporaryDirectory(prefix="prx-live-") as tmp:
                return load_generation(mirror_generation(live, store, tmp))
        except (SkipListError, StorageError, OSError) as exc:
            return Unreadable(relative_dir, f"{type(exc).__name__}: {exc}")

    def apart(self, batch: str, recorded: dict[str, str | None]) -> str | None:
        """Why the live directories of ``batch`` are not those ``recorded`` (relative_dir ->
        the ``dir_digest`` ``shard_samples`` holds), None when they are. Between an
        ``mds_shards`` rename and its ``shard_samples`` commit (a kill, or a run in progress)
        the lab places other samples than the loader reads: no answer from the lab is true
        then, so callers say "undecided" instead of in or out."""
        tree = self.batch_tree(batch)
        if isinstance(tree, Unreadable):
            return f"its directories cannot be listed: {tree.reason}"
        if set(tree) != set(recorded):
            only = sorted(set(tree) ^ set(recorded))
            return f"{len(only)} directory(ies) on one side only, e.g. {only[0]}"
        changed = sorted(r for r, d in recorded.items() if d and d != tree[r])
        return f"{changed[0]} was rewritten since" if changed else None
