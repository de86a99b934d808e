"""Resizing into buckets: within the q92 loss of the plain path, exact shapes, EXIF, q92 JPEG."""

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image, JpegImagePlugin

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS, DecodeRejected
from prx_assets.core.shards.buckets import assign_bucket, bucket_table
from prx_assets.core.shards.resize import (
    JPEG_QUALITY,
    AssignmentMismatch,
    Planes,
    SourceFacts,
    _bicubic_aa,
    _scaled_jpeg,
    _to_bucket,
    decode_divisor,
    encode_jpeg,
    encode_planes,
    estimate_jpeg_quality,
    jpeg_quality_tables,
    prepare_fast,
    psnr,
    render_jpeg,
    resize_plain,
    resize_to_bucket,
)
from prx_assets.demo.jpegs import demo_photo, encoded, jpeg_bytes, mosaic

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"


def _upscaled_jpeg(name: str, megapixels: float, quality: int = 95, exif: bytes = b"") -> bytes:
    img = demo_photo(None, name)
    s = (megapixels * 1e6 / (img.width * img.height)) ** 0.5
    big = img.resize((round(img.width * s), round(img.height * s)), Image.Resampling.BICUBIC)
    return encoded(big, "JPEG", quality=quality, exif=exif)


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
def test_pillow_path_shortcuts_match_plain_path(
    name: str, mp: float, tiers: tuple[int, ...]
) -> None:
    # The Pillow path (bicubic-aa, and every non-JPEG source): draft/reduce at >= 2x.
    data = _upscaled_jpeg(name, mp)
    a = assign_bucket(*_size(data), table=bucket_table(tiers=tiers))
    assert a is not None
    prepared = prepare_fast(data, a)
    assert prepared.draft_factor * prepared.reduce_factor >= 2  # the shortcut really ran
    # ... and kept at least 2x the target's pixels along both axes.
    bw = prepared.box[2] - prepared.box[0]
    bh = prepared.box[3] - prepared.box[1]
    assert bw >= 2 * a.shape.width - 1 and bh >= 2 * a.shape.height - 1
    fast = resize_to_bucket(data, a, resample="bicubic-aa")
    plain = resize_plain(data, a)
    assert fast.size == plain.size == (a.shape.width, a.shape.height)
    assert fast.mode == "RGB"
    assert psnr(fast, plain) > 50.0 > _q92_loss(plain)
    # The default path (scaled JPEG decode to the smallest covering eighth): within the loss.
    default = resize_to_bucket(data, a)
    assert default.size == plain.size
    assert psnr(default, plain) > _q92_loss(plain)


def test_pillow_path_without_shortcut_is_plain_sampling() -> None:
    # A PNG under 2x its bucket: no draft/reduce, Lanczos over the crop box only, which is
    # the same sampling as resizing the whole image and cropping.
    data = encoded(demo_photo((2121, 1414), "coffee.png"), "PNG", compress_level=1)
    a = assign_bucket(2121, 1414)
    assert a is not None and a.tier == 1024
    prepared = prepare_fast(data, a)
    assert (prepared.draft_factor, prepared.reduce_factor) == (1, 1)
    plain = resize_plain(data, a)
    assert psnr(resize_to_bucket(data, a), plain) > 70.0
    assert psnr(resize_to_bucket(data, a, resample="bicubic-aa"), plain) > _q92_loss(plain)


def _mosaic(size: tuple[int, int], seed: int) -> Image.Image:
    """A canvas of crops of the bundled photos at their native pixels: real per-pixel detail."""
    return mosaic(size, np.random.default_rng(seed), row_heights=(300, 600), tile_widths=(300, 700))


def test_lanczos_default_is_within_the_q92_loss_on_real_photos() -> None:
    # The quality criterion: on >= 95 % of real photos the default path's difference
    # from naive (full decode, Lanczos, crop) is smaller than the q92 encode's own loss.
    # Every bundled photo Lanczos-upscaled to ~2 MP (baseline and progressive in turn),
    # plus native-detail mosaics at two aspect ratios.
    inputs = []
    for i, path in enumerate(sorted(PHOTOS.iterdir())):
        img = Image.open(path).convert("RGB")
        s = (2e6 / (img.width * img.height)) ** 0.5
        big = img.resize((round(img.width * s), round(img.height * s)), Image.Resampling.LANCZOS)
        inputs.append(jpeg_bytes(big, progressive=i % 2 == 1))
    for seed, size in enumerate([(1901, 1301), (1151, 2047)]):
        inputs.append(jpeg_bytes(_mosaic(size, seed), progressive=seed % 2 == 1))
    invisible = 0
    for data in inputs:
        a = assign_bucket(*_size(data))
        assert a is not None
        plain = resize_plain(data, a)
        fast = resize_to_bucket(data, a)
        assert fast.size == plain.size
        invisible += psnr(fast, plain) > _q92_loss(plain)
    assert invisible >= 0.95 * len(inputs), f"{invisible}/{len(inputs)} within the q92 loss"


def test_scaled_decode_is_the_smallest_eighth_covering_the_cover_size() -> None:
    data = jpeg_bytes(_mosaic((2401, 1601), 7))
    a = assign_bucket(2401, 1601)
    assert a is not None
    img, box = _scaled_jpeg(data, a, 1, DEFAULT_MAX_PIXELS)
    rw, rh = a.resize_size
    m = next(m for m in range(1, 9) if img.size == (-(-2401 * m // 8), -(-1601 * m // 8)))
    assert m < 8  # a real reduction ...
    assert img.width >= rw and img.height >= rh  # ... that still covers the cover size ...
    smaller = (-(-2401 * (m - 1) // 8), -(-1601 * (m - 1) // 8))
    assert smaller[0] < rw or smaller[1] < rh  # ... and the next eighth down would not.
    assert box[2] - box[0] == pytest.approx(a.shape.width * img.width / rw, rel=2e-3)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_orientation_matches_the_plain_path(orientation: int) -> None:
    # Odd sizes, so the scaled decode has a partial last block column and row, which every
    # orientation moves to another edge; a box off by one pixel costs far more than q92.
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg_bytes(_mosaic((1201, 803), orientation), exif=exif.tobytes())
    w, h = (803, 1201) if orientation in (5, 6, 7, 8) else (1201, 803)
    a = assign_bucket(w, h)
    assert a is not None
    facts = SourceFacts.probe(data)
    assert facts.orientation == orientation and facts.scaled_decode
    plain = resize_plain(data, a)
    fast = resize_to_bucket(data, a, facts=facts)
    assert psnr(fast, plain) > _q92_loss(plain)


def test_greyscale_jpeg_takes_the_scaled_path() -> None:
    grey = _mosaic((1801, 1201), 3).convert("L")
    data = jpeg_bytes(grey)
    a = assign_bucket(1801, 1201)
    assert a is not None and SourceFacts.probe(data).scaled_decode
    fast = resize_to_bucket(data, a)
    arr = np.asarray(fast)
    assert fast.mode == "RGB" and (arr[..., 0] == arr[..., 1]).all()
    assert psnr(fast, resize_plain(data, a)) > _q92_loss(resize_plain(data, a))


def test_cmyk_jpeg_goes_through_the_policy_decode() -> None:
    data = encoded(_mosaic((1601, 1201), 4).convert("CMYK"), "JPEG", quality=95)
    a = assign_bucket(1601, 1201)
    assert a is not None and not SourceFacts.probe(data).scaled_decode
    plain = resize_plain(data, a)
    assert psnr(resize_to_bucket(data, a), plain) > 70.0  # Pillow path, exact


def test_a_jpeg_libjpeg_turbo_refuses_strictly_falls_back_to_the_policy_decode() -> None:
    data = jpeg_bytes(_mosaic((1601, 1201), 5))
    # Junk before the SOS marker: a libjpeg warning ("extraneous bytes"), which Pillow
    # tolerates (so ingest accepted it) and simplejpeg's strict mode refuses.
    sos = data.index(b"\xff\xda")
    odd = data[:sos] + b"\x00\x13" + data[sos:]
    with pytest.raises(ValueError):
        simplejpeg.decode_jpeg(odd)
    a = assign_bucket(1601, 1201)
    assert a is not None
    out = resize_to_bucket(odd, a)
    assert psnr(out, resize_plain(odd, a)) > 70.0


def test_recorded_facts_are_checked_against_the_bytes() -> None:
    data = jpeg_bytes(_mosaic((1601, 1201), 6))
    wrong = assign_bucket(1201, 1601)  # the size ingest would record for orientation 6
    assert wrong is not None
    with pytest.raises(AssignmentMismatch, match="assignment is for a 1201x1601"):
        resize_to_bucket(data, wrong, facts=SourceFacts("JPEG", "RGB", orientation=1))
    with pytest.raises(DecodeRejected, match="decompression_bomb"):
        resize_to_bucket(data, assign_bucket(1601, 1201), max_pixels=1_000_000)


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
    # PNG: no draft, exercises reduce/box only
    data = encoded(demo_photo(size, "coffee.png"), "PNG", compress_level=1)
    a = assign_bucket(*size)
    assert a is not None
    out = resize_to_bucket(data, a)
    assert out.size == (a.shape.width, a.shape.height)
    assert resize_plain(data, a).size == out.size


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
    data = encoded(demo_photo(None, "chelsea.png"), "JPEG", quality=quality)
    tables = jpeg_quality_tables(data)
    assert set(tables) == {0, 1} and all(len(t) == 64 for t in tables.values())
    assert estimate_jpeg_quality(data) == quality


def test_quality_tables_reject_non_jpeg() -> None:
    with pytest.raises(ValueError, match="not a JPEG"):
        jpeg_quality_tables((PHOTOS / "coffee.png").read_bytes())


def test_decode_scale_is_a_power_of_two_never_a_slow_eighth() -> None:
    # libjpeg-turbo's 5/8..7/8 IDCTs cost more than a full decode: a source whose smallest
    # covering eighth is one of those decodes at full size; 1/2, 1/4, 1/8 only while the
    # decoded pixels keep >= 2x the cover size (a scaled IDCT alone is a weak low-pass).
    a = assign_bucket(2401, 1601)
    assert a is not None
    rw, rh = a.resize_size
    eighth = next(m for m in range(1, 9) if 2401 * m / 8 >= rw and 1601 * m / 8 >= rh)
    assert 5 <= eighth <= 7  # the case the rule is for
    assert decode_divisor((2401, 1601), a.resize_size) == 1
    table = bucket_table(tiers=(512, 1024))  # a 1024 tier for the large sources
    for size, divisor in (((4801, 3201), 1), ((6001, 4001), 2), ((9601, 6401), 2)):
        b = assign_bucket(*size, table=table)
        assert b is not None and decode_divisor(size, b.resize_size) == divisor
    for size, cover in (((4000, 3000), (1000, 750)), ((4000, 3000), (1001, 750))):
        f = decode_divisor(size, cover)
        assert size[0] / f >= 2 * cover[0] and size[1] / f >= 2 * cover[1]
        assert f == 8 or size[0] / (2 * f) < 2 * cover[0] or size[1] / (2 * f) < 2 * cover[1]
    assert decode_divisor((4000, 3000), (1000, 750)) == 2
    assert decode_divisor((4000, 3000), (1001, 750)) == 1


def test_scaled_decodes_keep_a_margin_on_native_detail() -> None:
    # 24 MP of native-pixel mosaic into the 512 tier: the largest allowed scale (1/4 here)
    # keeps the difference from naive well under the q92 loss (the smallest covering one,
    # 1/8, measured 0.1-0.4 dB from failing).
    data = jpeg_bytes(_mosaic((6001, 4001), 0))
    a = assign_bucket(6001, 4001, table=bucket_table(tiers=(512,)))
    assert a is not None and decode_divisor((6001, 4001), a.resize_size) == 4
    plain = resize_plain(data, a)
    assert psnr(resize_to_bucket(data, a), plain) > _q92_loss(plain) + 6.0


@pytest.mark.parametrize("source", [(2401, 1601), (6001, 4001)])
def test_default_lanczos_is_the_naive_sampling(source: tuple[int, int]) -> None:
    # The planes against the naive full decode + Pillow Lanczos (RGB) + crop: luma is the
    # same sampling of the same pixels, so far closer than the q92 loss after a full decode;
    # the whole picture (chroma resampled from its own grid) within the loss.
    data = jpeg_bytes(_mosaic(source, 11))
    a = assign_bucket(*source, table=bucket_table(tiers=(512, 1024)))
    assert a is not None
    plain = resize_plain(data, a)
    planes = _to_bucket(data, a, DEFAULT_MAX_PIXELS, "lanczos", None)
    assert isinstance(planes, Planes) and planes.size == (a.shape.width, a.shape.height)
    luma = psnr(Image.fromarray(planes.y, "L"), plain.convert("YCbCr").getchannel("Y"))
    assert luma > (50.0 if decode_divisor(source, a.resize_size) == 1 else 45.0)
    fast = resize_to_bucket(data, a)
    assert fast.size == plain.size == (a.shape.width, a.shape.height)
    assert psnr(fast, plain) > _q92_loss(plain)
    # Pillow's Lanczos (from the smallest covering eighth, no margin): same shape; on this
    # 24 MP mosaic it is the one that falls under the q92 loss, which the margin prevents.
    pillow = resize_to_bucket(data, a, resample="lanczos-pillow")
    assert pillow.size == plain.size


@pytest.mark.parametrize("subsampling", ["4:4:4", "4:2:2", "4:2:0"])
@pytest.mark.parametrize("progressive", [False, True])
def test_every_chroma_layout_is_within_the_q92_loss(subsampling: str, progressive: bool) -> None:
    # Each plane is resampled from its own grid: full-size chroma, half-width, half-size.
    img = _mosaic((1901, 1301), 12)
    data = encoded(img, "JPEG", quality=95, subsampling=subsampling, progressive=progressive)
    a = assign_bucket(1901, 1301)
    assert a is not None
    assert isinstance(_to_bucket(data, a, DEFAULT_MAX_PIXELS, "lanczos", None), Planes)
    plain = resize_plain(data, a)
    assert psnr(resize_to_bucket(data, a), plain) > _q92_loss(plain)


@pytest.mark.parametrize("size", [(500, 400), (384, 600), (455, 455)])
def test_upscaled_assignments_take_the_planes_too(size: tuple[int, int]) -> None:
    # Short sides of 384..511 px are upscaled into the 512 tier: Lanczos-3 interpolation
    # (Pillow's, support 3) on each plane, within the q92 loss of the naive upscale.
    data = jpeg_bytes(demo_photo(size, "chelsea.png"))
    a = assign_bucket(*size)
    assert a is not None and a.upscaled
    assert isinstance(_to_bucket(data, a, DEFAULT_MAX_PIXELS, "lanczos", None), Planes)
    plain = resize_plain(data, a)
    fast = resize_to_bucket(data, a)
    assert fast.size == plain.size == (a.shape.width, a.shape.height)
    assert psnr(fast, plain) > _q92_loss(plain)


_SIMD_CHILD = """
import hashlib, io, sys
from PIL import Image
import prx_assets.core.shards.resize as resize
from prx_assets.core.shards.buckets import assign_bucket
data = sys.stdin.buffer.read()
a = assign_bucket(*Image.open(io.BytesIO(data)).size)
resize.PLANES_SIMD = sys.argv[1] == "simd"
print(hashlib.sha256(resize.render_jpeg(data, a)).hexdigest())
"""


@pytest.mark.parametrize("size", [(2401, 1601), (1201, 803), (6001, 4001)])
def test_render_bytes_do_not_depend_on_simd(size: tuple[int, int]) -> None:
    # The resampler is fixed-point; its AVX2 kernels and its portable code must give the
    # same bytes, or shards would differ between CPUs. Each in a fresh process.
    data = jpeg_bytes(_mosaic(size, 2))
    digests = {
        mode: subprocess.run(
            [sys.executable, "-c", _SIMD_CHILD, mode], input=data, capture_output=True, check=True
        ).stdout.strip()
        for mode in ("simd", "portable")
    }
    assert len(set(digests.values())) == 1 and len(digests["simd"]) == 64


@pytest.mark.parametrize("orientation", range(2, 9))
def test_the_array_turn_is_pillows_transpose(orientation: int) -> None:
    # The planes are turned as arrays after resampling; each EXIF turn must be exactly
    # Pillow's (what ImageOps.exif_transpose, and so the naive path, does), for one plane
    # and for interleaved pixels alike.
    from prx_assets.core.ingest.decode import ORIENTATION_TRANSPOSE
    from prx_assets.core.shards.resize import _turn

    img = _mosaic((301, 203), orientation)
    method = ORIENTATION_TRANSPOSE[orientation]
    np.testing.assert_array_equal(_turn(np.asarray(img), method), np.asarray(img.transpose(method)))
    grey = img.convert("L")
    np.testing.assert_array_equal(
        _turn(np.asarray(grey), method), np.asarray(grey.transpose(method))
    )


def test_render_encodes_the_planes_resize_to_bucket_shows() -> None:
    data = jpeg_bytes(_mosaic((1801, 1201), 4))
    a = assign_bucket(1801, 1201)
    assert a is not None
    planes = _to_bucket(data, a, DEFAULT_MAX_PIXELS, "lanczos", None)
    assert isinstance(planes, Planes)
    out = render_jpeg(data, a)
    assert out == encode_planes(planes) == render_jpeg(data, a)  # deterministic
    assert b"Exif" not in out and estimate_jpeg_quality(out) == JPEG_QUALITY
    decoded = Image.open(io.BytesIO(out))
    assert JpegImagePlugin.get_sampling(decoded) == 0  # 4:4:4
    shown = resize_to_bucket(data, a)  # the planes as RGB: what the trainer decodes
    assert psnr(decoded.convert("RGB"), shown) > _q92_loss(shown) - 0.5
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        encode_jpeg(np.zeros((4, 4), np.uint8))
