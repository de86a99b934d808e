"""Keeping a lab table cheap as it grows: delta index segments merged in size tiers,
compaction of one tier at a time, version retention by count and age, pinned versions,
orphaned files.

Why in the write path: every commit adds a fragment and a manifest. Left alone, indexes
cover only the fragments they were built on (every other fragment is scanned), the
manifest lists every fragment (each open and commit reads it) and ``_versions`` keeps every
manifest, so each operation costs O(batches) and building a table is quadratic. After each
commit the writer therefore keeps the unindexed fragments few (a run of them is compacted
and gets a small delta segment in each scalar index) and, like an LSM tree, merges the
newest segments once a size tier holds ``fan_in`` of them, compacting the fragments they
cover: each step costs that tier's rows, never the table's, so each row is rewritten
O(log rows) times and the segment and fragment counts stay O(fan_in × tiers). Then it
drops versions past the count/age policy. Versions pinned by a holder (a training snapshot)
are Lance tags and are never removed, nor the files they use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import lance
import pyarrow as pa
import pyarrow.fs as pafs
from lance.optimize import Compaction, CompactionOptions, CompactionTask, RewriteResult

from prx_assets.core.lab.io import arrow_filesystem, open_dataset
from prx_assets.core.lab.spec import TableSpec

TARGET_ROWS_PER_FRAGMENT = 1_048_576
# Files no version references are deleted once this old: longer than any write takes from
# its first fragment to its commit, so an in-flight write's files are never touched.
ORPHAN_MIN_AGE = timedelta(hours=24)
ORPHAN_SCAN_LIMIT = 100_000  # candidates listed per table and run; the next run continues
PIN_TAG_PREFIX = "pin-"
T = TypeVar("T")

# Runs a picklable module-level function over items elsewhere (a worker pool: other
# processes, Ray nodes) and returns one result per item, in order; an item that failed comes
# back as something that is not the function's result (the pools' ``ItemFailed``).
TaskMap = Callable[[Callable[[Any], Any], list[Any]], list[Any]]

VERSION_PINS = TableSpec(
    name="version_pins",
    schema=pa.schema(
        [
            pa.field("holder", pa.string(), nullable=False),  # who needs the versions kept
            pa.field("table", pa.string(), nullable=False),
            pa.field("version", pa.int64(), nullable=False),
            pa.field("tag", pa.string(), nullable=False),  # the Lance tag that keeps it
            pa.field("pinned_at", pa.timestamp("us", tz="UTC"), nullable=False),
        ]
    ),
    identity=("holder", "table"),
)
"""Versions a holder needs kept (``Lab.pin_versions``): cleanup never removes them."""


@dataclass(frozen=True)
class MaintenancePolicy:
    """When the write path maintains a table, and what retention keeps.

    New fragments stay unindexed (a read scans them flat: ~0.07 ms each per look-up, so
    the lag is small) until more than ``index_lag_fragments`` fragments or
    ``index_lag_rows`` rows are; then they are compacted into one fragment and given one
    small *delta* segment in every scalar index (a "run"). Why deltas: Lance 14's ordinary
    index update merges the whole index, and a compaction remaps every segment covering a
    fragment it rewrites, so both grew with the table (measured: ~0.85 s each at 100k rows
    for six indexes, against ~40 ms and ~20 ms for a delta and its remap). Runs are merged
    LSM-style: once ``fan_in`` segments of one size tier exist (tier ``t``:
    ``base_rows·fan_in^t`` up to ``base_rows·fan_in^(t+1)`` rows; tier 0 from 0), the
    newest segments down to that tier's oldest are merged into one and their fragments
    compacted into one, which remaps only that segment. Each row is thus rewritten
    O(log rows) times, and each index keeps at most ``fan_in - 1`` segments per tier (a
    query probes every segment: ~0.04 ms each with the process's cached session).
    Segments of ``max_segment_rows`` or more are not merged further by the write path
    (``Lab.maintain`` merges everything); fragments of ``target_rows_per_fragment`` or more
    are not rewritten unless a quarter of their rows are deleted.
    Versions beyond the newest ``keep_versions`` are removed once older than
    ``version_min_age`` (a reader that opened one earlier than that may still be reading
    it; hold longer ones with ``Lab.pin_versions``; ``retention``, when smaller, shortens
    that age); the current and pinned versions never. On a local lab the versions a live
    view holds are kept too (``readers``), so the age there is ``reader_min_age``, long
    enough for a one-shot read (open, then read at once). Every ``cleanup_every`` versions
    the write path applies retention when it would remove at least as many versions as it
    keeps (a cleanup reads every kept manifest, so that bounds its cost per version
    removed).
    """

    enabled: bool = True
    index_lag_fragments: int = 4
    index_lag_rows: int = 1_000_000
    fan_in: int = 4
    base_rows: int = 64
    max_segment_rows: int = 16 * TARGET_ROWS_PER_FRAGMENT
    target_rows_per_fragment: int = TARGET_ROWS_PER_FRAGMENT
    materialize_deleted_share: float = 0.25
    keep_versions: int = 100
    version_min_age: timedelta = timedelta(minutes=15)
    reader_min_age: timedelta = timedelta(seconds=30)
    retention: timedelta = timedelta(days=7)
    cleanup_every: int = 64
    compaction_batch_size: int = 1024  # rows per compaction read: bounds its memory


DEFAULT_POLICY = MaintenancePolicy()
MANUAL = MaintenancePolicy(enabled=False)


def _tier(rows: int, policy: MaintenancePolicy) -> int:
    if rows < policy.base_rows * policy.fan_in:
        return 0
    return int(math.log(rows / policy.base_rows, policy.fan_in))


def index_segments(ds: lance.LanceDataset, spec: TableSpec) -> dict[str, list[frozenset[int]]]:
    """The fragment ids each segment of the spec's scalar indexes covers, by index name, in
    manifest order (oldest first: ``optimize_indices(num_indices_to_merge=k)`` merges the
    last ``k``). Reads the manifest only."""
    wanted = {c for c, _ in spec.indexes}
    out: dict[str, list[frozenset[int]]] = {}
    for ix in ds.list_indices():
        if len(ix["fields"]) == 1 and ix["fields"][0] in wanted:
            out.setdefault(ix["name"], []).append(frozenset(ix.get("fragment_ids") or ()))
    return out


def unindexed_fragments(ds: lance.LanceDataset, spec: TableSpec) -> dict[int, int]:
    """Fragments (id -> physical rows) that some index of the spec does not cover."""
    segments = index_segments(ds, spec)
    rows = {f.fragment_id: f.metadata.physical_rows or 0 for f in ds.get_fragments()}
    if not segments:
        return {}
    covered = set(rows)
    for segs in segments.values():
        covered &= frozenset().union(*segs)
    return {f: n for f, n in rows.items() if f not in covered}


def _fold_plan(
    ds: lance.LanceDataset, spec: TableSpec, policy: MaintenancePolicy
) -> tuple[list[str], list[int]] | None:
    """The stale indexes and the uncovered small fragments to compact, once more than the
    lag is unindexed; None below it."""
    segments = index_segments(ds, spec)
    if not segments:
        return None
    rows = {f.fragment_id: f.metadata.physical_rows or 0 for f in ds.get_fragments()}
    cover = {name: frozenset().union(*segs) for name, segs in segments.items()}
    stale = sorted(name for name, c in cover.items() if set(rows) - c)
    uncovered = {f: n for f, n in rows.items() if any(f not in c for c in cover.values())}
    if not stale or (
        len(uncovered) <= policy.index_lag_fragments
        and sum(uncovered.values()) <= policy.index_lag_rows
    ):
        return None
    covered_by_any = frozenset().union(*cover.values())
    small = [
        f
        for f, n in uncovered.items()
        if f not in covered_by_any and n < policy.target_rows_per_fragment
    ]
    if len(small) < 2 or sum(rows[f] for f in small) >= policy.target_rows_per_fragment:
        small = []
    return stale, small


def fold_due(ds: lance.LanceDataset, spec: TableSpec, policy: MaintenancePolicy) -> bool:
    """Whether ``fold_new_fragments`` would act on ``ds`` (reads the manifest only)."""
    return _fold_plan(ds, spec, policy) is not None


def fold_new_fragments(
    ds: lance.LanceDataset,
    spec: TableSpec,
    policy: MaintenancePolicy,
    rewrite: TaskMap | None = None,
) -> dict[str, int]:
    """Once more than ``policy.index_lag_fragments`` fragments (or ``index_lag_rows`` rows)
    are not covered by the spec's scalar indexes: compact the uncovered small ones into one
    fragment (no index covers them, so nothing is remapped), then add one delta segment per
    stale index over it (``num_indices_to_merge=0``: the new rows only, not a merge). Below
    the bound a read scans those few fragments flat. ``rewrite``: where the compaction's
    rewriting runs (``compact``). Returns what was done (empty: nothing).
    """
    plan = _fold_plan(ds, spec, policy)
    if plan is None:
        return {}
    stale, small = plan
    done = {"fragments_compacted": 0, "indexes_refreshed": len(stale)}
    if small:
        done["fragments_compacted"] = compact(ds, small, policy, rewrite).fragments_removed
    ds.optimize.optimize_indices(index_names=stale, num_indices_to_merge=0)
    return done


def _due_merge(segs: list[frozenset[int]], rows: dict[int, int], policy: MaintenancePolicy) -> int:
    """How many of the newest segments to merge so that the lowest tier holding ``fan_in``
    segments becomes one segment (0: none due)."""
    sizes = [sum(rows.get(f, 0) for f in s) for s in segs]
    tiers: dict[int, list[int]] = {}
    for position, size in enumerate(sizes):
        if size < policy.max_segment_rows:
            tiers.setdefault(_tier(size, policy), []).append(position)
    for _, positions in sorted(tiers.items()):
        if len(positions) >= policy.fan_in:
            k = len(segs) - positions[0]
            # Never fold a segment the write path no longer merges into a new one.
            if all(sizes[p] < policy.max_segment_rows for p in range(positions[0], len(segs))):
                return k
    return 0


def merge_due_tier(
    ds: lance.LanceDataset,
    spec: TableSpec,
    policy: MaintenancePolicy,
    rewrite: TaskMap | None = None,
) -> dict[str, int]:
    """Merge the lowest index tier holding ``fan_in`` segments (the newest segments down to
    its oldest, into one per index), then compact the small fragments that merged segment
    covers into one: Lance compacts only fragments of equal index coverage, and remaps only
    the segment covering them, so the cost is that tier's rows, never the table's.
    ``rewrite``: where that compaction's rewriting runs (``compact``). Returns what was done
    (empty: nothing due)."""
    segments = index_segments(ds, spec)
    rows = {f.fragment_id: f.metadata.physical_rows or 0 for f in ds.get_fragments()}
    plan: dict[int, list[str]] = {}
    for name, segs in segments.items():
        if (k := _due_merge(segs, rows, policy)) >= 2:
            plan.setdefault(k, []).append(name)
    if not plan:
        return {}
    done = {"segments_merged": 0, "fragments_compacted": 0}
    for k, names in sorted(plan.items()):
        ds.optimize.optimize_indices(index_names=sorted(names), num_indices_to_merge=k)
        done["segments_merged"] += k * len(names)
    # The fragments every index now covers with its newest segment, and nothing else.
    newest = [segs[-1] for segs in index_segments(ds, spec).values() if segs]
    group = frozenset.intersection(*newest) if newest else frozenset()
    rows = {f.fragment_id: f.metadata.physical_rows or 0 for f in ds.get_fragments()}
    small = [f for f in sorted(group) if f in rows and rows[f] < policy.target_rows_per_fragment]
    if len(small) >= 2:
        done["fragments_compacted"] = compact(ds, small, policy, rewrite).fragments_removed
    return done


def heavy_fragments(ds: lance.LanceDataset, policy: MaintenancePolicy) -> list[int]:
    """Fragments with a ``materialize_deleted_share`` of their rows deleted (rewritten alone:
    the deleted rows stop costing reads). Reads the manifest only."""
    heavy = []
    for fragment in ds.get_fragments():
        meta = fragment.metadata
        rows = meta.physical_rows or 0
        deleted = meta.deletion_file.num_deleted_rows if meta.deletion_file else 0
        if rows and deleted / rows >= policy.materialize_deleted_share:
            heavy.append(meta.id)
    return heavy


def is_conflict(exc: BaseException) -> bool:
    """A lost race with a concurrent commit (retryable), as Lance reports it."""
    message = str(exc).lower()
    return any(w in message for w in ("conflict", "retryable", "preempted", "concurrent"))


def retry_conflicts(action: Callable[[], T], deferred: list[str], attempts: int = 6) -> T | None:
    """Run a maintenance step, redoing it when a concurrent commit won the race; after
    ``attempts`` lost races the step is recorded in ``deferred`` and skipped (the partition
    commits are what matter; the next run catches up). Other errors are raised."""
    for attempt in range(attempts):
        try:
            return action()
        except (OSError, RuntimeError, ValueError) as exc:
            if not is_conflict(exc):
                raise
            if attempt == attempts - 1:
                deferred.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            else:
                time.sleep(0.05 * (2**attempt))
    return None


def optimize_all_indices(uri: str) -> None:
    """Fold every unindexed fragment into every index of the table (scalar, FTS, vector),
    merging all of an index's segments into one: then every fragment has the same index
    coverage, which is what lets one compaction merge them all (``Lab.maintain``)."""
    ds = open_dataset(uri)
    segments: dict[str, int] = {}
    for ix in ds.list_indices():
        segments[ix["name"]] = segments.get(ix["name"], 0) + 1
    by_count: dict[int, list[str]] = {}
    for name, count in segments.items():
        by_count.setdefault(count, []).append(name)
    for count, names in sorted(by_count.items()):
        ds.optimize.optimize_indices(index_names=sorted(names), num_indices_to_merge=count)


@contextlib.contextmanager
def maintenance_lock(root: str, table: str, *, wait: bool = False) -> Iterator[bool]:
    """One maintainer per local table at a time; yields False when another holds it and
    ``wait`` is off (object stores: True, Lance's commit conflicts arbitrate)."""
    if "://" in root:
        yield True
        return
    lock_dir = Path(root) / ".locks"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / f"{table}.maintain.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@dataclass(frozen=True)
class CompactionJob:
    """One of a compaction plan's rewrite tasks, for a worker: the table (URI and the
    version the plan read) and the task. The worker opens the table itself (with the
    storage options its own environment gives) and returns the ``RewriteResult``: the rows
    it rewrites never pass through the committing process."""

    uri: str
    version: int
    task: CompactionTask


def rewrite_fragments(job: CompactionJob) -> RewriteResult:
    """Run one compaction task where it is called (a pool's worker)."""
    return job.task.execute(open_dataset(job.uri, job.version))


@dataclass(frozen=True)
class _NoCompaction:
    """A plan with no task: what ``compact_files`` reports when it does nothing."""

    fragments_removed: int = 0
    fragments_added: int = 0
    files_removed: int = 0
    files_added: int = 0


def compact(
    ds: lance.LanceDataset,
    candidates: list[int],
    policy: MaintenancePolicy,
    rewrite: TaskMap | None = None,
) -> Any:
    """Compact exactly ``candidates`` (everything else excluded), streaming in bounded
    batches; Lance remaps the indexes onto the new fragments.

    ``rewrite``: where the rewriting runs. None: here (``compact_files``). Given: Lance's
    distributed compaction (plan here, each task on ``rewrite``'s workers, one commit here),
    so a big batch's rows (an ``images`` row carries its thumbnail and preview) are read and
    written by the workers, not by the step (``benchmarks/bench_scaleout.py``). A task whose
    worker failed is left out of the commit (Lance commits any subset of a plan's tasks):
    its fragments stay as they were, for a later compaction.
    """
    excluded = [f.fragment_id for f in ds.get_fragments() if f.fragment_id not in set(candidates)]
    options = CompactionOptions(
        target_rows_per_fragment=policy.target_rows_per_fragment,
        materialize_deletions_threshold=policy.materialize_deleted_share,
        excluded_fragment_ids=excluded,
        batch_size=policy.compaction_batch_size,
        num_threads=1,
    )
    if rewrite is None:
        return ds.optimize.compact_files(**options)
    plan = Compaction.plan(ds, options)
    if plan.num_tasks() == 0:
        return _NoCompaction()
    jobs = [CompactionJob(ds.uri, plan.read_version, task) for task in plan.tasks]
    try:
        results = rewrite(rewrite_fragments, jobs)
    except RuntimeError:  # the pool itself was lost (a Ray cluster gone): compact later
        results = []
    done = [r for r in results if isinstance(r, RewriteResult)]
    if not done:
        return _NoCompaction()
    return Compaction.commit(ds, done, options)


def listed_versions(uri: str) -> list[tuple[int, float]]:
    """(version, manifest modification time) for every manifest in ``_versions``: one
    directory listing, no manifest read."""
    fs, path = arrow_filesystem(uri)
    entries = fs.get_file_info(pafs.FileSelector(f"{path}/_versions", allow_not_found=True))
    out = []
    for entry in entries:
        stem = entry.base_name.removesuffix(".manifest")
        if stem.isdigit() and entry.base_name.endswith(".manifest"):
            n = int(stem)
            version = 2**64 - 1 - n if n >= 2**63 else n  # V2 names count down
            mtime = entry.mtime.timestamp() if entry.mtime is not None else time.time()
            out.append((version, mtime))
    return out


def removable_versions(
    listing: list[tuple[int, float]], keep_versions: int, min_age: timedelta, held: Set[int]
) -> list[int]:
    """The listed versions retention may drop: not among the newest ``keep_versions``, not
    held by a live reader, and older than ``min_age``."""
    newest = set(sorted(v for v, _ in listing)[-keep_versions:])
    cutoff = time.time() - max(0.0, min_age.total_seconds())
    return sorted(v for v, mtime in listing if v not in newest and v not in held and mtime < cutoff)


def cleanup_due(
    uri: str,
    latest: int,
    policy: MaintenancePolicy,
    min_age: timedelta | None = None,
    held: Set[int] = frozenset(),
) -> bool:
    """Whether a cleanup would remove at least as many versions as it keeps (and at least
    one): a directory listing, no manifest read, so the write path does not pay a full
    cleanup (which reads every kept manifest) for a handful of versions; at most two
    manifests are read per version removed.
    ``min_age``: the age rule (default ``policy.version_min_age``); ``held``: versions
    live readers hold."""
    listing = listed_versions(uri)
    if len(listing) <= policy.keep_versions:
        return False
    age = policy.version_min_age if min_age is None else min_age
    drop = removable_versions(listing, policy.keep_versions, min(age, policy.retention), held)
    return len(drop) >= max(1, len(listing) - len(drop))


def cleanup_versions(
    uri: str,
    keep_versions: int,
    min_age: timedelta,
    retention: timedelta,
    held: Set[int] | None = None,
) -> dict[str, Any]:
    """Drop every version that is neither among the newest ``keep_versions`` nor younger
    than ``min(min_age, retention)``; pinned (tagged) versions and their files stay, and so
    do the versions in ``held`` (live readers of a local lab: ``readers.held_versions``;
    None: no reader holds are known, the age rule alone protects readers)."""
    if keep_versions < 1:
        raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
    ds = open_dataset(uri)
    age = max(timedelta(0), min(min_age, retention))
    if held is None:
        stats = ds.cleanup_old_versions(
            older_than=age, retain_versions=keep_versions, error_if_tagged_old_versions=False
        )
    else:
        drop = [
            v
            for v in removable_versions(listed_versions(uri), keep_versions, age, held)
            if v != ds.version
        ]
        if not drop:
            return {"versions_removed": 0, "bytes_removed": 0}
        stats = ds.cleanup_old_versions(versions=drop, error_if_tagged_old_versions=False)
    return {
        "versions_removed": getattr(stats, "old_versions", None),
        "bytes_removed": getattr(stats, "bytes_removed", None),
    }


def pin_tag(holder: str) -> str:
    """The Lance tag a holder's pin is kept by (a digest: holders are free text)."""
    return PIN_TAG_PREFIX + hashlib.sha256(holder.encode()).hexdigest()[:32]


def set_tag(ds: lance.LanceDataset, tag: str, version: int) -> None:
    tags = ds.tags.list()
    if tag in tags:
        if tags[tag]["version"] != version:
            ds.tags.update(tag, version)
    else:
        ds.tags.create(tag, version)


def drop_tag(ds: lance.LanceDataset, tag: str) -> None:
    if tag in ds.tags.list():
        ds.tags.delete(tag)


def remove_orphaned_files(
    ds: lance.LanceDataset,
    base_uri: str,
    retention: timedelta,
    min_age: timedelta = ORPHAN_MIN_AGE,
) -> dict[str, Any]:
    """Delete files of a table that no kept version references, if older than ``min_age``.

    A writer killed between ``write_fragments`` and its commit (or an index build or a
    compaction killed before theirs) leaves data, deletion or index files that no
    manifest names. Lance's ``cleanup_old_versions`` leaves such "unverified" files
    for 7 days, and ``delete_unverified=True`` removes them regardless of age, which
    would also delete the files of a write still in flight: its fragments are on disk
    before its commit names them, and a commit naming deleted files corrupts the table.
    So Lance lists the candidates (``explain_cleanup_old_versions``, the same rules as
    the cleanup) and only those at least ``min_age`` old (file modification time) are
    deleted here. ``min_age`` must exceed the longest write, from its first fragment to
    its commit (a partition replacement streams one batch; default 24 h). A file Lance
    lists that cannot be mapped to this table's directory is left alone.
    """
    if min_age < timedelta(0):
        raise ValueError(f"min_age must be >= 0, got {min_age}")
    plan = ds.explain_cleanup_old_versions(
        older_than=retention,
        delete_unverified=True,
        error_if_tagged_old_versions=False,  # pinned (tagged) versions are kept, not errors
        include_files=True,
        max_files=ORPHAN_SCAN_LIMIT,
    )
    base_key = object_key(base_uri)
    now = time.time()
    removed = kept = unmapped = 0
    removed_bytes = 0
    for candidate in plan.candidate_files:
        if not candidate.unverified:
            continue  # referenced by a version past retention: cleanup_old_versions' job
        path = candidate.path.lstrip("/")
        if not path.startswith(base_key + "/"):
            unmapped += 1
            continue
        fs, fs_path = arrow_filesystem(f"{base_uri}/{path[len(base_key) + 1 :]}")
        info = fs.get_file_info(fs_path)
        if info.type != pafs.FileType.File or info.mtime is None:
            continue
        if now - info.mtime.timestamp() < min_age.total_seconds():
            kept += 1
            continue
        fs.delete_file(fs_path)
        removed += 1
        removed_bytes += candidate.size_bytes
        _remove_empty_parent(fs, fs_path, base_key)
    return {
        "orphan_files_removed": removed,
        "orphan_bytes_removed": removed_bytes,
        "orphan_files_kept_recent": kept,
        "orphan_files_unmapped": unmapped,
        "orphan_scan_truncated": plan.candidate_files_truncated,
    }


def object_key(uri: str) -> str:
    """How Lance names a file of ``uri`` in cleanup plans: the path without scheme or root."""
    if "://" in uri:
        return uri.split("://", 1)[1].strip("/")
    return str(Path(uri).resolve()).strip("/")


def _remove_empty_parent(fs: pafs.FileSystem, path: str, base_key: str) -> None:
    """A killed index build leaves ``_indices/<uuid>/``: drop the folder once empty (local)."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return
    parent = Path(path).parent
    if parent.parent.name == "_indices" and str(parent).strip("/").startswith(base_key):
        with contextlib.suppress(OSError):
            parent.rmdir()  # only succeeds when empty
