"""The shard stage's JPEG planes extension: raw decode, Lanczos-3 per plane, raw encode."""

import io
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image, JpegImagePlugin

from prx_assets.core.shards import _planes
from prx_assets.core.shards.resize import estimate_jpeg_quality, psnr
from prx_assets.demo.jpegs import encoded, mosaic

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"
LIMIT = 89_478_485


def _photo(size: tuple[int, int], seed: int = 0) -> Image.Image:
    return mosaic(size, np.random.default_rng(seed), row_heights=(200, 400), tile_widths=(200, 500))


def _pillow_ycbcr(data: bytes) -> list[np.ndarray]:
    """Pillow's decode of the same bytes to YCbCr (libjpeg's, chroma upsampled)."""
    img = Image.open(io.BytesIO(data))
    img.draft("YCbCr", img.size)
    return [np.asarray(p) for p in img.convert("YCbCr").split()]


def _planes_of(data: bytes, denom: int = 1) -> tuple[str, int, int, list]:
    """The decoded planes as arrays (their padding cut off), each with its valid extent."""
    kind, w, h, planes = _planes.decode(data, denom, LIMIT)
    out = []
    for b, pw, ph, vw, vh, stride in planes:
        assert stride >= pw and len(b) >= stride * ph
        out.append((np.frombuffer(b, np.uint8).reshape(-1, stride)[:ph, :pw], (vw, vh)))
    return kind, w, h, out


@pytest.mark.parametrize("progressive", [False, True])
def test_luma_is_libjpegs_own_decode_and_444_chroma_too(progressive: bool) -> None:
    img = _photo((403, 301), 1)
    data = encoded(img, "JPEG", quality=95, subsampling="4:2:0", progressive=progressive)
    kind, w, h, planes = _planes_of(data)
    assert (kind, w, h) == ("YCbCr", 403, 301)
    np.testing.assert_array_equal(planes[0][0], _pillow_ycbcr(data)[0])
    # 4:4:4: nothing to upsample, every plane is Pillow's
    data = encoded(img, "JPEG", quality=95, subsampling="4:4:4", progressive=progressive)
    for (ours, _), theirs in zip(_planes_of(data)[3], _pillow_ycbcr(data), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(
    ("subsampling", "denom", "sizes", "valid"),
    [
        ("4:2:0", 1, [(1875, 1251), (938, 626), (938, 626)], [(1875, 1251), (937.5, 625.5)]),
        ("4:2:2", 1, [(1875, 1251), (938, 1251), (938, 1251)], [(1875, 1251), (937.5, 1251)]),
        ("4:4:4", 1, [(1875, 1251)] * 3, [(1875, 1251)] * 2),
        # Scaled: libjpeg-turbo decodes chroma with a twice-larger IDCT, so every plane has
        # the luma's size; a plane still stands for the unrounded 1875 / 2 columns.
        ("4:2:0", 2, [(938, 626)] * 3, [(937.5, 625.5)] * 2),
        ("4:2:0", 8, [(235, 157)] * 3, [(234.375, 156.375)] * 2),
    ],
)
def test_plane_sizes_and_the_extent_they_stand_for(
    subsampling: str, denom: int, sizes: list, valid: list
) -> None:
    data = encoded(_photo((1875, 1251), 2), "JPEG", quality=95, subsampling=subsampling)
    kind, w, h, planes = _planes_of(data, denom)
    assert (w, h) == (-(-1875 // denom), -(-1251 // denom))
    assert [(p.shape[1], p.shape[0]) for p, _ in planes] == sizes
    assert [v for _, v in planes] == [valid[0], valid[1], valid[1]]


def test_greyscale_is_one_plane() -> None:
    data = encoded(_photo((300, 200), 3).convert("L"), "JPEG", quality=95, subsampling="4:2:0")
    kind, w, h, planes = _planes_of(data)
    assert (kind, w, h, len(planes)) == ("GRAY", 300, 200, 1)
    np.testing.assert_array_equal(planes[0][0], np.asarray(Image.open(io.BytesIO(data))))


def _cmyk() -> bytes:
    return encoded(_photo((120, 80), 4).convert("CMYK"), "JPEG", quality=90)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_cmyk(), "colour space"),
        ((PHOTOS / "coffee.png").read_bytes(), "libjpeg"),
        (b"", "libjpeg"),
    ],
    ids=["cmyk", "png", "empty"],
)
def test_what_is_not_a_ycbcr_or_grey_jpeg_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _planes.decode(data, 1, LIMIT)


def test_corrupt_or_truncated_data_is_refused_never_half_decoded() -> None:
    data = encoded(_photo((640, 480), 5), "JPEG", quality=95)
    sos = data.index(b"\xff\xda")
    with pytest.raises(ValueError, match="extraneous bytes"):  # a libjpeg warning: refused
        _planes.decode(data[:sos] + b"\x00\x13" + data[sos:], 1, LIMIT)
    with pytest.raises(ValueError, match="libjpeg"):
        _planes.decode(data[: len(data) // 2], 1, LIMIT)
    with pytest.raises(ValueError, match="exceeds the limit of 307199 px"):
        _planes.decode(data, 1, 640 * 480 - 1)
    with pytest.raises(ValueError, match="denom"):
        _planes.decode(data, 3, LIMIT)


def test_random_damage_never_crashes_the_decoder() -> None:
    # Untrusted bytes: whatever the damage, a clean refusal or a complete decode.
    data = bytearray(encoded(_photo((320, 240), 6), "JPEG", quality=95, progressive=True))
    rng = np.random.default_rng(0)
    outcomes = {"refused": 0, "decoded": 0}
    for _ in range(300):
        bad = bytearray(data)
        for i in rng.integers(0, len(bad), int(rng.integers(1, 12))):
            bad[int(i)] = int(rng.integers(0, 256))
        bad = bad[: int(rng.integers(len(bad) // 3, len(bad) + 1))]
        try:
            kind, w, h, planes = _planes.decode(bytes(bad), 1, LIMIT)
        except ValueError:
            outcomes["refused"] += 1
        else:
            assert all(len(b) >= stride * ph for b, pw, ph, _, _, stride in planes)
            outcomes["decoded"] += 1
    assert outcomes["refused"] > 0


def _pillow_plane(
    plane: np.ndarray, valid: tuple[float, float], size: tuple, box: tuple
) -> np.ndarray:
    img = Image.fromarray(plane, "L")
    return np.asarray(img.resize(size, Image.Resampling.LANCZOS, box=(0, 0, *valid)).crop(box))


@pytest.mark.parametrize(
    ("shape", "valid", "size", "box"),
    [
        ((1251, 1875), (1875, 1251), (1024, 683), (0, 0, 1024, 683)),  # 0.55: 11 taps
        ((1251, 1875), (1875, 1251), (1216, 811), (0, 0, 1216, 811)),
        ((626, 938), (937.5, 625.5), (1216, 832), (8, 3, 1208, 829)),  # 4:2:0 chroma, up
        ((301, 403), (403, 301), (96, 64), (5, 0, 91, 64)),  # 0.24: wide support
        ((200, 300), (300, 200), (608, 416), (0, 8, 608, 408)),  # 2x up
        ((64, 64), (64, 64), (64, 64), (0, 0, 64, 64)),  # identity
    ],
)
def test_resample_is_pillows_lanczos_on_a_plane(
    shape: tuple, valid: tuple, size: tuple, box: tuple
) -> None:
    # Same sampling (pixel centres, support widened by the reduction, renormalised edges);
    # 14-bit weights (Pillow's: 22) and the passes in the other order (rows first; each pass
    # rounds to 8 bits, as Pillow's do): within 2 levels, most samples identical.
    h, w = shape
    plane = np.asarray(_photo((w, h), 7).convert("L"))
    ours = _planes.resample(plane.tobytes(), w, h, *valid, *size, box)
    ours = np.frombuffer(ours, np.uint8).reshape(box[3] - box[1], box[2] - box[0])
    diff = np.abs(ours.astype(int) - _pillow_plane(plane, valid, size, box).astype(int))
    assert diff.max() <= 2 and (diff == 0).mean() > 0.7


def test_chroma_is_upsampled_as_libjpeg_does_then_resampled_in_one_kernel() -> None:
    # A 4:2:0 JPEG's chroma, resampled from its half-size grid with libjpeg's triangle
    # upsampling folded into the Lanczos, is the chroma of libjpeg's own full-size decode
    # (Pillow, fancy upsampling) resampled by Pillow: within 2 levels, mostly identical.
    data = encoded(_photo((901, 601), 9), "JPEG", quality=95, subsampling="4:2:0")
    _, _, _, planes = _planes.decode(data, 1, LIMIT)
    full = _pillow_ycbcr(data)  # upsampled by libjpeg
    size, box = (608, 416), (0, 8, 608, 408)
    for (b, pw, ph, vw, vh, stride), upsampled in zip(planes[1:], full[1:], strict=True):
        assert (vw, vh) == (450.5, 300.5)
        ours = _planes.resample(b, pw, ph, vw, vh, *size, box, stride=stride, upsample=(2, 2))
        ours = np.frombuffer(ours, np.uint8).reshape(400, 608).astype(int)
        naive = _pillow_plane(upsampled, (901.0, 601.0), size, box).astype(int)
        assert np.abs(ours - naive).max() <= 2 and (ours == naive).mean() > 0.6
        direct = _planes.resample(b, pw, ph, vw, vh, *size, box, stride=stride)
        direct = np.frombuffer(direct, np.uint8).reshape(400, 608).astype(int)
        assert np.abs(direct - naive).mean() > 2 * np.abs(ours - naive).mean()  # it matters
    with pytest.raises(ValueError, match="upsample"):
        _planes.resample(b, pw, ph, vw, vh, *size, box, stride=stride, upsample=(0, 2))


def test_a_padded_plane_resamples_as_its_packed_copy() -> None:
    # The decoder hands planes over in whole DCT blocks (rows ``stride`` bytes apart, junk in
    # the padding): only the plane's own pixels may count.
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, (37, 53), np.uint8)
    padded = np.full((40, 64), 255, np.uint8)
    padded[:37, :53] = packed
    args = (53, 37, 52.5, 37.0, 30, 21, (1, 0, 29, 21))
    ours = _planes.resample(padded.tobytes(), *args, stride=64)
    assert ours == _planes.resample(packed.tobytes(), *args)
    with pytest.raises(ValueError, match="stride"):
        _planes.resample(padded.tobytes(), *args, stride=52)


def test_simd_and_portable_resampling_give_the_same_bytes() -> None:
    # Fixed point: the AVX2 kernel (where the CPU has it) and the portable code must agree
    # to the byte, or shards would differ between machines. Widths around the 32-column
    # step and the 16x16 transpose, ringing that clamps at 0 and 255, up and down.
    rng = np.random.default_rng(1)
    checked = 0
    for w, h in [(1, 1), (15, 17), (31, 33), (32, 32), (33, 31), (97, 130), (1000, 41)]:
        for plane in (rng.integers(0, 256, (h, w), np.uint8), (np.indices((h, w)).sum(0) % 2 * 255).astype(np.uint8)):  # fmt: skip
            for ow, oh in [(max(1, w // 3), max(1, h // 2)), (w * 2 + 1, h + 5), (w, h)]:
                box = (0, 0, ow, oh) if ow < 3 or oh < 3 else (1, 1, ow - 1, oh - 1)
                args = (plane.tobytes(), w, h, w - 0.25 if w > 1 else 1.0, float(h), ow, oh, box)
                assert _planes.resample(*args, simd=True) == _planes.resample(*args, simd=False)
                checked += 1
    assert checked == 42
    assert _planes.simd_kernels() in ("avx2", "sse2-transpose", "portable")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((b"\0" * 99, 10, 10, 10.0, 10.0, 5, 5, (0, 0, 5, 5)), "fewer than"),
        ((b"\0" * 100, 10, 10, 10.5, 10.0, 5, 5, (0, 0, 5, 5)), "valid extent"),
        ((b"\0" * 100, 10, 10, 10.0, 10.0, 5, 5, (0, 0, 6, 5)), "box"),
        ((b"\0" * 100, 10, 10, 10.0, 10.0, 5, 5, (3, 0, 3, 5)), "box"),
        ((b"\0" * 100, 0, 10, 10.0, 10.0, 5, 5, (0, 0, 5, 5)), "positive"),
    ],
)
def test_resample_refuses_bad_geometry(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _planes.resample(*args)


def test_encode_is_a_q92_444_jfif_jpeg_of_the_planes() -> None:
    ycbcr = _photo((203, 141), 8).convert("YCbCr")
    y, cb, cr = (np.asarray(p) for p in ycbcr.split())
    out = _planes.encode(y, cb, cr, 203, 141, 92)
    assert out == _planes.encode(y.copy(), cb.copy(), cr.copy(), 203, 141, 92)  # deterministic
    assert out[:4] == b"\xff\xd8\xff\xe0" and b"Exif" not in out and b"ICC_PROFILE" not in out
    assert estimate_jpeg_quality(out) == 92
    decoded = Image.open(io.BytesIO(out))
    assert decoded.size == (203, 141) and JpegImagePlugin.get_sampling(decoded) == 0  # 4:4:4
    # The decoder shows the planes' picture, up to the q92 loss (edge rows 141 -> 144 pad).
    assert psnr(decoded.convert("RGB"), ycbcr.convert("RGB")) > 38.0
    for ours, theirs in zip(_pillow_ycbcr(out), (y, cb, cr), strict=True):
        assert np.abs(ours.astype(int) - theirs.astype(int)).mean() < 2.0


def test_encode_refuses_short_planes_and_bad_quality() -> None:
    p = np.zeros((8, 8), np.uint8)
    with pytest.raises(ValueError, match="fewer than"):
        _planes.encode(p, p, p[:4], 8, 8, 92)
    with pytest.raises(ValueError, match="quality"):
        _planes.encode(p, p, p, 8, 8, 0)


@pytest.mark.parametrize(("subsampling", "upsample"), [("411", (4, 1)), ("440", (1, 2))])
def test_411_and_440_chroma_is_libjpegs_upsampling_then_lanczos(
    subsampling: str, upsample: tuple[int, int]
) -> None:
    # 4:1:1 chroma (a quarter of the columns) is upsampled by repetition, as libjpeg does it,
    # folded into the kernel: within 2 levels of libjpeg's own full-size chroma resampled by
    # Pillow. (That a 4x kernel stays inside its weights is the sanitizer test's:
    # test_planes_fuzz.py.)
    data = simplejpeg.encode_jpeg(np.asarray(_photo((901, 601), 10)), 95, "RGB", subsampling)
    _, _, _, planes = _planes.decode(data, 1, LIMIT)
    full = _pillow_ycbcr(data)
    size, box = (608, 416), (0, 8, 608, 408)
    for (b, pw, ph, vw, vh, stride), upsampled in zip(planes[1:], full[1:], strict=True):
        assert (round(901 / vw), round(601 / vh)) == upsample
        ours = _planes.resample(b, pw, ph, vw, vh, *size, box, stride=stride, upsample=upsample)
        ours = np.frombuffer(ours, np.uint8).reshape(400, 608).astype(int)
        naive = _pillow_plane(upsampled, (901.0, 601.0), size, box).astype(int)
        assert np.abs(ours - naive).max() <= 2 and (ours == naive).mean() > 0.6
