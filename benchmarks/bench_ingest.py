"""Ingest throughput (images/s per core) beside a plain Pillow open+decode loop, same process.

Both sides read the same demo files from disk. Ingest does everything raw_images does
before the Lance write: read bytes, sha256, header checks, full validation decode
(JPEG in DCT-scaled draft mode), EXIF orientation and policy bookkeeping. The baseline
is `Image.open(path).load()` per file. Single-threaded: one core.

    python -m benchmarks.bench_ingest [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

from PIL import Image  # noqa: E402

from prx_assets.core.ingest.runner import BatchIngest  # noqa: E402
from prx_assets.core.ingest.sources import discover_batches, iter_candidates  # noqa: E402
from prx_assets.demo.build import build_demo_landing  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_ingest.json"


def _time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small demo landing zone")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        landing = Path(tmp) / "landing"
        build_demo_landing(landing, size="small" if args.quick else "full")
        refs = [r for r in discover_batches(landing) if r.kind == "folder"]
        files = [
            (r, c.path) for r in refs for c in iter_candidates(r) if c.error is None and c.data
        ]
        paths = [r.path / p for r, p in files]

        def ingest() -> int:
            n = 0
            for ref in refs:
                run = BatchIngest(ref)
                for rb in run.image_batches():
                    n += rb.num_rows
            return n

        def baseline() -> int:
            n = 0
            for p in paths:
                try:
                    with Image.open(p) as img:
                        img.load()
                        n += 1
                except Exception:  # noqa: BLE001 - the bad files fail here too
                    pass
            return n

        accepted = ingest()
        decoded = baseline()
        t_ingest = min(_time(ingest) for _ in range(args.repeats))
        t_base = min(_time(baseline) for _ in range(args.repeats))
    result = {
        "files": len(paths),
        "ingest_accepted": accepted,
        "baseline_decoded": decoded,
        "ingest_images_per_s_per_core": round(accepted / t_ingest, 1),
        "pillow_open_decode_images_per_s_per_core": round(decoded / t_base, 1),
        "ratio_ingest_over_pillow": round((accepted / t_ingest) / (decoded / t_base), 2),
        "repeats": args.repeats,
        "command": "python -m benchmarks.bench_ingest" + (" --quick" if args.quick else ""),
    }
    print(f"{'path':34} {'images/s/core':>14}")
    print(f"{'ingest (validate + describe)':34} {result['ingest_images_per_s_per_core']:>14}")
    print(
        f"{'Pillow open + full decode':34} {result['pillow_open_decode_images_per_s_per_core']:>14}"
    )
    print(f"ratio ingest / Pillow: {result['ratio_ingest_over_pillow']}x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
