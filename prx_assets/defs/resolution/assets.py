"""resolution_profile: size facts per image, computed from metadata columns only."""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from prx_assets.core.resolution.profile import MIN_SIDE
from prx_assets.core.resolution.runner import profile_batch
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.metadata import counts_table, png_markdown
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource


@asset(
    partitions_def=BATCHES,
    deps=[raw_images],
    group_name="ingest",
    kinds={"lance"},
    code_version="resolution_profile-v1",
    description=(
        f"Megapixels, aspect, eligibility (short side >= {MIN_SIDE} px) and each image's "
        "bucket tier: the highest it fills without upscaling, or 512 with a recorded "
        "upscale (at most 512/384) when it fills none. Reads width/height only."
    ),
)
def resolution_profile(context: AssetExecutionContext, lab: LabResource) -> MaterializeResult:
    run = profile_batch(lab.lab(), context.partition_key)
    summary = run.summary
    return MaterializeResult(
        metadata={
            "images": summary.images,
            "eligible": summary.eligible,
            "ineligible": summary.images - summary.eligible,
            "ineligible_reasons": counts_table(summary.ineligible_reasons, "reason"),
            "images_per_max_tier": counts_table(summary.tier_counts, "tier", sort=False),
            "upscaled_to_lowest_tier": summary.upscaled_to_lowest_tier,
            "megapixels_percentiles": MetadataValue.json(summary.megapixel_percentiles),
            "aspect_percentiles": MetadataValue.json(summary.aspect_percentiles),
            "histogram": png_markdown(run.histogram_png, "resolution histogram"),
            "resolution_lance_version": run.version,
        }
    )
