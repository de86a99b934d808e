"""8-bit RGB/RGBA PNGs decoded by libspng (through ``imagecodecs``) instead of Pillow's decoder.

Why: a PNG has no reduced-scale decode, so ingest's validation decodes every pixel, and the
pHash thumbnail and the review preview come on top of it. Pillow's decoder (zlib-ng inflate,
then scalar row unfiltering and unpacking) took ~80 ms of CPU for a 3-4 MP RGB photo here;
libspng (SIMD unfiltering) takes ~51 ms for the same pixels (RGBA: ~100 ms and ~58 ms), which
is what brings ingest of a PNG under a plain ``Image.open().load()`` of it
(``benchmarks/bench_pipeline.py --formats mixed`` measures it).

The pixels are the same bytes: no gamma, ICC or transparency is applied by either decoder
(``imagecodecs.spng_decode`` passes libspng no decode flags), tested against Pillow's on RGB
and RGBA, interlaced or not, with and without ``tRNS``/``gAMA``/``iCCP``. Only the raw modes whose
layout both decoders agree on and where libspng is faster take this path (8-bit ``RGB`` and
``RGBA``: Pillow's raw mode for the file, read from its header); everything else (greyscale,
palette, 16-bit, 1/2/4-bit, grey with alpha, APNG, and a file with a chunk after the image
data that Pillow would read: ``only_inert_chunks_follow``) is Pillow's as before.

Fail closed, never open: whenever libspng declines (any error: a bad CRC, a truncated or
over-long stream, a bad Adler-32, limits) or its output disagrees with Pillow's header (size,
channels), the caller runs Pillow's own decode, which then accepts or refuses the file
exactly as before. libspng is the stricter of the two (it checks every chunk's CRC and the
zlib checksum, which Pillow skips for image data), so this path can only make an accepted
file cheaper, never accept a file Pillow would refuse. The output buffer is sized by the
header Pillow already checked against the pixel limit (``decode`` checks that libspng reads
the same one).

Memory: the decoded rows (3 bytes a pixel for RGB) and Pillow's image (4) are held together
while Pillow copies them in: a 24 MP RGB PNG peaked at 161 MB over the process's baseline
through ``check_candidate``, against 115 MB with Pillow's decoder; both bounded by the pixel
limit. An RGBA image uses the decoded rows in place.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import numpy as np

#: Pillow's raw mode for the PNG (``img.tile[0].args``) -> channels libspng must give back.
#: Not 8-bit greyscale: one byte per pixel leaves inflate as the whole cost, where Pillow's
#: zlib-ng is ahead (measured 35 ms for Pillow, 40 ms for libspng on 3-4 MP grey photos).
CHANNELS = {"RGB": 3, "RGBA": 4}


@functools.cache
def _decoder() -> Any | None:
    """``imagecodecs.spng_decode``, or None where it cannot be imported (Pillow decodes)."""
    try:
        import imagecodecs
    except ImportError:
        return None
    return getattr(imagecodecs, "spng_decode", None)


#: Text keys Pillow's ``Image.getexif`` reads an orientation from (``Raw profile type exif``,
#: ``exif``) or an XMP packet (``XML:com.adobe.xmp``, ``xmp``).
ORIENTATION_TEXT_KEYS = (b"exif", b"Raw profile type exif", b"XML:com.adobe.xmp", b"xmp")


def _inert_after_image_data(kind: bytes, body: bytes, text_memory: int) -> int | None:
    """Pillow's text memory after it reads chunk ``kind`` past the image data, or None when
    that chunk could change what it records (``info``: orientation, transparency) or refuse
    the file. Inert: a chunk type Pillow has no handler for (it only skips it), and a
    ``tEXt`` whose key is not one ``getexif`` reads, within Pillow's text memory limit."""
    from PIL import PngImagePlugin

    if not (kind.isascii() and kind.isalpha()):
        return None
    if not hasattr(PngImagePlugin.PngStream, f"chunk_{kind.decode()}"):
        return text_memory
    if kind != b"tEXt":
        return None
    key, _, value = body.partition(b"\0")
    if not key:
        return text_memory  # Pillow ignores a tEXt without a key
    if key in ORIENTATION_TEXT_KEYS:
        return None
    text_memory += len(value)  # latin-1: one character a byte, as Pillow counts it
    return text_memory if text_memory <= PngImagePlugin.MAX_TEXT_MEMORY else None


def only_inert_chunks_follow(data: bytes, idat_data_offset: int, text_memory: int) -> bool:
    """Whether the image data (consecutive IDATs from ``idat_data_offset``, where Pillow's
    header says the first one's data starts) is followed only by inert chunks, then IEND.

    Why: Pillow reads the chunks after the image data (text, ``eXIf``: orientation) only
    when it decodes the pixels, and one of them can make it refuse the file (its text memory
    limit). When each is inert (``_inert_after_image_data``: ``tIME``, private chunks, an
    ordinary ``tEXt`` such as the dates ImageMagick writes there), what Pillow parsed before
    the pixels is every fact the policy reads, and its load could not have refused. Anything
    else, a chunk cut short, or no IEND: False (Pillow decodes, accepts or refuses, as
    before). ``text_memory`` is what Pillow's header parse has counted so far. Reads chunk
    headers and those few text chunks only: microseconds.
    """
    pos = idat_data_offset - 8
    n = len(data)
    if pos < 0 or data[pos + 4 : pos + 8] != b"IDAT":
        return False
    in_image_data = True
    while pos + 12 <= n:
        length, kind = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if end > n:
            return False
        if kind == b"IEND":
            return length == 0
        if kind == b"IDAT" and in_image_data:
            pos = end
            continue
        in_image_data = False
        counted = _inert_after_image_data(kind, data[pos + 8 : end - 4], text_memory)
        if counted is None:
            return False
        text_memory = counted
        pos = end
    return False


def available() -> bool:
    """Whether the libspng decode can be used in this process."""
    return _decoder() is not None


def decode(data: bytes, size: tuple[int, int], rawmode: str) -> np.ndarray | None:
    """The pixels of an 8-bit RGB or RGBA PNG as a (height, width, channels) uint8 array, or
    None: use Pillow.

    ``size`` and ``rawmode`` are Pillow's reading of the header (size already within the
    pixel limit); libspng's result must match both, or it is not used.
    """
    spng_decode = _decoder()
    channels = CHANNELS.get(rawmode)
    if spng_decode is None or channels is None:
        return None
    # libspng sizes its output by the first chunk (IHDR must be first); Pillow's size may
    # come from a later one. Only when they are the same header is the buffer bounded by
    # the pixel limit Pillow's size was checked against.
    w, h = size
    if data[8:16] != b"\x00\x00\x00\x0dIHDR" or data[16:24] != struct.pack(">II", w, h):
        return None
    try:
        pixels = spng_decode(data)
    except Exception:  # noqa: BLE001 - any refusal: Pillow decides, with its own message
        return None
    if (
        pixels.dtype != np.uint8
        or pixels.shape != (h, w, channels)
        or not pixels.flags.c_contiguous
    ):
        return None
    return pixels
