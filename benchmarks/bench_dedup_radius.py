"""Near-duplicate look-ups at radius 3 against radius 0, on a real lab of 10^6 hashes.

What runs: ``gather_corpus`` (what ``phash_clusters`` reads for one batch) for a new batch of
10,000 hashes, half of them 1-3 bit mutations of corpus hashes, against an ``image_hashes``
table of 10^6 rows in 100 partitions (written through ``Lab.replace_partition``, indexes
as in production). Side by side in this process: radius 0 (the BTREE look-up of equal
hashes) and radius 3 (the corpus' hashes scanned, then ``closure_mask``); CPU time
(``time.process_time``, Lance's threads included) and wall, median of the repeats.

Tried and measured at commit ``eea3acf`` (reverted): four indexed 16-bit bands of the hash
(pigeonhole: within Hamming 3 two hashes share a band), the closure reading the rows that
share a band with its frontier. Each band value matches ~corpus / 65,536 rows, so a
10k-hash batch read 942k rows through 60 look-ups: 4.29 s CPU, 18.9x radius 0, against the
scan's 7.97x (``benchmarks/results/bench_dedup_radius_bands_eea3acf.json``). Bands pay only
for batches far smaller than 65,536 / 4 hashes; a platform batch holds ~100k.

Since stop 47 the radius path is the same scan made cheaper (``closure_mask``): the closure
runs on the scanned rows as they are (no distinct pass, no membership pass), 16-bit chunks
are grouped by a counting sort instead of two 64-bit sorts each, candidate pairs are checked
by popcount directly, and the closure's rows are taken by the row ids of that scan instead
of ``phash`` IN-list look-ups. Its cost still grows with the corpus (one scan of a hash and
a row id per image); the ratio is what this benchmark measures at 10^6.

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


def build(lab: Any, corpus: int, batch: int, rng: np.random.Generator) -> np.ndarray:
    import pyarrow as pa

    from prx_assets.core.tables import IMAGE_HASHES

    parts = 100
    hashes = rng.integers(0, 2**64 - 1, size=corpus, dtype=np.uint64, endpoint=True)
    per = corpus // parts
    for p in range(parts):
        h = hashes[p * per : (p + 1) * per]
        lab.replace_partition(IMAGE_HASHES, f"c{p:03d}", _rows(f"c{p:03d}", h, pa))
    near = rng.choice(hashes, size=batch // 2)
    for i in range(len(near)):
        for bit in rng.choice(64, size=int(rng.integers(1, 4)), replace=False):
            near[i] ^= np.uint64(1) << np.uint64(int(bit))
    fresh = rng.integers(0, 2**64 - 1, size=batch - len(near), dtype=np.uint64, endpoint=True)
    new = np.concatenate([near, fresh])
    lab.replace_partition(IMAGE_HASHES, "new", _rows("new", new, pa))
    return hashes


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from prx_assets.core.dedup import corpus as C
    from prx_assets.core.dedup.decisions import DedupSettings
    from prx_assets.core.lab import Lab

    corpus_n, batch_n, repeats = (10**6, 10_000, 2) if args.quick else (10**6, 10_000, 5)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"quick": args.quick, "cpus": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as d:
        lab = Lab(Path(d) / "lab")
        t = time.perf_counter()
        build(lab, corpus_n, batch_n, rng)
        out["build_s"] = round(time.perf_counter() - t, 1)
        s0, s3 = DedupSettings(radius=0), DedupSettings(radius=3)
        runs: dict[str, list[tuple[float, float]]] = {"r0": [], "r3": []}
        for _ in range(repeats):
            cpu, wall, g0 = timed(lambda: C.gather_corpus(lab, "new", s0))
            runs["r0"].append((cpu, wall))
            cpu, wall, g3 = timed(lambda: C.gather_corpus(lab, "new", s3))
            runs["r3"].append((cpu, wall))
        med = {
            k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
            for k, v in runs.items()
        }
        out.update(
            {
                "corpus_hashes": corpus_n,
                "batch_hashes": batch_n,
                "closure_hashes": g3.lookups["closure_hashes"],
                "corpus_hashes_scanned": g3.lookups["corpus_hashes_scanned"],
                **{f"{k}_cpu_s": round(c, 3) for k, (c, _) in med.items()},
                **{f"{k}_wall_s": round(w, 3) for k, (_, w) in med.items()},
            }
        )
    r0, r3 = med["r0"][0], med["r3"][0]
    out["ratio_r3_vs_r0"] = round(r3 / r0, 2)
    lines = [
        f"dedup gather, 10k-hash batch vs {corpus_n:,} hashes: radius 3 {r3:.2f} s CPU = "
        f"{r3 / r0:.2f}x radius 0 ({r0:.2f} s) (target <= {TARGET_RATIO:g}x)",
    ]
    out["summary"] = lines
    out["command"] = "python -m benchmarks.bench_dedup_radius" + (" --quick" if args.quick else "")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "summary"}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
