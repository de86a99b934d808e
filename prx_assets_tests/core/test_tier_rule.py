"""The tier rule as documented: under 384x384 px unused; otherwise the highest tier whose
nearest-aspect shape the image fills without upscaling, or 512 with a recorded upscale of at
most 512/384 when it fills none (the issue: README said "without upscaling" for all)."""

import pyarrow as pa

from prx_assets.core.resolution.profile import profile_images, summarise
from prx_assets.core.shards.buckets import assign_bucket

SIZES = {  # (width, height): (tier or None, upscaled)
    (383, 600): (None, False),  # short side under the cutoff
    (384, 384): (512, True),  # the largest upscale: 512/384
    (480, 480): (512, True),
    (600, 400): (512, True),  # short side >= 384, but under its aspect's 512 shape (416x608)
    (520, 520): (512, False),
    (1100, 1100): (1024, False),
    (2100, 2100): (2048, False),
    (4096, 4096): (4096, False),
}


def test_tiers_and_upscales_follow_the_documented_rule():
    for (w, h), (tier, upscaled) in SIZES.items():
        a = assign_bucket(w, h)
        if tier is None:
            assert a is None
            continue
        assert (a.tier, a.upscaled) == (tier, upscaled), (w, h)
        assert 1.0 < a.scale <= 512 / 384 if upscaled else a.scale <= 1.0

    widths, heights = zip(*SIZES, strict=True)
    images = pa.table(
        {
            "key": [f"k{i}" for i in range(len(SIZES))],
            "batch": ["b"] * len(SIZES),
            "width": list(widths),
            "height": list(heights),
        }
    )
    profile = profile_images(images)
    assert profile.column("max_tier").to_pylist() == [t for t, _ in SIZES.values()]
    summary = summarise(profile)
    assert summary.upscaled_to_lowest_tier == sum(u for _, u in SIZES.values())
    assert summary.tier_counts == {"512": 4, "1024": 1, "2048": 1, "4096": 1}
