"""Thumbnails for the browser: decoded by the project's policy, kept in a bounded LRU.

Why the decode policy: the bytes in ``images`` are untrusted originals; ``decode_rgb``
refuses decompression bombs and exotic formats and applies EXIF orientation, so a
thumbnail shows what training sees. JPEG draft mode keeps large photos cheap to shrink.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable

from PIL import Image

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS, decode_rgb

THUMB_SIZES: tuple[int, ...] = (256, 1024)  # grid cards, detail view
JPEG_QUALITY = 85


def render_thumbnail(
    data: bytes, size: int = 256, max_pixels: int = DEFAULT_MAX_PIXELS, quality: int = JPEG_QUALITY
) -> bytes:
    """JPEG bytes of the image fitted inside ``size`` x ``size`` (never upscaled).

    Raises ``DecodeRejected`` for bytes the decode policy refuses.
    """
    if size not in THUMB_SIZES:
        raise ValueError(f"thumbnail size must be one of {THUMB_SIZES}, got {size}")
    img = decode_rgb(data, max_pixels=max_pixels, draft_size=(size, size))
    img.thumbnail((size, size), Image.Resampling.LANCZOS, reducing_gap=2.0)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=quality, optimize=False)
    return out.getvalue()


class ThumbnailCache:
    """A byte-bounded, thread-safe LRU of rendered thumbnails keyed by (image key, size).

    Image keys are content hashes, so an entry never goes stale.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str, size: int, load: Callable[[], bytes]) -> bytes:
        """The cached thumbnail, or ``render_thumbnail(load(), size)`` stored for next time."""
        with self._lock:
            found = self._items.get((key, size))
            if found is not None:
                self._items.move_to_end((key, size))
                self.hits += 1
                return found
            self.misses += 1
        thumb = render_thumbnail(load(), size)  # outside the lock: decoding is the slow part
        with self._lock:
            if (key, size) not in self._items and len(thumb) <= self.max_bytes:
                self._items[(key, size)] = thumb
                self._bytes += len(thumb)
                while self._bytes > self.max_bytes:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= len(old)
        return thumb
