"""Ingest's decode of formats other than JPEG: cheaper, and the same answers.

A still WebP is decoded by libwebp's ``WebPDecode`` straight into RGB/RGBA
(``core/ingest/webp_direct``) instead of Pillow's animation-decoder path; the review preview of a
full-size decode is box-reduced first; an upright image is not copied. These tests prove the
pixels, the refusals, the EXIF orientation, the pHash thumbnail and the preview's size are what
they were (``benchmarks/bench_pipeline.py --formats mixed`` measures the CPU).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from prx_assets.core.dedup.gallery import PREVIEW_PX, preview_of_decoded
from prx_assets.core.dedup.phash import fast_thumbnail, thumbnail_from_bytes
from prx_assets.core.ingest import webp_direct
from prx_assets.core.ingest.decode import (
    DEFAULT_MAX_PIXELS,
    DecodeRejected,
    decode_rgb,
    inspect_and_decode,
    inspect_image,
    to_rgb,
)
from prx_assets.core.ingest.runner import check_candidate
from prx_assets.demo.jpegs import alpha_photo, demo_photo, encoded


def _pillow_policy(data: bytes) -> Image.Image:
    """The policy's pixels the way they were made before: Pillow's load, exif_transpose."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return to_rgb(ImageOps.exif_transpose(img))[0]


WEBPS = {
    "lossy": lambda: encoded(demo_photo(), "WEBP", quality=80),
    "lossless": lambda: encoded(demo_photo(), "WEBP", lossless=True),
    "lossy_alpha": lambda: encoded(alpha_photo(), "WEBP", quality=80),
    "lossless_alpha": lambda: encoded(alpha_photo(), "WEBP", lossless=True),
}


@pytest.mark.parametrize("kind", sorted(WEBPS))
def test_still_webp_decodes_directly_to_the_same_pixels_as_pillow(kind: str) -> None:
    data = WEBPS[kind]()
    header = Image.open(io.BytesIO(data))
    assert webp_direct.available()
    assert webp_direct.decode_still(data, header.size, header.mode) is not None  # the path runs
    info, rgb = inspect_and_decode(data)
    assert info == inspect_image(data)
    assert info.format == "WEBP" and info.mode == header.mode
    expected = _pillow_policy(data)
    assert rgb is not None and rgb.mode == "RGB"
    assert np.array_equal(np.asarray(rgb), np.asarray(expected))
    assert np.array_equal(np.asarray(decode_rgb(data)), np.asarray(expected))


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_webp_exif_orientation_is_applied_on_the_direct_path(orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encoded(demo_photo(), "WEBP", quality=85, exif=exif)
    info, rgb = inspect_and_decode(data)
    assert info.orientation == orientation
    expected = _pillow_policy(data)
    assert rgb is not None and (info.width, info.height) == rgb.size == expected.size
    assert np.array_equal(np.asarray(rgb), np.asarray(expected))


def _refusal(fn, data: bytes) -> str | None:
    try:
        fn(data)
    except DecodeRejected as exc:
        return exc.reason
    return None


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.97])
def test_damaged_webp_is_refused_as_pillow_refuses_it(cut: int, monkeypatch) -> None:
    good = encoded(demo_photo((640, 480)), "WEBP", quality=85)
    truncated = good[: int(len(good) * cut)]
    flipped = bytearray(good)
    for i in range(len(good) // 3, len(good) - 8, 97):  # damage the bitstream, not the header
        flipped[i] ^= 0x5A
    for data in (truncated, bytes(flipped)):
        direct = _refusal(inspect_image, data), _refusal(decode_rgb, data)
        with monkeypatch.context() as m:  # Pillow's own decode, as before the direct path
            m.setattr(webp_direct, "decode_still", lambda *a: None)
            pillow = _refusal(inspect_image, data), _refusal(decode_rgb, data)
        assert direct == pillow
    assert _refusal(inspect_image, truncated) is not None


def test_animated_webp_keeps_its_first_frame_and_frame_count() -> None:
    frames = [demo_photo(), demo_photo().transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    data = encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    info, rgb = inspect_and_decode(data)
    assert info.n_frames == 2 and rgb is not None
    assert np.array_equal(np.asarray(rgb), np.asarray(_pillow_policy(data)))


def test_png_and_webp_thumbnail_is_fast_thumbnail_bit_for_bit_and_preview_fits() -> None:
    """The one full decode feeds the pHash thumbnail (unchanged, bit for bit) and the preview."""
    big = demo_photo((1501, 1003))
    for fmt, kw in (("PNG", {}), ("WEBP", {"quality": 90}), ("WEBP", {"lossless": True})):
        data = encoded(big, fmt, **kw)
        _, (info, thumb, preview) = check_candidate((data, DEFAULT_MAX_PIXELS))
        assert thumb is not None and preview is not None
        assert np.array_equal(thumbnail_from_bytes(thumb), fast_thumbnail(data))
        small = Image.open(io.BytesIO(preview))
        assert small.format == "JPEG"
        assert small.size == ImageOps.contain(big, (PREVIEW_PX, PREVIEW_PX)).size
    # 16-bit greyscale PNG: scaled by bit depth on the same path, thumbnail unchanged.
    ramp = (np.arange(300 * 200, dtype=np.uint32).reshape(200, 300) * 65535 // 59999).astype(
        np.uint16
    )
    data = encoded(Image.fromarray(ramp), "PNG")  # mode I;16
    _, (info, thumb, preview) = check_candidate((data, DEFAULT_MAX_PIXELS))
    assert info.conversion == "high_bit_depth_to_8bit" and thumb is not None
    assert np.array_equal(thumbnail_from_bytes(thumb), fast_thumbnail(data))


@pytest.mark.parametrize(
    "size", [(4000, 3000), (3000, 4000), (2000, 2000), (113, 112), (150, 100), (50, 30)]
)
def test_preview_has_contains_size_and_stays_close_to_a_direct_bilinear(
    size: tuple[int, int],
) -> None:
    img = demo_photo(size)
    small = Image.open(io.BytesIO(preview_of_decoded(img)))
    expected = ImageOps.contain(img, (PREVIEW_PX, PREVIEW_PX), Image.Resampling.BILINEAR)
    assert small.size == expected.size
    diff = np.abs(np.asarray(small, np.int16) - np.asarray(expected, np.int16))
    assert diff.mean() < 4.0  # a JPEG of the same picture, not another picture


def test_preview_of_a_one_pixel_high_strip_exists() -> None:
    """``ImageOps.contain`` made such a strip 112x0 px, and the preview failed to encode."""
    small = Image.open(io.BytesIO(preview_of_decoded(demo_photo((1000, 1)))))
    assert small.size == (112, 1)
