"""Real multi-megapixel test JPEGs from the bundled photos (never noise), for the resize and
pipeline benchmarks and the resize tests: one generator, so the inputs they quote agree.

``mosaic``: a canvas tiled with crops of the photos at their native pixels (real per-pixel
detail, the hard case for a resampler); ``upscaled``: one photo cropped to an aspect ratio
and Lanczos-upscaled; ``jpeg_bytes``: encoded as the tests and benchmarks use (q95, baseline
or progressive, optional EXIF). Deterministic: the same arguments give the same bytes.
"""

from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
from PIL import Image

from prx_assets.demo.build import PHOTO_DIR


@lru_cache(maxsize=1)
def bundled_photos() -> tuple[Image.Image, ...]:
    """Every bundled photo as RGB, in file-name order (decoded once per process)."""
    files = sorted(PHOTO_DIR.iterdir(), key=lambda p: p.name)
    return tuple(Image.open(io.BytesIO(p.read_bytes())).convert("RGB") for p in files)


def mosaic(
    size: tuple[int, int],
    rng: np.random.Generator,
    row_heights: tuple[int, int] = (300, 700),
    tile_widths: tuple[int, int] = (300, 800),
) -> Image.Image:
    """``size`` covered row by row with native-pixel crops of random bundled photos.

    Row heights and tile widths are drawn from ``rng`` in the half-open ranges given; a
    crop is clipped to its photo, so a row may hold tiles shorter than the row.
    """
    photos = bundled_photos()
    canvas = Image.new("RGB", size)
    y = 0
    while y < size[1]:
        row_h = int(rng.integers(*row_heights))
        x = 0
        while x < size[0]:
            p = photos[int(rng.integers(len(photos)))]
            cw, ch = min(int(rng.integers(*tile_widths)), p.width), min(row_h, p.height)
            left = int(rng.integers(0, p.width - cw + 1))
            top = int(rng.integers(0, p.height - ch + 1))
            canvas.paste(p.crop((left, top, left + cw, top + ch)), (x, y))
            x += cw
        y += row_h
    return canvas


def crop_to_aspect(img: Image.Image, aspect: float) -> Image.Image:
    """The largest centred crop of ``img`` with width / height == ``aspect`` (rounded)."""
    w, h = img.size
    if w / h > aspect:
        cw = round(h * aspect)
        return img.crop(((w - cw) // 2, 0, (w - cw) // 2 + cw, h))
    ch = round(w / aspect)
    return img.crop((0, (h - ch) // 2, w, (h - ch) // 2 + ch))


def jpeg_bytes(
    img: Image.Image, quality: int = 95, progressive: bool = False, exif: bytes = b""
) -> bytes:
    """``img`` as a JPEG (Pillow's encoder, 4:2:0, no optimisation beyond ``progressive``)."""
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, progressive=progressive, exif=exif)
    return buf.getvalue()
