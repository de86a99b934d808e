"""The snapshot stage's lab tables: one row per training snapshot, one per sample it holds."""

from __future__ import annotations

import pyarrow as pa

from prx_assets.core.lab import TableSpec

TRAINING_SNAPSHOTS = TableSpec(
    name="training_snapshots",
    schema=pa.schema(
        [
            pa.field("snapshot_id", pa.string(), nullable=False),  # its name, a file name
            pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
            pa.field("status", pa.string(), nullable=False),  # live | retired
            pa.field("retired_at", pa.timestamp("us", tz="UTC")),
            pa.field("manifest_path", pa.string(), nullable=False),  # relative to shards root
            pa.field("manifest_sha256", pa.string(), nullable=False),  # the manifest self-hash
            pa.field("directories", pa.int64()),
            pa.field("samples", pa.int64()),  # written samples in those directories
            pa.field("kept_samples", pa.int64()),  # what training reads (after skip-lists)
            pa.field("lab_versions", pa.string()),  # JSON: table -> Lance version read
            pa.field("policy_fingerprints", pa.list_(pa.string())),
            pa.field("captioner_fingerprints", pa.list_(pa.string())),
            pa.field("classifier_fingerprints", pa.list_(pa.string())),
            pa.field("code_fingerprint", pa.string()),
        ]
    ),
    identity=("snapshot_id",),
    indexes=(("snapshot_id", "BTREE"),),
)

SNAPSHOT_SAMPLES = TableSpec(
    name="snapshot_samples",
    schema=pa.schema(
        [
            pa.field("snapshot_id", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("key", pa.string(), nullable=False),
            pa.field("tier", pa.int32()),
            pa.field("shape", pa.string()),
            pa.field("source", pa.string()),
            pa.field("relative_dir", pa.string()),
            pa.field("shard", pa.string()),
            pa.field("index_in_shard", pa.int32()),
            pa.field("caption_fingerprint", pa.string()),
            pa.field("class_fingerprint", pa.string()),
        ]
    ),
    # Only samples the snapshot trains on (kept by its pinned skip-lists): "which snapshots
    # contained image K" is one indexed lookup on key.
    identity=("snapshot_id", "batch", "key"),
    indexes=(("key", "BTREE"), ("snapshot_id", "BITMAP"), ("batch", "BITMAP")),
)
