"""What partitions spread over a cluster share: commits to one lab table.

With ``PRX_EXECUTOR=ray_runs`` each partition's steps run in a run of their own, on any
node, and no process carries another partition's images (``bench_scaleout`` measures one
partition's step). What every partition still shares is the lab: each ends each stage with
one commit to that stage's table (``Lab.replace_partition``: Lance's optimistic commit, a
concurrent commit of another partition rebased or retried) and the write path's
maintenance after it. This measures that shared cost on a real lab, a local directory and
``s3://`` on moto (127.0.0.1):

- one writer committing partitions of ``--rows`` rows one after another (wall and CPU per
  commit, maintenance included);
- ``--writers`` processes committing their own partitions at once: commits per second, the
  retries Lance's conflicts cost, failures (must be 0), and the table's rows checked after.

It then derives how many 16-core nodes of per-image work the concurrent commit rate keeps
fed, at partitions of 10^4 and 10^5 images, from the per-image work of ``bench_scaleout``'s
results file (said as such). On this 2-core host the writers share two cores, so the
concurrent rate is a floor: on a cluster each writer is a node of its own.

    python -m benchmarks.bench_partition_commits [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NODE_CORES = 16
TARGET_NODES = 100
PARTITION_IMAGES = (10_000, 100_000)
BUCKET = "prx-commits"


def rows_for(batch: str, n: int) -> pa.Table:
    from prx_assets.core.dedup.tables import IMAGE_HASHES

    keys = [f"{batch}/{i:07d}" for i in range(n)]
    return pa.table(
        {
            "key": keys,
            "batch": [batch] * n,
            "phash": [hash(k) & 0x7FFF_FFFF_FFFF_FFFF for k in keys],
            "phash_mode": ["fast"] * n,
            "phash_version": ["fast-v1"] * n,
            "ac_energy": [1.0] * n,
            "low_information": [False] * n,
            "pixels": [1024 * 1024] * n,
            "file_size": [200_000] * n,
        },
        schema=IMAGE_HASHES.schema,
    )


def commit_partitions(root: str, batches: list[str], rows: int, env: dict[str, str]) -> dict:
    """Commit each of ``batches`` (``rows`` rows) to ``image_hashes``; wall, CPU, retries."""
    os.environ.update(env)
    from prx_assets.core.dedup.tables import IMAGE_HASHES
    from prx_assets.core.lab import Lab

    lab = Lab(root)
    out: dict[str, Any] = {"walls": [], "cpus": [], "failures": [], "retries": 0}
    for batch in batches:
        data = rows_for(batch, rows)
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            result = lab.replace_partition(IMAGE_HASHES, batch, data)
            out["retries"] += int(result.get("attempts", 1)) - 1
        except Exception as exc:  # noqa: BLE001 - counted and shown: must be none
            out["failures"].append(f"{batch}: {type(exc).__name__}: {str(exc)[:300]}")
        out["walls"].append(time.perf_counter() - t0)
        out["cpus"].append(time.process_time() - c0)
    return out


def _worker(args: tuple) -> dict:
    return commit_partitions(*args)


def run_lab(root: str, env: dict[str, str], commits: int, writers: int, rows: int) -> dict:
    """Warm-up, one writer, then ``writers`` at once, on the lab at ``root``."""
    ctx = mp.get_context("spawn")  # a fresh interpreter per writer, as a node would have
    with ctx.Pool(1) as pool:
        pool.map(_worker, [(root, [f"warm.{i:03d}" for i in range(3)], rows, env)])
        t0 = time.perf_counter()
        one = pool.map(_worker, [(root, [f"one.{i:04d}" for i in range(commits)], rows, env)])[0]
        one_wall = time.perf_counter() - t0
    per_writer = max(1, commits // writers)
    jobs = [(root, [f"w{w}.{i:04d}" for i in range(per_writer)], rows, env) for w in range(writers)]
    with ctx.Pool(writers) as pool:
        pool.map(_worker, [(root, [f"warm{w}.000"], rows, env) for w in range(writers)])
        t0 = time.perf_counter()
        many = pool.map(_worker, jobs)
        many_wall = time.perf_counter() - t0
    os.environ.update(env)
    from prx_assets.core.dedup.tables import IMAGE_HASHES
    from prx_assets.core.lab import Lab

    lab = Lab(root)
    total = lab.dataset(IMAGE_HASHES.name).count_rows()
    expected_batches = 3 + commits + writers + writers * per_writer
    n = len(one["walls"])
    return {
        "one_writer": {
            "commits": n,
            "commits_per_s": n / one_wall,
            "wall_per_commit_s": sorted(one["walls"])[n // 2],
            "cpu_per_commit_s": sum(one["cpus"]) / n,
            "failures": one["failures"],
        },
        "concurrent": {
            "writers": writers,
            "commits": writers * per_writer,
            "commits_per_s": writers * per_writer / many_wall,
            "retries": sum(m["retries"] for m in many),
            "failures": [f for m in many for f in m["failures"]],
        },
        "rows_in_table": total,
        "rows_expected": expected_batches * rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="120 commits, 4 writers")
    parser.add_argument("--commits", type=int, default=None)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()
    commits = args.commits or (120 if args.quick else 400)
    scaleout = json.loads((RESULTS / "bench_scaleout.json").read_text())
    work = scaleout["work_cpu_per_image_s"]["raw_images"]
    per_node = NODE_CORES / work  # images/s one node's cores do of raw_images' work
    tmp = Path(tempfile.mkdtemp(prefix="prx-commits-"))
    labs: dict[str, Any] = {}
    s3 = None
    try:
        labs["local"] = run_lab(str(tmp / "lab"), {}, commits, args.writers, args.rows)
        if not args.no_s3:
            from benchmarks.bench_scaleout import S3

            s3 = S3()
            s3.client().create_bucket(Bucket=BUCKET)
            labs["s3_moto"] = run_lab(
                f"s3://{BUCKET}/lab", s3.env, commits // 2, args.writers, args.rows
            )
    finally:
        if s3 is not None:
            s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    lines = []
    for name, r in labs.items():
        one, many = r["one_writer"], r["concurrent"]
        ok = (
            not one["failures"]
            and not many["failures"]
            and r["rows_in_table"] == r["rows_expected"]
        )
        lines.append(
            f"one writer ({name}): {one['commits_per_s']:.1f} commits/s, "
            f"{1000 * one['wall_per_commit_s']:.0f} ms wall and "
            f"{1000 * one['cpu_per_commit_s']:.0f} ms CPU per commit of {args.rows} rows"
        )
        lines.append(
            f"{many['writers']} writers at once ({name}): {many['commits_per_s']:.1f} commits/s "
            f"= {many['commits_per_s'] / one['commits_per_s']:.2f}x one writer, "
            f"{many['retries']} retries, {len(many['failures'])} failures, rows exact: "
            f"{r['rows_in_table'] == r['rows_expected']} (target: 0 failures, exact) "
            f"{'met' if ok else 'MISSED'}"
        )
        for images in PARTITION_IMAGES:
            nodes = many["commits_per_s"] * images / per_node
            lines.append(
                f"nodes of {NODE_CORES} cores the {name} commit rate feeds at {images:,} images "
                f"per partition: {nodes:,.0f} (a floor: {many['writers']} writers on this "
                f"host's 2 cores) (target >= {TARGET_NODES}) "
                f"{'met' if nodes >= TARGET_NODES else 'MISSED'}"
            )
    result = {
        "benchmark": "bench_partition_commits",
        "command": "python -m benchmarks.bench_partition_commits" + " --quick" * args.quick,
        "rows_per_partition": args.rows,
        "raw_images_work_cpu_per_image_s": work,
        "work_from": "benchmarks/results/bench_scaleout.json (work_cpu_per_image_s.raw_images)",
        "labs": labs,
        "machine": f"{os.uname().machine}, {os.cpu_count()} cores",
        "headlines": lines,
    }
    name = "bench_partition_commits" + "_quick" * args.quick + ".json"
    (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
