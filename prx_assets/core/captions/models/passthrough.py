"""Send a photo to a VLM server as it was ingested, and let the server's processor resize it.

Why: a vLLM/SGLang server resizes every image itself (Qwen-VL's processor fits it to its
patch grid and pixel budget), so a client that decodes, resizes and re-encodes a 3-4 MP
JPEG first does that work twice, and it costs the caption step ~37-69 ms CPU per photo:
one step could not feed even one H200 (~20 images/s). Passing the ingested JPEG through
costs a header read, a metadata strip and base64 (a few ms); the server's processor does the
resize from the original pixels (``mm_processor_kwargs.max_pixels`` bounds its area).
The price is bytes on the wire: the original file (typically 1-3 MB) instead of a ~230 KB
re-encode.

Only what the server decodes to the pixels our decode policy would give is passed
through: a single-frame baseline or progressive JPEG, 8-bit RGB or greyscale, EXIF
orientation absent or 1 (a server does not rotate), no larger than ``max_bytes`` and within
the decode policy's pixel limit. Anything else (CMYK, rotated, PNG, WebP, ...) is prepared
here as ``resize="draft"`` does. Both are deterministic per image, so the captioner's
identity (``resize="server"``) names exactly what the fleet saw.

Metadata is stripped (APP1 EXIF/XMP, APP3-APP13, APP15 and comments; APP0 JFIF, APP2 ICC and
APP14 Adobe, which decide colours, are kept): requests carry pixels, not the photographer's
GPS. Hand-written because no maintained library strips JPEG segments losslessly without
decoding (Pillow re-encodes); the walk stops at the first scan and copies the rest as is.
"""

from __future__ import annotations

import io

from PIL import Image

from prx_assets.core.captions.models.base import DataURL, data_url
from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS

DEFAULT_MAX_BYTES = 8 * 1024 * 1024  # a bigger file is prepared here (bounded requests)
_ORIENTATION = 0x0112
_KEEP_APPS = {0xE0, 0xE2, 0xEE}  # JFIF, ICC profile, Adobe (colour transform)
_SOS, _EOI = 0xDA, 0xD9


def strip_jpeg_metadata(data: bytes) -> bytes | None:
    """``data`` without its metadata segments, or None when its markers do not parse."""
    if not data.startswith(b"\xff\xd8"):
        return None
    out = [b"\xff\xd8"]
    pos, end = 2, len(data)
    while pos < end:
        if data[pos] != 0xFF:
            return None
        while pos < end and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= end:
            return None
        marker = data[pos]
        pos += 1
        if marker == _EOI or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            return None  # no scan before the end: not an image a server should get
        if pos + 2 > end:
            return None
        length = int.from_bytes(data[pos : pos + 2], "big")
        if length < 2 or pos + length > end:
            return None
        segment_end = pos + length
        if marker == _SOS:
            out.append(b"\xff" + bytes((marker,)) + data[pos:])  # scans to the end, as is
            return b"".join(out)
        drop = marker == 0xFE or (0xE0 <= marker <= 0xEF and marker not in _KEEP_APPS)
        if not drop:
            out.append(b"\xff" + bytes((marker,)) + data[pos:segment_end])
        pos = segment_end
    return None


def server_ready_url(
    data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, max_pixels: int = DEFAULT_MAX_PIXELS
) -> DataURL | None:
    """The ingested JPEG as a metadata-free data URL, when a server decodes it to the same
    pixels as our policy; None when it must be prepared here instead."""
    if len(data) > max_bytes or not data.startswith(b"\xff\xd8\xff"):
        return None
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format != "JPEG" or img.mode not in ("RGB", "L"):
                return None
            if getattr(img, "n_frames", 1) != 1 or img.width * img.height > max_pixels:
                return None
            if img.getexif().get(_ORIENTATION, 1) != 1:
                return None
    except Exception:  # noqa: BLE001 - unreadable header: prepared (and refused) here
        return None
    stripped = strip_jpeg_metadata(data)
    if stripped is None:
        return None
    return data_url(stripped)
