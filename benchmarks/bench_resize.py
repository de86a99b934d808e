"""Bucket + fast resize + q92 encode vs a naive Pillow pipeline, single-threaded, side by side.

Inputs: the demo photos upscaled to 1..24 MP and saved as JPEG q95 in a temp dir.
Naive: open -> convert('RGB') -> Lanczos to the cover size -> crop -> save(q92), with the
same bucket geometry and the same JPEG settings, so only the resize path differs.
Quality: PSNR(fast pixels, naive pixels) is compared with the loss of the q92 encode itself,
PSNR(naive pixels, decode(naive q92 bytes)); the fast path is "invisible" on an image when
its difference from naive is smaller than that encode loss.

Three bucket tables: the default (512..4096; the no-upscale rule keeps every source under
2x its bucket below 4096, so draft/reduce, which need a source >= 4x its target per side
to keep 2x after halving, never apply) and low-resolution stage tables (512 and 1024; 512
only), where large photos are many times their bucket.

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

from PIL import Image

from prx_assets.core.buckets import Assignment, assign_bucket, bucket_table
from prx_assets.core.resize import (
    JPEG_OPTIMIZE,
    JPEG_QUALITY,
    JPEG_SUBSAMPLING,
    encode_jpeg,
    prepare_fast,
    psnr,
)

REPO = Path(__file__).resolve().parents[1]
PHOTOS = REPO / "prx_assets" / "demo" / "photos"
RESULTS = REPO / "benchmarks" / "results" / "bench_resize.json"
FULL_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "retina.jpg", "text.png")
QUICK_PHOTOS = ("astronaut.png", "coffee.png", "rocket.jpg")
TABLES = {
    "default": bucket_table(),
    "512+1024": bucket_table(tiers=(512, 1024)),
    "512": bucket_table(tiers=(512,)),
}


def make_inputs(tmp: Path, photos: tuple[str, ...], sizes_mp: tuple[float, ...]) -> list[Path]:
    paths = []
    for name in photos:
        src = Image.open(PHOTOS / name).convert("RGB")
        for mp in sizes_mp:
            s = (mp * 1e6 / (src.width * src.height)) ** 0.5
            big = src.resize(
                (round(src.width * s), round(src.height * s)), Image.Resampling.BICUBIC
            )
            path = tmp / f"{Path(name).stem}_{mp:g}mp.jpg"
            big.save(path, "JPEG", quality=95)
            paths.append(path)
    return paths


def fast_pipeline(data: bytes, table: dict) -> tuple[bytes, Image.Image, Assignment, int]:
    w, h = Image.open(io.BytesIO(data)).size  # header only (ingest already knows this)
    a = assign_bucket(w, h, table=table)
    assert a is not None
    src = prepare_fast(data, a)
    img = src.image.resize((a.shape.width, a.shape.height), Image.Resampling.LANCZOS, box=src.box)
    return encode_jpeg(img), img, a, src.draft_factor * src.reduce_factor


def naive_pipeline(data: bytes, a: Assignment) -> tuple[bytes, Image.Image]:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    img = img.resize(a.resize_size, Image.Resampling.LANCZOS).crop(a.crop_box)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=JPEG_QUALITY, subsampling=JPEG_SUBSAMPLING)
    return buf.getvalue(), img


def run(quick: bool) -> dict:
    photos = QUICK_PHOTOS if quick else FULL_PHOTOS
    sizes = (1, 6, 20) if quick else (1, 2, 4, 6, 12, 24)
    repeats = 1 if quick else 3
    rows = []
    with tempfile.TemporaryDirectory() as tmpdir:
        inputs = make_inputs(Path(tmpdir), photos, sizes)
        for table_name, table in TABLES.items():
            for path in inputs:
                data = path.read_bytes()
                t_fast, t_naive = [], []
                for _ in range(repeats):  # interleaved, best of: the machine is shared
                    t0 = time.perf_counter()
                    fast_bytes, fast_img, a, shortcut = fast_pipeline(data, table)
                    t1 = time.perf_counter()
                    naive_bytes, naive_img = naive_pipeline(data, a)
                    t2 = time.perf_counter()
                    t_fast.append(t1 - t0)
                    t_naive.append(t2 - t1)
                q92 = Image.open(io.BytesIO(naive_bytes)).convert("RGB")
                rows.append(
                    {
                        "table": table_name,
                        "image": path.name,
                        "mp": float(path.stem.split("_")[-1].removesuffix("mp")),
                        "bucket": f"{a.tier}/{a.shape.name}",
                        "shortcut": shortcut,
                        "fast_s": min(t_fast),
                        "naive_s": min(t_naive),
                        "psnr_fast_vs_naive": psnr(fast_img, naive_img),
                        "psnr_q92_loss": psnr(naive_img, q92),
                        "bytes_equal": fast_bytes == naive_bytes,
                    }
                )
    return {"quick": quick, "rows": rows}


def summarise(result: dict) -> list[dict]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["table"], r["mp"]), []).append(r)
    out = []
    for (table, mp), rs in sorted(groups.items()):
        fast = len(rs) / sum(r["fast_s"] for r in rs)
        naive = len(rs) / sum(r["naive_s"] for r in rs)
        invisible = [r["psnr_fast_vs_naive"] > r["psnr_q92_loss"] for r in rs]
        finite = [r["psnr_fast_vs_naive"] for r in rs if r["psnr_fast_vs_naive"] != float("inf")]
        out.append(
            {
                "table": table,
                "mp": mp,
                "n": len(rs),
                "fast_img_s": fast,
                "naive_img_s": naive,
                "ratio": fast / naive,
                "shortcut_share": sum(r["shortcut"] > 1 for r in rs) / len(rs),
                "min_psnr_fast_vs_naive": min(finite) if finite else float("inf"),
                "median_psnr_q92_loss": statistics.median(r["psnr_q92_loss"] for r in rs),
                "invisible_share": sum(invisible) / len(rs),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 photos, 1/6/20 MP, 1 repeat")
    args = parser.parse_args()
    result = run(args.quick)
    summary = summarise(result)
    print(
        f"JPEG q{JPEG_QUALITY} {JPEG_SUBSAMPLING} optimize={JPEG_OPTIMIZE}; single-threaded\n"
        f"{'table':8} {'MP':>4} {'n':>3} {'fast/s':>7} {'naive/s':>7} {'ratio':>6} "
        f"{'shortcut':>8} {'minPSNR f-n':>11} {'q92 loss':>8} {'invisible':>9}"
    )
    for s in summary:
        print(
            f"{s['table']:8} {s['mp']:>4g} {s['n']:>3} {s['fast_img_s']:>7.2f} "
            f"{s['naive_img_s']:>7.2f} {s['ratio']:>5.2f}x {s['shortcut_share']:>8.0%} "
            f"{s['min_psnr_fast_vs_naive']:>9.1f}dB {s['median_psnr_q92_loss']:>6.1f}dB "
            f"{s['invisible_share']:>9.0%}"
        )
    rows = result["rows"]
    for table in TABLES:
        rs = [r for r in rows if r["table"] == table]
        ratio = sum(r["naive_s"] for r in rs) / sum(r["fast_s"] for r in rs)
        inv = sum(r["psnr_fast_vs_naive"] > r["psnr_q92_loss"] for r in rs) / len(rs)
        print(f"{table}: overall ratio {ratio:.2f}x, fast/naive diff < q92 loss on {inv:.0%}")
    result["summary"] = summary
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
