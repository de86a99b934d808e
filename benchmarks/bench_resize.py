"""Bucket + resize + q92 encode (the shard path) vs a naive Pillow pipeline, one core, side by side.

Naive: open -> convert('RGB') -> Lanczos to the cover size -> crop -> save(q92), with the
same bucket geometry and the same JPEG settings (4:4:4), so only the resize path differs.
Fast: ``render_jpeg`` (default ``resample="lanczos"``: a JPEG's own Y, Cb and Cr planes from a
libjpeg-turbo raw decode at 1/8, 1/4, 1/2 or full size, Lanczos-3 per plane over the crop box,
encoded 4:4:4 from the planes; core/shards/resize.py), the bytes the shards hold. Also timed:
``resample="bicubic-aa"`` (torch's antialiased bicubic after the Pillow decode, the former
default). Quality is judged on the pixels before the encode (``resize_to_bucket``, computed
outside the timings), as against the naive pixels before theirs. The ``shortcut`` column is the Pillow path's draft/reduce
(what non-JPEG sources and bicubic-aa use). The whole stage in the asset, with its Lance and
MDS work, is ``benchmarks/bench_pipeline.py``.

Quality: PSNR(fast pixels, naive pixels) against the loss of the q92 encode itself,
PSNR(naive pixels, decode(naive q92 bytes)); the fast path is "invisible" on an image when
its difference from naive is smaller than that encode loss. Target: >= 2x on 1-6 MP JPEGs
with the default table, invisible on >= 95 % of images. Beside it, what a trainer decodes:
each shard (fast and naive bytes, decoded) against the exact Lanczos (the naive decode
resized in floating point, no 8-bit pass: ``exact_lanczos``), and the largest shortfall of
the fast shard against the naive one. Why: the planes are the encoder's 8-bit YCbCr input,
a quantisation the naive pipeline meets only inside its encoder, so on very smooth large
photos, whose q92 loss is tiny, the pre-encode comparison mostly measures that rounding.

Inputs, all JPEG q95 (how photos arrive): ``upscaled``, the demo photos bicubic-upscaled to
the size (smooth: flattering to any resampler); ``mosaic``, tiles of the demo photos at
their native pixels (real per-pixel detail: the hard case for a filter change), at four
aspect ratios. Tables: the default (512..4096) and low-resolution stage tables (512+1024,
512), where large photos are many times their bucket and draft/reduce apply.

One core: torch intra-op threads = 1 (Pillow is single-threaded). torch's import (~3 s, once
per process) is outside the timings.

    python -m benchmarks.bench_resize [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from prx_assets.core.shards.buckets import Assignment, assign_bucket, bucket_table
from prx_assets.core.shards.resize import (
    JPEG_OPTIMIZE,
    JPEG_QUALITY,
    JPEG_SUBSAMPLING,
    RESAMPLE,
    _torch,
    prepare_fast,
    psnr,
    render_jpeg,
    resize_to_bucket,
)
from prx_assets.demo.jpegs import encoded, mosaic

REPO = Path(__file__).resolve().parents[1]
PHOTOS = REPO / "prx_assets" / "demo" / "photos"
RESULTS = REPO / "benchmarks" / "results" / "bench_resize.json"
FULL_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "retina.jpg", "text.png")
QUICK_PHOTOS = ("astronaut.png", "rocket.jpg")
MOSAIC_ASPECTS = (1.0, 1.5, 0.75, 16 / 9)
TABLES = {
    "default": bucket_table(),
    "512+1024": bucket_table(tiers=(512, 1024)),
    "512": bucket_table(tiers=(512,)),
}
TARGET_MP = (1.0, 6.0)  # the range for the headline number


def _save(img: Image.Image, path: Path) -> Path:
    img.save(path, "JPEG", quality=95)
    return path


def make_upscaled(tmp: Path, photos: tuple[str, ...], sizes_mp: tuple[float, ...]) -> list[Path]:
    paths = []
    for name in photos:
        src = Image.open(PHOTOS / name).convert("RGB")
        for mp in sizes_mp:
            s = (mp * 1e6 / (src.width * src.height)) ** 0.5
            big = src.resize(
                (round(src.width * s), round(src.height * s)), Image.Resampling.BICUBIC
            )
            paths.append(_save(big, tmp / f"upscaled_{Path(name).stem}_{mp:g}mp.jpg"))
    return paths


def make_mosaics(tmp: Path, sizes_mp: tuple[float, ...], aspects: tuple[float, ...]) -> list[Path]:
    """Canvases filled with crops of every demo photo at native resolution (no resampling)."""
    rng = np.random.default_rng(0)
    paths = []
    for mp in sizes_mp:
        for aspect in aspects:
            w = round((mp * 1e6 * aspect) ** 0.5)
            h = round(w / aspect)
            canvas = mosaic((w, h), rng, row_heights=(350, 700), tile_widths=(350, 800))
            paths.append(_save(canvas, tmp / f"mosaic_a{aspect:.2f}_{mp:g}mp.jpg"))
    return paths


def fast_pipeline(data: bytes, table: dict, resample: str = RESAMPLE) -> tuple[bytes, Assignment]:
    w, h = Image.open(io.BytesIO(data)).size  # header only (ingest already knows this)
    a = assign_bucket(w, h, table=table)
    assert a is not None
    return render_jpeg(data, a, resample=resample), a


def naive_pipeline(data: bytes, a: Assignment) -> tuple[bytes, Image.Image]:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    img = img.resize(a.resize_size, Image.Resampling.LANCZOS).crop(a.crop_box)
    return encoded(img, "JPEG", quality=JPEG_QUALITY, subsampling=JPEG_SUBSAMPLING), img


def exact_lanczos(data: bytes, a: Assignment) -> np.ndarray:
    """The naive decode's Lanczos to the cover size and crop in floating point (Pillow's "F"
    mode per channel: one rounding-free pass per axis): HxWx3 float."""
    rgb = Image.open(io.BytesIO(data)).convert("RGB")
    return np.stack(
        [
            np.asarray(
                ch.convert("F").resize(a.resize_size, Image.Resampling.LANCZOS).crop(a.crop_box)
            )
            for ch in rgb.split()
        ],
        axis=-1,
    ).astype(np.float64)


def psnr_to(img: Image.Image, ref: np.ndarray) -> float:
    mse = float(np.mean((np.asarray(img, np.float64) - ref) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


def _timed(fn, *args):  # noqa: ANN001, ANN202
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def run(quick: bool) -> dict:
    torch = _torch()
    torch.set_num_threads(1)
    photos = QUICK_PHOTOS if quick else FULL_PHOTOS
    sizes = (1, 2, 6, 20) if quick else (1, 2, 4, 6, 12, 24)
    aspects = MOSAIC_ASPECTS[:2] if quick else MOSAIC_ASPECTS
    repeats = 1 if quick else 3
    rows = []
    with tempfile.TemporaryDirectory() as tmpdir:
        inputs = make_upscaled(Path(tmpdir), photos, sizes) + make_mosaics(
            Path(tmpdir), sizes, aspects
        )
        for table_name, table in TABLES.items():
            for path in inputs:
                data = path.read_bytes()
                fast_bytes, a = fast_pipeline(data, table)  # warm-up, and the bytes
                fast_img = resize_to_bucket(data, a)  # the pixels those bytes encode
                bicubic_img = resize_to_bucket(data, a, resample="bicubic-aa")
                t_fast, t_naive, t_bicubic = [], [], []
                for _ in range(repeats):  # interleaved, best of: the machine is shared
                    t_fast.append(_timed(fast_pipeline, data, table)[0])
                    dt, (naive_bytes, naive_img) = _timed(naive_pipeline, data, a)
                    t_naive.append(dt)
                    t_bicubic.append(_timed(fast_pipeline, data, table, "bicubic-aa")[0])
                q92 = Image.open(io.BytesIO(naive_bytes)).convert("RGB")
                exact = exact_lanczos(data, a)
                src = prepare_fast(data, a)
                kind, rest = path.stem.split("_", 1)
                rows.append(
                    {
                        "table": table_name,
                        "kind": kind,
                        "image": path.name,
                        "mp": float(rest.rsplit("_", 1)[-1].removesuffix("mp")),
                        "size": list(a.source_size),
                        "bucket": f"{a.tier}/{a.shape.name}",
                        "shortcut": src.draft_factor * src.reduce_factor,
                        "fast_s": min(t_fast),
                        "naive_s": min(t_naive),
                        "bicubic_aa_s": min(t_bicubic),
                        "psnr_fast_vs_naive": psnr(fast_img, naive_img),
                        "psnr_bicubic_aa_vs_naive": psnr(bicubic_img, naive_img),
                        "psnr_q92_loss": psnr(naive_img, q92),
                        "psnr_fast_shard_vs_exact": psnr_to(
                            Image.open(io.BytesIO(fast_bytes)).convert("RGB"), exact
                        ),
                        "psnr_naive_shard_vs_exact": psnr_to(q92, exact),
                    }
                )
    return {"quick": quick, "resample": RESAMPLE, "rows": rows}


def _invisible(r: dict) -> bool:
    return r["psnr_fast_vs_naive"] > r["psnr_q92_loss"]


def _ratio(rs: list[dict], key: str = "fast_s") -> float:
    return sum(r["naive_s"] for r in rs) / sum(r[key] for r in rs)


def summarise(result: dict) -> list[dict]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["table"], r["mp"]), []).append(r)
    out = []
    for (table, mp), rs in sorted(
        groups.items(), key=lambda kv: (list(TABLES).index(kv[0][0]), kv[0][1])
    ):
        margins = [r["psnr_fast_vs_naive"] - r["psnr_q92_loss"] for r in rs]
        out.append(
            {
                "table": table,
                "mp": mp,
                "n": len(rs),
                "fast_img_s": len(rs) / sum(r["fast_s"] for r in rs),
                "naive_img_s": len(rs) / sum(r["naive_s"] for r in rs),
                "ratio": _ratio(rs),
                "bicubic_aa_ratio": _ratio(rs, "bicubic_aa_s"),
                "shortcut_share": sum(r["shortcut"] > 1 for r in rs) / len(rs),
                "min_margin_db": min(margins),
                "median_psnr_q92_loss": statistics.median(r["psnr_q92_loss"] for r in rs),
                "invisible_share": sum(map(_invisible, rs)) / len(rs),
                "median_psnr_fast_shard_vs_exact": statistics.median(
                    r["psnr_fast_shard_vs_exact"] for r in rs
                ),
                "median_psnr_naive_shard_vs_exact": statistics.median(
                    r["psnr_naive_shard_vs_exact"] for r in rs
                ),
                "max_shard_shortfall_db": max(
                    r["psnr_naive_shard_vs_exact"] - r["psnr_fast_shard_vs_exact"] for r in rs
                ),
            }
        )
    return out


def headline(rows: list[dict]) -> dict:
    """Default table, 1-6 MP: the issue's target, overall and per input kind."""
    lo, hi = TARGET_MP
    sel = [r for r in rows if r["table"] == "default" and lo <= r["mp"] <= hi]
    out = {"n": len(sel), "ratio": _ratio(sel), "bicubic_aa_ratio": _ratio(sel, "bicubic_aa_s")}
    out["invisible_share"] = sum(map(_invisible, sel)) / len(sel)
    for kind in sorted({r["kind"] for r in sel}):
        ks = [r for r in sel if r["kind"] == kind]
        out[kind] = {
            "n": len(ks),
            "ratio": _ratio(ks),
            "invisible_share": sum(map(_invisible, ks)) / len(ks),
            "per_image_ratio_min": min(r["naive_s"] / r["fast_s"] for r in ks),
            "per_image_ratio_median": statistics.median(r["naive_s"] / r["fast_s"] for r in ks),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer photos/sizes, 1 repeat")
    args = parser.parse_args()
    result = run(args.quick)
    summary = summarise(result)
    print(
        f"JPEG q{JPEG_QUALITY} {JPEG_SUBSAMPLING} optimize={JPEG_OPTIMIZE}; resample {RESAMPLE}; "
        "one core\n"
        f"{'table':8} {'MP':>4} {'n':>3} {'fast/s':>7} {'naive/s':>7} {'ratio':>6} "
        f"{'bicubic':>7} {'shortcut':>8} {'min margin':>10} {'q92 loss':>8} {'invisible':>9} "
        f"{'shards vs exact: fast':>21} {'naive':>6} {'worst':>6}"
    )
    for s in summary:
        print(
            f"{s['table']:8} {s['mp']:>4g} {s['n']:>3} {s['fast_img_s']:>7.2f} "
            f"{s['naive_img_s']:>7.2f} {s['ratio']:>5.2f}x {s['bicubic_aa_ratio']:>6.2f}x "
            f"{s['shortcut_share']:>8.0%} {s['min_margin_db']:>8.1f}dB "
            f"{s['median_psnr_q92_loss']:>6.1f}dB {s['invisible_share']:>9.0%} "
            f"{s['median_psnr_fast_shard_vs_exact']:>19.1f}dB "
            f"{s['median_psnr_naive_shard_vs_exact']:>4.1f}dB {s['max_shard_shortfall_db']:>4.2f}dB"
        )
    rows = result["rows"]
    for table in TABLES:
        rs = [r for r in rows if r["table"] == table]
        inv = sum(map(_invisible, rs)) / len(rs)
        worst = max(r["psnr_naive_shard_vs_exact"] - r["psnr_fast_shard_vs_exact"] for r in rs)
        print(
            f"{table}: overall ratio {_ratio(rs):.2f}x, fast/naive diff < q92 loss on {inv:.0%}, "
            f"decoded fast shard at most {worst:.2f} dB further from the exact Lanczos than "
            "the naive shard"
        )
    head = headline(rows)
    print(
        f"HEADLINE default table, 1-6 MP ({head['n']} JPEGs): {head['ratio']:.2f}x "
        f"(Lanczos box only: {head['bicubic_aa_ratio']:.2f}x), invisible on "
        f"{head['invisible_share']:.0%}"
        + "".join(
            f"; {k}: {v['ratio']:.2f}x (per image {v['per_image_ratio_min']:.2f}-"
            f"median {v['per_image_ratio_median']:.2f}), invisible {v['invisible_share']:.0%}"
            for k, v in head.items()
            if isinstance(v, dict)
        )
    )
    result["summary"] = summary
    result["headline"] = head
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
