"""The fixed cost of one ``PRX_EXECUTOR=ray`` step on a warm cluster: Ray tasks vs actors.

Dagster's multiprocess executor runs every step in a new process, and a new process that
joins Ray is a new Ray *job*: Ray starts that job's task workers afresh (a process each,
then the stage's imports when the first item's function is unpickled). ``RayPool`` used to
run each item as a Ray task; it now sends items to long-lived, detached ``PrxWorker``
actors that an earlier step started and that stay warm across jobs
(``core/ray_pool.py``).

Both run here, side by side, against one real cluster started here (``LocalRayCluster``:
a head and one worker node on 127.0.0.1, one CPU each). A step is a fresh Python process
that joins the cluster and maps ingest's real per-image check (``_check_or_skip``, from
the stage's module: a worker that unpickles it imports what a step's worker imports) over
``--items`` copies of a bundled photo. Its fixed cost is the time from joining to the last
result, measured inside that process (the interpreter's start and imports, the same on both
paths, are left out and reported apart). The task steps run first (warm actors hold the
CPUs a task needs); the first step of each path is reported apart (the actors' first step
starts them). Also measured: a step
inside a process that has already joined (the in-process executor, ``ray_runs``' run
worker), and a step with no items.

    python -m benchmarks.bench_ray_step [--quick] [--steps 6] [--items 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "bench_ray_step.json"
TARGET_S = 0.5

# One step in a fresh process: join, map, leave. Prints the seconds from joining to the last
# result, and the seconds the process spent before (start and imports).
STEP = r"""
import json, logging, sys, time
started = time.perf_counter()
path, items, photo = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import ray
from prx_assets.core.ingest.runner import _check_or_skip
from prx_assets.core.workers import make_pool
from prx_assets.core.ray_pool import run_prx_item
data = open(photo, "rb").read()
work = [(data, 40_000_000, None)] * items
ready = time.perf_counter()
if path == "tasks":  # the previous RayPool: a Ray task per item, in this job's workers
    ray.init(namespace="prx_assets", logging_level=logging.WARNING, log_to_driver=False)
    task = ray.remote(num_cpus=1, max_retries=3)(run_prx_item)
    fn_ref = ray.put(_check_or_skip)
    out = ray.get([task.remote(fn_ref, w) for w in work])
else:  # RayPool now: the warm PrxWorker actors
    out = list(make_pool("ray").map_ordered(_check_or_skip, work))
assert all(o is not None and o[0] is not None for o in out), out
done = time.perf_counter()
print(json.dumps({"step_s": done - ready, "start_s": ready - started}))
"""


def fresh_step(path: str, items: int, photo: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", STEP, path, str(items), str(photo)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{path} step failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def joined_step(items: int) -> float:
    """A step in this process, which has joined already (the actors are warm)."""
    from prx_assets.core.workers import make_pool

    start = time.perf_counter()
    pool = make_pool("ray")
    assert list(pool.map_ordered(abs, (-i for i in range(items)))) == list(range(items))
    pool.close()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps per path")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--items", type=int, default=2, help="photos per step (2: one per CPU)")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    started = time.perf_counter()

    from prx_assets.core import ray_pool
    from prx_assets.core.ray_local import LocalRayCluster
    from prx_assets.demo.photo_batch import write_photo_batch

    with tempfile.TemporaryDirectory(prefix="bench-ray-step-") as tmp:
        names = write_photo_batch(Path(tmp) / "photo", 1)
        photo = Path(tmp) / "photo" / names[0]
        cluster = LocalRayCluster(
            Path(tmp) / "ray", worker_nodes=1, env={"PYTHONPATH": str(REPO)}, dashboard=False
        ).start()
        os.environ["RAY_ADDRESS"] = cluster.address
        runs: dict[str, list[dict[str, float]]] = {"tasks": [], "actors": []}
        try:
            # Tasks first: the actors hold a CPU each while they are warm, so a task (one
            # CPU) would wait for them to end. The first step of each is reported apart.
            for path in ("tasks", "actors"):
                runs[path] = [fresh_step(path, args.items, photo) for _ in range(steps + 1)]
            joined_step(args.items)  # this process joins (the actors are warm already)
            joined = [joined_step(args.items) for _ in range(steps)]
            empty = [joined_step(0) for _ in range(steps)]
        finally:
            ray_pool.disconnect()
            cluster.stop()

    def med(path: str, field: str = "step_s") -> float:
        return statistics.median(r[field] for r in runs[path][1:])

    result = {
        "benchmark": "bench_ray_step",
        "command": "python -m benchmarks.bench_ray_step"
        + (" --quick" if args.quick else f" --steps {steps}")
        + f" --items {args.items}",
        "items_per_step": args.items,
        "cluster": "LocalRayCluster: head + 1 worker node on 127.0.0.1, 1 CPU each",
        "fresh_process_step_s": {
            p: [round(r["step_s"], 3) for r in runs[p]] for p in ("tasks", "actors")
        },
        "fresh_process_start_s": {
            p: [round(r["start_s"], 3) for r in runs[p]] for p in ("tasks", "actors")
        },
        "tasks_median_s": round(med("tasks"), 3),
        "actors_median_s": round(med("actors"), 3),
        "actors_vs_tasks": round(med("actors") / med("tasks"), 3),
        "joined_process_step_s": [round(t, 3) for t in joined],
        "empty_step_ms": [round(t * 1000, 2) for t in empty],
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    result["headlines"] = [
        f"fresh-process ray step fixed cost (actors): {result['actors_median_s']:.2f} s "
        f"(target <= {TARGET_S} s) {'met' if med('actors') <= TARGET_S else 'MISSED'}; "
        f"Ray tasks, as before: {result['tasks_median_s']:.2f} s "
        f"(actors/tasks {result['actors_vs_tasks']:.2f}x)",
        f"ray step in a joined process: {statistics.median(joined):.2f} s "
        f"(target <= {TARGET_S} s) {'met' if statistics.median(joined) <= TARGET_S else 'MISSED'}"
        f"; an empty step {statistics.median(empty) * 1000:.1f} ms",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print("\n".join(result["headlines"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
