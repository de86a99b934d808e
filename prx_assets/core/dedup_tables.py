"""Lab tables of the dedup stage (contracts shared by the dedup, skip-list and audit code)."""

from __future__ import annotations

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
            pa.field("low_information", pa.bool_()),  # never merged on the hash alone
            pa.field("pixels", pa.int64()),  # width * height, for the keeper rule
            pa.field("file_size", pa.int64()),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("phash", "BTREE")),
)

PHASH_CLUSTERS = TableSpec(
    name="phash_clusters",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("cluster_id", pa.string()),  # stable: the keeper's key (see core docs)
            pa.field("cluster_size", pa.int32()),
            pa.field("keeper_key", pa.string()),
            pa.field("keeper_batch", pa.string()),
            pa.field("is_keeper", pa.bool_()),  # False -> skip-list reason "duplicate"
            pa.field("low_information", pa.bool_()),  # flagged for review, never merged
            pa.field("radius", pa.int32()),  # Hamming radius the decision used (0 = exact)
            pa.field("phash_version", pa.string()),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("cluster_id", "BTREE")),
)
