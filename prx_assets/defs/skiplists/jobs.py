"""The jobs the opt-out sensor requests: one per partitions definition it targets."""

from dagster import define_asset_job

from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.skiplists.assets import SKIP_LISTS_ASSET
from prx_assets.defs.skiplists.intake import OPT_OUT_LISTS, OPT_OUT_LISTS_ASSET

opt_out_intake_job = define_asset_job(
    "opt_out_intake",
    selection=[OPT_OUT_LISTS_ASSET],
    partitions_def=OPT_OUT_LISTS,
    description="The intake of one opt-out list (the opt-out sensor's first request).",
)

opt_out_skip_lists_job = define_asset_job(
    "opt_out_skip_lists",
    selection=[SKIP_LISTS_ASSET],
    partitions_def=BATCHES,
    description=(
        "skip_lists alone, for one partition a recorded opt-out list affects (the opt-out "
        "sensor's second request)."
    ),
)
