"""Still WebP images decoded straight into an RGB/RGBA buffer by the libwebp Pillow loaded.

Why: Pillow opens every WebP through libwebp's animation decoder, which decodes the first
frame into an RGBA canvas, copies that canvas into a Python bytes object and unpacks it once
more; on 3-4 MP photos that is ~2.7x the CPU of libwebp's own ``WebPDecode`` into an RGB
buffer (``benchmarks/bench_pipeline.py --formats mixed`` measures it). The pixels are the same
bytes (same library, same decoder: tested against Pillow's, lossy and lossless, RGB and RGBA).

The library is the very one ``PIL._webp`` loaded into this process (found in
``/proc/self/maps``), never another copy on the system, and its decoder ABI is checked by
libwebp itself (``WebPInitDecoderConfigInternal`` refuses an incompatible one). Whenever it
cannot be used (not found, ABI refused, an animation, a size that disagrees with Pillow's
header, any decoder status but OK) the caller falls back to Pillow's own decode, which then
accepts or refuses the file exactly as before: this path can only make a decode cheaper,
never change which files are accepted.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

WEBP_DECODER_ABI_VERSION = 0x0209  # libwebp >= 1.3's decode.h; libwebp checks the major byte
MODE_RGB = 0
MODE_RGBA = 1
VP8_STATUS_OK = 0


class _Features(ctypes.Structure):
    _fields_ = [
        ("width", ctypes.c_int),
        ("height", ctypes.c_int),
        ("has_alpha", ctypes.c_int),
        ("has_animation", ctypes.c_int),
        ("format", ctypes.c_int),
        ("pad", ctypes.c_uint32 * 5),
    ]


class _RGBABuffer(ctypes.Structure):
    _fields_ = [("rgba", ctypes.c_void_p), ("stride", ctypes.c_int), ("size", ctypes.c_size_t)]


class _YUVABuffer(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("y", "u", "v", "a")),
        *((name, ctypes.c_int) for name in ("y_stride", "u_stride", "v_stride", "a_stride")),
        *((name, ctypes.c_size_t) for name in ("y_size", "u_size", "v_size", "a_size")),
    ]


class _Buffers(ctypes.Union):
    _fields_ = [("RGBA", _RGBABuffer), ("YUVA", _YUVABuffer)]


class _DecBuffer(ctypes.Structure):
    _fields_ = [
        ("colorspace", ctypes.c_int),
        ("width", ctypes.c_int),
        ("height", ctypes.c_int),
        ("is_external_memory", ctypes.c_int),
        ("u", _Buffers),
        ("pad", ctypes.c_uint32 * 4),
        ("private_memory", ctypes.c_void_p),
    ]


_OPTION_INTS = (
    "bypass_filtering",
    "no_fancy_upsampling",
    "use_cropping",
    "crop_left",
    "crop_top",
    "crop_width",
    "crop_height",
    "use_scaling",
    "scaled_width",
    "scaled_height",
    "use_threads",
    "dithering_strength",
    "flip",
    "alpha_dithering_strength",
)


class _Options(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int) for name in _OPTION_INTS), ("pad", ctypes.c_uint32 * 5)]


class _Config(ctypes.Structure):
    _fields_ = [("input", _Features), ("output", _DecBuffer), ("options", _Options)]


def _pillows_libwebp() -> Path | None:
    """The path of the libwebp that Pillow's WebP plugin loaded into this process."""
    try:
        import PIL._webp  # noqa: F401 - loads the library we then look up
    except ImportError:
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        name = Path(path).name
        if name.startswith("libwebp") and not name.startswith(("libwebpdemux", "libwebpmux")):
            if ".so" in name:
                return Path(path)
    return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = _pillows_libwebp()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.WebPInitDecoderConfigInternal.argtypes = [ctypes.POINTER(_Config), ctypes.c_int]
        lib.WebPInitDecoderConfigInternal.restype = ctypes.c_int
        lib.WebPGetFeaturesInternal.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.POINTER(_Features),
            ctypes.c_int,
        ]
        lib.WebPGetFeaturesInternal.restype = ctypes.c_int
        lib.WebPDecode.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(_Config)]
        lib.WebPDecode.restype = ctypes.c_int
        lib.WebPFreeDecBuffer.argtypes = [ctypes.POINTER(_DecBuffer)]
        lib.WebPFreeDecBuffer.restype = None
        probe = _Config()
        if not lib.WebPInitDecoderConfigInternal(ctypes.byref(probe), WEBP_DECODER_ABI_VERSION):
            return None  # an ABI this layout was not written for
    except (OSError, AttributeError):
        return None
    return lib


def available() -> bool:
    """Whether the direct decode can be used in this process."""
    return _library() is not None


def decode_still(data: bytes, size: tuple[int, int], mode: str) -> bytearray | None:
    """The pixels of a still WebP as ``mode`` ("RGB" or "RGBA") rows, or None: use Pillow.

    ``size`` is Pillow's header size (already checked against the pixel limit): the
    buffer is allocated for it and the stream's own features must agree, so a stream can
    never make this allocate more than the policy allowed.
    """
    lib = _library()
    if lib is None or mode not in ("RGB", "RGBA"):
        return None
    config = _Config()
    if not lib.WebPInitDecoderConfigInternal(ctypes.byref(config), WEBP_DECODER_ABI_VERSION):
        return None
    features = config.input
    status = lib.WebPGetFeaturesInternal(
        data, len(data), ctypes.byref(features), WEBP_DECODER_ABI_VERSION
    )
    w, h = size
    if (
        status != VP8_STATUS_OK
        or features.has_animation
        or (features.width, features.height) != (w, h)
        or bool(features.has_alpha) != (mode == "RGBA")
    ):
        return None
    channels = 4 if mode == "RGBA" else 3
    out = bytearray(w * h * channels)
    view = (ctypes.c_uint8 * len(out)).from_buffer(out)
    config.output.colorspace = MODE_RGBA if mode == "RGBA" else MODE_RGB
    config.output.is_external_memory = 1
    config.output.u.RGBA.rgba = ctypes.addressof(view)
    config.output.u.RGBA.stride = w * channels
    config.output.u.RGBA.size = len(out)
    try:
        status = lib.WebPDecode(data, len(data), ctypes.byref(config))
    finally:
        lib.WebPFreeDecBuffer(ctypes.byref(config.output))  # nothing held with external memory
        del view
    return out if status == VP8_STATUS_OK else None
