"""Near-duplicate look-ups at radius 3 against radius 0, and the halves' index against the scan.

What runs: ``gather_corpus`` (what ``phash_clusters`` reads for one batch) for a new batch of
10,000 hashes and a small one of 100, half of each 1-3 bit mutations of corpus hashes,
against an ``image_hashes`` table of 10^6 rows in 100 partitions (written through
``Lab.replace_partition``, indexes as in production), then again after the corpus grew to
10^7 (``--quick``: 2 x 10^6). Side by side in this process, CPU time (``time.process_time``,
Lance's threads included) and wall, median of the repeats:

- radius 0 (the BTREE look-up of equal hashes) and radius 3 as ``phash_clusters`` runs it
  (``near="auto"``: ``corpus.near_path`` picks the cheaper path), the ratio the target is on;
- radius 3 through each path forced: the scan of the corpus' hashes (``closure_mask``) and
  the hash halves' indexes (``phash_hi``/``phash_lo`` BTREEs, 33 probe values per half and
  frontier hash), for both batches: the scan's cost follows the corpus, the index's the
  batch and its candidates;
- what one probe value costs against one scanned row, from those runs: the measured basis
  of ``corpus.PROBE_TO_SCAN_COST``.

Tried and measured at commit ``eea3acf`` (reverted): four indexed 16-bit bands of the hash
(pigeonhole: within Hamming 3 two hashes share a band), the closure reading the rows that
share a band with its frontier. Each band value matches ~corpus / 65,536 rows, so a
10k-hash batch read 942k rows through 60 look-ups: 4.29 s CPU, 18.9x radius 0, against the
scan's 7.97x (``benchmarks/results/bench_dedup_radius_bands_eea3acf.json``). The halves
match ~corpus / 2^32 rows per probe value instead, at 66 values per hash.

    python -m benchmarks.bench_dedup_radius [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "bench_dedup_radius.json"
TARGET_RATIO = 3.0


def _near(rng: np.random.Generator, hashes: np.ndarray, n: int) -> np.ndarray:
    """``n`` new hashes: half 1-3 bit mutations of ``hashes``, half random."""
    near = rng.choice(hashes, size=n // 2)
    for i in range(len(near)):
        for bit in rng.choice(64, size=int(rng.integers(1, 4)), replace=False):
            near[i] ^= np.uint64(1) << np.uint64(int(bit))
    fresh = rng.integers(0, 2**64 - 1, size=n - len(near), dtype=np.uint64, endpoint=True)
    return np.concatenate([near, fresh])


def grow(lab: Any, have: int, want: int, rng: np.random.Generator, parts: int = 100) -> np.ndarray:
    """Corpus partitions until ``want`` rows (``have`` already there); the new hashes."""
    import pyarrow as pa

    from prx_assets.core.tables import IMAGE_HASHES

    per = 10**6 // 100
    hashes = rng.integers(0, 2**64 - 1, size=want - have, dtype=np.uint64, endpoint=True)
    for p in range((want - have) // per):
        name = f"c{(have // per) + p:05d}"
        lab.replace_partition(IMAGE_HASHES, name, _rows(name, hashes[p * per : (p + 1) * per], pa))
    return hashes


def add_batches(lab: Any, hashes: np.ndarray, sizes: dict[str, int], rng: Any) -> None:
    import pyarrow as pa

    from prx_assets.core.tables import IMAGE_HASHES

    for name, n in sizes.items():
        lab.replace_partition(IMAGE_HASHES, name, _rows(name, _near(rng, hashes, n), pa))


def _rows(batch: str, h: np.ndarray, pa: Any) -> Any:
    """Hash rows as ``image_hashes`` holds them."""
    from prx_assets.core.tables import IMAGE_HASHES

    n = len(h)
    columns = {
        "key": [f"{batch}-{i}" for i in range(n)],
        "batch": [batch] * n,
        "phash": h.view(np.int64),
        "phash_mode": ["fast"] * n,
        "phash_version": ["fast-v1"] * n,
        "ac_energy": np.full(n, 9.0, np.float32),
        "low_information": np.zeros(n, bool),
        "pixels": np.full(n, 10**6, np.int64),
        "file_size": np.full(n, 10**5, np.int64),
        "phash_hi": (h >> np.uint64(32)).astype(np.int64),
        "phash_lo": (h & np.uint64(0xFFFFFFFF)).astype(np.int64),
    }
    arrays = [
        pa.array(columns[f.name], f.type) if f.name in columns else pa.nulls(n, f.type)
        for f in IMAGE_HASHES.schema
    ]
    return pa.Table.from_arrays(arrays, schema=IMAGE_HASHES.schema)


def timed(fn: Any) -> tuple[float, float, Any]:
    c, w = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c, time.perf_counter() - w, out


def measure(lab: Any, repeats: int) -> dict[str, Any]:
    """The gathers at the lab's current size, medians of ``repeats``."""
    from prx_assets.core.dedup import corpus as C
    from prx_assets.core.dedup.decisions import DedupSettings

    s0, s3 = DedupSettings(radius=0), DedupSettings(radius=3)
    plan = {
        "r0": ("new", s0, C.NEAR_AUTO),
        "r3": ("new", s3, C.NEAR_AUTO),
        "r3_scan": ("new", s3, C.NEAR_SCAN),
        "r3_index": ("new", s3, C.NEAR_INDEX),
        "small_r0": ("small", s0, C.NEAR_AUTO),
        "small_r3_scan": ("small", s3, C.NEAR_SCAN),
        "small_r3_index": ("small", s3, C.NEAR_INDEX),
        "small_r3": ("small", s3, C.NEAR_AUTO),
    }
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in plan}
    found: dict[str, Any] = {}
    for _ in range(repeats):
        for name, (batch, settings, near) in plan.items():
            cpu, wall, g = timed(
                lambda b=batch, st=settings, n=near: C.gather_corpus(lab, b, st, near=n)
            )
            runs[name].append((cpu, wall))
            found[name] = g
    out: dict[str, Any] = {"corpus_rows": lab.view().count_rows("image_hashes")}
    for name, v in runs.items():
        out[f"{name}_cpu_s"] = round(statistics.median(c for c, _ in v), 3)
        out[f"{name}_wall_s"] = round(statistics.median(w for _, w in v), 3)
    for name in ("r3", "small_r3"):
        out[f"{name}_path"] = "index" if found[name].lookups.get("near_path_index") else "scan"
    for name in ("r3_index", "small_r3_index"):
        for k in ("probe_values", "candidate_rows", "closure_rounds"):
            out[f"{name}_{k}"] = found[name].lookups[k]
    for a, b in (("r3_scan", "r3_index"), ("small_r3_scan", "small_r3_index")):
        keys = [sorted(found[x].corpus.column("key").to_pylist()) for x in (a, b)]
        out[f"{b}_same_rows_as_scan"] = keys[0] == keys[1]
    # One probe value against one scanned row, from the 10k batch: the paths' extra CPU over
    # radius 0 (which both pay too), per probe value and per scanned corpus hash.
    scan_row = max(out["r3_scan_cpu_s"] - out["r0_cpu_s"], 1e-9) / out["corpus_rows"]
    probe = max(out["r3_index_cpu_s"] - out["r0_cpu_s"], 1e-9) / out["r3_index_probe_values"]
    out["probe_to_scan_cost"] = round(probe / scan_row, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from prx_assets.core.dedup import corpus as C
    from prx_assets.core.lab import Lab

    first, second = 10**6, (2 * 10**6 if args.quick else 10**7)
    batch_n, small_n = 10_000, 100
    repeats = 2 if args.quick else 3
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"quick": args.quick, "cpus": len(os.sched_getaffinity(0))}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        lab = Lab(Path(d) / "lab")
        t = time.perf_counter()
        hashes = grow(lab, 0, first, rng)
        add_batches(lab, hashes, {"new": batch_n, "small": small_n}, rng)
        out["build_s"] = round(time.perf_counter() - t, 1)
        rows.append(measure(lab, repeats))
        print(json.dumps(rows[-1]), flush=True)
        grow(lab, first, second, rng)
        rows.append(measure(lab, repeats))
        print(json.dumps(rows[-1]), flush=True)
    out["rows"] = rows
    base, big = rows
    ratio = base["r3_cpu_s"] / base["r0_cpu_s"]
    out["ratio_r3_vs_r0"] = round(ratio, 2)
    growth = big["corpus_rows"] / base["corpus_rows"]
    lines = [
        f"dedup gather, 10k-hash batch vs {base['corpus_rows']:,} hashes: radius 3 "
        f"{base['r3_cpu_s']:.2f} s CPU = {ratio:.2f}x radius 0 ({base['r0_cpu_s']:.2f} s; "
        f"path chosen: {base['r3_path']}) (target <= {TARGET_RATIO:g}x)",
        f"corpus x{growth:.0f} ({big['corpus_rows']:,}): radius 3 through the halves' index, "
        f"100-hash batch {base['small_r3_index_cpu_s']:.3f} -> {big['small_r3_index_cpu_s']:.3f} s, "
        f"10k batch {base['r3_index_cpu_s']:.2f} -> {big['r3_index_cpu_s']:.2f} s; through the "
        f"scan {base['small_r3_scan_cpu_s']:.2f} -> {big['small_r3_scan_cpu_s']:.2f} s and "
        f"{base['r3_scan_cpu_s']:.2f} -> {big['r3_scan_cpu_s']:.2f} s (growth: index "
        f"x{big['small_r3_index_cpu_s'] / base['small_r3_index_cpu_s']:.1f} / "
        f"x{big['r3_index_cpu_s'] / base['r3_index_cpu_s']:.1f}, scan "
        f"x{big['small_r3_scan_cpu_s'] / base['small_r3_scan_cpu_s']:.1f} / "
        f"x{big['r3_scan_cpu_s'] / base['r3_scan_cpu_s']:.1f}; flat would be x1)",
        f"same rows through both paths: "
        f"{all(r[k] for r in rows for k in r if k.endswith('_same_rows_as_scan'))}; auto chose "
        f"{base['small_r3_path']} / {big['small_r3_path']} (100) and {base['r3_path']} / "
        f"{big['r3_path']} (10k)",
        f"one probe value costs {base['probe_to_scan_cost']:g} / {big['probe_to_scan_cost']:g} "
        f"scanned rows (corpus.PROBE_TO_SCAN_COST = {C.PROBE_TO_SCAN_COST})",
    ]
    out["summary"] = lines
    out["command"] = "python -m benchmarks.bench_dedup_radius" + (" --quick" if args.quick else "")
    target = RESULTS.with_name("bench_dedup_radius.quick.json") if args.quick else RESULTS
    target.parent.mkdir(exist_ok=True)
    target.write_text(json.dumps(out, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
