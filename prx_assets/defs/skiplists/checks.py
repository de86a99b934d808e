"""Asset checks of the skip-list stage, evaluated inside ``skip_lists`` on what it read.

Why a caption-coverage check here: an image without a usable caption (its source had no alt
text, the captioner refused it) is skipped as ``no_caption``, which keeps training clean but
can silently empty a batch; this check turns "most of the batch has no caption" into a red
partition instead of a metadata count. Partitioned like the caption stage's checks.
"""

import warnings

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    MetadataValue,
    PreviewWarning,
)

from prx_assets.core.skiplists.decisions import CaptionCoverage
from prx_assets.defs.partitions import BATCHES

CAPTION_COVERAGE = "skip_lists_caption_coverage"
MAX_LISTED = 20


def caption_coverage_spec(asset: str) -> AssetCheckSpec:
    with warnings.catch_warnings():
        # Partitioned checks are "preview" in 1.13; chosen knowingly, as in the caption stage.
        warnings.simplefilter("ignore", PreviewWarning)
        return AssetCheckSpec(
            CAPTION_COVERAGE,
            asset=asset,
            partitions_def=BATCHES,
            description=(
                "ERROR when more than the configured share (skip_policy.max_no_caption_share) "
                "of the batch's eligible images has no usable caption (no caption row, or a "
                "null, empty or whitespace caption); those images are skipped as no_caption."
            ),
        )


def caption_coverage_result(coverage: CaptionCoverage, max_share: float) -> AssetCheckResult:
    more = coverage.without_caption - MAX_LISTED
    return AssetCheckResult(
        check_name=CAPTION_COVERAGE,
        passed=coverage.share <= max_share,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "eligible_images": coverage.eligible,
            "without_caption": coverage.without_caption,
            "share_without_caption": round(coverage.share, 4),
            "max_share": max_share,
            "keys_without_caption": MetadataValue.json(
                coverage.keys[:MAX_LISTED] + ([f"... and {more} more"] if more > 0 else [])
            ),
        },
    )
