"""8-bit PNGs decoded by libspng (through ``imagecodecs``) instead of Pillow's PNG decoder.

Why: a PNG has no reduced-scale decode, so ingest's validation decodes every pixel, and
the pHash thumbnail and the review preview come on top of it. Pillow's decoder (zlib-ng
inflate, then scalar row unfiltering and unpacking) took ~80 ms of CPU for a 3-4 MP photo
here; libspng (SIMD unfiltering) takes ~51 ms for the same pixels, which is what brings
ingest of a PNG under a plain ``Image.open().load()`` of it
(``benchmarks/bench_pipeline.py --formats mixed`` measures it).

The pixels are the same bytes: no gamma, ICC or transparency is applied by either decoder
(libspng's decode flags stay 0 for these formats), tested against Pillow's on RGB, RGBA and
greyscale, interlaced or not, with and without ``tRNS``/``gAMA``. Only the three raw modes
whose layout both decoders agree on take this path (8-bit ``RGB``, ``RGBA``, ``L``: Pillow's
raw mode for the file, read from its header); everything else (palette, 16-bit, 1/2/4-bit,
grey with alpha, APNG) is Pillow's as before.

Fail closed, never open: whenever libspng declines (any error: a bad CRC, a truncated or
over-long stream, a bad Adler-32, limits) or its output disagrees with Pillow's header (size,
channels), the caller runs Pillow's own decode, which then accepts or refuses the file
exactly as before. libspng is the stricter of the two (it checks every chunk's CRC and the
zlib checksum, which Pillow skips for image data), so this path can only make an accepted
file cheaper, never accept a file Pillow would refuse. The output buffer is sized by the
header Pillow already checked against the pixel limit.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import numpy as np

#: Pillow's raw mode for the PNG (``img.tile[0].args``) -> channels libspng must give back.
CHANNELS = {"RGB": 3, "RGBA": 4, "L": 1}


@functools.cache
def _decoder() -> Any | None:
    """``imagecodecs.spng_decode``, or None where it cannot be imported (Pillow decodes)."""
    try:
        import imagecodecs
    except ImportError:
        return None
    return getattr(imagecodecs, "spng_decode", None)


def only_image_data_follows(data: bytes, idat_data_offset: int) -> bool:
    """Whether the chunks from the first IDAT on are IDATs and then IEND, and nothing else.

    ``idat_data_offset`` is where Pillow's header says the first IDAT's data starts. Why:
    Pillow reads the chunks after the image data (text, ``eXIf``: orientation) only when it
    decodes the pixels; when nothing but IEND follows them, the header it has parsed is
    complete. Any other chunk there, a malformed length, or a stream cut short: False (Pillow
    decodes, and accepts or refuses, as before). Walks chunk headers only: microseconds.
    """
    pos = idat_data_offset - 8
    n = len(data)
    first = True
    while pos >= 0 and pos + 12 <= n:
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"IEND":
            return not first and length == 0
        if kind != b"IDAT":
            return False
        first = False
        pos += 12 + length
    return False


def available() -> bool:
    """Whether the libspng decode can be used in this process."""
    return _decoder() is not None


def decode(data: bytes, size: tuple[int, int], rawmode: str) -> np.ndarray | None:
    """The pixels of an 8-bit PNG as a (height, width[, channels]) uint8 array, or None:
    use Pillow.

    ``size`` and ``rawmode`` are Pillow's reading of the header (size already within the
    pixel limit); libspng's result must match both, or it is not used.
    """
    spng_decode = _decoder()
    channels = CHANNELS.get(rawmode)
    if spng_decode is None or channels is None:
        return None
    try:
        pixels = spng_decode(data)
    except Exception:  # noqa: BLE001 - any refusal: Pillow decides, with its own message
        return None
    w, h = size
    expected = (h, w) if channels == 1 else (h, w, channels)
    if pixels.dtype != np.uint8 or pixels.shape != expected or not pixels.flags.c_contiguous:
        return None
    return pixels
