"""A landing-zone folder batch of real photographs at camera-like sizes (bundled photos,
upscaled), for the Ray tests and benchmark: per-image work large enough to be worth spreading.

Deterministic: the same arguments write the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageOps

from prx_assets.demo.build import PHOTO_DIR, load_photo_metadata

# Variants keep the copies of one photo apart (distinct pHashes, distinct shard samples).
_VARIANTS = (
    lambda im: im,
    ImageOps.mirror,
    ImageOps.flip,
    lambda im: im.transpose(Image.Transpose.ROTATE_90),
    # The rest of the square's symmetries: up to 8 distinct copies of each photo.
    lambda im: im.transpose(Image.Transpose.ROTATE_180),
    lambda im: im.transpose(Image.Transpose.ROTATE_270),
    lambda im: im.transpose(Image.Transpose.TRANSPOSE),
    lambda im: im.transpose(Image.Transpose.TRANSVERSE),
)


def write_photo_batch(folder: Path, count: int, long_side: int = 1600) -> list[str]:
    """``count`` JPEGs (q90, long side ``long_side`` px) with alt-text sidecars in ``folder``,
    then ``_SUCCESS``; returns the image file names."""
    meta = load_photo_metadata()
    names = sorted(meta)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i in range(count):
        name = names[i % len(names)]
        variant = _VARIANTS[(i // len(names)) % len(_VARIANTS)]
        with Image.open(PHOTO_DIR / name) as src:
            im = variant(src.convert("RGB"))
        scale = long_side / max(im.size)
        im = im.resize((round(im.width * scale), round(im.height * scale)), Image.BICUBIC)
        stem = f"{i:04d}-{Path(name).stem}"
        im.save(folder / f"{stem}.jpg", quality=90)
        (folder / f"{stem}.txt").write_text(meta[name]["alt_text"], encoding="utf-8")
        written.append(f"{stem}.jpg")
    (folder / "_SUCCESS").write_bytes(b"")
    return written
