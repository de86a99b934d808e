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

GPU path (where ``torch.cuda.is_available()``; otherwise it says so and is skipped):
nvJPEG decode of batches of JPEG bytes (``torchvision.io.decode_jpeg(device="cuda")``, EXIF
orientation applied, per-image CPU fallback counted), luma on the GPU, a 32x32 thumbnail
by ``F.interpolate(mode="bicubic", antialias=True)`` (and, for comparison, Pillow's exact
Lanczos-3 coefficients as two matrix products), and the batched DCT as one matrix product
on the GPU. Reported: images/s against ``phash_many`` (fast, one CPU core) on the same bytes
in the same process, and agreement with the CPU fast hash, the reference, and planted
duplicates found. Needs only torch, torchvision, numpy, Pillow and scipy with
``--gpu-only`` (imagehash is then not imported); ``--device cpu`` runs the same code on the
CPU to check it where there is no GPU (its timings mean nothing).

    python -m benchmarks.bench_phash [--quick]
    python -m benchmarks.bench_phash --gpu-only [--quick] [--out PATH]
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

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from prx_assets.core.dedup import phash as P  # noqa: E402
from prx_assets.demo.jpegs import jpeg_bytes  # noqa: E402

PHOTOS = Path(__file__).resolve().parents[1] / "prx_assets" / "demo" / "photos"
RESULTS = Path(__file__).resolve().parent / "results" / "bench_phash.json"
GPU_RESULTS = RESULTS.with_name("bench_phash_gpu.json")
_ORIENTATION_TAG = 0x0112
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
        bases.append(jpeg_bytes(crop, 90))
        copies.append(
            [
                jpeg_bytes(crop.resize((round(crop.width * f), round(crop.height * f)), LANCZOS), q)
                for f, q in ((0.5, 80), (0.75, 90))
            ]
        )
    return bases, copies


def _found(hashes: list[int], n: int) -> int:
    """Planted copies (laid out after the n bases, two per base) at Hamming 0 from their base."""
    return sum(hashes[i] == hashes[n + 2 * i + k] for i in range(n) for k in range(2))


def _decode_all(datas: list[bytes]) -> None:
    for data in datas:
        img = Image.open(io.BytesIO(data))
        img.draft("RGB", (P.FAST_DRAFT_TARGET, P.FAST_DRAFT_TARGET))
        img.load()


def _imagehash_all(datas: list[bytes]) -> None:
    import imagehash  # only the CPU comparison needs it (not installed on the GPU machines)

    for data in datas:
        imagehash.phash(Image.open(io.BytesIO(data)))


def _time(fn, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _cpu_section(files: list[dict], datas: dict, sizes: list[float], reps: int, quick: bool):
    """fast vs imagehash vs the reduced-scale decode, one core; agreement by draft target."""
    groups: dict[tuple, list[bytes]] = {}
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
    bases, copies = _agreement_set(15 if quick else 40)
    flat = bases + [c for cs in copies for c in cs]
    ref = [r.hash for r in P.phash_many(flat, mode="reference")]
    agreement: dict = {"reference": {"planted_found": _found(ref, len(bases))}}
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
    return {
        "ms_per_image": [
            {"kind": kind, "mp": mp, **{k: 1e3 * v for k, v in t.items()}}
            for (kind, mp), t in best.items()
        ],
        "summary": summary,
        "batched_fast_ms_per_image": 1e3 * batch_fast,
        "agreement_by_draft_target": agreement,
        "targets": targets,
    }


# ---------------------------------------------------------------------------------------------
# GPU path: nvJPEG decode, luma + 32x32 resize and the batched DCT on the device


def pillow_lanczos_matrix(in_size: int, out_size: int = P.THUMB_SIZE) -> np.ndarray:
    """(out, in) matrix with Pillow's Lanczos-3 coefficients (float path of ImagingResample).

    ``m @ column`` resamples one axis exactly as ``Image.resize(..., LANCZOS)`` does for a
    mode "F" image, so two products give the float Lanczos thumbnail of a whole image.
    """
    if in_size < 1 or out_size < 1:
        raise ValueError(f"sizes must be >= 1, got {in_size} -> {out_size}")
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 3.0 * filterscale
    m = np.zeros((out_size, in_size))
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        t = (np.arange(xmin, xmax) - center + 0.5) / filterscale
        w = np.where((t >= -3.0) & (t < 3.0), np.sinc(t) * np.sinc(t / 3.0), 0.0)
        total = w.sum()
        m[xx, xmin:xmax] = w / total if total != 0 else w
    return m


class GpuHasher:
    """Batched pHash of JPEG bytes on a torch device (decode, luma, resize, DCT there)."""

    RESIZES = ("bicubic", "lanczos")

    def __init__(self, device: str = "cuda", resize: str = "bicubic") -> None:
        import torch
        import torch.nn.functional as F
        from torchvision.io import ImageReadMode, decode_jpeg

        if resize not in self.RESIZES:
            raise ValueError(f"resize must be one of {self.RESIZES}, got {resize!r}")
        self.torch, self.F = torch, F
        self.decode_jpeg, self.rgb = decode_jpeg, ImageReadMode.RGB
        self.device = torch.device(device)
        self.resize = resize
        self.dct = torch.from_numpy(P._DCT).to(self.device, torch.float64)
        self.luma = torch.tensor([0.299, 0.587, 0.114], device=self.device).view(3, 1, 1)
        self._mats: dict[int, object] = {}
        self.cpu_fallbacks = 0  # images nvJPEG refused, decoded by the CPU policy instead
        self.batched_failures = 0  # batches decoded image by image after a batch error

    def _decode(self, tensors: list) -> list:
        # nvJPEG ignores apply_exif_orientation (torchvision: "only implemented on CPU"), so
        # orientation is applied here on every device, from the header that Pillow parses.
        kw = {"mode": self.rgb, "device": self.device}
        try:
            imgs = [(img, False) for img in self.decode_jpeg(tensors, **kw)]
        except RuntimeError:
            self.batched_failures += 1
            imgs = [self._decode_one(t, kw) for t in tensors]
        pairs = zip(imgs, tensors, strict=True)
        return [img if done else self._orient(img, t) for (img, done), t in pairs]

    def _decode_one(self, tensor, kw: dict):
        """(image, already oriented): nvJPEG alone, else the CPU policy decode (oriented)."""
        try:
            return self.decode_jpeg(tensor, **kw), False
        except RuntimeError:
            from prx_assets.core.ingest.decode import decode_rgb

            self.cpu_fallbacks += 1
            img = np.asarray(decode_rgb(tensor.numpy().tobytes()))
            return self.torch.from_numpy(img).permute(2, 0, 1).to(self.device), True

    def _orient(self, img, data):
        orientation = (
            Image.open(io.BytesIO(data.numpy().tobytes())).getexif().get(_ORIENTATION_TAG, 1)
        )
        if orientation == 2:
            return img.flip(-1)
        if orientation == 3:
            return img.flip(-1, -2)
        if orientation == 4:
            return img.flip(-2)
        if orientation == 5:
            return img.transpose(-1, -2)
        if orientation == 6:
            return self.torch.rot90(img, -1, (-2, -1))
        if orientation == 7:
            return img.flip(-1, -2).transpose(-1, -2)
        if orientation == 8:
            return self.torch.rot90(img, 1, (-2, -1))
        return img

    def _matrix(self, n: int):
        if n not in self._mats:
            self._mats[n] = self.torch.from_numpy(pillow_lanczos_matrix(n)).to(
                self.device, self.torch.float32
            )
        return self._mats[n]

    def _thumb(self, img):
        y = (img.float() * self.luma).sum(0)  # (H, W) luma in [0, 255]
        if self.resize == "bicubic":
            # The antialiased CUDA kernel refuses very large factors (shared memory):
            # box-average down to at most 8x the target first (an integer reduce, like
            # Pillow's reduce()), then the antialiased bicubic step.
            k = max(1, min(y.shape[0], y.shape[1]) // (8 * P.THUMB_SIZE))
            if k > 1:
                y = self.F.avg_pool2d(y[None, None], k, k, ceil_mode=True)[0, 0]
            t = self.F.interpolate(
                y[None, None],
                size=(P.THUMB_SIZE, P.THUMB_SIZE),
                mode="bicubic",
                antialias=True,
                align_corners=False,
            )[0, 0]
        else:
            t = self._matrix(y.shape[0]) @ y @ self._matrix(y.shape[1]).T
        return t.clamp(0.0, 255.0)

    def hash_batch(self, datas: list[bytes]) -> np.ndarray:
        """uint64 hashes of one batch of encoded images (JPEG; others fall back to the CPU)."""
        torch = self.torch
        tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        thumbs = torch.stack([self._thumb(img) for img in self._decode(tensors)])
        blocks = thumbs.reshape(len(datas), -1).double() @ self.dct  # (B, 64)
        middle = blocks.sort(dim=1).values[:, 31:33].mean(dim=1, keepdim=True)
        bits = (blocks > middle + P.TIE_TOLERANCE).cpu().numpy()
        return P._pack_bits(bits)

    def hash_all(self, datas: list[bytes], batch: int = 64) -> np.ndarray:
        parts = [self.hash_batch(datas[i : i + batch]) for i in range(0, len(datas), batch)]
        return np.concatenate(parts) if parts else np.empty(0, np.uint64)

    def decode_only(self, datas: list[bytes], batch: int = 64) -> None:
        torch = self.torch
        for i in range(0, len(datas), batch):
            self._decode(
                [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas[i : i + batch]]
            )

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()


def _time_device(fn, hasher: GpuHasher, reps: int) -> float:
    fn()  # warm-up: CUDA context, nvJPEG handles, kernels, resampling matrices
    hasher.sync()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        hasher.sync()
        best = min(best, time.perf_counter() - t)
    return best


def _gpu_section(
    by_kind: dict[str, list[bytes]],
    device: str,
    reps: int,
    quick: bool,
    batch: int,
    n_images: int,
) -> dict:
    """GPU (or, to check the code, CPU-device) hashing vs phash_many on one core, per kind."""
    import torch
    import torchvision

    if device == "cuda" and not torch.cuda.is_available():
        msg = (
            "GPU decode path (torchvision nvJPEG) NOT measured: torch.cuda.is_available() is "
            "False here (no CUDA device)."
        )
        print(f"\n{msg}")
        return {"measured": False, "reason": msg}
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (code check only)"
    dev = "gpu" if device == "cuda" else "cpu-check"
    hashers = {r: GpuHasher(device, r) for r in GpuHasher.RESIZES}
    per_kind = max(1, n_images // len(by_kind))
    print(
        f"\nGPU path on {name} (torch {torch.__version__}, torchvision {torchvision.__version__}): "
        f"{per_kind} JPEGs per kind, batches of {batch}, best of {reps}"
    )
    print(f"{'kind':12s} {'method':30s} {'img/s':>9s} {'ms/img':>8s} {'vs CPU fast 1 core':>19s}")
    throughput: dict[str, dict] = {}
    for kind, datas in by_kind.items():
        pool = (datas * (per_kind // max(1, len(datas)) + 1))[:per_kind]
        rows = {"cpu fast (phash_many)": _time(lambda p=pool: P.phash_many(p), max(1, reps - 1))}
        rows[f"{dev} decode only"] = _time_device(
            lambda p=pool: hashers["bicubic"].decode_only(p, batch), hashers["bicubic"], reps
        )
        for r, h in hashers.items():
            rows[f"{dev} full path, {r}"] = _time_device(
                lambda h=h, p=pool: h.hash_all(p, batch), h, reps
            )
        base = rows["cpu fast (phash_many)"]
        for label, t in rows.items():
            print(
                f"{kind:12s} {label:30s} {per_kind / t:9.1f} {1e3 * t / per_kind:8.3f} {base / t:18.2f}x"
            )
        mp = statistics.mean(math.prod(Image.open(io.BytesIO(d)).size) for d in datas) / 1e6
        throughput[kind] = {
            "images": len(pool),
            "mean_megapixels": mp,
            "images_per_s": {k: len(pool) / t for k, t in rows.items()},
            "speedup_vs_cpu_fast_1_core": {k: base / t for k, t in rows.items()},
        }
    fb = {r: (h.cpu_fallbacks, h.batched_failures) for r, h in hashers.items()}
    print(f"images decoded by the CPU instead / batches decoded one by one: {fb}")

    bases, copies = _agreement_set(15 if quick else 40)
    flat = bases + [c for cs in copies for c in cs]
    fast = [r.hash for r in P.phash_many(flat)]
    ref = [r.hash for r in P.phash_many(flat, mode="reference")]
    agreement: dict[str, dict] = {
        "cpu_fast": {"planted_found": _found(fast, len(bases))},
        "reference": {"planted_found": _found(ref, len(bases))},
    }
    for r, h in hashers.items():
        got = [int(x) for x in h.hash_all(flat, batch)]
        d_fast = [P.hamming(a, b) for a, b in zip(got, fast, strict=True)]
        d_ref = [P.hamming(a, b) for a, b in zip(got, ref, strict=True)]
        agreement[r] = {
            "exact_vs_fast": sum(d == 0 for d in d_fast) / len(flat),
            "exact_vs_reference": sum(d == 0 for d in d_ref) / len(flat),
            "mean_hamming_vs_fast": statistics.mean(d_fast),
            "max_hamming_vs_fast": max(d_fast),
            "planted_found": _found(got, len(bases)),
        }
    n_planted = 2 * len(bases)
    print(
        f"\nagreement on {len(flat)} random crops at 0.8-4 MP (+ planted copies 50%/q80, 75%/q90)"
    )
    print(
        f"{'hash':10s} {'=fast':>6s} {'=ref':>6s} {'mean d':>7s} {'max d':>6s} {'planted found':>14s}"
    )
    for r, a in agreement.items():
        if r in GpuHasher.RESIZES:
            print(
                f"{r:10s} {a['exact_vs_fast']:6.0%} {a['exact_vs_reference']:6.0%} "
                f"{a['mean_hamming_vs_fast']:7.2f} {a['max_hamming_vs_fast']:6d} "
                f"{a['planted_found']:>8d}/{n_planted}"
            )
        else:
            print(f"{r:10s} {'':6s} {'':6s} {'':7s} {'':6s} {a['planted_found']:>8d}/{n_planted}")
    return {
        "measured": device == "cuda",
        "device": name,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "batch": batch,
        "throughput": throughput,
        "cpu_fallbacks": {r: h.cpu_fallbacks for r, h in hashers.items()},
        "batched_decode_failures": {r: h.batched_failures for r, h in hashers.items()},
        "agreement": agreement,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 photos, 2 sizes, 3 reps")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument(
        "--gpu-only",
        action="store_true",
        help="only the GPU path vs phash_many (no imagehash needed)",
    )
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: check the GPU code here"
    )
    parser.add_argument("--batch", type=int, default=64, help="images per nvJPEG batch")
    parser.add_argument("--gpu-images", type=int, default=None, help="images in the GPU pool")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args()
    names = ["china.jpg", "coffee.png", "astronaut.png", "rocket.jpg", "chelsea.png"]
    sizes = [1.0, 2.0, 4.0, 6.0]
    reps = args.reps or 5
    if args.quick:
        names, sizes, reps = names[:3], [1.0, 6.0], args.reps or 3
    n_gpu = args.gpu_images or (96 if args.quick else 512)

    results: dict = {
        "benchmark": "bench_phash",
        "quick": args.quick,
        "reps": reps,
        "fast_version": P.phash_version("fast"),
        "draft_target": P.FAST_DRAFT_TARGET,
    }
    with tempfile.TemporaryDirectory() as tmp:
        files = _make_inputs(Path(tmp), names, sizes)
        datas = {f["path"]: f["path"].read_bytes() for f in files}
        results["files"] = [
            {"file": f["path"].name, "kind": f["kind"], "mp": f["mp"], "size": f["size"]}
            for f in files
        ]
        if not args.gpu_only:
            results.update(_cpu_section(files, datas, sizes, reps, args.quick))
        try:
            by_kind: dict[str, list[bytes]] = {}
            for f in files:
                by_kind.setdefault(f["kind"], []).append(datas[f["path"]])
            results["gpu"] = _gpu_section(by_kind, args.device, reps, args.quick, args.batch, n_gpu)
        except ImportError as exc:
            msg = f"GPU decode path NOT measured: {exc} (needs torch and torchvision)"
            print(f"\n{msg}")
            results["gpu"] = {"measured": False, "reason": msg}
    results["cuda"] = bool(results["gpu"].get("measured"))

    out = args.out or (GPU_RESULTS if args.gpu_only else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
