"""Asset checks of the caption stage, evaluated inside the assets on what was stored.

The checks are partitioned by batch (``AssetCheckSpec(partitions_def=BATCHES)``, a preview
feature of Dagster 1.13): each partition has its own check status instead of the last run's
result standing for every batch.
"""

import warnings

import numpy as np
import pyarrow as pa
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    MetadataValue,
    PreviewWarning,
)

from prx_assets.core.captions.models import LABELS
from prx_assets.core.captions.tables import CaptionStats
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
        "Captions outside the prompt's 100-200 word window (WARN, with counts). Alt-text "
        "fallback captions are short, so they are reported outside the window too.",
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
        metadata["note"] = MetadataValue.text(
            f"{ALT_TEXT_NOTE}; alt texts are short, so most fall outside the window"
        )
    return AssetCheckResult(
        check_name=CAPTIONS_LENGTH_WINDOW,
        passed=stats.outside == 0,
        severity=AssetCheckSeverity.WARN,
        metadata=metadata,
        description=f"{stats.outside} of {stats.captions} captions outside {lo}-{hi} words",
    )


def _coverage(expected: dict[str, str], derived: pa.Table) -> dict[str, int]:
    """Counts of missing, extra, duplicated and fingerprint-mismatched derived rows."""
    keys = derived.column("key").to_pylist()
    fps = derived.column("caption_fingerprint").to_pylist()
    seen: dict[str, int] = {}
    mismatched = 0
    for k, fp in zip(keys, fps, strict=True):
        seen[k] = seen.get(k, 0) + 1
        if k in expected and expected[k] != fp:
            mismatched += 1
    return {
        "missing": sum(1 for k in expected if k not in seen),
        "extra": sum(1 for k in seen if k not in expected),
        "duplicated": sum(1 for n in seen.values() if n > 1),
        "fingerprint_mismatch": mismatched,
    }


def classes_in_sync_result(captions: pa.Table, classes: pa.Table) -> AssetCheckResult:
    """``captions``: key, backend_fingerprint; ``classes``: key, caption_fingerprint, p_*, label."""
    expected = dict(
        zip(
            captions.column("key").to_pylist(),
            captions.column("backend_fingerprint").to_pylist(),
            strict=True,
        )
    )
    counts = _coverage(expected, classes)
    probs = np.stack(
        [
            np.asarray(classes.column(c).to_numpy(zero_copy_only=False), dtype=np.float64)
            for c in ("p_visual", "p_text", "p_nsfw")
        ],
        axis=1,
    ).reshape(-1, 3)
    labels = np.array(classes.column("label").to_pylist(), dtype=object)
    scored = ~np.isnan(probs).any(axis=1)
    bad_sum = int((np.abs(probs[scored].sum(axis=1) - 1.0) > 1e-3).sum())
    argmax = np.array(LABELS, dtype=object)[np.argmax(probs[scored], axis=1)]
    bad_label = int((labels[scored] != argmax).sum())
    counts.update(probabilities_not_summing_to_1=bad_sum, label_not_argmax=bad_label)
    counts["unclassified"] = int((~scored).sum())
    problems = {k: v for k, v in counts.items() if v and k != "unclassified"}
    return AssetCheckResult(
        check_name=CLASSES_IN_SYNC,
        passed=not problems,
        metadata={"class_rows": classes.num_rows, "captions": len(expected), **counts},
        description="in sync" if not problems else f"problems: {problems}",
    )


def embeddings_in_sync_result(captions: pa.Table, embeddings: pa.Table) -> AssetCheckResult:
    """``captions``: key, caption, backend_fingerprint; ``embeddings``: key, caption_fingerprint,
    vector."""
    expected = {
        k: fp
        for k, text, fp in zip(
            captions.column("key").to_pylist(),
            captions.column("caption").to_pylist(),
            captions.column("backend_fingerprint").to_pylist(),
            strict=True,
        )
        if (text or "").strip()
    }
    counts = _coverage(expected, embeddings)
    if embeddings.num_rows:
        vectors = np.asarray(
            embeddings.column("vector").combine_chunks().flatten().to_numpy(zero_copy_only=False),
            dtype=np.float32,
        ).reshape(embeddings.num_rows, -1)
        norms = np.linalg.norm(vectors, axis=1)
        counts["not_unit_norm"] = int((np.abs(norms - 1.0) > 1e-3).sum())
    else:
        counts["not_unit_norm"] = 0
    problems = {k: v for k, v in counts.items() if v}
    return AssetCheckResult(
        check_name=EMBEDDINGS_IN_SYNC,
        passed=not problems,
        metadata={"embeddings": embeddings.num_rows, "captions_with_text": len(expected), **counts},
        description="in sync" if not problems else f"problems: {problems}",
    )
