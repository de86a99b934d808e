"""Safe image decoding: the one policy every stage uses to turn bytes into RGB pixels.

Why a policy module: ingest, hashing and resizing must agree on what an image *is*
(orientation, colour conversion, which frame), and untrusted bytes must never be able
to exhaust memory or reach an exotic decoder.

Policy (also in the README, "Decoding and bad input"):
- Only real photo formats are opened: JPEG (and MPO, its multi-picture variant),
  PNG, WebP, TIFF, BMP and GIF. Everything else is rejected by name.
- Dimensions are read from the header first; more than ``max_pixels`` (default
  89.5 MP, Pillow's own warning limit) is refused before any pixel is decoded.
- The whole stream is decoded once at ingest, so truncated files fail there with
  Pillow's own "image file is truncated" message (LOAD_TRUNCATED_IMAGES stays off).
- Two decoders stand in for Pillow's where they give the same pixels for less CPU, and
  decline (Pillow then decodes, accepts or refuses as before) whenever they cannot: a still
  WebP by libwebp's own ``WebPDecode`` (``webp_direct``), an 8-bit RGB/RGBA/greyscale PNG
  by libspng (``png_direct``). Which files are accepted, and every refusal, stay Pillow's.
- EXIF orientation is applied; width/height are reported after orientation.
- Animated images: the first frame is used and the frame count is recorded.
- Colour: CMYK and YCbCr convert to RGB; palette images are expanded; alpha is composited
  onto white (a transparent product cut-out should look like a cut-out on white, not on
  black).
- High bit depth greyscale is scaled by its bit depth, never stretched by the image's own
  range (a constant mid grey stays mid grey, a dark ramp stays dark):
  16-bit (modes ``I;16``, ``I;16L``, ``I;16B``, ``I;16N``): ``v * 255 / 65535``, rounded
  half up. Mode ``I`` (32-bit integers; how some decoders hand over 16-bit samples) is read
  on the same 16-bit scale, values outside 0..65535 clipped. Mode ``F`` (32-bit floats) is
  read as 0..1: clipped to that range, NaN as 0, then ``* 255`` rounded half up.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from prx_assets.core.ingest import png_direct, webp_direct

DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's MAX_IMAGE_PIXELS: ~89.5 MP
# Decoders Pillow may try. MPO (multi-picture JPEG) is opened by the JPEG decoder and
# reported as "MPO"; its first picture is used like any multi-frame image.
ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "TIFF", "BMP", "GIF")
ALPHA_BACKGROUND = (255, 255, 255)

# Never decode a partial stream silently.
ImageFile.LOAD_TRUNCATED_IMAGES = False

_ORIENTATION_TAG = 0x0112
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}

# ImageOps.exif_transpose's methods, by EXIF orientation.
ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def transpose_box(
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    method: Image.Transpose | None,
) -> tuple[float, float, float, float]:
    """Where ``box`` lands when an image of ``size`` is transposed by ``method``."""
    w, h = size
    x0, y0, x1, y1 = box
    T = Image.Transpose
    if method is None:
        return box
    if method == T.FLIP_LEFT_RIGHT:
        return (w - x1, y0, w - x0, y1)
    if method == T.FLIP_TOP_BOTTOM:
        return (x0, h - y1, x1, h - y0)
    if method == T.ROTATE_180:
        return (w - x1, h - y1, w - x0, h - y0)
    if method == T.TRANSPOSE:
        return (y0, x0, y1, x1)
    if method == T.ROTATE_90:  # counter-clockwise: (x, y) -> (y, w - x)
        return (y0, w - x1, y1, w - x0)
    if method == T.ROTATE_270:  # clockwise: (x, y) -> (h - y, x)
        return (h - y1, x0, h - y0, x1)
    if method == T.TRANSVERSE:  # (x, y) -> (h - y, w - x)
        return (h - y1, w - x1, h - y0, w - x0)
    raise ValueError(f"unsupported transpose {method}")


class DecodeRejected(Exception):
    """An input that cannot become a training image; ``reason`` is a stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ImageInfo:
    """What ingest records about an accepted image (after orientation)."""

    format: str
    width: int
    height: int
    mode: str
    n_frames: int
    orientation: int
    conversion: str  # how the pixels became RGB: "none", "cmyk", "alpha_on_white", ...

    @property
    def animated(self) -> bool:
        return self.n_frames > 1


#: What the validating decode reads: the bytes, or a seekable binary file holding them (a
#: big file is decoded from its copy in the blob store, never held whole: ingest's runner).
Source = bytes | BinaryIO


def _stream(data: Source) -> BinaryIO:
    """A fresh stream over ``data``: a new ``BytesIO``, or the file rewound."""
    if isinstance(data, bytes | bytearray | memoryview):
        return io.BytesIO(data)
    data.seek(0)
    return data


def _is_empty(data: Source) -> bool:
    if isinstance(data, bytes | bytearray | memoryview):
        return not data
    data.seek(0, io.SEEK_END)
    return data.tell() == 0


def _open(data: Source, max_pixels: int) -> Image.Image:
    if _is_empty(data):
        raise DecodeRejected("empty_file", "0 bytes")
    try:
        # formats= restricts which decoders Pillow may even try.
        with warnings.catch_warnings():
            # Our own limit below decides; Pillow's warning would only be noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(_stream(data), formats=list(ALLOWED_FORMATS))
    except UnidentifiedImageError:
        # Tell "an image we refuse" apart from "not an image at all".
        try:
            other = Image.open(_stream(data))
            fmt = other.format
            other.close()
        except Exception:  # noqa: BLE001 - any failure means: not an image we know
            fmt = None
        if fmt:
            raise DecodeRejected(
                "format_not_allowed", f"{fmt} is not an accepted photo format"
            ) from None
        raise DecodeRejected("not_an_image", "no image decoder recognises these bytes") from None
    except Image.DecompressionBombError:
        # Pillow's own header check (at twice its limit) fired first; same outcome, and the
        # detail names the limit that applies, not Pillow's 2x threshold (179 MP).
        limit = min(max_pixels, 2 * Image.MAX_IMAGE_PIXELS)
        detail = f"more pixels than the limit of {limit} px (checked before decoding)"
        raise DecodeRejected("decompression_bomb", detail) from None
    except Exception as exc:  # noqa: BLE001 - malformed headers raise many types
        raise DecodeRejected("corrupt_header", f"{type(exc).__name__}: {exc}") from None
    w, h = img.size
    if w <= 0 or h <= 0:
        raise DecodeRejected("corrupt_header", f"invalid dimensions {w}x{h}")
    if w * h > max_pixels:
        raise DecodeRejected(
            "decompression_bomb",
            f"{w}x{h} = {w * h} px exceeds the limit of {max_pixels} px (checked before decoding)",
        )
    return img


def _orientation(img: Image.Image) -> int:
    try:
        value = int(img.getexif().get(_ORIENTATION_TAG, 1))
    except Exception:  # noqa: BLE001 - a broken EXIF block must not reject the photo
        return 1
    return value if 1 <= value <= 8 else 1


def open_header(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open untrusted bytes by the policy (allowed formats, pixel limit); no pixel decoded."""
    return _open(data, max_pixels)


def orientation_of(img: Image.Image) -> int:
    """The EXIF orientation (1..8) of an opened image; 1 when absent, invalid or unreadable."""
    return _orientation(img)


HIGH_BIT_DEPTH_MODES: tuple[str, ...] = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
_ROWS_PER_STEP = 512  # rows converted at a time: a 89 MP image never needs a 64-bit copy


def _high_bit_depth_to_l(img: Image.Image) -> Image.Image:
    """8-bit greyscale by bit depth (the rule in the module docstring), in row blocks."""
    arr = np.asarray(img)
    out = np.empty(arr.shape, np.uint8)
    for start in range(0, arr.shape[0], _ROWS_PER_STEP):
        block = arr[start : start + _ROWS_PER_STEP]
        if img.mode == "F":
            unit = np.clip(np.nan_to_num(block.astype(np.float64), nan=0.0), 0.0, 1.0)
            out[start : start + _ROWS_PER_STEP] = np.floor(unit * 255.0 + 0.5)
        else:
            v = np.clip(block, 0, 65535).astype(np.uint32)
            out[start : start + _ROWS_PER_STEP] = (v * 255 + 32767) // 65535
    return Image.fromarray(out, "L")


def to_rgb(img: Image.Image) -> tuple[Image.Image, str]:
    """Convert a decoded frame to 8-bit RGB by the documented policy."""
    mode = img.mode
    if mode == "RGB":
        return img, "none"
    if mode in ("CMYK", "YCbCr", "LAB", "HSV"):
        return img.convert("RGB"), mode.lower()
    if mode in HIGH_BIT_DEPTH_MODES:
        return _high_bit_depth_to_l(img).convert("RGB"), "high_bit_depth_to_8bit"
    if mode == "P":
        has_alpha = "transparency" in img.info
        img = img.convert("RGBA" if has_alpha else "RGB")
        if not has_alpha:
            return img, "palette"
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img if img.mode == "RGBA" else img.convert("RGBA")
        # Pasting through the alpha band onto an RGB canvas is Pillow's ``alpha_composite``
        # onto an opaque white RGBA canvas then ``convert("RGB")``, byte for byte (both round
        # v * a + 255 * (255 - a) over 255 the same way: tested on every (value, alpha)
        # pair), in one pass instead of four (~3x less CPU on a 4 MP cut-out).
        background = Image.new("RGB", rgba.size, ALPHA_BACKGROUND)
        background.paste(rgba, (0, 0), rgba)
        return background, "alpha_on_white"
    if mode in ("L", "1"):
        return img.convert("RGB"), "greyscale"
    return img.convert("RGB"), mode.lower()


def _load_first_frame(img: Image.Image, data: Source, n_frames: int) -> Image.Image:
    """Decode the first frame of an opened image; returns the loaded image to use.

    A still WebP given as bytes is decoded by ``webp_direct`` (the same libwebp, the same
    pixels, ~2.7x less CPU than Pillow's animation-decoder path); the opened image is then
    closed and a new one returned. Whenever that path declines, Pillow's own ``load`` runs,
    so which files are accepted or refused, and why, is Pillow's as before.
    """
    if (
        img.format == "WEBP"
        and n_frames == 1
        and isinstance(data, bytes)
        and img.mode in ("RGB", "RGBA")
    ):
        pixels = webp_direct.decode_still(data, img.size, img.mode)
        if pixels is not None:
            direct = Image.frombuffer(img.mode, img.size, pixels, "raw", img.mode, 0, 1)
            direct.format = img.format  # (frombuffer's image has none)
            img.close()
            return direct
    if n_frames > 1:
        img.seek(0)
    img.load()
    return img


def _png_decoded_directly(img: Image.Image, data: Source, n_frames: int) -> Image.Image:
    """An opened PNG decoded by ``png_direct`` (libspng) when it is a plain 8-bit RGB or RGBA
    still; otherwise ``img`` itself, unloaded.

    It runs before the EXIF orientation is read because Pillow's ``PngImageFile.getexif``
    decodes the whole image first (an ``eXIf`` or text chunk may follow the image data).
    Here only inert chunks may follow it (``png_direct.only_inert_chunks_follow``: none that
    Pillow would read an orientation or transparency from, or refuse the file for), so the
    header Pillow already parsed holds every fact the policy reads, and the decoded image
    carries a copy of its ``info``: orientation and transparency read the same. The original
    is closed when it is replaced; a declined decode leaves it to Pillow's own ``load``,
    which accepts or refuses as before.
    """
    if img.format != "PNG" or n_frames != 1 or not isinstance(data, bytes):
        return img
    png = getattr(img, "png", None)
    if getattr(png, "im_n_frames", 0) is not None:  # APNG (or an unknown Pillow): Pillow's
        return img
    if len(img.tile) != 1 or img.tile[0][0] != "zip" or img.tile[0][3] != img.mode:
        return img  # 16-bit, 1/2/4-bit, palette, or a layout not Pillow's plain raw mode
    text_memory = getattr(png, "text_memory", None)
    if text_memory is None or not png_direct.only_inert_chunks_follow(
        data, img.tile[0][2], text_memory
    ):
        return img
    pixels = png_direct.decode(data, img.size, img.mode)
    if pixels is None:
        return img
    # RGB is copied into Pillow's 4-byte pixels; RGBA rows are used in place.
    direct = Image.frombuffer(img.mode, img.size, pixels, "raw", img.mode, 0, 1)
    direct.format = img.format
    direct.info = dict(img.info)
    img.close()
    return direct


def oriented(img: Image.Image, orientation: int) -> Image.Image:
    """``img`` turned upright by EXIF ``orientation`` (1..8); the image itself, not a copy,
    when there is nothing to turn (``ImageOps.exif_transpose`` copies every image)."""
    method = ORIENTATION_TRANSPOSE.get(orientation)
    return img if method is None else img.transpose(method)


def _decode_checked(
    data: Source, max_pixels: int, draft_size: tuple[int, int] | None
) -> tuple[Image.Image, ImageInfo]:
    """Open by the policy, record what ingest stores, and decode the first frame.

    The one validating decode behind ``inspect_image`` and ``inspect_and_decode``: the
    refusals (``DecodeRejected``) and the recorded facts cannot drift apart between them.
    ``draft_size`` (oriented pixels) lets a JPEG decode at the smallest DCT scale still at
    least that large; libjpeg entropy-decodes every scan at any scale, so truncation and
    corrupt data are refused the same way. Returns the loaded, un-oriented image (the
    caller closes it) and its ``ImageInfo``; on a refusal the image is already closed.
    """
    img = _open(data, max_pixels)
    fmt = img.format or "UNKNOWN"
    n_frames = int(getattr(img, "n_frames", 1) or 1)
    img = _png_decoded_directly(img, data, n_frames)
    orientation = _orientation(img)
    w, h = img.size
    mode = img.mode
    try:
        if draft_size is not None and fmt in ("JPEG", "MPO"):
            tw, th = draft_size
            if orientation in _TRANSPOSING_ORIENTATIONS:
                tw, th = th, tw
            img.draft("RGB", (tw, th))
        img = _load_first_frame(img, data, n_frames)
    except Image.DecompressionBombError as exc:
        img.close()
        raise DecodeRejected("decompression_bomb", str(exc)) from None
    except OSError as exc:
        img.close()
        msg = str(exc)
        reason = "truncated" if "truncated" in msg else "corrupt_data"
        raise DecodeRejected(reason, msg) from None
    except Exception as exc:  # noqa: BLE001
        img.close()
        raise DecodeRejected("corrupt_data", f"{type(exc).__name__}: {exc}") from None
    if orientation in _TRANSPOSING_ORIENTATIONS:
        w, h = h, w
    _, conversion = _conversion_for_mode(mode, "transparency" in img.info)
    info = ImageInfo(
        format=fmt,
        width=w,
        height=h,
        mode=mode,
        n_frames=n_frames,
        orientation=orientation,
        conversion=conversion,
    )
    return img, info


def inspect_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageInfo:
    """Validate untrusted bytes completely (header, limits, full decode) without keeping pixels.

    JPEGs are verified in draft mode (DCT scaling to 1/8: the smallest scale at least 1x1
    px): libjpeg still entropy-decodes every scan, so truncation and corrupt data are
    caught, at a fraction of the cost.
    """
    img, info = _decode_checked(data, max_pixels, (1, 1))
    img.close()
    return info


def inspect_and_decode(
    data: Source,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    draft_size: tuple[int, int] | None = None,
) -> tuple[ImageInfo, Image.Image | None]:
    """``inspect_image``'s validation and ``decode_rgb``'s pixels from one decode.

    Why: validating a stream means entropy-decoding all of it, which is also the whole cost
    of the reduced-scale decode pHash needs; doing both from one decode saves the second.
    The refusals are ``inspect_image``'s (any DCT scale entropy-decodes every scan, so the
    answer is the same as its 1/8 draft), and the image equals ``decode_rgb(data, max_pixels,
    draft_size)`` step for step. The image is None when the policy's RGB conversion fails
    (the file is still valid; a stage that needs pixels then decodes and reports it).
    """
    img, info = _decode_checked(data, max_pixels, draft_size)
    try:
        rgb: Image.Image | None = to_rgb(oriented(img, info.orientation))[0]
    except Exception:  # noqa: BLE001 - valid file, no pixels for the caller
        rgb = None
    return info, rgb


def _conversion_for_mode(mode: str, palette_alpha: bool) -> tuple[str, str]:
    if mode == "RGB":
        return mode, "none"
    if mode in ("CMYK", "YCbCr", "LAB", "HSV"):
        return mode, mode.lower()
    if mode in HIGH_BIT_DEPTH_MODES:
        return mode, "high_bit_depth_to_8bit"
    if mode == "P":
        return mode, "alpha_on_white" if palette_alpha else "palette"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return mode, "alpha_on_white"
    if mode in ("L", "1"):
        return mode, "greyscale"
    return mode, mode.lower()


def decode_rgb(
    data: bytes,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    draft_size: tuple[int, int] | None = None,
) -> Image.Image:
    """Decode to an oriented RGB image by the policy.

    ``draft_size``: for JPEGs, let libjpeg decode at the smallest DCT scale that is still
    at least this large (in oriented pixels). Stages that downscale anyway use it.
    """
    img = _open(data, max_pixels)
    img = _png_decoded_directly(img, data, int(getattr(img, "n_frames", 1) or 1))
    try:
        if draft_size is not None and img.format in ("JPEG", "MPO"):
            tw, th = draft_size
            if _orientation(img) in _TRANSPOSING_ORIENTATIONS:
                tw, th = th, tw
            img.draft("RGB", (tw, th))
        orientation = _orientation(img)
        img = _load_first_frame(img, data, int(getattr(img, "n_frames", 1) or 1))
        rgb, _ = to_rgb(oriented(img, orientation))
        return rgb
    except DecodeRejected:
        raise
    except OSError as exc:
        msg = str(exc)
        raise DecodeRejected("truncated" if "truncated" in msg else "corrupt_data", msg) from None
