"""The fixed cost of one ``PRX_EXECUTOR=ray`` step on a warm cluster: old path vs new.

A step's pool used to join the cluster (``ray.init``: a new Ray job, so fresh worker
processes), probe every alive node's code (a task pinned to each, which starts a worker
there; 120 s timeout) and leave (``ray.shutdown``), whether the step had 0 items or 1000.
Now the process joins once and keeps the connection, a node is probed once (its answer is
kept in the cluster's key-value store), and a step with no items joins nothing.

Both paths run here, side by side in one process, against one real cluster started here
(``LocalRayCluster``: a head and one worker node on 127.0.0.1, one CPU each): each step
maps a trivial function over ``--items`` items (default 1; 0 measures an empty step) and
the step's wall time is the fixed cost (the work itself is microseconds). The old path is
reproduced from the previous ``RayPool`` (init, node probe, map, shutdown). The first new
step (joining, probing the nodes once) is reported apart; the median of the rest is the
per-step fixed cost.

    python -m benchmarks.bench_ray_step [--quick] [--steps 6] [--items 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 0.5


def old_step(address: str, items: int) -> None:
    """The previous RayPool's life in one step: join, probe every node, map, leave."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from prx_assets.core.ray_pool import code_fingerprint, probe_node, run_prx_item

    ray.init(address=address, namespace="prx_assets", logging_level=logging.WARNING,
             log_to_driver=False)  # fmt: skip
    try:
        int(ray.cluster_resources().get("CPU", 0))
        probe = ray.remote(num_cpus=0)(probe_node)
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        refs = [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)
            ).remote()
            for n in nodes
        ]
        ours = code_fingerprint()
        assert all(fp == ours for _, fp in ray.get(refs, timeout=120))
        task = ray.remote(num_cpus=1)(run_prx_item)
        fn_ref = ray.put(abs)
        assert ray.get([task.remote(fn_ref, -i) for i in range(items)]) == list(range(items))
    finally:
        ray.shutdown()


def new_step(items: int) -> None:
    """A step's pool as the stages make it now (``make_pool("ray")``)."""
    from prx_assets.core.workers import make_pool

    pool = make_pool("ray")
    try:
        assert list(pool.map_ordered(abs, (-i for i in range(items)))) == list(range(items))
    finally:
        pool.close()


def timed(step, *args) -> float:
    start = time.perf_counter()
    step(*args)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps per path")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--items", type=int, default=1)
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps

    import os

    from prx_assets.core import ray_pool
    from prx_assets.core.ray_local import LocalRayCluster

    with tempfile.TemporaryDirectory(prefix="bench-ray-step-") as tmp:
        cluster = LocalRayCluster(
            Path(tmp) / "ray", worker_nodes=1, env={"PYTHONPATH": str(REPO)}, dashboard=False
        ).start()
        os.environ["RAY_ADDRESS"] = cluster.address
        try:
            old = [timed(old_step, cluster.address, args.items) for _ in range(steps)]
            first = timed(new_step, args.items)
            new = [timed(new_step, args.items) for _ in range(steps)]
            empty = [timed(new_step, 0) for _ in range(steps)]
        finally:
            ray_pool.disconnect()
            cluster.stop()
    result = {
        "benchmark": "bench_ray_step",
        "command": "python -m benchmarks.bench_ray_step"
        + (" --quick" if args.quick else f" --steps {steps}")
        + f" --items {args.items}",
        "items_per_step": args.items,
        "old_step_s": [round(t, 3) for t in old],
        "new_first_step_s": round(first, 3),
        "new_step_s": [round(t, 3) for t in new],
        "new_empty_step_s": [round(t, 4) for t in empty],
        "old_median_s": round(statistics.median(old), 3),
        "new_median_s": round(statistics.median(new), 3),
    }
    print(json.dumps(result, indent=1))
    print(
        f"ray step fixed cost: {result['new_median_s']:.2f} s (target <= {TARGET_S} s); "
        f"old path {result['old_median_s']:.2f} s; an empty step "
        f"{statistics.median(empty) * 1000:.1f} ms"
    )
    return 0 if result["new_median_s"] <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
