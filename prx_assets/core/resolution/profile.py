"""Resolution profile: per-image size facts and per-batch statistics, from metadata only.

Why metadata only: width and height were recorded at ingest (after EXIF orientation),
so the profile never touches image bytes and costs a column scan of two integers.

The tier rule (``buckets.assign_bucket``, default): images under 384x384 px are not used;
every other image goes to the highest tier (512/1024/2048/4096) whose nearest-aspect shape
it fills without upscaling, or, when it fills none (a short side of 384-511 px, or just
under the 512 shape of its aspect), to 512 with a recorded upscale of at most 512/384.
``max_tier`` is that tier; ``ProfileSummary.upscaled_to_lowest_tier`` counts the second case.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from prx_assets.core.shards.buckets import assign_bucket, max_fillable_tier
from prx_assets.core.tables import RESOLUTION

MIN_SIDE = 384  # images under 384x384 px are not used for training
TIERS = (512, 1024, 2048, 4096)


def ineligible_reason(width: int, height: int, min_side: int = MIN_SIDE) -> str | None:
    if min(width, height) < min_side:
        return f"short_side_below_{min_side}"
    if width * height < min_side * min_side:
        return f"pixels_below_{min_side}x{min_side}"
    return None


def profile_images(images: pa.Table, min_side: int = MIN_SIDE) -> pa.Table:
    """Rows of the ``resolution`` table for images with key, batch, width and height."""
    keys = images.column("key").to_pylist()
    batches = images.column("batch").to_pylist()
    w = np.asarray(images.column("width").to_numpy(zero_copy_only=False), dtype=np.int64)
    h = np.asarray(images.column("height").to_numpy(zero_copy_only=False), dtype=np.int64)
    reasons = [ineligible_reason(int(a), int(b), min_side) for a, b in zip(w, h, strict=True)]
    tiers = [
        None if r is not None else max_fillable_tier(int(a), int(b))
        for a, b, r in zip(w, h, reasons, strict=True)
    ]
    return pa.table(
        {
            "key": keys,
            "batch": batches,
            "width": w.astype(np.int32),
            "height": h.astype(np.int32),
            "megapixels": (w * h) / 1e6,
            "aspect": np.where(h > 0, w / np.maximum(h, 1), 0.0),
            "eligible": [r is None for r in reasons],
            "ineligible_reason": reasons,
            "max_tier": pa.array(tiers, type=pa.int32()),
        },
        schema=RESOLUTION.schema,
    )


@dataclass(frozen=True)
class ProfileSummary:
    """One batch's profile in numbers: what the asset shows a data lead about its sizes."""

    images: int
    eligible: int
    ineligible_reasons: dict[str, int]
    tier_counts: dict[str, int]
    upscaled_to_lowest_tier: int  # eligible, but filling no tier: 512 with an upscale
    megapixel_percentiles: dict[str, float]
    aspect_percentiles: dict[str, float]


def summarise(profile: pa.Table) -> ProfileSummary:
    n = profile.num_rows
    eligible = profile.column("eligible").to_pylist()
    reasons: dict[str, int] = {}
    for r in profile.column("ineligible_reason").to_pylist():
        if r is not None:
            reasons[r] = reasons.get(r, 0) + 1
    tiers: dict[str, int] = {str(t): 0 for t in TIERS}
    for t in profile.column("max_tier").to_pylist():
        if t is not None:
            tiers[str(t)] = tiers.get(str(t), 0) + 1
    qs = (5, 25, 50, 75, 95)
    mp = profile.column("megapixels").to_numpy(zero_copy_only=False)
    ar = profile.column("aspect").to_numpy(zero_copy_only=False)

    def pct(a: np.ndarray) -> dict[str, float]:
        if a.size == 0:
            return {}
        return {f"p{q}": round(float(np.percentile(a, q)), 4) for q in qs}

    sizes = zip(
        profile.column("width").to_pylist(), profile.column("height").to_pylist(), strict=True
    )
    upscaled = sum(
        1
        for (w, h), ok in zip(sizes, eligible, strict=True)
        if ok and (a := assign_bucket(int(w), int(h))) is not None and a.upscaled
    )
    return ProfileSummary(
        images=n,
        eligible=int(sum(eligible)),
        ineligible_reasons=reasons,
        tier_counts=tiers,
        upscaled_to_lowest_tier=upscaled,
        megapixel_percentiles=pct(mp),
        aspect_percentiles=pct(ar),
    )
