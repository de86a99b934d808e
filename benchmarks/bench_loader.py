"""Loader cost: skip-list dataset vs plain StreamingDataset, and on-the-fly text encoding.

Run from the repo root: ``python -m benchmarks.bench_loader [--quick]``.

1. Throughput of iterating the same MDS shards (3 partitions) with a plain
   ``StreamingDataset`` (over a plain-index twin of each directory, its shards hard links:
   a published index is refused by plain streaming) and with ``SkipListDataset`` (no skips; 5 % skipped, so every shard
   is a ``FilteredShard``), alternating in one process; per-sample rates, median of reps.
   Measured twice: raw samples (loader overhead only, the worst case) and through a
   ``DataLoader`` whose collate decodes the JPEGs (what training pays).
2. Collate cost per batch: decode only vs decode + text latents from a tiny and a
   BERT-small-sized randomly initialised encoder (built offline), torch on 1 thread.

Prints a table and writes ``benchmarks/results/bench_loader.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from streaming import MDSWriter, StreamingDataset  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from prx_assets.core.shards.mds import BASE_COLUMNS  # noqa: E402
from prx_assets.core.shards.published import mark_published  # noqa: E402
from prx_assets.core.skiplists.sidecars import read_index_shards, write_partition_skiplists  # noqa: E402
from prx_assets.loader import HFTextEncoder, ImageTextCollate, SkipListDataset  # noqa: E402
from prx_assets.loader.collate import jpeg_bytes  # noqa: E402
from prx_assets.loader.offline_encoder import SMALL, TINY, build_offline_bert  # noqa: E402

PHOTOS = Path(__file__).resolve().parents[1] / "prx_assets" / "demo" / "photos"
RESULTS = Path(__file__).resolve().parent / "results" / "bench_loader.json"
WORDS = (
    "a photo of the red cat dog sitting on green grass near brick wall with coffee cup and "
    "old coins under a bright flower in soft morning light studio portrait of street"
).split()
COLUMNS = dict(BASE_COLUMNS)  # the shard contract written by core/shards/mds.py


def _jpeg_pool(size: int, n: int, rng: random.Random) -> list[bytes]:
    photos = sorted(p for p in PHOTOS.iterdir() if p.suffix.lower() in (".jpg", ".png"))
    imgs = [Image.open(p).convert("RGB") for p in photos]
    pool = []
    for i in range(n):
        img = imgs[i % len(imgs)]
        side = min(img.size)
        x, y = rng.randrange(img.width - side + 1), rng.randrange(img.height - side + 1)
        crop = img.crop((x, y, x + side, y + side)).resize((size, size))
        pool.append(jpeg_bytes(crop, quality=90))
    return pool


def _caption(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 20)))


def write_data(root: Path, partitions: int, per_partition: int, size: int) -> list[Path]:
    rng = random.Random(0)
    pool = _jpeg_pool(size, 48, rng)
    dirs = []
    for p in range(partitions):
        out = root / "mds" / "0" / f"{size}x{size}" / f"b{p}"
        with MDSWriter(out=str(out), columns=COLUMNS, size_limit=1 << 20) as w:
            for i in range(per_partition):
                w.write(
                    {
                        "image": pool[(i * 7 + p) % len(pool)],
                        "caption": _caption(rng),
                        "key": f"{p}/{i}",
                        "orig_width": size,
                        "orig_height": size,
                        "tier": 0,
                        "shape": f"{size}x{size}",
                        "source": "public",
                        "license": "cc-by",
                    }
                )
        _plain_twin(out)
        mark_published(out)  # as mds_shards publishes it: readable by the loader only
        dirs.append(out)
    return dirs


def _plain_twin(d: Path) -> Path:
    """The baseline's copy of a directory: its shard files hard-linked (the same bytes, the
    same page cache) beside MDSWriter's plain version 2 index, which plain streaming reads
    (a published index it refuses: core/shards/published.py)."""
    twin = plain_dir(d)
    twin.mkdir(parents=True)
    for f in d.iterdir():
        if f.name == "index.json":
            (twin / f.name).write_bytes(f.read_bytes())
        else:
            os.link(f, twin / f.name)
    return twin


def plain_dir(d: Path) -> Path:
    """``<root>/mds/...`` -> ``<root>/plain/...``."""
    parts = d.parts
    i = len(parts) - 1 - parts[::-1].index("mds")
    return Path(*parts[:i], "plain", *parts[i + 1 :])


def set_skips(dirs: list[Path], fraction: float) -> int:
    """Publish a skip-list generation per directory skipping ``fraction`` of every shard."""
    rng = random.Random(1)
    skipped = 0
    for d in dirs:
        skips = {}
        for name, n in read_index_shards(d):
            chosen = rng.sample(range(n), int(round(n * fraction)))
            skips[name] = {i: ["duplicate"] for i in chosen}
            skipped += len(chosen)
        write_partition_skiplists(d, skips)
    return skipped


def _timed(fn) -> tuple[int, float, float]:
    """(samples, wall s, process CPU s): CPU time is far less sensitive to other tenants."""
    w0, c0 = time.perf_counter(), time.process_time()
    n = fn()
    return n, time.perf_counter() - w0, time.process_time() - c0


def _bench_get_item(datasets: dict[str, Any], rounds: int, block: int = 1000) -> dict[str, Any]:
    """The per-sample path alone (spanner, shard, skip mapping, MDS read): no threads, no
    polling sleeps, so it is the least noisy view of what the skip-lists add per sample."""
    rng = random.Random(2)
    per_sample: dict[str, list[float]] = {k: [] for k in datasets}
    for r in range(rounds):
        order = list(datasets) if r % 2 == 0 else list(reversed(datasets))
        for name in order:
            ds = datasets[name]
            ids = [rng.randrange(ds.num_samples) for _ in range(block)]
            c0 = time.process_time()
            for i in ids:
                ds.get_item(i)
            per_sample[name].append((time.process_time() - c0) / block)
    med = {k: statistics.median(v) for k, v in per_sample.items()}
    return {
        "rounds": rounds,
        "block": block,
        "median_us_per_sample_cpu": {k: 1e6 * v for k, v in med.items()},
        "paired_ratio_vs_plain_cpu": {
            k: statistics.median(
                p / s for p, s in zip(per_sample["plain"], per_sample[k], strict=True)
            )
            for k in per_sample
        },
    }


def bench_throughput(dirs: list[Path], reps: int, decode_batches: bool) -> dict[str, Any]:
    """Per-sample rates for plain vs skip-list datasets over the same shards.

    Each rep runs one epoch of every dataset, in alternating order; ratios are taken per rep
    (paired) and the median reported, for wall time and for CPU time.
    """
    from streaming import Stream

    kw = {"batch_size": 16, "num_canonical_nodes": 1, "shuffle": True}
    plain = StreamingDataset(streams=[Stream(local=str(plain_dir(d))) for d in dirs], **kw)
    set_skips(dirs, 0.0)
    skip0 = SkipListDataset(streams=[Stream(local=str(d)) for d in dirs], **kw)
    skipped = set_skips(dirs, 0.05)
    skip5 = SkipListDataset(streams=[Stream(local=str(d)) for d in dirs], **kw)
    assert skip5.num_samples == plain.num_samples - skipped
    datasets = {"plain": plain, "skip_0pct": skip0, "skip_5pct": skip5}
    collate = ImageTextCollate()

    def run(ds) -> int:
        if not decode_batches:
            return sum(1 for _ in ds)
        loader = DataLoader(ds, batch_size=16, num_workers=0, collate_fn=collate)
        return sum(len(b["key"]) for b in loader)

    for ds in datasets.values():  # warm the page cache and the code paths
        run(ds)
    out: dict[str, Any] = {
        "samples_per_epoch": {k: int(ds.num_samples) for k, ds in datasets.items()},
        "reps": reps,
    }
    if not decode_batches:
        out["get_item"] = _bench_get_item(datasets, rounds=4 * reps)
    runs: dict[str, list[tuple[int, float, float]]] = {k: [] for k in datasets}
    for rep in range(reps):
        order = list(datasets) if rep % 2 == 0 else list(reversed(datasets))
        for name in order:
            runs[name].append(_timed(lambda ds=datasets[name]: run(ds)))

    def rates(name: str, col: int) -> list[float]:
        return [r[0] / r[col] for r in runs[name]]

    for col, label in ((1, "wall"), (2, "cpu")):
        out[f"median_samples_per_s_{label}"] = {k: statistics.median(rates(k, col)) for k in runs}
        out[f"all_samples_per_s_{label}"] = {k: rates(k, col) for k in runs}
        out[f"paired_ratio_vs_plain_{label}"] = {
            k: statistics.median(
                a / b for a, b in zip(rates(k, col), rates("plain", col), strict=True)
            )
            for k in runs
        }
    return out


def bench_encoders(workdir: Path, dirs: list[Path], reps: int, batch: int) -> dict[str, Any]:
    ds = SkipListDataset(local=str(dirs[0]), batch_size=batch)
    samples = [ds[i] for i in range(batch)]
    words = sorted(set(WORDS)) + [str(i) for i in range(10)]
    encoders: dict[str, Any] = {"none": None}
    for name, cfg in (("tiny", TINY), ("small", SMALL)):
        path = build_offline_bert(
            workdir / f"enc_{name}", words, max_position_embeddings=128, **cfg
        )
        encoders[name] = HFTextEncoder.from_pretrained(path, max_length=77)
    collates = {k: ImageTextCollate(e) for k, e in encoders.items()}
    for c in collates.values():
        c(samples)  # warm up
    times: dict[str, list[float]] = {k: [] for k in collates}
    for rep in range(reps):
        order = list(collates) if rep % 2 == 0 else list(reversed(collates))
        for name in order:
            t0 = time.perf_counter()
            collates[name](samples)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    params = {
        k: (sum(p.numel() for p in e.model.parameters()) if e is not None else 0)
        for k, e in encoders.items()
    }
    return {
        "batch_size": batch,
        "max_length": 77,
        "params": params,
        "median_ms_per_batch": {k: 1000 * v for k, v in med.items()},
        "ratio_vs_no_encoding": {k: med[k] / med["none"] for k in med},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    per_partition, reps, enc_reps = (400, 5, 5) if args.quick else (2000, 15, 15)
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        workdir = Path(tmp)
        t0 = time.perf_counter()
        dirs = write_data(workdir, partitions=3, per_partition=per_partition, size=128)
        setup_s = time.perf_counter() - t0
        raw = bench_throughput(dirs, reps, decode_batches=False)
        decoded = bench_throughput(dirs, max(3, reps // 2), decode_batches=True)
        enc = bench_encoders(workdir, dirs, enc_reps, batch=16)

    out = {
        "benchmark": "bench_loader",
        "quick": args.quick,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch_threads": 1,
        },
        "data": {"partitions": 3, "samples_per_partition": per_partition, "image": "128x128 JPEG"},
        "setup_s": setup_s,
        "throughput_raw_samples": raw,
        "throughput_decoded_batches": decoded,
        "collate_encoders": enc,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")

    gi = raw["get_item"]
    print(f"{'per-sample get_item (CPU)':<42}{'us':>9}{'ratio':>8}")
    for k in ("plain", "skip_0pct", "skip_5pct"):
        us, ratio = gi["median_us_per_sample_cpu"][k], gi["paired_ratio_vs_plain_cpu"][k]
        print(f"  {k:<40}{us:>9.2f}{ratio:>8.3f}")
    print(f"\n{'epoch iteration (samples/s)':<42}{'wall/s':>9}{'ratio':>8}{'cpu/s':>9}{'ratio':>8}")
    for label, res in (("raw", raw), ("decoded", decoded)):
        for k in ("plain", "skip_0pct", "skip_5pct"):
            print(
                f"  {label + ': ' + k:<40}"
                f"{res['median_samples_per_s_wall'][k]:>9.0f}"
                f"{res['paired_ratio_vs_plain_wall'][k]:>8.3f}"
                f"{res['median_samples_per_s_cpu'][k]:>9.0f}"
                f"{res['paired_ratio_vs_plain_cpu'][k]:>8.3f}"
            )
    print(f"\n{'collate, batch 16, 128x128':<34}{'ms/batch':>12}{'vs none':>10}{'params':>12}")
    for k, ms in enc["median_ms_per_batch"].items():
        ratio, params = enc["ratio_vs_no_encoding"][k], enc["params"][k]
        print(f"  {k:<32}{ms:>12.2f}{ratio:>10.2f}{params:>12,}")
    print(
        f"\nwrote {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}"
    )


if __name__ == "__main__":
    main()
