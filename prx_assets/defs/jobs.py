"""Jobs shared by sensors and the CLI."""

from dagster import AssetSelection, define_asset_job

from prx_assets.defs.partitions import BATCHES

# Every per-batch stage; later stages join by their group.
BATCH_STAGE_GROUPS = ("ingest", "captions", "dedup", "shards", "skiplists")

batch_pipeline_job = define_asset_job(
    "batch_pipeline",
    selection=AssetSelection.groups(*BATCH_STAGE_GROUPS),
    partitions_def=BATCHES,
    description="Every per-batch stage for one batch, in dependency order.",
)
