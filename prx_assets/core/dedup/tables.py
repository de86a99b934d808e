"""Lab tables of the dedup stage (contracts shared by the dedup, skip-list and audit code)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from prx_assets.core.lab import TableSpec

IMAGE_HASHES = TableSpec(
    name="image_hashes",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("phash", pa.int64()),  # the 64-bit hash as signed int64 (bit-identical)
            pa.field("phash_mode", pa.string()),  # fast | reference
            pa.field("phash_version", pa.string()),  # e.g. fast-v1: a change means rehash all
            pa.field("ac_energy", pa.float32()),
            # At the threshold configured when hashed; phash_clusters re-derives the flag
            # from ac_energy with its own (configured) threshold.
            pa.field("low_information", pa.bool_()),
            pa.field("pixels", pa.int64()),  # width * height, for the keeper rule
            pa.field("file_size", pa.int64()),
            # The hash's upper and lower 32 bits (0 .. 2^32 - 1), each a BTREE: a pair within
            # Hamming 3 is within 1 on one half (pigeonhole), so near-duplicates are found by
            # probing 33 values per half (core/dedup/corpus.py, ``closure_rows``). Null on
            # rows written before they existed: then the corpus is scanned instead.
            pa.field("phash_hi", pa.int64()),
            pa.field("phash_lo", pa.int64()),
        ]
    ),
    identity=("batch", "key"),
    indexes=(
        ("key", "BTREE"),
        ("batch", "BITMAP"),
        ("phash", "BTREE"),
        ("phash_hi", "BTREE"),
        ("phash_lo", "BTREE"),
    ),
)
HALF_COLUMNS = ("phash_hi", "phash_lo")


def phash_halves(phash: pa.Array | pa.ChunkedArray) -> tuple[pa.Array, pa.Array]:
    """The upper and lower 32 bits of int64 hashes (bit patterns), as int64 in 0 .. 2^32-1;
    nulls stay null."""
    arr = phash.combine_chunks() if isinstance(phash, pa.ChunkedArray) else phash
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    u = arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    hi = (u >> np.uint64(32)).astype(np.int64)
    lo = (u & np.uint64(0xFFFFFFFF)).astype(np.int64)
    mask = ~valid
    return pa.array(hi, pa.int64(), mask=mask), pa.array(lo, pa.int64(), mask=mask)


def with_phash_halves(table: pa.Table | pa.RecordBatch) -> pa.Table | pa.RecordBatch:
    """``table`` with ``phash_hi``/``phash_lo`` derived from its ``phash`` (replacing any)."""
    hi, lo = phash_halves(table.column("phash"))
    for name, values in zip(HALF_COLUMNS, (hi, lo), strict=True):
        at = table.schema.get_field_index(name)
        field = pa.field(name, pa.int64())
        table = (
            table.set_column(at, field, values) if at >= 0 else table.append_column(field, values)
        )
    return table


PHASH_CLUSTERS = TableSpec(
    name="phash_clusters",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            # The keeper's key: unchanged while the keeper is, so a lower-resolution copy
            # joining later changes no stored row of the batches already decided.
            pa.field("cluster_id", pa.string()),
            # Members when this batch was decided. It can lag behind (by copies that change
            # no decision of this batch); count rows by cluster_id for the current size.
            pa.field("cluster_size", pa.int32()),
            pa.field("keeper_key", pa.string()),
            pa.field("keeper_batch", pa.string()),
            pa.field("is_keeper", pa.bool_()),  # False -> skip-list reason "duplicate"
            pa.field("low_information", pa.bool_()),  # flagged for review, never merged
            pa.field("radius", pa.int32()),  # Hamming radius the decision used (0 = exact)
            pa.field("phash_version", pa.string()),
            # Radius, low-information threshold, hash version and keeper rule together: rows
            # with another value were decided under another configuration.
            pa.field("config_fingerprint", pa.string()),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("cluster_id", "BTREE")),
)

DEDUP_DIRTY = TableSpec(
    name="dedup_dirty",
    schema=pa.schema(
        [
            pa.field("dirty_id", pa.string(), nullable=False),  # digest of the other columns
            pa.field("batch", pa.string(), nullable=False),  # the batch whose rows are stale
            pa.field("key", pa.string(), nullable=False),
            pa.field("cluster_id", pa.string()),  # the cluster it now belongs to
            pa.field("change", pa.string()),  # stored -> current decision, human-readable
            pa.field("detected_by", pa.string()),  # the batch whose phash_clusters saw it
            pa.field("detected_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    identity=("dirty_id",),
    indexes=(),  # a handful of pending rows at any time: scans are cheaper than indexes
)

DEDUP_STATE = TableSpec(
    name="dedup_state",
    schema=pa.schema(
        [
            pa.field("batch", pa.string(), nullable=False),
            pa.field("config_fingerprint", pa.string()),  # what the batch was decided under
            pa.field("radius", pa.int32()),
            pa.field("phash_version", pa.string()),
            pa.field("images", pa.int64()),
            pa.field("kept", pa.int64()),
            pa.field("duplicates", pa.int64()),  # non-keepers (skipped in training)
            pa.field("low_information", pa.int64()),
            pa.field("decided_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    # One row per decided batch, written with its phash_clusters rows: the dedup sensor finds
    # batches decided under another configuration by reading these rows only.
    identity=("batch",),
    indexes=(),
)
