"""Test and benchmark images made from the bundled photos (never noise), and the one way to
encode them: one generator, so the inputs the tests and benchmarks quote agree, and no test
file re-declares its own "save to bytes".

``bundled_photos``, ``demo_photo``, ``alpha_photo``: the photos as RGB (or RGBA);
``mosaic``: a multi-megapixel canvas tiled with crops of the photos at their native pixels
(real per-pixel detail, the hard case for a resampler); ``crop_to_aspect``: a centred crop
to an aspect ratio; ``encoded``: any image saved by Pillow with exactly the arguments
given; ``jpeg_bytes``: a JPEG as the resize tests and pipeline benchmarks use (q95,
baseline or progressive, optional EXIF); ``solid_jpeg``: a small flat-colour JPEG, the
stand-in photo of the landing and ingest tests; ``bucketed_photos``: the photos resized to
their buckets and encoded as shards store them, the payload of the MDS writer's tests and
benchmark. Deterministic: the same arguments give the same bytes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from prx_assets.core.shards.buckets import Assignment, assign_bucket
from prx_assets.core.shards.mds import MDSSample
from prx_assets.core.shards.resize import encode_jpeg, resize_to_bucket

PHOTO_DIR = resources.files("prx_assets.demo") / "photos"


def encoded(img: Image.Image, fmt: str, **save: Any) -> bytes:
    """``img`` saved as ``fmt`` with Pillow, ``save`` passed to ``Image.save`` unchanged.

    The one "save to bytes" helper: a test that needs particular bytes names every
    argument at its call site (Pillow's defaults apply to the rest, e.g. JPEG quality 75).
    """
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def jpeg_bytes(
    img: Image.Image, quality: int = 95, progressive: bool = False, exif: bytes = b""
) -> bytes:
    """``img`` as a JPEG (Pillow's encoder, 4:2:0, no optimisation beyond ``progressive``)."""
    return encoded(img, "JPEG", quality=quality, progressive=progressive, exif=exif)


def solid_jpeg(
    size: tuple[int, int] = (64, 48), color: tuple[int, int, int] = (120, 30, 200), **save: Any
) -> bytes:
    """A flat-colour RGB JPEG of ``size`` (Pillow's default quality 75 unless ``save`` says).

    Small and fast: the stand-in photo of tests about landing, reading and refusing files,
    where the pixels do not matter but distinct colours give distinct bytes (and keys).
    """
    return encoded(Image.new("RGB", size, color), "JPEG", **save)


@lru_cache(maxsize=1)
def bundled_photos() -> tuple[Image.Image, ...]:
    """Every bundled photo as RGB, in file-name order (decoded once per process)."""
    files = sorted(PHOTO_DIR.iterdir(), key=lambda p: p.name)
    return tuple(Image.open(io.BytesIO(p.read_bytes())).convert("RGB") for p in files)


def demo_photo(size: tuple[int, int] | None = (301, 207), name: str = "chelsea.png") -> Image.Image:
    """The bundled photo ``name`` as RGB, resized to ``size`` (Pillow's default filter) unless
    ``size`` is None. A new image each call, so a caller may change it.

    The defaults are the decode tests' usual input: a real photo at odd sides (301 x 207),
    so edge blocks and odd chroma rows are exercised.
    """
    img = Image.open(io.BytesIO((PHOTO_DIR / name).read_bytes())).convert("RGB")
    return img if size is None else img.resize(size)


def alpha_photo() -> Image.Image:
    """``demo_photo()`` as RGBA with every kind of alpha: the top third at 90, the left half
    below it opaque, the rest fully transparent (for the decoders' alpha-on-white policy)."""
    rgba = demo_photo().convert("RGBA")
    alpha = np.zeros((rgba.height, rgba.width), np.uint8)
    alpha[:, : rgba.width // 2] = 255
    alpha[: rgba.height // 3] = 90
    rgba.putalpha(Image.fromarray(alpha, "L"))
    return rgba


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


@dataclass(frozen=True)
class BucketedPhoto:
    """A bundled photo as a shard holds it: resized to its bucket, encoded by the writer's
    ``encode_jpeg`` (q92), with the original size the sample records."""

    stem: str  # the file name without its extension
    jpeg: bytes
    bucket: Assignment
    orig_width: int
    orig_height: int

    def sample(self, key: str, caption: str) -> MDSSample:
        """The photo as an MDS sample under ``key`` (source "demo", public-domain)."""
        return MDSSample(
            key=key,
            image=self.jpeg,
            caption=caption,
            orig_width=self.orig_width,
            orig_height=self.orig_height,
            tier=self.bucket.tier,
            shape=self.bucket.shape.name,
            source="demo",
            license="public-domain",
        )


@lru_cache(maxsize=1)
def bucketed_photos() -> tuple[BucketedPhoto, ...]:
    """Every bundled photo that gets a bucket (passes the 384 px cutoff), in file-name order.

    Real bucketed JPEGs for the MDS writer's tests and benchmark, so both write the same
    payload; made from the files' own bytes, as the shard stage makes them.
    """
    out = []
    for path in sorted(PHOTO_DIR.iterdir(), key=lambda p: p.name):
        data = path.read_bytes()
        w, h = Image.open(io.BytesIO(data)).size
        a = assign_bucket(w, h)
        if a is not None:
            jpeg = encode_jpeg(resize_to_bucket(data, a))
            out.append(BucketedPhoto(Path(path.name).stem, jpeg, a, w, h))
    return tuple(out)
