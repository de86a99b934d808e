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


def closure_rows(
    view: LabView, seeds: Sequence[int], settings: DedupSettings
) -> tuple[pa.Table, dict[str, int]]:
    """The non-low-information ``image_hashes`` rows (``HASH_COLUMNS``) of every hash in
    the radius closure of ``seeds`` over the corpus (``closure_mask`` on one scan of the
    corpus' hashes and row ids), and what was read.

    Why by row id: the scan that gives the corpus' hashes gives each row's id too, and a
    closure's rows are scattered over the corpus, where each ``phash`` IN-list look-up
    pays an index search and a take (the whole gather: ``benchmarks/bench_dedup_radius.py``)."""
    hashes, row_ids = corpus_hashes(view, settings)
    mask = closure_mask(np.asarray(seeds, dtype=np.int64), hashes, settings.radius)
    taken = np.sort(row_ids[mask])
    rows = (
        view.take_rows(IMAGE_HASHES.name, taken.tolist(), HASH_COLUMNS)
        if len(taken)
        else _empty(IMAGE_HASHES.schema, HASH_COLUMNS)
    )
    lookups = {
        "closure_hashes": len(np.unique(hashes[mask])),
        "corpus_hashes_scanned": len(hashes),
    }
    return rows.select(list(HASH_COLUMNS)), lookups


@dataclass
class Gathered:
    """The rows one batch's decision needs, as read at one ``image_hashes`` version."""

    corpus: pa.Table  # HASH_COLUMNS
    stored: pa.Table  # STORED_COLUMNS of the other batches' members
    lookups: dict[str, int]
    hashes_version: int | None = None  # the image_hashes version every hash read saw


def gather_corpus(
    reader: Reader, batch: str, settings: DedupSettings, chunk: int = DEFAULT_LOOKUP_CHUNK
) -> Gathered:
    """Every row that can take part in a decision of ``batch``, and the stored decisions.

    1. ``batch``'s hashes of the configured version;
    2. the former members of ``batch``'s stored clusters (``cluster_id`` BTREE) and their
       hashes, so an image that left ``batch`` re-decides its old cluster;
    3. every row sharing one of those hashes (``phash`` BTREE), or for r > 0 every row in
       their components (:func:`~prx_assets.core.dedup.decisions.closure_mask` over one
       scan of the corpus' hashes; the rows then taken by id);
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
        members, read = closure_rows(view, seeds, settings)
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
