"""Asset checks of the skip-list stage, evaluated inside the asset on what it read.

Why a caption-coverage check here: an image without a usable caption (its source had no alt
text, the captioner refused it) is skipped as ``no_caption``, which keeps training clean but
can silently empty a batch; this check turns "most of the batch has no caption" into a red
partition instead of a metadata count. Partitioned like the caption stage's checks.

Why a check on each opt-out list: a rejected list is a legal request that is not applied
until someone fixes the file; a red partition of ``opt_out_lists`` says so where a data lead
looks, with the reason.
"""

import warnings

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    MetadataValue,
    PartitionsDefinition,
    PreviewWarning,
)

from prx_assets.core.skiplists.decisions import CaptionCoverage
from prx_assets.core.skiplists.intake import IntakeOutcome
from prx_assets.defs.partitions import BATCHES

CAPTION_COVERAGE = "skip_lists_caption_coverage"
LIST_ACCEPTED = "opt_out_list_accepted"
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


def caption_coverage_over_range(
    coverages: dict[str, CaptionCoverage], max_share: float
) -> AssetCheckResult:
    """The check of a run over several partitions (an opt-out's or a policy's batched
    reruns): Dagster records one evaluation per run there, so it fails when any partition
    is over the share and names those, worst first, with each one's figures."""
    over = sorted(
        ((b, c) for b, c in coverages.items() if c.share > max_share),
        key=lambda bc: (-bc[1].share, bc[0]),
    )
    worst = max(coverages.items(), key=lambda bc: (bc[1].share, bc[0]))[1] if coverages else None
    return AssetCheckResult(
        check_name=CAPTION_COVERAGE,
        passed=not over,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "partitions_checked": len(coverages),
            "partitions_over_share": MetadataValue.json(
                [
                    {"batch": b, "eligible": c.eligible, "without_caption": c.without_caption}
                    for b, c in over[:MAX_LISTED]
                ]
                + ([f"... and {len(over) - MAX_LISTED} more"] if len(over) > MAX_LISTED else [])
            ),
            "worst_share_without_caption": round(worst.share, 4) if worst else 0.0,
            "max_share": max_share,
        },
    )


def list_accepted_spec(asset: str, partitions_def: PartitionsDefinition) -> AssetCheckSpec:
    """A rejected opt-out list is a legal request not applied: someone must fix the file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreviewWarning)
        return AssetCheckSpec(
            LIST_ACCEPTED,
            asset=asset,
            partitions_def=partitions_def,
            description=(
                "Passes when the list was accepted. A rejected list (malformed, too large, "
                "changed while read) fails its partition's run instead, with the reason, so "
                "this check does not run for it: nothing of it is applied until a corrected "
                "file is dropped as a new list."
            ),
        )


def list_accepted_result(outcome: IntakeOutcome) -> AssetCheckResult:
    return AssetCheckResult(
        check_name=LIST_ACCEPTED,
        passed=outcome.accepted,
        severity=AssetCheckSeverity.ERROR,
        metadata={"status": outcome.status, "reason": MetadataValue.text(outcome.reason or "")},
    )
