"""Hamming-0 clustering of 1e8 hashes: ``cluster_exact`` vs ``numpy.unique``, one core.

Each side runs in its own subprocess on the same seeded data (1e8 random uint64, ~1% of
items overwritten with the value of another item), so each peak RSS is its own. Reported per
side: wall and CPU time of the call (CPU time is the fairer "one core" figure on a shared
machine), peak RSS of the process (``ru_maxrss``; it includes the 800 MB
input), RSS right before the call, and the call's own peak allocation (``tracemalloc``, which
numpy reports its buffers to). The baseline is ``np.unique(h, return_inverse=True,
return_counts=True)`` plus ``counts[inverse]`` so both sides end with per-item cluster and
size; both report duplicate counts, which must agree.

    python -m benchmarks.bench_clustering [--quick] [--n N]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_clustering.json"
DUP_FRACTION = 0.01


def _data(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    h = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True)
    k = int(n * DUP_FRACTION)
    h[rng.integers(0, n, k)] = h[rng.integers(0, n, k)]
    return h


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _child(which: str, n: int) -> None:
    from prx_assets.core.dedup.clustering import cluster_exact  # imported outside the timing

    h = _data(n)
    rss_before = _rss_mb()
    tracemalloc.start()
    cpu = time.process_time()
    t = time.perf_counter()
    if which == "cluster_exact":
        c = cluster_exact(h)
        elapsed = time.perf_counter() - t
        cpu = time.process_time() - cpu
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        peak_rss = _rss_mb()
        n_clusters = c.n_clusters
        sum_sizes = int(c.size.sum(dtype=np.int64))
    else:
        uniq, inverse, counts = np.unique(h, return_inverse=True, return_counts=True)
        size = counts[inverse]
        elapsed = time.perf_counter() - t
        cpu = time.process_time() - cpu
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        peak_rss = _rss_mb()
        n_clusters = len(uniq)
        sum_sizes = int(size.sum(dtype=np.int64))
    print(
        json.dumps(
            {
                "method": which,
                "n": n,
                "seconds": elapsed,
                "cpu_seconds": cpu,
                "peak_rss_mb": peak_rss,
                "rss_before_call_mb": rss_before,
                "traced_peak_mb": traced / 2**20,
                "n_duplicates": n - n_clusters,
                "sum_of_sizes": sum_sizes,
            }
        )
    )


def _run(which: str, n: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_clustering", "--child", which, "--n", str(n)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1e7 hashes instead of 1e8")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument(
        "--child", choices=["cluster_exact", "numpy_unique"], help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    n = args.n or (10_000_000 if args.quick else 100_000_000)
    if args.child:
        _child(args.child, n)
        return

    ours = _run("cluster_exact", n)
    base = _run("numpy_unique", n)
    assert ours["n_duplicates"] == base["n_duplicates"], (ours, base)
    assert ours["sum_of_sizes"] == base["sum_of_sizes"], (ours, base)

    print(
        f"Hamming-0 clustering of {n:.0e} hashes (~{DUP_FRACTION:.0%} planted duplicates), one core"
    )
    print(
        f"{'method':14s} {'wall s':>7s} {'CPU s':>7s} {'peak RSS MB':>12s} {'RSS before':>11s} "
        f"{'traced MB':>10s}"
    )
    for r in (ours, base):
        print(
            f"{r['method']:14s} {r['seconds']:7.2f} {r['cpu_seconds']:7.2f} {r['peak_rss_mb']:12.0f} "
            f"{r['rss_before_call_mb']:11.0f} {r['traced_peak_mb']:10.0f}"
        )
    speedup = base["seconds"] / ours["seconds"]
    cpu_speedup = base["cpu_seconds"] / ours["cpu_seconds"]
    mem_ratio = base["peak_rss_mb"] / ours["peak_rss_mb"]
    print(
        f"speedup {speedup:.2f}x wall, {cpu_speedup:.2f}x CPU; peak RSS {mem_ratio:.2f}x lower; "
        f"duplicates found {ours['n_duplicates']} (both agree)"
    )
    targets = {
        "wall_seconds<=10": ours["seconds"] <= 10,
        "cpu_seconds<=10": ours["cpu_seconds"] <= 10,
        "peak_rss<=2.5GB": ours["peak_rss_mb"] <= 2500,
    }
    if n == 100_000_000:
        print(
            "targets:", ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in targets.items())
        )

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "bench_clustering",
                "n": n,
                "quick": args.quick,
                "cluster_exact": ours,
                "numpy_unique": base,
                "speedup": speedup,
                "cpu_speedup": cpu_speedup,
                "peak_rss_ratio": mem_ratio,
                "targets_at_1e8": targets if n == 100_000_000 else None,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
