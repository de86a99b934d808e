"""Asset checks of the caption stage, evaluated inside the assets on what was stored.

The checks are partitioned by batch (``AssetCheckSpec(partitions_def=BATCHES)``, a preview
feature of Dagster 1.13): each partition has its own check status instead of the last run's
result standing for every batch.
"""

import warnings

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    MetadataValue,
    PreviewWarning,
)

from prx_assets.core.captions.tables import CaptionStats
from prx_assets.core.captions.verify import SyncReport
from prx_assets.defs.captions.resources import ALT_TEXT_NOTE
from prx_assets.defs.partitions import BATCHES

CAPTIONS_LENGTH_WINDOW = "captions_length_window"
CLASSES_IN_SYNC = "caption_classes_in_sync"
EMBEDDINGS_IN_SYNC = "caption_embeddings_in_sync"


def _spec(name: str, asset: str, description: str) -> AssetCheckSpec:
    with warnings.catch_warnings():
        # Partitioned checks are "preview" in 1.13; chosen knowingly (see module docstring).
        warnings.simplefilter("ignore", PreviewWarning)
        return AssetCheckSpec(name, asset=asset, partitions_def=BATCHES, description=description)


def length_window_spec(asset: str = "captions") -> AssetCheckSpec:
    return _spec(
        CAPTIONS_LENGTH_WINDOW,
        asset,
        "Captions outside the prompt's 100-200 word window (WARN, with counts). Not "
        "applicable to alt-text fallback captions (passes, saying so, with their counts).",
    )


def classes_in_sync_spec(asset: str = "caption_classes") -> AssetCheckSpec:
    return _spec(
        CLASSES_IN_SYNC,
        asset,
        "Every caption of the partition has exactly one class row, made from the same "
        "captioner fingerprint, with probabilities summing to 1 and the label their argmax.",
    )


def embeddings_in_sync_spec(asset: str = "caption_embeddings") -> AssetCheckSpec:
    return _spec(
        EMBEDDINGS_IN_SYNC,
        asset,
        "Every non-empty caption of the partition has exactly one unit-norm embedding, made "
        "from the same captioner fingerprint.",
    )


def length_window_result(stats: CaptionStats, is_fallback: bool) -> AssetCheckResult:
    lo, hi = stats.window
    metadata = {
        "captions": stats.captions,
        "outside_window": stats.outside,
        "too_short": stats.too_short,
        "too_long": stats.too_long,
        "empty": stats.empty,
        "window_words": f"{lo}-{hi}",
    }
    if is_fallback:
        # The window is the VLM prompt's; alt text was never asked to meet it. Failing here
        # would leave a permanent warning on every offline graph that says nothing.
        metadata["note"] = MetadataValue.text(
            f"{ALT_TEXT_NOTE}; not applicable: the window is the VLM prompt's"
        )
        metadata["applies"] = False
        return AssetCheckResult(
            check_name=CAPTIONS_LENGTH_WINDOW,
            passed=True,
            severity=AssetCheckSeverity.WARN,
            metadata=metadata,
            description=(
                f"not applicable: fallback captions (alt text); {stats.outside} of "
                f"{stats.captions} outside {lo}-{hi} words"
            ),
        )
    metadata["applies"] = True
    return AssetCheckResult(
        check_name=CAPTIONS_LENGTH_WINDOW,
        passed=stats.outside == 0,
        severity=AssetCheckSeverity.WARN,
        metadata=metadata,
        description=f"{stats.outside} of {stats.captions} captions outside {lo}-{hi} words",
    )


def classes_in_sync_result(report: SyncReport) -> AssetCheckResult:
    """From ``verify.classes_sync`` over what ``caption_classes`` stored."""
    return AssetCheckResult(
        check_name=CLASSES_IN_SYNC,
        passed=report.in_sync,
        metadata={"class_rows": report.derived_rows, "captions": report.expected, **report.counts},
        description="in sync" if report.in_sync else f"problems: {report.problems}",
    )


def embeddings_in_sync_result(report: SyncReport) -> AssetCheckResult:
    """From ``verify.embeddings_sync`` over what ``caption_embeddings`` stored."""
    return AssetCheckResult(
        check_name=EMBEDDINGS_IN_SYNC,
        passed=report.in_sync,
        metadata={
            "embeddings": report.derived_rows,
            "captions_with_text": report.expected,
            **report.counts,
        },
        description="in sync" if report.in_sync else f"problems: {report.problems}",
    )
