"""resolution_profile: size facts per image, computed from metadata columns only."""

import numpy as np
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from prx_assets.core.plots import resolution_histogram
from prx_assets.core.resolution.profile import MIN_SIDE, profile_images, summarise
from prx_assets.core.tables import IMAGES, RESOLUTION
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
    store = lab.lab()
    batch = context.partition_key
    images = store.read_batch(IMAGES.name, batch, columns=["key", "batch", "width", "height"])
    profile = profile_images(images)
    written = store.replace_partition(RESOLUTION, batch, profile)
    summary = summarise(profile)
    w = profile.column("width").to_numpy().astype(np.int64)
    h = profile.column("height").to_numpy().astype(np.int64)
    png = resolution_histogram(w, h, MIN_SIDE, f"{batch}: {summary.images} images")
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
            "histogram": png_markdown(png, "resolution histogram"),
            "resolution_lance_version": written["version"],
        }
    )
