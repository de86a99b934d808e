"""Cross-batch near-duplicate decisions, one batch at a time, against the whole corpus.

Why per batch and not one corpus-wide pass: a new batch must not re-hash the old ones nor
re-decide every batch. ``phash_clusters(B)`` therefore reads only what can touch B's
decisions: B's hashes, the corpus rows sharing one of them (Lance ``phash`` BTREE, IN-lists
in chunks; for a radius r > 0 the component closure found by multi-index hashing), and the
former members of B's previous clusters (so removing an image from B re-decides its old
partners). Those rows hold every cluster touching B *whole*, so the keeper rule applied to
them is the corpus-wide decision (:func:`plan_batch`).

The same computation says which *other* batches' stored decisions no longer hold (a
higher-resolution copy arriving in B flips the old keeper). B writes only its own rows (one
commit per partition); the stale batches are listed in the tiny ``dedup_dirty`` table, which
the dedup sensor reads to rerun exactly those partitions (their ``phash_clusters`` and
skip-lists, never their shards). Only decision fields count (cluster, keeper, is_keeper,
low_information): a lower-resolution copy joining an old cluster changes nothing stored
elsewhere, so no other partition reruns. ``cluster_id`` is the keeper's key for that reason.

Keeper rule (``KEEPER_RULE_VERSION``): most pixels, then larger file, then smallest key,
then smallest batch (the same bytes can arrive in two batches under the same key).
Low-information images (``ac_energy`` under the threshold) are their own singleton cluster
and their own keeper: their bits are noise, so they are never merged on the hash alone.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import lance
import numpy as np
import pyarrow as pa
from PIL import Image, ImageDraw, ImageOps

from prx_assets.core.batching import chunked
from prx_assets.core.dedup.clustering import (
    chunk_masks,
    cluster_exact,
    cluster_radius,
    radius_pairs,
)
from prx_assets.core.dedup.phash import DEFAULT_LOW_INFO_THRESHOLD, PHASH_MODES, phash_version
from prx_assets.core.ingest.decode import decode_rgb
from prx_assets.core.lab import Lab, in_list, sql_literal
from prx_assets.core.tables import DEDUP_DIRTY, DEDUP_STATE, IMAGE_HASHES, IMAGES, PHASH_CLUSTERS

KEEPER_RULE_VERSION = "keeper-v1"
MAX_DEDUP_RADIUS = 8
DEFAULT_LOOKUP_CHUNK = 1024
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
    the clusters touching it (as gathered by :func:`gather_corpus`). ``stored``: the
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


def radius_closure(seeds: np.ndarray, universe: np.ndarray, radius: int) -> np.ndarray:
    """Every hash of ``universe`` joined to a seed by a chain of steps within ``radius``.

    ``universe`` holds the corpus' distinct (non-low-information) hashes. Each round looks up
    the frontier's neighbours by the pigeonhole chunks (a pair within r agrees exactly on one
    of r + 1 chunks), verifies them by popcount, and continues from the new ones, so the
    work follows the components, not the corpus size squared. Returns sorted uint64 hashes
    (the seeds included).
    """
    if not 1 <= radius <= MAX_DEDUP_RADIUS:
        raise ValueError(f"radius_closure needs a radius in 1..{MAX_DEDUP_RADIUS}, got {radius}")
    uni = np.unique(np.asarray(universe).astype(np.int64).view(np.uint64))
    seen = np.unique(np.asarray(seeds).astype(np.int64).view(np.uint64))
    if not len(uni) or not len(seen):
        return seen
    masks = chunk_masks(radius)
    masked = [np.sort(uni & m) for m in masks]
    order = [np.argsort(uni & m, kind="stable") for m in masks]
    visited = np.isin(uni, seen)
    frontier = seen
    while len(frontier):
        cand_parts = []
        for m, sm, om in zip(masks, masked, order, strict=True):
            fm = np.unique(frontier & m)
            lo = np.searchsorted(sm, fm, side="left")
            hi = np.searchsorted(sm, fm, side="right")
            hit = hi > lo
            if hit.any():
                idx = np.concatenate([om[a:b] for a, b in zip(lo[hit], hi[hit], strict=True)])
                cand_parts.append(idx)
        if not cand_parts:
            break
        cand = np.unique(np.concatenate(cand_parts))
        cand = cand[~visited[cand]]
        if not len(cand):
            break
        both = np.concatenate([frontier, uni[cand]])
        i, j, _ = radius_pairs(both, radius)
        nf = len(frontier)
        linked = np.unique(np.r_[j[(i < nf) & (j >= nf)], i[(j < nf) & (i >= nf)]]) - nf
        new = cand[linked]
        visited[new] = True
        frontier = uni[new]
    return np.union1d(seen, uni[visited])


# ---------------------------------------------------------------------------------------------
# Reading what touches a batch from the lab


def _int_list(column: str, values: Iterable[int]) -> str:
    vals = sorted({int(v) for v in values})
    return f"{column} IN ({', '.join(str(v) for v in vals)})" if vals else "false"


def _empty(schema: pa.Schema, columns: Sequence[str]) -> pa.Table:
    return pa.Table.from_pylist([], schema=pa.schema([schema.field(c) for c in columns]))


def _read(lab: Lab, spec_name: str, schema: pa.Schema, columns: Sequence[str], where: str):
    if not lab.exists(spec_name):
        return _empty(schema, columns)
    return lab.read(spec_name, list(columns), where)


def _concat(parts: list[pa.Table], schema: pa.Schema, columns: Sequence[str]) -> pa.Table:
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return _empty(schema, columns)
    return pa.concat_tables(parts)


def _cluster_members(
    lab: Lab, cluster_ids: Sequence[str], columns: list[str], condition: str, chunk: int
) -> pa.Table:
    """Stored decisions of the given clusters (BTREE on cluster_id), read in IN-list chunks."""
    parts = [
        _read(
            lab,
            PHASH_CLUSTERS.name,
            PHASH_CLUSTERS.schema,
            columns,
            f"{in_list('cluster_id', part)} AND {condition}",
        )
        for part in chunked(cluster_ids, chunk)
    ]
    return _concat(parts, PHASH_CLUSTERS.schema, columns)


def cluster_members(
    lab: Lab, cluster_ids: Iterable[str], columns: Sequence[str], chunk: int = DEFAULT_LOOKUP_CHUNK
) -> pa.Table:
    """Stored ``phash_clusters`` rows of these clusters, every batch (``cluster_id`` BTREE)."""
    ids = sorted(set(cluster_ids))
    return _cluster_members(lab, ids, list(columns), "cluster_id IS NOT NULL", chunk)


def lookup_by_hashes(
    lab: Lab, hashes: Iterable[int], version: str, chunk: int = DEFAULT_LOOKUP_CHUNK
) -> pa.Table:
    """``image_hashes`` rows (``HASH_COLUMNS``) of ``version`` whose phash is in ``hashes``.

    ``hashes`` may be signed or unsigned 64-bit values; one BTREE lookup per chunk.
    """
    signed = sorted({int(np.uint64(int(h) & (2**64 - 1)).view(np.int64)) for h in hashes})
    parts = [
        _read(
            lab,
            IMAGE_HASHES.name,
            IMAGE_HASHES.schema,
            HASH_COLUMNS,
            f"{_int_list('phash', part)} AND phash_version = {sql_literal(version)}",
        )
        for part in chunked(signed, chunk)
    ]
    return _concat(parts, IMAGE_HASHES.schema, HASH_COLUMNS)


def lookup_by_keys(
    lab: Lab,
    table: str,
    schema: pa.Schema,
    pairs: Iterable[tuple[str, str]],
    columns: Sequence[str],
    extra: str | None = None,
    chunk: int = DEFAULT_LOOKUP_CHUNK,
) -> pa.Table:
    """Rows of ``table`` for (batch, key) pairs: a ``key`` BTREE lookup, then the exact pairs."""
    wanted = set(pairs)
    keys = sorted({k for _, k in wanted})
    cols = list(dict.fromkeys(["batch", "key", *columns]))
    parts = []
    for part in chunked(keys, chunk):
        where = in_list("key", part) + (f" AND {extra}" if extra else "")
        got = _read(lab, table, schema, cols, where)
        if got.num_rows:
            keep = [
                (b, k) in wanted
                for b, k in zip(
                    got.column("batch").to_pylist(), got.column("key").to_pylist(), strict=True
                )
            ]
            parts.append(got.filter(pa.array(keep, pa.bool_())))
    return _concat(parts, schema, cols).select(list(columns))


def corpus_hashes(lab: Lab, settings: DedupSettings) -> np.ndarray:
    """Distinct non-low-information hashes of the configured version (radius > 0 only)."""
    where = (
        f"phash_version = {sql_literal(settings.phash_version)} "
        f"AND ac_energy >= {float(settings.low_info_threshold)!r}"
    )
    table = _read(lab, IMAGE_HASHES.name, IMAGE_HASHES.schema, ["phash"], where)
    return np.unique(table.column("phash").to_numpy().astype(np.int64))


@dataclass
class Gathered:
    corpus: pa.Table  # HASH_COLUMNS
    stored: pa.Table  # STORED_COLUMNS of the other batches' members
    lookups: dict[str, int]


def _pairs(table: pa.Table) -> list[tuple[str, str]]:
    return list(
        zip(table.column("batch").to_pylist(), table.column("key").to_pylist(), strict=True)
    )


def gather_corpus(
    lab: Lab, batch: str, settings: DedupSettings, chunk: int = DEFAULT_LOOKUP_CHUNK
) -> Gathered:
    """Every row that can take part in a decision of ``batch``, and the stored decisions.

    1. ``batch``'s hashes of the configured version;
    2. the former members of ``batch``'s stored clusters (``cluster_id`` BTREE) and their
       hashes, so an image that left ``batch`` re-decides its old cluster;
    3. every row sharing one of those hashes (``phash`` BTREE), or for r > 0 every row in
       their components (:func:`radius_closure` over the corpus' distinct hashes);
    4. the stored ``phash_clusters`` rows of the other batches' members (``key`` BTREE).
    """
    version = settings.phash_version
    thr = settings.low_info_threshold
    own = _read(
        lab,
        IMAGE_HASHES.name,
        IMAGE_HASHES.schema,
        HASH_COLUMNS,
        f"batch = {sql_literal(batch)} AND phash_version = {sql_literal(version)}",
    )
    old = _read(
        lab,
        PHASH_CLUSTERS.name,
        PHASH_CLUSTERS.schema,
        ["cluster_id"],
        f"batch = {sql_literal(batch)}",
    )
    old_ids = sorted({c for c in old.column("cluster_id").to_pylist() if c is not None})
    former = _cluster_members(
        lab, old_ids, list(STORED_COLUMNS), f"batch != {sql_literal(batch)}", chunk
    )
    former_hashes = lookup_by_keys(
        lab,
        IMAGE_HASHES.name,
        IMAGE_HASHES.schema,
        _pairs(former),
        HASH_COLUMNS,
        extra=f"phash_version = {sql_literal(version)}",
        chunk=chunk,
    )
    seeds = [
        h
        for t in (own, former_hashes)
        for h, e in zip(
            t.column("phash").to_pylist(), t.column("ac_energy").to_pylist(), strict=True
        )
        if e >= thr
    ]
    lookups = {
        "own_rows": own.num_rows,
        "former_members": former.num_rows,
        "seed_hashes": len(set(seeds)),
    }
    if settings.radius > 0 and seeds:
        universe = corpus_hashes(lab, settings)
        seeds = radius_closure(np.asarray(seeds, dtype=np.int64), universe, settings.radius)
        lookups["closure_hashes"] = len(seeds)
        lookups["corpus_distinct_hashes_scanned"] = len(universe)
    members = lookup_by_hashes(lab, [int(s) for s in seeds], version, chunk)
    lookups["rows_sharing_hashes"] = members.num_rows
    others = members.filter(
        pa.array(
            [
                b != batch and e >= thr
                for b, e in zip(
                    members.column("batch").to_pylist(),
                    members.column("ac_energy").to_pylist(),
                    strict=True,
                )
            ],
            pa.bool_(),
        )
    )
    corpus = pa.concat_tables([own.select(list(HASH_COLUMNS)), others.select(list(HASH_COLUMNS))])
    stored = lookup_by_keys(
        lab,
        PHASH_CLUSTERS.name,
        PHASH_CLUSTERS.schema,
        _pairs(others),
        STORED_COLUMNS,
        chunk=chunk,
    )
    lookups["corpus_rows"] = corpus.num_rows
    return Gathered(corpus=corpus, stored=stored, lookups=lookups)


# ---------------------------------------------------------------------------------------------
# The dirty list: other batches whose stored decisions no longer hold


def _dirty_id(change: DecisionChange, detected_by: str, detected_at: datetime) -> str:
    raw = json.dumps(
        [change.batch, change.key, change.cluster_id, detected_by, detected_at.isoformat()]
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def dirty_rows(
    changes: Sequence[DecisionChange], detected_by: str, detected_at: datetime
) -> pa.Table:
    if detected_at.tzinfo is None:
        raise ValueError("detected_at must be timezone-aware (UTC)")
    return pa.Table.from_pylist(
        [
            {
                "dirty_id": _dirty_id(c, detected_by, detected_at),
                "batch": c.batch,
                "key": c.key,
                "cluster_id": c.cluster_id,
                "change": f"{c.before} -> {c.after}",
                "detected_by": detected_by,
                "detected_at": detected_at,
            }
            for c in changes
        ],
        schema=DEDUP_DIRTY.schema,
    )


def mark_dirty(
    lab: Lab,
    changes: Sequence[DecisionChange],
    detected_by: str,
    detected_at: datetime | None = None,
) -> int:
    """Append one ``dedup_dirty`` row per change (appends never conflict with each other)."""
    if not changes:
        return 0
    rows = dirty_rows(changes, detected_by, detected_at or datetime.now(UTC))
    lab.ensure(DEDUP_DIRTY)
    lance.write_dataset(rows, lab.uri(DEDUP_DIRTY.name), mode="append")
    return rows.num_rows


def read_dirty(lab: Lab, batch: str | None = None) -> pa.Table:
    where = f"batch = {sql_literal(batch)}" if batch is not None else None
    if not lab.exists(DEDUP_DIRTY.name):
        return pa.Table.from_pylist([], schema=DEDUP_DIRTY.schema)
    return lab.read(DEDUP_DIRTY.name, DEDUP_DIRTY.schema.names, where)


def clear_dirty(lab: Lab, dirty_ids: Sequence[str], attempts: int = 8) -> int:
    """Delete exactly these rows (read before the rerun read the corpus); later ones stay."""
    if not dirty_ids or not lab.exists(DEDUP_DIRTY.name):
        return 0
    last: Exception | None = None
    for attempt in range(attempts):
        try:
            lab.dataset(DEDUP_DIRTY.name).delete(in_list("dirty_id", dirty_ids))
            return len(set(dirty_ids))
        except OSError as exc:  # a concurrent delete on the same fragment: retry on the new one
            last = exc
            time.sleep(0.05 * (2**attempt))
    assert last is not None
    raise last


# ---------------------------------------------------------------------------------------------
# Configuration sweep: batches decided under another configuration


def state_row(
    batch: str, plan: BatchPlan, settings: DedupSettings, decided_at: datetime
) -> pa.Table:
    """The batch's ``dedup_state`` row: what it was decided under, and its counts."""
    kept = int(sum(plan.rows.column("is_keeper").to_pylist()))
    return pa.Table.from_pylist(
        [
            {
                "batch": batch,
                "config_fingerprint": settings.fingerprint(),
                "radius": settings.radius,
                "phash_version": settings.phash_version,
                "images": plan.stats.images,
                "kept": kept,
                "duplicates": plan.stats.images - kept,
                "low_information": plan.stats.low_information,
                "decided_at": decided_at,
            }
        ],
        schema=DEDUP_STATE.schema,
    )


@dataclass(frozen=True)
class StaleDecision:
    batch: str
    config_fingerprint: str | None  # found in dedup_state
    phash_version: str | None
    needs_rehash: bool  # decided from hashes of another version: rerun image_hashes first


def stale_decisions(lab: Lab, settings: DedupSettings) -> dict[str, StaleDecision]:
    """Batches decided under another configuration, from ``dedup_state`` (a row per batch)."""
    if not lab.exists(DEDUP_STATE.name):
        return {}
    fp = settings.fingerprint()
    out = {}
    for r in lab.read(
        DEDUP_STATE.name, ["batch", "config_fingerprint", "phash_version"]
    ).to_pylist():
        if r["config_fingerprint"] != fp:
            out[r["batch"]] = StaleDecision(
                batch=r["batch"],
                config_fingerprint=r["config_fingerprint"],
                phash_version=r["phash_version"],
                needs_rehash=r["phash_version"] != settings.phash_version,
            )
    return out


def dedup_run_key(batch: str, assets: Sequence[str], markers: Iterable[str]) -> str:
    """The same stale state gives the same key, so Dagster requests it once."""
    raw = json.dumps([batch, sorted(assets), sorted(markers)])
    return f"dedup:{batch}:{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


# ---------------------------------------------------------------------------------------------
# What to rerun: the dedup sensor's decision, shared with the CLI and the demo (no daemon)

DEFAULT_SETTLE_ROUNDS = 3


@dataclass(frozen=True)
class DedupRerun:
    batch: str
    assets: tuple[str, ...]
    run_key: str
    reasons: tuple[str, ...]  # human-readable, for the run's tags and the log


def dedup_reruns(
    lab: Lab,
    settings: DedupSettings,
    downstream: Sequence[str] = (),
    registered: set[str] | None = None,
    *,
    hashes_asset: str = IMAGE_HASHES.name,
    clusters_asset: str = PHASH_CLUSTERS.name,
) -> dict[str, DedupRerun]:
    """Batch -> what to rerun there, for every partition whose dedup rows are stale.

    Stale: rows in ``dedup_dirty`` (a newer batch contradicts the stored decisions) or a
    ``dedup_state`` row decided under another configuration (a pHash mode change needs
    ``hashes_asset`` too). ``registered``: the partitions that exist (others are ignored: a
    deleted partition's leftover rows must not resurrect it). The dedup sensor requests
    exactly these; :func:`settle_dedup` runs them in process.
    """
    markers: dict[str, list[str]] = {}
    reasons: dict[str, list[str]] = {}
    by_batch: dict[str, list[dict]] = {}
    for row in read_dirty(lab).to_pylist():
        by_batch.setdefault(row["batch"], []).append(row)
    for batch, rows in by_batch.items():
        markers[batch] = [f"dirty:{r['dirty_id']}" for r in rows]
        by = ", ".join(sorted({r["detected_by"] for r in rows}))
        reasons[batch] = [f"{len(rows)} decision(s) changed by {by}"]
    stale = stale_decisions(lab, settings)
    for batch, found in stale.items():
        markers.setdefault(batch, []).append(f"decided:{found.config_fingerprint}")
        reasons.setdefault(batch, []).append(f"decided under {found.config_fingerprint}")
    out = {}
    for batch in sorted(markers):
        if registered is not None and batch not in registered:
            continue
        rehash = batch in stale and stale[batch].needs_rehash
        assets = ((hashes_asset,) if rehash else ()) + (clusters_asset, *downstream)
        assets = tuple(dict.fromkeys(assets))
        keyed = [*markers[batch], f"configured:{settings.fingerprint()}"]
        out[batch] = DedupRerun(
            batch=batch,
            assets=assets,
            run_key=dedup_run_key(batch, assets, keyed),
            reasons=tuple(reasons[batch]),
        )
    return out


@dataclass
class SettleReport:
    """What :func:`settle_dedup` reran, and whether the stale set ended empty."""

    reruns: list[DedupRerun] = field(default_factory=list)
    rounds: int = 0
    failed: list[DedupRerun] = field(default_factory=list)
    still_stale: list[str] = field(default_factory=list)  # batches, when not settled

    @property
    def settled(self) -> bool:
        return not self.failed and not self.still_stale


def settle_dedup(
    lab: Lab,
    settings: DedupSettings,
    registered: set[str],
    execute: Callable[[DedupRerun], bool],
    downstream: Sequence[str] = (),
    max_rounds: int = DEFAULT_SETTLE_ROUNDS,
    *,
    hashes_asset: str = IMAGE_HASHES.name,
    clusters_asset: str = PHASH_CLUSTERS.name,
    also_stale: Callable[[], dict[str, DedupRerun]] | None = None,
) -> SettleReport:
    """Run what the dedup sensor would request, in process, until nothing is stale.

    ``also_stale``: further reruns another sensor would request (the skip-list sensor's
    partitions whose training copy changed); a dedup rerun of the same batch wins, since
    it includes skip_lists.

    For the CLI and the demo, where no daemon ticks the sensor: each round reruns every
    stale partition (``execute(rerun)`` materialises ``rerun.assets`` for ``rerun.batch``
    and returns success). One round normally settles: each rerun decides its batch
    against the whole corpus, so reruns agree with each other; a second only confirms.
    Stops at the first failed rerun (its partition stays stale, so the sensor or the next
    call retries it) or after ``max_rounds``; ``still_stale`` then names what is left.
    """
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")

    def stale() -> dict[str, DedupRerun]:
        wanted = dedup_reruns(
            lab,
            settings,
            downstream,
            registered,
            hashes_asset=hashes_asset,
            clusters_asset=clusters_asset,
        )
        if also_stale is not None:
            for batch, rerun in also_stale().items():
                wanted.setdefault(batch, rerun)
        return wanted

    report = SettleReport()
    for _ in range(max_rounds):
        wanted = stale()
        if not wanted:
            return report
        report.rounds += 1
        for rerun in wanted.values():
            report.reruns.append(rerun)
            if not execute(rerun):
                report.failed.append(rerun)
                break
        if report.failed:
            break
    report.still_stale = sorted(stale())
    return report


# ---------------------------------------------------------------------------------------------
# Checks over stored rows


@dataclass
class KeeperCheck:
    clusters: int
    no_keeper: list[str]
    several_keepers: list[str]
    keeper_not_largest: list[str]
    low_information_not_own_keeper: list[str]

    @property
    def one_keeper(self) -> bool:
        return not (self.no_keeper or self.several_keepers or self.low_information_not_own_keeper)

    @property
    def keeper_largest(self) -> bool:
        return not self.keeper_not_largest


def check_keepers(members: pa.Table, pixels: dict[tuple[str, str], int]) -> KeeperCheck:
    """Stored rows of some clusters (all their members, every batch) vs the keeper rule.

    ``members``: ``cluster_id, batch, key, is_keeper, low_information``. Low-information rows
    are singletons and must be their own keeper; the rest are grouped by ``cluster_id``.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    low_bad = []
    for r in members.to_pylist():
        if r["low_information"]:
            if not r["is_keeper"] or r["cluster_id"] != r["key"]:
                low_bad.append(f"{r['batch']}:{r['key']}")
            continue
        groups.setdefault(r["cluster_id"], []).append(r)
    no_keeper, several, not_largest = [], [], []
    for cid, rows in sorted(groups.items()):
        keepers = [r for r in rows if r["is_keeper"]]
        if not keepers:
            no_keeper.append(cid)
        elif len(keepers) > 1:
            several.append(cid)
        else:
            best = max(pixels.get((r["batch"], r["key"]), -1) for r in rows)
            k = keepers[0]
            if pixels.get((k["batch"], k["key"]), -1) < best:
                not_largest.append(cid)
    return KeeperCheck(len(groups), no_keeper, several, not_largest, low_bad)


def read_cluster_members(
    lab: Lab,
    cluster_ids: Iterable[str],
    settings: DedupSettings,
    chunk: int = DEFAULT_LOOKUP_CHUNK,
) -> tuple[pa.Table, dict[tuple[str, str], int]]:
    """Every stored member (all batches, this configuration) of the clusters, and pixels."""
    cols = ["cluster_id", "batch", "key", "is_keeper", "low_information"]
    ids = sorted(set(cluster_ids))
    fp = sql_literal(settings.fingerprint())
    members = _cluster_members(lab, ids, cols, f"config_fingerprint = {fp}", chunk)
    px = lookup_by_keys(
        lab,
        IMAGE_HASHES.name,
        IMAGE_HASHES.schema,
        _pairs(members),
        ["batch", "key", "pixels"],
        extra=f"phash_version = {sql_literal(settings.phash_version)}",
        chunk=chunk,
    )
    pixels = {
        (b, k): int(p)
        for b, k, p in zip(
            px.column("batch").to_pylist(),
            px.column("key").to_pylist(),
            px.column("pixels").to_pylist(),
            strict=True,
        )
    }
    return members, pixels


# ---------------------------------------------------------------------------------------------
# Gallery: a contact sheet of a few clusters, keeper marked


@dataclass(frozen=True)
class Tile:
    data: bytes | None  # encoded image; None draws a placeholder
    lines: tuple[str, ...]  # up to two caption lines; the first gets KEEP / dup in front
    keeper: bool


_KEEPER_RGB = (20, 150, 60)
_DUP_RGB = (200, 40, 40)


def contact_sheet(groups: Sequence[Sequence[Tile]], thumb: int = 112, title: str = "") -> bytes:
    """One row per cluster, thumbnails side by side, keeper framed green, copies red (PNG)."""
    if not groups or not any(groups):
        raise ValueError("contact_sheet needs at least one non-empty group")
    if thumb < 32:
        raise ValueError(f"thumb must be >= 32 px, got {thumb}")
    pad, text_h, frame = 6, 26, 4
    cell_w, cell_h = thumb + 2 * frame, thumb + 2 * frame + text_h
    cols = max(len(g) for g in groups)
    head = 18 if title else 0
    sheet = Image.new(
        "RGB",
        (pad + cols * (cell_w + pad), head + pad + len(groups) * (cell_h + pad)),
        (250, 250, 250),
    )
    draw = ImageDraw.Draw(sheet)
    if title:
        draw.text((pad, 3), title, fill=(0, 0, 0))
    for row, group in enumerate(groups):
        for col, tile in enumerate(group):
            x = pad + col * (cell_w + pad)
            y = head + pad + row * (cell_h + pad)
            colour = _KEEPER_RGB if tile.keeper else _DUP_RGB
            draw.rectangle((x, y, x + cell_w - 1, y + thumb + 2 * frame - 1), fill=colour)
            if tile.data is not None:
                img = decode_rgb(tile.data, draft_size=(thumb, thumb))
                img = ImageOps.contain(img, (thumb, thumb), Image.Resampling.BILINEAR)
            else:
                img = Image.new("RGB", (thumb, thumb), (200, 200, 200))
            ox = x + frame + (thumb - img.width) // 2
            oy = y + frame + (thumb - img.height) // 2
            sheet.paste(img, (ox, oy))
            status = "KEEP" if tile.keeper else "dup"
            lines = [f"{status}: {line}" if i == 0 else line for i, line in enumerate(tile.lines)]
            draw.multiline_text(
                (x + 1, y + thumb + 2 * frame + 1),
                "\n".join(_fit(line, cell_w) for line in lines[:2]),
                fill=colour,
                spacing=1,
            )
    buf = io.BytesIO()
    # 256 colours are plenty for a review sheet and keep the UI's event metadata small.
    sheet.quantize(colors=256).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def _fit(line: str, width_px: int, char_px: int = 6) -> str:
    """Shorten from the left (batch names differ at the end: ``source.chunk``)."""
    room = max(4, width_px // char_px)
    return line if len(line) <= room else "…" + line[-(room - 1) :]


def gallery_groups(
    lab: Lab, batch: str, decisions: pa.Table, max_clusters: int = 4, max_members: int = 5
) -> list[list[Tile]]:
    """Tiles for a few duplicate clusters touching ``batch`` (cross-batch ones first)."""
    rows = decisions.to_pylist()
    by_cluster: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_cluster.setdefault(r["cluster_id"], []).append(r)
    touching = [
        c for c, ms in by_cluster.items() if len(ms) > 1 and any(m["batch"] == batch for m in ms)
    ]
    touching.sort(key=lambda c: (-len({m["batch"] for m in by_cluster[c]}), -len(by_cluster[c]), c))
    chosen = touching[:max_clusters]
    members = {
        c: sorted(
            by_cluster[c],
            key=lambda m: (not m["is_keeper"], m["batch"] != batch, m["batch"], m["key"]),
        )[:max_members]
        for c in chosen
    }
    pairs = [(m["batch"], m["key"]) for c in chosen for m in members[c]]
    images = lookup_by_keys(
        lab, IMAGES.name, IMAGES.schema, pairs, ["batch", "key", "image", "width", "height"]
    )
    found = {(r["batch"], r["key"]): r for r in images.to_pylist()}
    groups = []
    for c in chosen:
        tiles = []
        for m in members[c]:
            img = found.get((m["batch"], m["key"]))
            size = f"{img['width']}x{img['height']}" if img else "?"
            tiles.append(Tile(img["image"] if img else None, (size, m["batch"]), m["is_keeper"]))
        groups.append(tiles)
    return groups


# ---------------------------------------------------------------------------------------------
# The demo's planted duplicates


class _HasPlanted(Protocol):
    planted_duplicates: list[tuple[str, str]]


def _split(ref: str) -> tuple[str, str]:
    batch, sep, path = ref.partition(":")
    if not sep or not batch or not path:
        raise ValueError(f"expected 'batch:path', got {ref!r}")
    return batch, path


def summarise_planted(lab: Lab, manifest: _HasPlanted) -> dict[str, Any]:
    """How many planted (copy, original) pairs ended in one cluster, keeper the larger image.

    A pair counts as *found* when both images have a ``phash_clusters`` row with the same
    ``cluster_id``; *keeper ok* when that cluster's keeper has at least as many pixels as
    either image of the pair. Copies under the training size cutoff are never hashed (not
    eligible), and are reported as such rather than as misses.
    """
    pairs = [(_split(c), _split(o)) for c, o in manifest.planted_duplicates]
    refs = {r for pair in pairs for r in pair}
    batches = sorted({b for b, _ in refs})
    images = pa.table({})
    if lab.exists(IMAGES.name) and refs:
        images = lab.read(
            IMAGES.name,
            ["batch", "path", "key", "width", "height"],
            f"{in_list('batch', batches)} AND {in_list('path', [p for _, p in refs])}",
        )
    key_of = {
        (r["batch"], r["path"]): (r["key"], r["width"] * r["height"]) for r in images.to_pylist()
    }
    wanted = [(b, k) for (b, _), (k, _) in key_of.items()]
    decided = lookup_by_keys(
        lab,
        PHASH_CLUSTERS.name,
        PHASH_CLUSTERS.schema,
        wanted,
        ["batch", "key", "cluster_id", "keeper_key", "keeper_batch", "is_keeper"],
    )
    hashed = lookup_by_keys(
        lab, IMAGE_HASHES.name, IMAGE_HASHES.schema, wanted, ["batch", "key", "phash", "pixels"]
    )
    dec = {(r["batch"], r["key"]): r for r in decided.to_pylist()}
    hsh = {(r["batch"], r["key"]): r for r in hashed.to_pylist()}
    px_of = {(r["batch"], r["key"]): r["pixels"] for r in hashed.to_pylist()}
    out_pairs = []
    for copy, orig in pairs:
        entry: dict[str, Any] = {"copy": ":".join(copy), "original": ":".join(orig)}
        ids = [key_of.get(copy), key_of.get(orig)]
        if None in ids:
            entry["status"] = "not_ingested"
        else:
            members = [(copy[0], ids[0][0]), (orig[0], ids[1][0])]
            if any(m not in hsh for m in members):
                entry["status"] = "not_hashed"
                entry["note"] = "under the size cutoff (not eligible) or not hashed yet"
            elif any(m not in dec for m in members):
                entry["status"] = "not_decided"
            else:
                a, b = (hsh[m]["phash"] for m in members)
                entry["hamming"] = ((a ^ b) & (2**64 - 1)).bit_count()
                d = [dec[m] for m in members]
                if d[0]["cluster_id"] != d[1]["cluster_id"]:
                    entry["status"] = "missed"
                else:
                    entry["status"] = "found"
                    keeper = (d[0]["keeper_batch"], d[0]["keeper_key"])
                    entry["keeper"] = ":".join(keeper)
                    keeper_px = px_of.get(keeper)
                    if keeper_px is None:  # keeper outside the pair: read its pixels
                        t = lookup_by_keys(
                            lab, IMAGE_HASHES.name, IMAGE_HASHES.schema, [keeper], ["pixels"]
                        )
                        keeper_px = t.column("pixels")[0].as_py() if t.num_rows else None
                    entry["keeper_ok"] = keeper_px is not None and keeper_px >= max(
                        px_of[m] for m in members
                    )
        out_pairs.append(entry)
    status = [p["status"] for p in out_pairs]
    return {
        "planted": len(out_pairs),
        "found": status.count("found"),
        "keeper_is_higher_resolution": sum(bool(p.get("keeper_ok")) for p in out_pairs),
        "not_hashed": status.count("not_hashed"),
        "missed": status.count("missed"),
        "not_decided": status.count("not_decided"),
        "not_ingested": status.count("not_ingested"),
        "pairs": out_pairs,
    }
