"""Near-duplicate decisions over rows that hold whole clusters: pure, no I/O.

Keeper rule (``KEEPER_RULE_VERSION``): most pixels, then larger file, then smallest key,
then smallest batch (the same bytes can arrive in two batches under the same key).
Low-information images (``ac_energy`` under the threshold) are their own singleton cluster
and their own keeper: their bits are noise, so they are never merged on the hash alone.

:func:`plan_batch` decides one batch against the rows :mod:`.corpus` gathered for it and
says which *other* batches' stored decisions no longer hold. Only decision fields count
(cluster, keeper, is_keeper, low_information): a lower-resolution copy joining an old
cluster changes nothing stored elsewhere, so no other partition reruns. ``cluster_id`` is
the keeper's key for that reason. :func:`closure_mask` finds, for a radius r > 0, which
scanned rows are in the component closure of a batch's hashes (the corpus reader then
takes those rows); :func:`radius_closure` is the same closure as a set of hashes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from prx_assets.core.dedup.clustering import (
    chunk_masks,
    cluster_exact,
    cluster_radius,
)
from prx_assets.core.dedup.phash import DEFAULT_LOW_INFO_THRESHOLD, PHASH_MODES, phash_version
from prx_assets.core.tables import PHASH_CLUSTERS

KEEPER_RULE_VERSION = "keeper-v1"
MAX_DEDUP_RADIUS = 8
HASH_COLUMNS = ("key", "batch", "phash", "ac_energy", "pixels", "file_size")
DECISION_FIELDS = ("cluster_id", "keeper_key", "keeper_batch", "is_keeper", "low_information")
STORED_COLUMNS = ("key", "batch", *DECISION_FIELDS, "config_fingerprint")


@dataclass(frozen=True)
class DedupSettings:
    """What a decision depends on besides the hashes; its fingerprint is stored per row."""

    radius: int = 0
    low_info_threshold: float = DEFAULT_LOW_INFO_THRESHOLD
    phash_mode: str = "fast"

    def __post_init__(self) -> None:
        if isinstance(self.radius, bool) or not isinstance(self.radius, int):
            raise TypeError(f"radius must be an int, got {self.radius!r}")
        if not 0 <= self.radius <= MAX_DEDUP_RADIUS:
            raise ValueError(f"radius must be in 0..{MAX_DEDUP_RADIUS}, got {self.radius}")
        if not self.low_info_threshold >= 0:
            raise ValueError(f"low_info_threshold must be >= 0, got {self.low_info_threshold}")
        if self.phash_mode not in PHASH_MODES:
            raise ValueError(f"phash_mode must be one of {PHASH_MODES}, got {self.phash_mode!r}")

    @property
    def phash_version(self) -> str:
        return phash_version(self.phash_mode)

    def fingerprint(self) -> str:
        """Readable and exact: ``r0-lo1.0-fast-v1-keeper-v1``."""
        return (
            f"r{self.radius}-lo{float(self.low_info_threshold)!r}-"
            f"{self.phash_version}-{KEEPER_RULE_VERSION}"
        )


# ---------------------------------------------------------------------------------------------
# Pure logic: clusters and keepers over rows that hold whole clusters


def _column(table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        raise ValueError(f"column {name!r} has {col.null_count} null value(s)")
    return col.to_numpy(zero_copy_only=False)


def _strings(table: pa.Table, name: str) -> np.ndarray:
    values = _column(table, name)
    return values.astype(str) if len(values) else np.empty(0, dtype="U1")


def keeper_order(pixels: int, file_size: int, key: str, batch: str) -> tuple[int, int, str, str]:
    """Sort key of the keeper rule (the smallest sorts first): most pixels, then larger file,
    then smaller key, then smaller batch; the order :func:`decide` ranks a cluster in. The
    skip policy walks a cluster in this order to find its training copy."""
    return (-int(pixels), -int(file_size), key, batch)


def decide(rows: pa.Table, settings: DedupSettings) -> pa.Table:
    """Cluster ``rows`` (whole clusters, columns ``HASH_COLUMNS``) and apply the keeper rule.

    Returns ``key, batch, cluster_id, cluster_size, keeper_key, keeper_batch, is_keeper,
    low_information`` in the input order.
    """
    missing = [c for c in HASH_COLUMNS if c not in rows.column_names]
    if missing:
        raise ValueError(f"hash rows lack columns {missing}")
    n = rows.num_rows
    keys, batches = _strings(rows, "key"), _strings(rows, "batch")
    if n > 1:
        order = np.lexsort((batches, keys))
        same = (keys[order][1:] == keys[order][:-1]) & (batches[order][1:] == batches[order][:-1])
        if same.any():
            i = order[1:][same][0]
            raise ValueError(f"rows must be unique by (batch, key); {batches[i]}:{keys[i]} repeats")
    hashes = _column(rows, "phash").astype(np.int64).view(np.uint64)
    energy = _column(rows, "ac_energy").astype(np.float64)
    pixels = _column(rows, "pixels").astype(np.int64)
    sizes = _column(rows, "file_size").astype(np.int64)
    if (pixels < 0).any() or (sizes < 0).any():
        raise ValueError("pixels and file_size must be >= 0")
    low = energy < settings.low_info_threshold
    if settings.radius == 0:
        clusters = cluster_exact(hashes, singletons=low)
    else:
        clusters = cluster_radius(hashes, settings.radius, singletons=low)
    cl = clusters.cluster_of.astype(np.int64)
    # Per cluster, the first in this order is the keeper (the order of keeper_order).
    order = np.lexsort((batches, keys, -sizes, -pixels, cl))
    starts = np.flatnonzero(np.r_[True, cl[order][1:] != cl[order][:-1]]) if n else order[:0]
    counts = np.diff(np.r_[starts, n])
    group = np.empty(n, dtype=np.int64)
    group[order] = np.repeat(np.arange(len(starts)), counts)
    keeper = order[starts][group] if n else order
    return pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "batch": pa.array(batches, pa.string()),
            "cluster_id": pa.array(keys[keeper], pa.string()),
            "cluster_size": pa.array(counts[group] if n else [], pa.int32()),
            "keeper_key": pa.array(keys[keeper], pa.string()),
            "keeper_batch": pa.array(batches[keeper], pa.string()),
            "is_keeper": pa.array(keeper == np.arange(n), pa.bool_()),
            "low_information": pa.array(low, pa.bool_()),
        }
    )


@dataclass(frozen=True)
class DecisionChange:
    """A row of another batch whose stored decision differs from the corpus' current one."""

    batch: str
    key: str
    cluster_id: str
    before: str
    after: str


@dataclass
class BatchStats:
    """Counts of one batch's decision: its duplicates, and what it changes elsewhere."""

    images: int = 0
    low_information: int = 0
    clusters_with_duplicates: int = 0  # clusters of size > 1 that hold an image of the batch
    within_batch_duplicates: int = 0  # non-keepers of the batch whose keeper is in the batch
    duplicates_of_other_batches: int = 0  # non-keepers of the batch kept in another batch
    keepers_over_other_batches: int = 0  # keepers of the batch with members elsewhere
    displaced_in_other_batches: int = 0  # other batches' stored keepers that no longer are
    cluster_sizes: dict[int, int] = field(default_factory=dict)  # size -> clusters (touching)
    affected_batches: list[str] = field(default_factory=list)
    undecided_members: int = 0  # other batches' members with no stored decision yet
    other_config_members: int = 0  # other batches' members decided under another config


@dataclass
class BatchPlan:
    """One batch decided against the corpus: its rows, the other batches' changes, stats."""

    rows: pa.Table  # this batch's PHASH_CLUSTERS rows
    changes: list[DecisionChange]
    stats: BatchStats
    decisions: pa.Table  # every row considered (this batch and the other members)


def describe_decision(row: dict[str, Any]) -> str:
    if row["low_information"]:
        return "low_information"
    role = "keeper" if row["is_keeper"] else "duplicate"
    return f"{role} of {row['keeper_batch']}:{row['keeper_key']}"


def plan_batch(
    batch: str, corpus: pa.Table, stored: pa.Table | None, settings: DedupSettings
) -> BatchPlan:
    """Decide ``batch`` against ``corpus`` and list other batches' stored rows that now differ.

    ``corpus``: rows of ``HASH_COLUMNS``, every image of ``batch`` plus every other row of
    the clusters touching it (as :func:`.corpus.gather_corpus` gathers them). ``stored``: the
    ``PHASH_CLUSTERS`` rows (``STORED_COLUMNS``) of those other members. Members with no
    stored row are not decided yet (their own run will do it); members decided under another
    configuration are rerun by the configuration sweep; neither is reported as a change.
    """
    decisions = decide(corpus, settings)
    fp = settings.fingerprint()
    mine = np.asarray(decisions.column("batch").to_pylist(), dtype=object) == batch
    own = decisions.filter(pa.array(mine))
    own = own.sort_by("key")
    n_own = own.num_rows
    rows = own.append_column("radius", pa.array([settings.radius] * n_own, pa.int32()))
    rows = rows.append_column("phash_version", pa.array([settings.phash_version] * n_own))
    rows = rows.append_column("config_fingerprint", pa.array([fp] * n_own))
    rows = rows.select(PHASH_CLUSTERS.schema.names).cast(PHASH_CLUSTERS.schema)

    stats = BatchStats(images=n_own)
    own_list = own.to_pylist()
    stats.low_information = sum(r["low_information"] for r in own_list)
    all_list = decisions.to_pylist()
    members: dict[str, list[dict[str, Any]]] = {}
    for r in all_list:
        members.setdefault(r["cluster_id"], []).append(r)
    touching = {r["cluster_id"] for r in own_list}
    for cid in touching:
        size = len(members[cid])
        stats.cluster_sizes[size] = stats.cluster_sizes.get(size, 0) + 1
        if size > 1:
            stats.clusters_with_duplicates += 1
    for r in own_list:
        if r["is_keeper"]:
            if any(m["batch"] != batch for m in members[r["cluster_id"]]):
                stats.keepers_over_other_batches += 1
        elif r["keeper_batch"] == batch:
            stats.within_batch_duplicates += 1
        else:
            stats.duplicates_of_other_batches += 1

    stored_by: dict[tuple[str, str], dict[str, Any]] = {}
    if stored is not None and stored.num_rows:
        for s in stored.select(list(STORED_COLUMNS)).to_pylist():
            stored_by[(s["batch"], s["key"])] = s
    changes = []
    for r in all_list:
        if r["batch"] == batch:
            continue
        s = stored_by.get((r["batch"], r["key"]))
        if s is None:
            stats.undecided_members += 1
            continue
        if s["config_fingerprint"] != fp:
            stats.other_config_members += 1
            continue
        if any(s[f] != r[f] for f in DECISION_FIELDS):
            changes.append(
                DecisionChange(
                    r["batch"],
                    r["key"],
                    r["cluster_id"],
                    describe_decision(s),
                    describe_decision(r),
                )
            )
            if s["is_keeper"] and not r["is_keeper"]:
                stats.displaced_in_other_batches += 1
    stats.affected_batches = sorted({c.batch for c in changes})
    return BatchPlan(rows=rows, changes=changes, stats=stats, decisions=decisions)


# ---------------------------------------------------------------------------------------------
# Radius r > 0: the component closure of a batch's hashes (multi-index hashing)


# Candidate pairs a closure round verifies at once (bounded memory for a large frontier).
_CLOSURE_PAIR_BLOCK = 1 << 22


class _ChunkBuckets:
    """The hashes grouped by one multi-index chunk: ``order[starts[v]:starts[v + 1]]``
    are the positions whose chunk value is ``v``'s (``lookup``).

    Why not a sort of the masked hashes: a chunk of at most 16 bits (radius >= 3) is
    grouped by a counting sort (numpy's radix ``argsort`` on uint16 and a ``bincount``;
    an aligned 16-bit chunk is read in place through a uint16 view), linear in the hashes,
    where a sort and an argsort of the masked 64-bit values were the closure's largest cost
    (the whole gather: ``benchmarks/bench_dedup_radius.py``). Wider chunks keep one argsort
    and ``searchsorted``."""

    def __init__(self, hashes: np.ndarray, mask: np.uint64) -> None:
        self.mask = mask
        self.shift = np.uint64(int(mask).bit_length() - int(mask).bit_count())
        width = int(mask).bit_count()
        self.small = width <= 16
        if self.small:
            if width == 16 and int(self.shift) % 16 == 0 and sys.byteorder == "little":
                values = np.ascontiguousarray(hashes.view(np.uint16)[int(self.shift) // 16 :: 4])
            else:
                values = ((hashes & mask) >> self.shift).astype(np.uint16)
            self.order = np.argsort(values, kind="stable")
            self.starts = np.r_[0, np.cumsum(np.bincount(values, minlength=1 << width))]
        else:
            values = (hashes & mask) >> self.shift
            self.order = np.argsort(values)
            self.sorted = values[self.order]

    def lookup(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per hash, the [lo, hi) range of ``order`` holding the positions that share its
        chunk."""
        values = (hashes & self.mask) >> self.shift
        if self.small:
            v = values.astype(np.int64)
            return self.starts[v], self.starts[v + 1]
        return (
            np.searchsorted(self.sorted, values, side="left"),
            np.searchsorted(self.sorted, values, side="right"),
        )


def _within(
    frontier: np.ndarray, uni: np.ndarray, buckets: list[_ChunkBuckets], radius: int
) -> np.ndarray:
    """Positions of ``uni`` within ``radius`` of some ``frontier`` hash (with repeats):
    each frontier hash against the universe entries that share one of its chunks, checked
    by popcount, in blocks of at most ``_CLOSURE_PAIR_BLOCK`` pairs."""
    found: list[np.ndarray] = []
    for b in buckets:
        lo, hi = b.lookup(frontier)
        counts = hi - lo
        hit = np.flatnonzero(counts)
        if not len(hit):
            continue
        cum = np.cumsum(counts[hit])
        start = 0
        while start < len(hit):
            base = cum[start - 1] if start else 0
            end = max(
                start + 1, int(np.searchsorted(cum, base + _CLOSURE_PAIR_BLOCK, side="right"))
            )
            rows, c = hit[start:end], counts[hit[start:end]]
            left = np.repeat(rows, c)
            offsets = np.arange(len(left)) - np.repeat(np.cumsum(c) - c, c)
            positions = b.order[np.repeat(lo[rows], c) + offsets]
            close = np.bitwise_count(frontier[left] ^ uni[positions]) <= radius
            found.append(positions[close])
            start = end
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def _unsigned(hashes: np.ndarray) -> np.ndarray:
    """64-bit hashes (signed or unsigned) as uint64, without a copy when already 64-bit."""
    h = np.asarray(hashes)
    if h.dtype in (np.int64, np.uint64):
        return h.view(np.uint64)
    return h.astype(np.int64).view(np.uint64)


def _check_radius(radius: int) -> None:
    if not 1 <= radius <= MAX_DEDUP_RADIUS:
        raise ValueError(f"radius_closure needs a radius in 1..{MAX_DEDUP_RADIUS}, got {radius}")


def closure_mask(seeds: np.ndarray, hashes: np.ndarray, radius: int) -> np.ndarray:
    """Which entries of ``hashes`` (any order, repeats allowed: e.g. a scan's rows) are
    joined to a seed by a chain of steps within ``radius``.

    Each round looks up the frontier's neighbours by the pigeonhole chunks (a pair within r
    agrees exactly on one of r + 1 chunks), verifies them by popcount, and continues from
    the new ones, so the work follows the components, not the corpus size squared. Taking
    the rows as they were scanned (no distinct pass) saves a sort of the corpus and a
    membership pass over it to find the rows of the closure's hashes again."""
    _check_radius(radius)
    h = _unsigned(hashes)
    frontier = np.unique(_unsigned(seeds))
    visited = np.zeros(len(h), dtype=bool)
    if not len(h) or not len(frontier):
        return visited
    buckets = [_ChunkBuckets(h, m) for m in chunk_masks(radius)]
    while len(frontier):
        near = np.unique(_within(frontier, h, buckets, radius))
        new = near[~visited[near]]
        if not len(new):
            break
        visited[new] = True
        frontier = np.unique(h[new])
    return visited


def radius_closure(seeds: np.ndarray, universe: np.ndarray, radius: int) -> np.ndarray:
    """Every hash of ``universe`` joined to a seed by a chain of steps within ``radius``
    (``closure_mask``), as sorted uint64 hashes, the seeds included."""
    _check_radius(radius)
    uni = _unsigned(universe)
    seen = np.unique(_unsigned(seeds))
    if not len(uni) or not len(seen):
        return seen
    return np.union1d(seen, uni[closure_mask(seen, uni, radius)])
