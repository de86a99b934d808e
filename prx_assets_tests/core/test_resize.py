"""Resizing into buckets: fast path equals plain path, exact shapes, EXIF, q92 JPEG."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from prx_assets.core.shards.buckets import assign_bucket, bucket_table
from prx_assets.core.shards.resize import (
    JPEG_QUALITY,
    _bicubic_aa,
    encode_jpeg,
    estimate_jpeg_quality,
    jpeg_quality_tables,
    prepare_fast,
    psnr,
    resize_plain,
    resize_to_bucket,
)

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"


def _upscaled_jpeg(name: str, megapixels: float, quality: int = 95, exif: bytes = b"") -> bytes:
    img = Image.open(PHOTOS / name).convert("RGB")
    s = (megapixels * 1e6 / (img.width * img.height)) ** 0.5
    big = img.resize((round(img.width * s), round(img.height * s)), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    big.save(buf, "JPEG", quality=quality, exif=exif)
    return buf.getvalue()


def _size(data: bytes) -> tuple[int, int]:
    return Image.open(io.BytesIO(data)).size


def _q92_loss(img: Image.Image) -> float:
    """PSNR of the q92 round trip itself: the bar a resize shortcut must stay under."""
    return psnr(img, Image.open(io.BytesIO(encode_jpeg(img))).convert("RGB"))


@pytest.mark.parametrize(
    ("name", "mp", "tiers"),
    [
        ("astronaut.png", 12, (512,)),  # 3464 px square -> 512: draft 1/2 + reduce
        ("chelsea.png", 18, (512, 1024)),  # 3:2 -> 1024 tier, draft 1/2
        ("rocket.jpg", 10, (512,)),
        ("hubble_deep_field.jpg", 6, (512,)),
    ],
)
def test_fast_path_matches_plain_path(name: str, mp: float, tiers: tuple[int, ...]) -> None:
    data = _upscaled_jpeg(name, mp)
    a = assign_bucket(*_size(data), table=bucket_table(tiers=tiers))
    assert a is not None
    prepared = prepare_fast(data, a)
    assert prepared.draft_factor * prepared.reduce_factor >= 2  # the shortcut really ran
    # ... and kept at least 2x the target's pixels along both axes.
    bw = prepared.box[2] - prepared.box[0]
    bh = prepared.box[3] - prepared.box[1]
    assert bw >= 2 * a.shape.width - 1 and bh >= 2 * a.shape.height - 1
    fast = resize_to_bucket(data, a)
    plain = resize_plain(data, a)
    assert fast.size == plain.size == (a.shape.width, a.shape.height)
    assert fast.mode == "RGB"
    # After draft/reduce the last pass is Lanczos over the crop box, whatever `resample`.
    lanczos = resize_to_bucket(data, a, resample="lanczos")
    assert fast.tobytes() == lanczos.tobytes()
    # The shortcut's difference from the naive Lanczos result is below the q92 loss.
    assert psnr(fast, plain) > 50.0 > _q92_loss(plain)


def test_default_table_fast_path_is_plain_path() -> None:
    # With the no-upscale tier rule the source is < 2x the bucket, so no draft/reduce:
    # the only difference is resizing just the crop box, the same sampling.
    data = _upscaled_jpeg("coffee.png", 3)
    a = assign_bucket(*_size(data))
    assert a is not None and a.tier == 1024
    prepared = prepare_fast(data, a)
    assert (prepared.draft_factor, prepared.reduce_factor) == (1, 1)
    plain = resize_plain(data, a)
    assert psnr(resize_to_bucket(data, a, resample="lanczos"), plain) > 70.0
    assert psnr(resize_to_bucket(data, a), plain) > _q92_loss(plain)


@pytest.mark.parametrize("size", [(900, 600), (512, 512), (300, 200), (1201, 801)])
def test_bicubic_aa_is_pillows_bicubic(size: tuple[int, int]) -> None:
    # Down- and upscaling (the 384..511 px images are upscaled into the 512 tier).
    src = Image.open(PHOTOS / "chelsea.png").convert("RGB")
    ours = Image.fromarray(np.ascontiguousarray(_bicubic_aa(src, size)), "RGB")
    pillow = src.resize(size, Image.Resampling.BICUBIC)
    diff = np.abs(np.asarray(ours, np.int16) - np.asarray(pillow, np.int16))
    assert diff.max() <= 2 and (diff > 0).mean() < 0.01


def test_channels_last_output_equals_public_interpolate() -> None:
    import torch

    src = Image.open(PHOTOS / "coffee.png").convert("RGB")
    ours = _bicubic_aa(src, (457, 305))
    x = torch.from_numpy(np.array(src)).permute(2, 0, 1).unsqueeze(0)
    public = torch.nn.functional.interpolate(x, size=(305, 457), mode="bicubic", antialias=True)
    assert np.array_equal(ours, public[0].permute(1, 2, 0).numpy())


def test_unknown_resample_is_refused() -> None:
    data = _upscaled_jpeg("coffee.png", 1)
    a = assign_bucket(*_size(data))
    assert a is not None
    with pytest.raises(ValueError, match="resample must be"):
        resize_to_bucket(data, a, resample="nearest")


@pytest.mark.parametrize(
    "size", [(3000, 700), (700, 3000), (1700, 1100), (400, 400), (1024, 2048), (5000, 800)]
)
def test_output_is_exactly_the_bucket_shape(size: tuple[int, int]) -> None:
    img = Image.open(PHOTOS / "coffee.png").convert("RGB").resize(size)
    buf = io.BytesIO()
    img.save(buf, "PNG", compress_level=1)  # PNG: no draft, exercises reduce/box only
    a = assign_bucket(*size)
    assert a is not None
    out = resize_to_bucket(buf.getvalue(), a)
    assert out.size == (a.shape.width, a.shape.height)
    assert resize_plain(buf.getvalue(), a).size == out.size


def test_exif_rotated_jpeg() -> None:
    # Stored landscape with orientation 6 (rotate 90 CW): the image *is* portrait.
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _upscaled_jpeg("rocket.jpg", 8, exif=exif.tobytes())
    stored_w, stored_h = _size(data)
    a = assign_bucket(stored_h, stored_w, table=bucket_table(tiers=(512,)))
    assert a is not None and a.shape.height > a.shape.width
    fast = resize_to_bucket(data, a)
    assert fast.size == (a.shape.width, a.shape.height)
    plain = resize_plain(data, a)
    assert psnr(fast, plain) > _q92_loss(plain)
    # The assignment of the unrotated size does not fit these bytes.
    wrong = assign_bucket(stored_w, stored_h, table=bucket_table(tiers=(512,)))
    with pytest.raises(ValueError, match="assignment is for a"):
        resize_to_bucket(data, wrong)


def test_encode_is_q92_444_deterministic_and_metadata_free() -> None:
    exif = Image.Exif()
    exif[0x010F] = "SecretCam"  # Make
    data = _upscaled_jpeg("flower.jpg", 2, exif=exif.tobytes())
    a = assign_bucket(*_size(data))
    assert a is not None
    img = resize_to_bucket(data, a)
    out = encode_jpeg(img)
    assert out == encode_jpeg(resize_to_bucket(data, a))  # byte-identical rerun
    assert b"Exif" not in out and b"SecretCam" not in out and b"ICC_PROFILE" not in out
    assert estimate_jpeg_quality(out) == JPEG_QUALITY == 92
    decoded = Image.open(io.BytesIO(out))
    assert JpegImagePlugin.get_sampling(decoded) == 0  # 0 = 4:4:4
    assert decoded.size == img.size
    assert psnr(decoded.convert("RGB"), img) > 38.0
    with pytest.raises(ValueError, match="RGB"):
        encode_jpeg(img.convert("L"))


@pytest.mark.parametrize("quality", [10, 50, 75, 90, 92, 95, 100])
def test_quality_estimate_reads_the_tables(quality: int) -> None:
    buf = io.BytesIO()
    Image.open(PHOTOS / "chelsea.png").convert("RGB").save(buf, "JPEG", quality=quality)
    tables = jpeg_quality_tables(buf.getvalue())
    assert set(tables) == {0, 1} and all(len(t) == 64 for t in tables.values())
    assert estimate_jpeg_quality(buf.getvalue()) == quality


def test_quality_tables_reject_non_jpeg() -> None:
    with pytest.raises(ValueError, match="not a JPEG"):
        jpeg_quality_tables((PHOTOS / "coffee.png").read_bytes())
