"""The decoding policy: what is accepted, what is refused and why, and how pixels become RGB."""

import numpy as np
import pytest
from PIL import Image

from prx_assets.core.ingest.decode import DecodeRejected, decode_rgb, inspect_image, to_rgb
from prx_assets.demo.jpegs import encoded
from prx_assets_tests.bounds import MIB, peak_rss_growth
from prx_assets_tests.conftest import PHOTOS


def _reason(data: bytes, **kw) -> str:
    with pytest.raises(DecodeRejected) as err:
        inspect_image(data, **kw)
    assert err.value.detail, "every rejection carries a specific detail"
    return err.value.reason


def test_real_photos_are_accepted_with_their_true_size():
    for path in sorted(PHOTOS.iterdir()):
        info = inspect_image(path.read_bytes())
        with Image.open(path) as img:
            assert (info.width, info.height) == img.size, path.name


def test_truncated_jpeg_keeps_pillows_error():
    data = encoded(Image.new("RGB", (800, 600), (10, 200, 30)), "JPEG", quality=90)
    with pytest.raises(DecodeRejected) as err:
        inspect_image(data[: len(data) // 2])
    assert err.value.reason == "truncated"
    assert "truncated" in err.value.detail


def test_truncated_png_is_rejected():
    data = encoded(
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 300, 3), np.uint8)), "PNG"
    )
    assert _reason(data[: len(data) // 2]) in ("truncated", "corrupt_data")


def test_empty_and_non_image_bytes():
    assert _reason(b"") == "empty_file"
    assert _reason(b"hello, not an image" * 10) == "not_an_image"


def test_formats_outside_the_photo_list_are_refused_by_name():
    data = encoded(Image.new("RGB", (32, 32)), "ICO")
    with pytest.raises(DecodeRejected) as err:
        inspect_image(data)
    assert err.value.reason == "format_not_allowed"
    assert "ICO" in err.value.detail


def test_decompression_bomb_is_refused_before_decoding(monkeypatch):
    bomb = encoded(Image.new("1", (20_000, 20_000)), "PNG")  # 400 MP in a few KB
    assert len(bomb) < 200_000
    decoded: list[tuple[int, int]] = []
    load = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda im: decoded.append(im.size) or load(im))

    def refuse() -> DecodeRejected:
        with pytest.raises(DecodeRejected) as err:
            inspect_image(bomb)
        return err.value

    # What the time bound stood for: no pixel is decoded, so memory stays far below the
    # 400 MB that even a 1-bit decode of 400 MP takes (Pillow holds a byte per pixel).
    refused, grown = peak_rss_growth(refuse)
    assert refused.reason == "decompression_bomb"
    assert "checked before decoding" in refused.detail
    assert decoded == []
    assert grown < 64 * MIB, f"resident memory grew {grown / MIB:.0f} MiB"


def test_pixel_limit_is_configurable():
    data = encoded(Image.new("RGB", (1000, 1000)), "JPEG", quality=90)
    inspect_image(data, max_pixels=1_000_000)
    assert _reason(data, max_pixels=999_999) == "decompression_bomb"


def test_exif_orientation_is_applied_to_dimensions_and_pixels():
    img = Image.new("RGB", (600, 300), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 100, 300))  # blue stripe on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    data = encoded(img, "JPEG", quality=90, exif=exif.tobytes())
    info = inspect_image(data)
    assert (info.width, info.height, info.orientation) == (300, 600, 6)
    rgb = decode_rgb(data)
    assert rgb.size == (300, 600)
    top = np.asarray(rgb)[:50].mean(axis=(0, 1))
    assert top[2] > 200 and top[0] < 60  # the blue stripe is now at the top


@pytest.mark.parametrize(
    ("mode_image", "conversion"),
    [
        (lambda: Image.new("CMYK", (64, 48), (0, 255, 255, 0)), "cmyk"),
        (
            lambda: Image.fromarray(np.full((48, 64), 65535 // 2, np.uint16)),
            "high_bit_depth_to_8bit",
        ),
        (lambda: Image.new("RGB", (64, 48), (200, 10, 10)).convert("P"), "palette"),
        (lambda: Image.new("RGBA", (64, 48), (255, 0, 0, 0)), "alpha_on_white"),
        (lambda: Image.new("LA", (64, 48), (0, 0)), "alpha_on_white"),
        (lambda: Image.new("L", (64, 48), 77), "greyscale"),
    ],
)
def test_colour_modes_become_rgb_by_policy(mode_image, conversion):
    img = mode_image()
    rgb, how = to_rgb(img)
    assert rgb.mode == "RGB" and rgb.size == img.size
    assert how == conversion
    if conversion == "alpha_on_white":  # fully transparent pixels land on white
        assert np.asarray(rgb).min() == 255


def test_cmyk_jpeg_round_trip_is_red():
    data = encoded(Image.new("RGB", (64, 48), (220, 20, 20)).convert("CMYK"), "JPEG", quality=90)
    info = inspect_image(data)
    assert info.conversion == "cmyk"
    r, g, b = np.asarray(decode_rgb(data)).mean(axis=(0, 1))
    assert r > 150 and g < 90 and b < 90


def test_animated_gif_uses_first_frame_and_records_frames():
    frames = [Image.new("RGB", (80, 60), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    info = inspect_image(data)
    assert info.n_frames == 3 and info.animated
    r, g, b = np.asarray(decode_rgb(data)).mean(axis=(0, 1))
    assert r > 200 and g < 50 and b < 50


def test_draft_decoding_keeps_at_least_the_requested_size():
    data = (PHOTOS / "retina.jpg").read_bytes()
    small = decode_rgb(data, draft_size=(200, 200))
    assert 200 <= small.width < 1411 and small.width == small.height


# --------------------------------------------------------------------------- bit depth


def _scaled16(values: np.ndarray) -> np.ndarray:
    """The documented rule: v * 255 / 65535, rounded half up (exact integer arithmetic)."""
    return ((values.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)


def _grey(rgb: Image.Image) -> np.ndarray:
    arr = np.asarray(rgb)
    assert (
        rgb.mode == "RGB"
        and (arr[..., 0] == arr[..., 1]).all()
        and (arr[..., 1] == arr[..., 2]).all()
    )
    return arr[..., 0]


CONSTANT = np.full((24, 32), 30000, np.uint16)  # 30000/65535 of white: a mid grey
RAMP = np.tile(np.linspace(0, 20000, 32).round().astype(np.uint16), (24, 1))  # dark ramp


def _image16(values: np.ndarray, mode: str) -> Image.Image:
    h, w = values.shape
    if mode == "I":
        return Image.fromarray(values.astype(np.int32), "I")
    order = {"I;16": "<", "I;16L": "<", "I;16B": ">", "I;16N": "="}[mode]
    return Image.frombytes(mode, (w, h), values.astype(order + "u2").tobytes())


@pytest.mark.parametrize("mode", ["I;16", "I;16L", "I;16B", "I;16N", "I"])
@pytest.mark.parametrize("values", [CONSTANT, RAMP], ids=["constant", "ramp"])
def test_16_bit_images_are_scaled_by_bit_depth_not_stretched(mode, values):
    rgb, how = to_rgb(_image16(values, mode))
    assert how == "high_bit_depth_to_8bit"
    assert (_grey(rgb) == _scaled16(values)).all()


def test_16_bit_constant_grey_stays_mid_grey_and_a_dark_ramp_stays_dark():
    assert np.unique(_grey(to_rgb(_image16(CONSTANT, "I;16"))[0])).tolist() == [117]
    ramp = _grey(to_rgb(_image16(RAMP, "I;16"))[0])
    assert (ramp.min(), ramp.max()) == (0, 78)  # not stretched to 0..255


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_files_decode_by_bit_depth(fmt):
    data = encoded(_image16(CONSTANT, "I;16"), fmt)
    assert inspect_image(data).conversion == "high_bit_depth_to_8bit"
    assert np.unique(_grey(decode_rgb(data))).tolist() == [117]
    ramp = _grey(decode_rgb(encoded(_image16(RAMP, "I;16"), fmt)))
    assert (ramp == _scaled16(RAMP)).all()


def test_32_bit_integer_values_outside_16_bits_are_clipped():
    values = np.array([[-5, 0, 65535, 70000, 2**31 - 1]], np.int32)
    grey = _grey(to_rgb(Image.fromarray(values, "I"))[0])
    assert grey.tolist() == [[0, 0, 255, 255, 255]]


def test_float_images_are_clipped_to_unit_range_and_scaled():
    values = np.array([[-0.5, 0.0, 0.25, 0.5, 1.0, 3.0, np.nan]], np.float32)
    grey = _grey(to_rgb(Image.fromarray(values, "F"))[0])
    assert grey.tolist() == [[0, 0, 64, 128, 255, 255, 0]]
    constant = np.full((8, 8), 30000 / 65535, np.float32)
    assert np.unique(_grey(to_rgb(Image.fromarray(constant, "F"))[0])).tolist() == [117]


def _outcome(fn, data: bytes):
    try:
        return fn(data)
    except DecodeRejected as exc:
        return ("rejected", exc.reason)


def test_inspect_image_and_inspect_and_decode_agree_on_facts_and_refusals():
    # Both run one validating decode (_decode_checked): what ingest records (format, size
    # after EXIF turn, mode, frames, conversion) and every refusal must be the same.
    from prx_assets.core.ingest.decode import inspect_and_decode

    photo = Image.open(PHOTOS / "china.jpg").convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: reported width/height swap
    gif = [Image.new("P", (40, 30), i) for i in range(3)]
    cases = [p.read_bytes() for p in sorted(PHOTOS.iterdir())]
    cases += [
        encoded(photo, "JPEG", quality=90, exif=exif.tobytes()),
        encoded(photo.convert("CMYK"), "JPEG", quality=90),
        encoded(photo.convert("L"), "JPEG", quality=90, progressive=True),
        encoded(gif[0], "GIF", save_all=True, append_images=gif[1:]),
        encoded(photo.convert("RGBA"), "PNG"),
    ]
    broken = [b"", b"not an image" * 9, cases[4][: len(cases[4]) // 2], cases[-5][:-4000]]
    for data in cases + broken:
        draft = (128, 128)
        info = _outcome(inspect_image, data)
        both = _outcome(lambda d, draft=draft: inspect_and_decode(d, draft_size=draft), data)
        assert info == (both if both[0] == "rejected" else both[0])
    assert all(isinstance(_outcome(inspect_image, d), tuple) for d in broken)
    rotated = inspect_image(cases[len(cases) - 5])
    assert (rotated.width, rotated.height) == (photo.height, photo.width)
