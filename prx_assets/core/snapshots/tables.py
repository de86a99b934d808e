"""The snapshot stage's lab tables: one row per training snapshot, one per directory it
froze (with a digest of its members, so a diff skips what did not change), one per sample it
holds."""

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

SNAPSHOT_DIRECTORIES = TableSpec(
    name="snapshot_directories",
    schema=pa.schema(
        [
            pa.field("snapshot_id", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("relative_dir", pa.string(), nullable=False),
            pa.field("index_sha256", pa.string(), nullable=False),
            pa.field("generation", pa.string(), nullable=False),
            # sha256 over the directory's kept samples as ``snapshot_samples`` holds them
            # (``members_digest``): two snapshots with the same digest for a directory train
            # on the same samples there, with the same captions, classes and sources.
            pa.field("members_sha256", pa.string(), nullable=False),
            pa.field("samples", pa.int64(), nullable=False),
            pa.field("kept_samples", pa.int64(), nullable=False),
        ]
    ),
    # A diff reads two snapshots' rows (O(directories)) and then only the samples of the
    # batches whose directories differ.
    identity=("snapshot_id", "relative_dir"),
    indexes=(("snapshot_id", "BITMAP"), ("batch", "BITMAP")),
)
