"""The snapshot stage's lab tables: one row per training snapshot, one per directory it
froze (with a digest of its members, so a diff skips what did not change), and one per
shard of each skip-list generation a snapshot froze (shared by every snapshot that froze
the same generation). No row per sample: which samples a snapshot holds is derived from
these and ``shard_samples`` at the snapshot's pinned version (core/snapshots/members.py),
so a snapshot costs O(directories) in the lab.

``snapshot_samples`` is the per-sample table older versions wrote; it is no longer written
and is read only for the snapshots that have rows in it (made before this change)."""

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
    # Legacy (read-only): snapshots made by older versions listed their samples here.
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

SKIP_GENERATIONS = TableSpec(
    name="skip_generations",
    schema=pa.schema(
        [
            pa.field("relative_dir", pa.string(), nullable=False),
            pa.field("generation", pa.string(), nullable=False),  # skiplists.json self-hash
            pa.field("shard", pa.string(), nullable=False),
            pa.field("sidecar_sha256", pa.string(), nullable=False),  # as the manifest names it
            pa.field("samples", pa.int32(), nullable=False),  # samples in the shard
            pa.field("skipped", pa.list_(pa.int32()), nullable=False),  # sorted indices
        ]
    ),
    # Content-addressed by (directory, generation): written once, the first time a snapshot
    # freezes that generation, from the verified sidecars; later snapshots of an unchanged
    # directory add nothing. A generation's rows are never replaced or deleted.
    identity=("relative_dir", "generation", "shard"),
    indexes=(("relative_dir", "BTREE"), ("generation", "BTREE")),
)
