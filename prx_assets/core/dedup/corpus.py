"""Read what can touch one batch's dedup decisions from the lab, through index look-ups.

Why per batch and not one corpus-wide pass: a new batch must not re-hash the old ones nor
re-decide every batch. ``phash_clusters(B)`` therefore reads only what can touch B's
decisions: B's hashes, the corpus rows sharing one of them (Lance ``phash`` BTREE, IN-lists
in chunks; for a radius r > 0 the component closure found by multi-index hashing), and the
former members of B's previous clusters (so removing an image from B re-decides its old
partners). Those rows hold every cluster touching B *whole*, so the keeper rule applied to
them is the corpus-wide decision (:func:`prx_assets.core.dedup.decisions.plan_batch`).

Every reader here takes a :class:`~prx_assets.core.lab.LabView` (or a ``Lab``, read through
a view of its own): each table is opened once per gather, so all of a gather's reads of
``image_hashes`` see one version, which :class:`Gathered` records (the cluster runner
compares it after writing to know whether hashes landed meanwhile).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from prx_assets.core.batching import chunked
from prx_assets.core.dedup.decisions import (
    HASH_COLUMNS,
    STORED_COLUMNS,
    DedupSettings,
    closure_mask,
)
from prx_assets.core.dedup.tables import HALF_COLUMNS
from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.tables import IMAGE_HASHES, PHASH_CLUSTERS

DEFAULT_LOOKUP_CHUNK = 1024

Reader = Lab | LabView


def as_view(reader: Reader) -> LabView:
    """A view opening each table once; a view is used as it is (its snapshot, its counts)."""
    return reader.view() if isinstance(reader, Lab) else reader


def _int_list(column: str, values: Iterable[int]) -> str:
    vals = sorted({int(v) for v in values})
    return f"{column} IN ({', '.join(str(v) for v in vals)})" if vals else "false"


def _empty(schema: pa.Schema, columns: Sequence[str]) -> pa.Table:
    return pa.Table.from_pylist([], schema=pa.schema([schema.field(c) for c in columns]))


def _read(
    view: LabView, table: str, schema: pa.Schema, columns: Sequence[str], where: str
) -> pa.Table:
    """A pushed-down read; an absent table reads as empty *with* the columns asked for."""
    if not view.exists(table):
        return _empty(schema, columns)
    return view.read(table, list(columns), where)


def _concat(parts: list[pa.Table], schema: pa.Schema, columns: Sequence[str]) -> pa.Table:
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return _empty(schema, columns)
    return pa.concat_tables(parts)


def pairs_of(table: pa.Table) -> list[tuple[str, str]]:
    """The (batch, key) pairs of a table's rows, in order."""
    return list(
        zip(table.column("batch").to_pylist(), table.column("key").to_pylist(), strict=True)
    )


def cluster_members(
    reader: Reader,
    cluster_ids: Iterable[str],
    columns: Sequence[str],
    chunk: int = DEFAULT_LOOKUP_CHUNK,
    where: str = "cluster_id IS NOT NULL",
) -> pa.Table:
    """Stored ``phash_clusters`` rows of these clusters, every batch (``cluster_id`` BTREE),
    read in IN-list chunks; ``where`` narrows them further."""
    view = as_view(reader)
    ids = sorted(set(cluster_ids))
    parts = [
        _read(
            view,
            PHASH_CLUSTERS.name,
            PHASH_CLUSTERS.schema,
            list(columns),
            f"{in_list('cluster_id', part)} AND {where}",
        )
        for part in chunked(ids, chunk)
    ]
    return _concat(parts, PHASH_CLUSTERS.schema, columns)


def lookup_by_hashes(
    reader: Reader, hashes: Iterable[int], version: str, chunk: int = DEFAULT_LOOKUP_CHUNK
) -> pa.Table:
    """``image_hashes`` rows (``HASH_COLUMNS``) of ``version`` whose phash is in ``hashes``.

    ``hashes`` may be signed or unsigned 64-bit values; one BTREE lookup per chunk.
    """
    view = as_view(reader)
    signed = sorted({int(np.uint64(int(h) & (2**64 - 1)).view(np.int64)) for h in hashes})
    parts = [
        _read(
            view,
            IMAGE_HASHES.name,
            IMAGE_HASHES.schema,
            HASH_COLUMNS,
            f"{_int_list('phash', part)} AND phash_version = {sql_literal(version)}",
        )
        for part in chunked(signed, chunk)
    ]
    return _concat(parts, IMAGE_HASHES.schema, HASH_COLUMNS)


def lookup_by_keys(
    reader: Reader,
    table: str,
    schema: pa.Schema,
    pairs: Iterable[tuple[str, str]],
    columns: Sequence[str],
    extra: str | None = None,
    chunk: int = DEFAULT_LOOKUP_CHUNK,
) -> pa.Table:
    """Rows of ``table`` for (batch, key) pairs: a ``key`` BTREE lookup, then the exact pairs."""
    view = as_view(reader)
    wanted = set(pairs)
    keys = sorted({k for _, k in wanted})
    cols = list(dict.fromkeys(["batch", "key", *columns]))
    parts = []
    for part in chunked(keys, chunk):
        where = in_list("key", part) + (f" AND {extra}" if extra else "")
        got = _read(view, table, schema, cols, where)
        if got.num_rows:
            keep = [pair in wanted for pair in pairs_of(got)]
            parts.append(got.filter(pa.array(keep, pa.bool_())))
    return _concat(parts, schema, cols).select(list(columns))


def corpus_hashes(reader: Reader, settings: DedupSettings) -> tuple[np.ndarray, np.ndarray]:
    """The phash (int64) and row id of every non-low-information row of the configured
    version (radius > 0 only): one scan, in which the closure is found and from which its
    rows are then taken by id."""
    where = (
        f"phash_version = {sql_literal(settings.phash_version)} "
        f"AND ac_energy >= {float(settings.low_info_threshold)!r}"
    )
    view = as_view(reader)
    if not view.exists(IMAGE_HASHES.name):
        return np.empty(0, np.int64), np.empty(0, np.uint64)
    table = view.read(IMAGE_HASHES.name, ["phash"], where, with_row_id=True)
    if not table.num_rows:
        return np.empty(0, np.int64), np.empty(0, np.uint64)
    return (
        table.column("phash").to_numpy().astype(np.int64),
        table.column("_rowid").to_numpy().astype(np.uint64),
    )


# Near-duplicate search through the hash halves' indexes (``IMAGE_HASHES``: ``phash_hi``,
# ``phash_lo``): a pair within Hamming r <= 3 is within r // 2 <= 1 on one 32-bit half, so a
# frontier hash's candidates are the rows whose upper or lower half is one of the 33 values
# within 1 of its own (r <= 1: its own halves only).
INDEX_MAX_RADIUS = 3
NEAR_AUTO, NEAR_INDEX, NEAR_SCAN = "auto", "index", "scan"
# ``auto`` probes the indexes while their probe values are fewer than the corpus rows over
# this ratio, else scans the corpus' hashes: what a probe value costs against a scanned row
# (``python -m benchmarks.bench_dedup_radius`` runs both paths side by side and prints it:
# 90 and 60.5 at 10^6 and 10^7 hashes in bench_dedup_radius.json, 60-166 over three runs
# here). Past ``SCAN_MAX_ROWS`` it always probes: the scan
# holds a hash and a row id (16 bytes) per corpus row in the step's memory (4 GiB there).
PROBE_TO_SCAN_COST = 150
SCAN_MAX_ROWS = 1 << 28
_BITS32 = np.uint64(0xFFFFFFFF)


def _half_ball(values: np.ndarray, radius: int) -> np.ndarray:
    """The distinct 32-bit values within Hamming ``radius`` (0 or 1) of ``values``."""
    if radius == 0:
        return np.unique(values)
    flips = np.left_shift(np.int64(1), np.arange(32, dtype=np.int64))
    near = (values[:, None] ^ flips[None, :]).ravel()
    return np.unique(np.concatenate([values, near]))


def probe_values(frontier: int, radius: int) -> int:
    """How many index values a frontier of that many hashes probes (both halves)."""
    return 2 * frontier * (1 + 32 * (radius // 2))


def halves_indexed(view: LabView, settings: DedupSettings) -> bool:
    """Whether every row of the configured version has its hash halves (columns present,
    none null): only then can the indexes find every near-duplicate."""
    schema = view.schema(IMAGE_HASHES.name)
    if schema is None or not all(c in schema.names for c in HALF_COLUMNS):
        return False
    nulls = view.read(
        IMAGE_HASHES.name,
        ["phash"],
        f"phash_hi IS NULL AND phash_version = {sql_literal(settings.phash_version)}",
        limit=1,
    )
    return nulls.num_rows == 0


def near_path(view: LabView, seeds: int, settings: DedupSettings, mode: str = NEAR_AUTO) -> str:
    """``index`` or ``scan`` for a closure of ``seeds`` hashes (``mode``: ``auto`` chooses by
    cost, ``index`` insists where it is exact, ``scan`` always scans)."""
    if mode not in (NEAR_AUTO, NEAR_INDEX, NEAR_SCAN):
        raise ValueError(f"near-duplicate path {mode!r}: use auto, index or scan")
    if mode == NEAR_SCAN or settings.radius > INDEX_MAX_RADIUS:
        return NEAR_SCAN
    if not halves_indexed(view, settings):
        return NEAR_SCAN  # rows without halves would be missed: scan (exact)
    if mode == NEAR_INDEX:
        return NEAR_INDEX
    rows = view.count_rows(IMAGE_HASHES.name)
    cost = probe_values(seeds, settings.radius) * PROBE_TO_SCAN_COST
    return NEAR_INDEX if cost < rows or rows > SCAN_MAX_ROWS else NEAR_SCAN


def _indexed_closure(
    view: LabView, seeds: np.ndarray, settings: DedupSettings, chunk: int
) -> tuple[np.ndarray, dict[str, int]]:
    """Row ids of the radius closure of ``seeds``, found through the halves' indexes: each
    round probes the frontier's half values, keeps the candidates joined to the frontier by
    a chain within the radius (``closure_mask`` over the candidates: every step a real
    pair), and continues from the hashes it had not seen. A member y of the closure is
    within r of some member x found earlier, so y is among x's candidates: the rounds find
    exactly what ``closure_mask`` over a scan of the whole corpus finds."""
    radius, ball = settings.radius, settings.radius // 2
    where = (
        f"phash_version = {sql_literal(settings.phash_version)} "
        f"AND ac_energy >= {float(settings.low_info_threshold)!r}"
    )
    frontier = np.unique(np.asarray(seeds, dtype=np.int64).view(np.uint64))
    seen = np.empty(0, np.uint64)
    members: dict[int, None] = {}
    probes = candidates = rounds = 0
    while len(frontier):
        rounds += 1
        seen = np.union1d(seen, frontier)
        parts = []
        for column, values in (
            ("phash_hi", (frontier >> np.uint64(32)).astype(np.int64)),
            ("phash_lo", (frontier & _BITS32).astype(np.int64)),
        ):
            probe = _half_ball(values, ball)
            probes += len(probe)
            for part in chunked(probe.tolist(), chunk):
                got = view.read(
                    IMAGE_HASHES.name,
                    ["phash"],
                    f"{_int_list(column, part)} AND {where}",
                    with_row_id=True,
                )
                if got.num_rows:
                    parts.append(got)
        if not parts:
            break
        got = pa.concat_tables(parts)
        hashes = got.column("phash").to_numpy().astype(np.int64)
        row_ids = got.column("_rowid").to_numpy().astype(np.uint64)
        candidates += len(hashes)
        mask = closure_mask(frontier.view(np.int64), hashes, radius)
        for rid in row_ids[mask].tolist():
            members[rid] = None
        frontier = np.setdiff1d(np.unique(hashes[mask].view(np.uint64)), seen)
    read = {"probe_values": probes, "candidate_rows": candidates, "closure_rounds": rounds}
    return np.fromiter(members, dtype=np.uint64, count=len(members)), read


def closure_rows(
    view: LabView,
    seeds: Sequence[int],
    settings: DedupSettings,
    mode: str = NEAR_AUTO,
    chunk: int = 8192,
) -> tuple[pa.Table, dict[str, int]]:
    """The non-low-information ``image_hashes`` rows (``HASH_COLUMNS``) of every hash in
    the radius closure of ``seeds`` over the corpus, and what was read.

    Two exact paths (``near_path``): through the hash halves' indexes (``_indexed_closure``:
    the cost follows the candidates, for r <= 3 and a corpus whose rows all have halves), or
    one scan of the corpus' hashes and row ids (``closure_mask``: the cost follows the
    corpus). Either way the rows are then taken by row id: a closure's rows are scattered
    over the corpus, where each ``phash`` IN-list look-up pays an index search and a take
    (the whole gather: ``benchmarks/bench_dedup_radius.py``)."""
    # Signed (as stored) or unsigned 64-bit values: the same bit patterns.
    seed_array = np.array([int(h) & 0xFFFFFFFFFFFFFFFF for h in seeds], np.uint64).view(np.int64)
    path = near_path(view, len(np.unique(seed_array)), settings, mode)
    if path == NEAR_INDEX:
        taken, lookups = _indexed_closure(view, seed_array, settings, chunk)
        taken = np.sort(taken)
        lookups["closure_hashes"] = -1  # filled from the rows below
        lookups["corpus_hashes_scanned"] = 0
    else:
        hashes, row_ids = corpus_hashes(view, settings)
        mask = closure_mask(seed_array, hashes, settings.radius)
        taken = np.sort(row_ids[mask])
        lookups = {
            "closure_hashes": len(np.unique(hashes[mask])),
            "corpus_hashes_scanned": len(hashes),
        }
    rows = (
        view.take_rows(IMAGE_HASHES.name, taken.tolist(), HASH_COLUMNS)
        if len(taken)
        else _empty(IMAGE_HASHES.schema, HASH_COLUMNS)
    )
    if path == NEAR_INDEX:
        lookups["closure_hashes"] = len(set(rows.column("phash").to_pylist()))
    lookups["near_path_index"] = int(path == NEAR_INDEX)
    return rows.select(list(HASH_COLUMNS)), lookups


@dataclass
class Gathered:
    """The rows one batch's decision needs, as read at one ``image_hashes`` version."""

    corpus: pa.Table  # HASH_COLUMNS
    stored: pa.Table  # STORED_COLUMNS of the other batches' members
    lookups: dict[str, int]
    hashes_version: int | None = None  # the image_hashes version every hash read saw


def gather_corpus(
    reader: Reader,
    batch: str,
    settings: DedupSettings,
    chunk: int = DEFAULT_LOOKUP_CHUNK,
    near: str = NEAR_AUTO,
) -> Gathered:
    """Every row that can take part in a decision of ``batch``, and the stored decisions.

    1. ``batch``'s hashes of the configured version;
    2. the former members of ``batch``'s stored clusters (``cluster_id`` BTREE) and their
       hashes, so an image that left ``batch`` re-decides its old cluster;
    3. every row sharing one of those hashes (``phash`` BTREE), or for r > 0 every row in
       their components (``closure_rows``: through the hash halves' indexes, or
       :func:`~prx_assets.core.dedup.decisions.closure_mask` over one scan of the corpus'
       hashes, whichever ``near_path`` finds cheaper; ``near`` forces one); the rows then
       taken by id;
    4. the stored ``phash_clusters`` rows of the other batches' members (``key`` BTREE).
    """
    view = as_view(reader)
    version = settings.phash_version
    thr = settings.low_info_threshold
    own = _read(
        view,
        IMAGE_HASHES.name,
        IMAGE_HASHES.schema,
        HASH_COLUMNS,
        f"batch = {sql_literal(batch)} AND phash_version = {sql_literal(version)}",
    )
    old = _read(
        view,
        PHASH_CLUSTERS.name,
        PHASH_CLUSTERS.schema,
        ["cluster_id"],
        f"batch = {sql_literal(batch)}",
    )
    old_ids = sorted({c for c in old.column("cluster_id").to_pylist() if c is not None})
    former = cluster_members(
        view, old_ids, STORED_COLUMNS, chunk, where=f"batch != {sql_literal(batch)}"
    )
    former_hashes = lookup_by_keys(
        view,
        IMAGE_HASHES.name,
        IMAGE_HASHES.schema,
        pairs_of(former),
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
        members, read = closure_rows(view, seeds, settings, mode=near)
        lookups.update(read)
    else:
        members = lookup_by_hashes(view, [int(s) for s in seeds], version, chunk)
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
        view,
        PHASH_CLUSTERS.name,
        PHASH_CLUSTERS.schema,
        pairs_of(others),
        STORED_COLUMNS,
        chunk=chunk,
    )
    lookups["corpus_rows"] = corpus.num_rows
    return Gathered(
        corpus=corpus,
        stored=stored,
        lookups=lookups,
        hashes_version=view.version(IMAGE_HASHES.name),
    )
