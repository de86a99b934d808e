"""The bucket table: tiers, patch-aligned shapes, token budget, aspect range and assignment."""

import json
import math

import pytest

from prx_assets.core.shards.buckets import (
    DEFAULT_TIERS,
    TOKEN_TOLERANCE,
    BucketShape,
    assign_bucket,
    bucket_table,
    bucket_table_json,
    max_fillable_tier,
)

EXPECTED_1024_LANDSCAPE = [
    (704, 1408),
    (768, 1344),
    (768, 1280),
    (832, 1216),
    (896, 1152),
    (960, 1088),
    (1024, 1024),
]


def test_exact_shapes_at_1024() -> None:
    shapes = bucket_table()[1024]
    got = {(s.height, s.width) for s in shapes}
    expected = set(EXPECTED_1024_LANDSCAPE) | {(w, h) for h, w in EXPECTED_1024_LANDSCAPE}
    assert got == expected
    assert len(shapes) == 13


@pytest.mark.parametrize("tier", DEFAULT_TIERS)
def test_table_properties(tier: int) -> None:
    shapes = bucket_table()[tier]
    step = tier // 16
    budget = (tier // 16) ** 2
    assert len(shapes) == 13
    assert sum(s.height > s.width for s in shapes) == 6  # portrait
    assert sum(s.height < s.width for s in shapes) == 6  # landscape
    for s in shapes:
        assert s.tier == tier
        assert s.height % step == 0 and s.width % step == 0
        ratio = s.tokens(16) / budget
        assert 1 - TOKEN_TOLERANCE <= ratio <= 1.0, (s, ratio)
    aspects = [s.aspect for s in shapes]
    assert aspects == sorted(aspects) and len(set(aspects)) == 13  # strictly monotone
    assert aspects[0] == pytest.approx(0.5) and aspects[-1] == pytest.approx(2.0)
    assert aspects[6] == 1.0
    for s, t in zip(shapes, reversed(shapes), strict=True):  # transpose symmetry
        assert (s.height, s.width) == (t.width, t.height)


def test_tiers_are_scaled_copies() -> None:
    table = bucket_table()
    base = table[512]
    for tier in (1024, 2048, 4096):
        f = tier // 512
        assert [(s.height * f, s.width * f) for s in base] == [
            (s.height, s.width) for s in table[tier]
        ]


def test_shape_names_and_tokens() -> None:
    s = BucketShape(1024, 768, 1344)
    assert s.name == "768x1344"
    assert s.tokens(16) == 48 * 84
    assert s.tokens(32) == 24 * 42
    with pytest.raises(ValueError, match="multiple of patch"):
        s.tokens(100)


def test_other_parameters_and_bad_ones() -> None:
    small = bucket_table(tiers=(1024,), n_shapes=5)[1024]
    assert [s.name for s in small] == ["1408x704", "1216x832", "1024x1024", "832x1216", "704x1408"]
    assert bucket_table(tiers=(1024,), patch=64)[1024] == bucket_table(tiers=(1024,))[1024]
    with pytest.raises(ValueError, match="odd"):
        bucket_table(n_shapes=12)
    with pytest.raises(ValueError, match="patch size 128 must divide"):
        bucket_table(tiers=(1024,), patch=128)
    with pytest.raises(ValueError, match="multiple of 16"):
        bucket_table(tiers=(1000,))
    with pytest.raises(ValueError, match="symmetric"):
        bucket_table(min_aspect=0.4, max_aspect=2.0)
    with pytest.raises(ValueError, match="round to the same shape"):
        bucket_table(n_shapes=31)


def test_json_export_round_trips() -> None:
    obj = json.loads(bucket_table_json())
    assert obj["patch"] == 16
    assert sorted(obj["tiers"], key=int) == [str(t) for t in DEFAULT_TIERS]
    shapes = obj["tiers"]["1024"]
    assert [(d["height"], d["width"]) for d in shapes] == [
        (s.height, s.width) for s in bucket_table()[1024]
    ]
    assert shapes[6] == {
        "name": "1024x1024",
        "height": 1024,
        "width": 1024,
        "aspect": 1.0,
        "tokens": 4096,
    }
    assert bucket_table_json() == bucket_table_json()  # stable text


def _check_geometry(width: int, height: int) -> None:
    a = assign_bucket(width, height)
    assert a is not None
    rw, rh = a.resize_size
    left, top, right, bottom = a.crop_box
    assert (right - left, bottom - top) == (a.shape.width, a.shape.height)
    assert 0 <= left and 0 <= top and right <= rw and bottom <= rh
    # Centred: the margins differ by at most one pixel.
    assert abs(left - (rw - right)) <= 1 and abs(top - (rh - bottom)) <= 1
    # Cover: one side matches the shape exactly, and scale is the cover scale.
    assert rw == a.shape.width or rh == a.shape.height
    assert a.scale == pytest.approx(max(a.shape.width / width, a.shape.height / height))
    assert rw == pytest.approx(width * a.scale, abs=1) and rh == pytest.approx(
        height * a.scale, abs=1
    )


@pytest.mark.parametrize(
    "size", [(1000, 1000), (3000, 2000), (2000, 3000), (4000, 1000), (600, 5000), (777, 555)]
)
def test_assignment_geometry(size: tuple[int, int]) -> None:
    _check_geometry(*size)


def test_exact_extremes_need_no_crop() -> None:
    for w, h in [(2048, 1024), (1024, 2048), (1408, 704)]:
        a = assign_bucket(w, h)
        assert a is not None
        assert a.shape.aspect == pytest.approx(w / h)
        assert not a.outside_aspect_range
        assert a.crop_box == (0, 0, a.shape.width, a.shape.height)
        assert a.crop_fraction == 0.0
    assert assign_bucket(2048, 1024).shape.name == "704x1408"


def test_outside_range_goes_to_extreme_shape_with_centre_crop() -> None:
    a = assign_bucket(4000, 1000)  # aspect 4
    assert a is not None and a.outside_aspect_range
    assert a.shape == BucketShape(1024, 704, 1408)
    assert a.resize_size == (2816, 704)
    assert a.crop_box == (704, 0, 2112, 704)
    assert a.crop_fraction == pytest.approx(0.5)
    tall = assign_bucket(1000, 4000)
    assert tall is not None and tall.shape == BucketShape(1024, 1408, 704)
    assert tall.crop_box == (0, 704, 704, 2112)


def test_cutoff() -> None:
    assert assign_bucket(383, 1000) is None  # short side under 384
    assert assign_bucket(1000, 383) is None
    assert max_fillable_tier(383, 5000) is None
    a = assign_bucket(384, 384)  # eligible, smaller than the 512 tier: bounded upscale
    assert a is not None and a.tier == 512 and a.upscaled
    assert a.scale == pytest.approx(512 / 384)
    assert assign_bucket(200, 200, min_side=128) is not None
    with pytest.raises(ValueError, match="positive"):
        assign_bucket(0, 100)


def test_no_upscale_rule_chooses_lower_tier() -> None:
    # 1023 px square does not fill 1024x1024: it goes to 512, downscaled.
    a = assign_bucket(1023, 1023)
    assert a is not None and a.tier == 512 and not a.upscaled and a.scale < 1
    assert assign_bucket(1024, 1024).tier == 1024
    # Landscape 3:2 must fill 832x1216-shaped buckets: 2432x1664 at 2048.
    assert max_fillable_tier(2432, 1664) == 2048
    assert max_fillable_tier(2431, 1664) == 1024
    assert max_fillable_tier(2432, 1663) == 1024
    assert max_fillable_tier(8000, 6000) == 4096
    # Nearest-tier variant: 1000 px goes to 1024 with a tiny upscale.
    up = assign_bucket(1000, 1000, allow_upscale=True)
    assert up is not None and up.tier == 1024 and up.upscaled


def test_nearest_aspect_is_in_log_space() -> None:
    shapes = bucket_table()[1024]
    for w in range(1000, 2400, 37):
        a = assign_bucket(w, 1100)
        assert a is not None
        best = min(abs(math.log(s.aspect / (w / 1100))) for s in shapes)
        assert abs(math.log(a.shape.aspect / (w / 1100))) == pytest.approx(best)


def test_custom_table() -> None:
    table = bucket_table(tiers=(512,))
    a = assign_bucket(6000, 4000, table=table)
    assert a is not None and a.tier == 512 and a.shape.name == "416x608"
    assert max_fillable_tier(6000, 4000, table=table) == 512
