"""Fast pHash vs imagehash.phash, and vs the reduced-scale JPEG decode alone, on one core.

Inputs are generated in a temp dir: demo photos upscaled (Lanczos) to 1-6 MP and saved as
JPEG q90, baseline and progressive. All methods read the same in-memory bytes; each (kind,
size) group is timed as one batch, methods interleaved, best of ``--reps`` (the machine is
shared and noisy), reported per image. Methods:

- ``imagehash``: ``imagehash.phash(Image.open(...))`` (full decode, Lanczos, scipy DCT);
- ``fast``: ``phash_many`` over the group (policy decode at DCT scale, batched DCT);
- ``decode``: ``Image.open`` + ``draft("RGB", (128, 128))`` + ``load()``: the CPU floor for
  decoding the whole file at reduced scale (fast beats it on progressive files, where it
  decodes only the DC scans).

Also measured, on random crops of the demo photos at 0.8-4 MP with planted copies (50%/q80,
75%/q90): exact agreement with the reference mode and planted duplicates found at Hamming 0,
per draft target. That is how ``FAST_DRAFT_TARGET`` was chosen.

    python -m benchmarks.bench_phash [--quick]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"  # one core, before numpy loads a BLAS

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import imagehash  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from prx_assets.core import phash as P  # noqa: E402

PHOTOS = Path(__file__).resolve().parents[1] / "prx_assets" / "demo" / "photos"
RESULTS = Path(__file__).resolve().parent / "results" / "bench_phash.json"
LANCZOS = Image.Resampling.LANCZOS


def _make_inputs(root: Path, names: list[str], sizes_mp: list[float]) -> list[dict]:
    files = []
    for name in names:
        src = Image.open(PHOTOS / name).convert("RGB")
        for mp in sizes_mp:
            s = math.sqrt(mp * 1e6 / (src.width * src.height))
            big = src.resize(
                (round(src.width * s), round(src.height * s)), Image.Resampling.LANCZOS
            )
            for progressive in (False, True):
                kind = "progressive" if progressive else "baseline"
                path = root / f"{Path(name).stem}_{mp}mp_{kind}.jpg"
                big.save(path, "JPEG", quality=90, progressive=progressive)
                files.append({"path": path, "kind": kind, "mp": mp, "size": big.size})
    return files


def _agreement_set(n: int, seed: int = 1) -> tuple[list[bytes], list[list[bytes]]]:
    """Random crops of the demo photos at 0.8-4 MP (JPEG q90), each with two planted copies."""
    rng = np.random.default_rng(seed)
    photos = [Image.open(p).convert("RGB") for p in sorted(PHOTOS.iterdir())]
    bases, copies = [], []
    for i in range(n):
        im = photos[i % len(photos)]
        fw, fh = rng.uniform(0.4, 0.95, 2)
        w, h = int(im.width * fw), int(im.height * fh)
        x, y = rng.integers(0, im.width - w + 1), rng.integers(0, im.height - h + 1)
        s = math.sqrt(rng.uniform(0.8, 4.0) * 1e6 / (w * h))
        crop = im.crop((x, y, x + w, y + h)).resize((round(w * s), round(h * s)), LANCZOS)
        bases.append(_jpeg(crop, 90))
        copies.append(
            [
                _jpeg(crop.resize((round(crop.width * f), round(crop.height * f)), LANCZOS), q)
                for f, q in ((0.5, 80), (0.75, 90))
            ]
        )
    return bases, copies


def _found(hashes: list[int], n: int) -> int:
    """Planted copies (laid out after the n bases, two per base) at Hamming 0 from their base."""
    return sum(hashes[i] == hashes[n + 2 * i + k] for i in range(n) for k in range(2))


def _jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _decode_all(datas: list[bytes]) -> None:
    for data in datas:
        img = Image.open(io.BytesIO(data))
        img.draft("RGB", (P.FAST_DRAFT_TARGET, P.FAST_DRAFT_TARGET))
        img.load()


def _imagehash_all(datas: list[bytes]) -> None:
    for data in datas:
        imagehash.phash(Image.open(io.BytesIO(data)))


def _time(fn, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 photos, 2 sizes, 3 reps")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    names = ["china.jpg", "coffee.png", "astronaut.png", "rocket.jpg", "chelsea.png"]
    sizes = [1.0, 2.0, 4.0, 6.0]
    reps = args.reps or 5
    if args.quick:
        names, sizes, reps = names[:3], [1.0, 6.0], args.reps or 3

    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        print("GPU decode path (torchvision nvJPEG) skipped: no CUDA device is present.")

    with tempfile.TemporaryDirectory() as tmp:
        files = _make_inputs(Path(tmp), names, sizes)
        datas = {f["path"]: f["path"].read_bytes() for f in files}
        groups = {}
        for f in files:
            groups.setdefault((f["kind"], f["mp"]), []).append(datas[f["path"]])
        best: dict[tuple, dict[str, float]] = {g: {} for g in groups}
        for _ in range(reps):  # interleave methods so load spikes hit all of them
            for g, group in groups.items():
                times = {
                    "imagehash": _time(lambda group=group: _imagehash_all(group), 1),
                    "fast": _time(lambda group=group: P.phash_many(group), 1),
                    "decode": _time(lambda group=group: _decode_all(group), 1),
                }
                for k, v in times.items():
                    best[g][k] = min(best[g].get(k, math.inf), v / len(group))

        # Batched throughput over all files at once (what the pipeline does).
        all_bytes = [datas[f["path"]] for f in files]
        batch_fast = _time(lambda: P.phash_many(all_bytes), 2) / len(all_bytes)

    # Agreement with reference, and planted duplicates found, by draft target: on random
    # crops of the demo photos at 0.8-4 MP (upscaled files are too smooth to tell apart).
    bases, copies = _agreement_set(15 if args.quick else 40)
    flat = bases + [c for cs in copies for c in cs]
    ref = [r.hash for r in P.phash_many(flat, mode="reference")]
    agreement = {"reference": {"planted_found": _found(ref, len(bases))}}
    for target in (64, 128, 256):
        t0 = time.perf_counter()
        thumbs = np.stack([P.fast_thumbnail(d, draft_target=target) for d in flat])
        elapsed = time.perf_counter() - t0
        hashes = [int(h) for h in P.hash_thumbnails(thumbs)[0]]
        dist = [P.hamming(a, b) for a, b in zip(hashes, ref, strict=True)]
        agreement[target] = {
            "exact_rate": sum(d == 0 for d in dist) / len(dist),
            "mean_hamming": statistics.mean(dist),
            "max_hamming": max(dist),
            "planted_found": _found(hashes, len(bases)),
            "ms_per_image": 1e3 * elapsed / len(flat),
        }

    print(f"\nfast pHash vs imagehash.phash, one core, best of {reps} (ms per image)")
    print(
        f"{'kind':12s} {'MP':>4s} {'imagehash':>10s} {'fast':>8s} {'decode':>8s} "
        f"{'speedup':>8s} {'fast/decode':>12s}"
    )
    summary = {}
    for kind in ("baseline", "progressive"):
        for mp in sizes:
            t = best[(kind, mp)]
            print(
                f"{kind:12s} {mp:4.0f} {1e3 * t['imagehash']:10.2f} {1e3 * t['fast']:8.2f} "
                f"{1e3 * t['decode']:8.2f} {t['imagehash'] / t['fast']:7.2f}x "
                f"{t['fast'] / t['decode']:11.2f}x"
            )
        ih, fa, de = (
            sum(best[(kind, mp)][k] for mp in sizes) for k in ("imagehash", "fast", "decode")
        )
        summary[kind] = {"speedup_vs_imagehash": ih / fa, "fast_over_decode": fa / de}
        print(f"{kind:12s} {'all':>4s} {'':10s} {'':8s} {'':8s} {ih / fa:7.2f}x {fa / de:11.2f}x")
    print(f"\nbatched phash_many over all {len(all_bytes)} files: {1e3 * batch_fast:.2f} ms/image")
    n_planted = 2 * len(bases)
    print(
        f"\nfast vs reference by draft target, {len(flat)} random crops at 0.8-4 MP "
        f"(+ planted copies at 50%/q80 and 75%/q90)"
    )
    print(
        f"{'target':>9s} {'exact':>6s} {'mean d':>7s} {'max d':>6s} {'dups found':>11s} {'ms/img':>7s}"
    )
    print(
        f"{'reference':>9s} {'':6s} {'':7s} {'':6s} {agreement['reference']['planted_found']:>5d}/{n_planted:<5d}"
    )
    for target in (64, 128, 256):
        a = agreement[target]
        print(
            f"{target:9d} {a['exact_rate']:6.0%} {a['mean_hamming']:7.2f} {a['max_hamming']:6d} "
            f"{a['planted_found']:>5d}/{n_planted:<5d} {a['ms_per_image']:7.2f}"
        )
    targets = {
        "baseline_speedup>=5": summary["baseline"]["speedup_vs_imagehash"] >= 5,
        "progressive_speedup>=2": summary["progressive"]["speedup_vs_imagehash"] >= 2,
        "within_1.2x_of_decode": max(s["fast_over_decode"] for s in summary.values()) <= 1.2,
    }
    print("\ntargets:", ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in targets.items()))

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "bench_phash",
                "quick": args.quick,
                "reps": reps,
                "fast_version": P.phash_version("fast"),
                "draft_target": P.FAST_DRAFT_TARGET,
                "cuda": cuda,
                "files": [
                    {"file": f["path"].name, "kind": f["kind"], "mp": f["mp"], "size": f["size"]}
                    for f in files
                ],
                "ms_per_image": [
                    {"kind": kind, "mp": mp, **{k: 1e3 * v for k, v in t.items()}}
                    for (kind, mp), t in best.items()
                ],
                "summary": summary,
                "batched_fast_ms_per_image": 1e3 * batch_fast,
                "agreement_by_draft_target": agreement,
                "targets": targets,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
