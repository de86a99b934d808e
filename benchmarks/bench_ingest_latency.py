"""Ingest on object storage when each round trip takes time: overlapped vs one at a time.

An ingest worker on object storage makes three requests per photo (its alt-text sidecar, the
photo, the blob it stores) around ~5 ms of CPU. A remote store answers each in tens of
milliseconds, so a worker that waits for each in turn is idle most of the time and a
cluster's ingest rate is set by storage latency, not by its cores. Since this stop's change
the worker keeps ``PRX_INGEST_IO_THREADS`` (8) round trips in flight
(``core/ingest/runner.py``: ``_check_items_overlapped``); ``PRX_INGEST_IO_THREADS=1`` is the
previous behaviour, one after the other.

What runs, in this process (the step process) and its pool's workers, through Dagster as a
user runs it: the ``raw_images`` asset (``batch_pipeline``, ``execute_in_process``) on four
partitions of distinct real photos (``prx_assets.demo.photo_batch``, with their alt-text
sidecars) in a landing zone on a real S3 server (moto, in a process of its own, behind the
byte-counting relay of ``bench_scaleout``, which here holds each response ``--latency-ms``
before relaying it, as a remote store's time to first byte), the lab on the same server.
The partitions alternate one at a time / overlapped / overlapped / one at a time after a
warm-up partition, between two 1-photo partitions, side by side in one run; each must
ingest every photo. Reported: the step's own time in its run (``bench_scaleout.
step_seconds``) per photo past its fixed cost (``(step(N) - step(1)) / (N - 1)``, the two
1-photo steps averaged) and all-in, and the ratios overlapped / one at a time.

moto on this 2-core machine spends a few ms of CPU per request itself, so with no added
latency the two are close (CPU-bound: nothing to overlap); the ratio is the figure for a
store whose round trips are slow, which is every remote one.

    python -m benchmarks.bench_ingest_latency --quick      # 32 photos per partition, 20 ms
    python -m benchmarks.bench_ingest_latency              # 64 photos, 0 and 20 ms
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "bench_ingest_latency.json"
BUCKET = "prx-ingest-latency"
ORDER = (("seq_a", 1), ("ovl_a", None), ("ovl_b", None), ("seq_b", 1))


def _photos(root: Path, per_partition: int, long_side: int) -> dict[str, Path]:
    """A one-photo warm-up folder and four folders of the same bundled photos, each at its
    own long side (8 px apart): distinct bytes (no blob is stored twice), the same pictures
    and nearly the same work; alt-text sidecars beside each."""
    from prx_assets.demo.photo_batch import write_photo_batch

    folders = {}
    parts = [("warm", 1, long_side + 8), ("one_a", 1, long_side + 16)]
    parts += [(name, per_partition, long_side - 8 * k) for k, (name, _) in enumerate(ORDER)]
    parts += [("one_b", 1, long_side + 24)]
    for part, count, side in parts:
        folder = root / part
        write_photo_batch(folder, count, side)
        (folder / "_SUCCESS").unlink()  # uploaded last, as a deployment's uploader does
        folders[part] = folder
    return folders


def run(latency_ms: float, per_partition: int, long_side: int) -> dict[str, Any]:
    from dagster import AssetKey, instance_for_test

    from benchmarks.bench_scaleout import S3, step_seconds
    from prx_assets.core.ingest.runner import IO_THREADS_ENV
    from prx_assets.core.lab import Lab
    from prx_assets.definitions import build_defs
    from prx_assets.defs.partitions import BATCHES
    from prx_assets_tests.forkservers import _stop_forkserver

    tmp = Path(tempfile.mkdtemp(prefix="bil-"))
    s3 = S3(latency_ms)
    try:
        with mock.patch.dict(os.environ):  # every variable set below is undone after
            folders = _photos(tmp / "photos", per_partition, long_side)
            client = s3.client()
            client.create_bucket(Bucket=BUCKET)
            for part, folder in folders.items():
                for f in sorted(folder.iterdir()):
                    client.put_object(
                        Bucket=BUCKET, Key=f"landing/photos/{part}/{f.name}", Body=f.read_bytes()
                    )
                client.put_object(Bucket=BUCKET, Key=f"landing/photos/{part}/_SUCCESS", Body=b"")
            os.environ.update(s3.env)
            os.environ.pop("PRX_EXECUTOR", None)  # the process pool on this machine's cores
            os.environ["PRX_LANDING_URI"] = f"s3://{BUCKET}/landing"
            os.environ["PRX_LAB_URI"] = f"s3://{BUCKET}/lab"
            os.environ["PRX_SHARDS_URI"] = f"s3://{BUCKET}/shards"
            # The pool's workers fork from one forkserver per process, which keeps the
            # environment of its first start: started again, they reach this run's server.
            _stop_forkserver()
            runs: dict[str, dict[str, Any]] = {}
            with instance_for_test() as instance:
                keys = [f"photos.{p}" for p in folders]
                instance.add_dynamic_partitions(BATCHES.name, keys)
                job = build_defs(str(tmp / "data")).resolve_job_def("batch_pipeline")
                for part, threads in (("warm", None), ("one_a", None), *ORDER, ("one_b", None)):
                    if threads is None:
                        os.environ.pop(IO_THREADS_ENV, None)
                    else:
                        os.environ[IO_THREADS_ENV] = str(threads)
                    t0 = time.perf_counter()
                    result = job.execute_in_process(
                        partition_key=f"photos.{part}",
                        instance=instance,
                        asset_selection=[AssetKey("raw_images")],
                    )
                    wall = time.perf_counter() - t0
                    if not result.success:
                        raise RuntimeError(f"raw_images failed on photos.{part}")
                    runs[part] = {
                        "io_threads": threads or 8,
                        "run_wall_s": wall,
                        "step_s": step_seconds(instance, result.run_id, "raw_images"),
                    }
                lab = Lab(f"s3://{BUCKET}/lab")
                for part, _ in ORDER:
                    rows = lab.count("images", f"batch = 'photos.{part}'")
                    if rows != per_partition:
                        raise RuntimeError(
                            f"photos.{part}: {rows} images rows, expected {per_partition}"
                        )
                    runs[part]["images_rows"] = rows
    finally:
        _stop_forkserver()
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    one = statistics.mean(runs[p]["step_s"] for p in ("one_a", "one_b"))
    seq = statistics.mean(runs[p]["step_s"] for p in ("seq_a", "seq_b"))
    ovl = statistics.mean(runs[p]["step_s"] for p in ("ovl_a", "ovl_b"))
    return {
        "latency_ms": latency_ms,
        "photos_per_partition": per_partition,
        "runs": runs,
        "one_photo_step_s": one,
        "one_at_a_time_s_per_photo": seq / per_partition,
        "overlapped_s_per_photo": ovl / per_partition,
        "ratio": ovl / seq,
        # Per photo past the step's fixed cost (the 1-photo steps bracketing the others).
        "one_at_a_time_marginal_s": (seq - one) / (per_partition - 1),
        "overlapped_marginal_s": (ovl - one) / (per_partition - 1),
        "marginal_ratio": (ovl - one) / (seq - one),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 photos per partition, 20 ms")
    parser.add_argument("--photos", type=int, default=None, help="per partition (max 120)")
    parser.add_argument("--latency-ms", type=float, action="append", default=None)
    parser.add_argument("--long-side", type=int, default=1600)
    args = parser.parse_args()
    os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
    per = args.photos or (32 if args.quick else 64)
    if not 2 <= per <= 120:
        parser.error("--photos must be 2..120 (the bundled photos give 120 distinct copies)")
    latencies = args.latency_ms or ([20.0] if args.quick else [0.0, 20.0])
    started = time.perf_counter()
    results = [run(lat, per, args.long_side) for lat in latencies]
    headlines = []
    for r in results:
        headlines += [
            f"ingest on object storage, {r['latency_ms']:.0f} ms per round trip, per photo "
            f"past the step's fixed cost: {1000 * r['overlapped_marginal_s']:.1f} ms "
            f"overlapped vs {1000 * r['one_at_a_time_marginal_s']:.1f} ms one at a time "
            f"(ratio {r['marginal_ratio']:.2f}; two workers, {r['photos_per_partition']} "
            "photos per partition)",
            f"  all-in per photo {1000 * r['overlapped_s_per_photo']:.1f} vs "
            f"{1000 * r['one_at_a_time_s_per_photo']:.1f} ms (ratio {r['ratio']:.2f}); "
            f"the step's fixed cost (a 1-photo step) {r['one_photo_step_s']:.2f} s",
        ]
    out = {
        "benchmark": "bench_ingest_latency",
        "command": "python -m benchmarks.bench_ingest_latency"
        + (" --quick" if args.quick else "")
        + (f" --photos {per}" if args.photos else "")
        + "".join(f" --latency-ms {lat:g}" for lat in (args.latency_ms or [])),
        "results": results,
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
        "elapsed_s": round(time.perf_counter() - started, 1),
        "headlines": headlines,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print("\n".join(headlines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
