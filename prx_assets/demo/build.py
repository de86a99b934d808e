"""Build the demo landing zone from the bundled photographs, deterministically.

The bundled photos (see PHOTOS.md) are expanded into a few hundred samples that
exercise every stage: varied sizes and aspect ratios (some upscaled with Lanczos so
the higher tiers have members: those are marked ``synthetic_upscale`` in their
sidecar), true duplicates (downscaled and recompressed copies, some in another batch),
images under the 384 px cutoff, colour-mode edge cases, and a handful of bad files.

Batches (one of each input kind):
- ``public-skimage/000/``       a folder with WebDataset-style .txt/.json sidecars
- ``public-sklearn/001.tar``    a WebDataset tar, with two unsafe members planted
- ``internal-studio/002.parquet`` a manifest of paths into ``internal-studio/_files``
- ``public-skimage/003/``       a second folder chunk with cross-batch duplicates
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from prx_assets.demo.jpegs import PHOTO_DIR, encoded, jpeg_bytes, solid_jpeg

ASPECTS = (0.42, 0.5, 0.62, 0.75, 0.9, 1.0, 1.2, 1.33, 1.6, 2.0, 2.4)


@dataclass
class DemoManifest:
    """What was planted, so the demo and the tests can check each stage found it."""

    batches: list[str] = field(default_factory=list)
    planted_duplicates: list[tuple[str, str]] = field(default_factory=list)  # (copy, original)
    bad_files: dict[str, str] = field(default_factory=dict)  # "batch:path" -> expected reason
    small_images: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def load_photo_metadata() -> dict[str, dict]:
    return json.loads((resources.files("prx_assets.demo") / "photos.json").read_text())


def _rgb(name: str) -> Image.Image:
    with Image.open(io.BytesIO((PHOTO_DIR / name).read_bytes())) as img:
        return img.convert("RGB")


def _crop_to_aspect(img: Image.Image, aspect: float, rng: np.random.Generator) -> Image.Image:
    w, h = img.size
    if w / h > aspect:
        cw, ch = max(8, int(h * aspect)), h
    else:
        cw, ch = w, max(8, int(w / aspect))
    left = int(rng.integers(0, w - cw + 1))
    top = int(rng.integers(0, h - ch + 1))
    return img.crop((left, top, left + cw, top + ch))


def _sidecars(meta: dict, **extra: object) -> tuple[bytes, bytes]:
    info = {"url": meta.get("url"), "license": meta["license"], "credit": meta["credit"], **extra}
    return meta["alt_text"].encode(), json.dumps(info, sort_keys=True).encode()


def _write_sample(folder: Path, stem: str, data: bytes, ext: str, meta: dict, **extra) -> None:
    (folder / f"{stem}{ext}").write_bytes(data)
    txt, js = _sidecars(meta, **extra)
    (folder / f"{stem}.txt").write_bytes(txt)
    (folder / f"{stem}.json").write_bytes(js)


def _variants(
    name: str, img: Image.Image, rng: np.random.Generator, n: int
) -> list[tuple[str, bytes, dict]]:
    """Crops at varied aspects and scales; some upscaled so higher tiers are populated."""
    out = []
    for i in range(n):
        aspect = float(ASPECTS[int(rng.integers(0, len(ASPECTS)))])
        crop = _crop_to_aspect(img, aspect, rng)
        scale = float(rng.choice([0.6, 1.0, 1.0, 1.6, 2.4, 3.2]))
        size = (max(16, int(crop.width * scale)), max(16, int(crop.height * scale)))
        extra = {"synthetic_upscale": scale > 1.0}
        variant = crop.resize(size, Image.Resampling.LANCZOS)
        quality = int(rng.integers(85, 96))
        out.append((f"{Path(name).stem}-v{i:02d}", jpeg_bytes(variant, quality), extra))
    return out


def _bad_files() -> dict[str, tuple[bytes, str]]:
    """Named bad inputs and the rejection reason each must produce."""
    good = solid_jpeg((640, 480), (120, 30, 200), quality=90)
    ico = encoded(Image.new("RGB", (64, 64), (1, 2, 3)), "ICO")
    bomb = encoded(Image.new("1", (12_000, 9_000)), "PNG")  # 108 MP, a few KB
    return {
        "bad-truncated.jpg": (good[: len(good) // 2], "truncated"),
        "bad-empty.jpg": (b"", "empty_file"),
        "bad-notanimage.jpg": (b"this is a text file, not a JPEG\n" * 4, "not_an_image"),
        "bad-icon.jpg": (ico, "format_not_allowed"),
        "bad-bomb.png": (bomb, "decompression_bomb"),
        "bad-document.pdf": (b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n", "unsupported_extension"),
    }


def _mode_edge_cases(photo: Image.Image) -> dict[str, tuple[bytes, str]]:
    """Colour modes and containers the decoding policy converts, with their expected policy."""
    base = photo.resize((600, 450), Image.Resampling.LANCZOS)
    cmyk = jpeg_bytes(base.convert("CMYK"), 92)
    grey16 = encoded(Image.fromarray(np.asarray(base.convert("L"), np.uint16) * 257), "PNG")
    palette = encoded(base.convert("P", palette=Image.Palette.ADAPTIVE, colors=64), "PNG")
    rgba = base.convert("RGBA")
    alpha = np.asarray(rgba).copy()
    alpha[:, : alpha.shape[1] // 3, 3] = 0  # a transparent third
    rgba_png = encoded(Image.fromarray(alpha, "RGBA"), "PNG")
    frames = [base.rotate(a) for a in (0, 10, 20)]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display: stored 600x450, shown 450x600
    rotated = jpeg_bytes(base, 92, exif=exif.tobytes())
    return {
        "mode-cmyk.jpg": (cmyk, "cmyk"),
        "mode-16bit.png": (grey16, "high_bit_depth_to_8bit"),
        "mode-palette.png": (palette, "palette"),
        "mode-rgba.png": (rgba_png, "alpha_on_white"),
        "mode-animated.gif": (gif, "palette"),
        "mode-exif-rotated.jpg": (rotated, "none"),
    }


def build_demo_landing(landing: Path, size: str = "full", seed: int = 0) -> DemoManifest:
    """Write the demo batches into ``landing`` (replacing any earlier demo batches)."""
    if size not in ("full", "small"):
        raise ValueError("size must be 'full' or 'small'")
    per_photo = 12 if size == "full" else 2
    rng = np.random.default_rng(seed)
    meta = load_photo_metadata()
    photos = sorted(meta)
    skimage_photos = [p for p in photos if p not in ("china.jpg", "flower.jpg")]
    if size == "small":
        skimage_photos = ["astronaut.png", "coffee.png", "chelsea.png", "retina.jpg"]
    manifest = DemoManifest()
    landing.mkdir(parents=True, exist_ok=True)
    for source in ("public-skimage", "public-sklearn", "internal-studio"):
        shutil.rmtree(landing / source, ignore_errors=True)

    # Batch 000: a folder of originals, variants, small images and bad files.
    b000 = landing / "public-skimage" / ".000.partial"
    b000.mkdir(parents=True)
    count = 0
    for name in skimage_photos:
        m = meta[name]
        _write_sample(b000, Path(name).stem, (PHOTO_DIR / name).read_bytes(), Path(name).suffix, m)
        count += 1
        img = _rgb(name)
        for stem, data, extra in _variants(name, img, rng, per_photo):
            _write_sample(b000, stem, data, ".jpg", m, **extra)
            count += 1
        small = img.copy()
        small.thumbnail((300, 300))  # under the 384 px cutoff whatever the original
        _write_sample(b000, f"{Path(name).stem}-small", jpeg_bytes(small, 90), ".jpg", m)
        manifest.small_images.append(f"public-skimage.000:{Path(name).stem}-small.jpg")
        count += 1
    for fname, (data, reason) in _bad_files().items():
        (b000 / fname).write_bytes(data)
        manifest.bad_files[f"public-skimage.000:{fname}"] = reason
        count += 1
    (b000 / "_SUCCESS").write_text("")
    b000.rename(landing / "public-skimage" / "000")
    manifest.counts["public-skimage.000"] = count
    manifest.batches.append("public-skimage.000")

    # Batch 001: a WebDataset tar of the scikit-learn photos, plus two unsafe members.
    tar_tmp = landing / "public-sklearn" / "001.tar.partial"
    tar_tmp.parent.mkdir(parents=True)
    (landing / "public-sklearn" / "_source.json").write_text(
        json.dumps({"license": "CC-BY-2.0", "visibility": "public"})
    )
    count = 0
    with tarfile.open(tar_tmp, "w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))

        for name in ("china.jpg", "flower.jpg"):
            m = meta[name]
            img = _rgb(name)
            samples = [(Path(name).stem, (PHOTO_DIR / name).read_bytes(), {})]
            samples += _variants(name, img, rng, per_photo)
            for stem, data, extra in samples:
                txt, js = _sidecars(m, **extra)
                add(f"{stem}.jpg", data)
                add(f"{stem}.txt", txt)
                add(f"{stem}.json", js)
                count += 1
        evil = tarfile.TarInfo("../escape.jpg")
        payload = solid_jpeg((500, 500), (9, 9, 9), quality=90)
        evil.size = len(payload)
        tar.addfile(evil, io.BytesIO(payload))
        link = tarfile.TarInfo("link.jpg")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
        count += 2
    manifest.bad_files["public-sklearn.001:../escape.jpg"] = "unsafe_path"
    manifest.bad_files["public-sklearn.001:link.jpg"] = "unsafe_path"
    tar_tmp.rename(landing / "public-sklearn" / "001.tar")
    manifest.counts["public-sklearn.001"] = count
    manifest.batches.append("public-sklearn.001")

    # Batch 002: a manifest of internal files, incl. colour-mode edge cases.
    files = landing / "internal-studio" / "_files"
    files.mkdir(parents=True)
    rows = []
    coffee = _rgb("coffee.png")
    for fname, (data, policy) in _mode_edge_cases(coffee).items():
        (files / fname).write_bytes(data)
        rows.append(
            {
                "path": f"_files/{fname}",
                "alt_text": f"Studio test image ({policy} policy): a cup of coffee on a table.",
                "license": "internal",
                "url": None,
                "id": f"studio-{Path(fname).stem}",
            }
        )
    for stem, data, _ in _variants("astronaut.png", _rgb("astronaut.png"), rng, per_photo):
        (files / f"{stem}.jpg").write_bytes(data)
        rows.append(
            {
                "path": f"_files/{stem}.jpg",
                "alt_text": meta["astronaut.png"]["alt_text"],
                "license": "internal",
                "url": f"https://studio.example.invalid/assets/{stem}",
                "id": f"studio-{stem}",
            }
        )
    rows.append(
        {"path": "_files/missing.jpg", "alt_text": None, "license": "internal", "url": None,
         "id": "studio-missing"}
    )  # fmt: skip
    rows.append(
        {"path": "../../outside.jpg", "alt_text": None, "license": "internal", "url": None,
         "id": "studio-outside"}
    )  # fmt: skip
    manifest.bad_files["internal-studio.002:_files/missing.jpg"] = "missing_file"
    manifest.bad_files["internal-studio.002:../../outside.jpg"] = "unsafe_path"
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, landing / "internal-studio" / "002.parquet.tmp")
    (landing / "internal-studio" / "002.parquet.tmp").rename(
        landing / "internal-studio" / "002.parquet"
    )
    manifest.counts["internal-studio.002"] = len(rows)
    manifest.batches.append("internal-studio.002")

    # Batch 003: duplicates of batch-000 photos (downscaled, recompressed), new crops.
    b003 = landing / "public-skimage" / ".003.partial"
    b003.mkdir(parents=True)
    count = 0
    if size == "full":  # copies that stay over the 384 px cutoff, so dedup can see them
        dup_sources = [p for p in skimage_photos if min(_rgb(p).size) * 3 // 4 >= 384]
    else:
        dup_sources = skimage_photos[:2]
    for name in dup_sources:
        m = meta[name]
        img = _rgb(name)
        half = img.resize((img.width * 3 // 4, img.height * 3 // 4), Image.Resampling.LANCZOS)
        stem = Path(name).stem
        _write_sample(b003, f"{stem}-dup-downscaled", jpeg_bytes(half, 88), ".jpg", m)
        _write_sample(b003, f"{stem}-dup-recompressed", jpeg_bytes(img, 75), ".jpg", m)
        original = f"public-skimage.000:{stem}{Path(name).suffix}"
        manifest.planted_duplicates.append(
            (f"public-skimage.003:{stem}-dup-downscaled.jpg", original)
        )
        manifest.planted_duplicates.append(
            (f"public-skimage.003:{stem}-dup-recompressed.jpg", original)
        )
        count += 2
    (b003 / "_SUCCESS").write_text("")
    b003.rename(landing / "public-skimage" / "003")
    manifest.counts["public-skimage.003"] = count
    manifest.batches.append("public-skimage.003")
    return manifest
