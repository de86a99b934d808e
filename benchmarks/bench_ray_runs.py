"""Per-step fixed cost of spreading partitions over a Ray cluster: which dagster-ray design.

Three ways to run a job's steps, side by side in one process against one warm cluster
(``LocalRayCluster``: a head and one worker node on 127.0.0.1, 2 CPUs each, the dashboard's
job server on 127.0.0.1), on a chain of ``--steps`` no-op ops (the work is nothing, so a
step's wall time is its fixed cost):

- ``ray_executor``: dagster-ray's executor, each step a Ray job (``dagster api
  execute_step`` in a fresh interpreter placed by Ray);
- ``ray_runs``: what ``PRX_EXECUTOR=ray_runs`` does: the run is one Ray job launched by
  dagster-ray's ``RayRunLauncher`` and its steps run inside it (``ray_run_executor``); the
  run's one-off launch cost (a Ray job, an interpreter importing Dagster and the job) is
  reported apart from the per-step cost;
- ``multiprocess`` (the baseline, today's default and ``PRX_EXECUTOR=ray``): each step in a
  new process on the Dagster host.

Per-step fixed cost = the run's step-phase wall time / steps. The machine this ran on is
stated with the figures (a shared 2-core host inflates every figure alike; compare ratios).

    python -m benchmarks.bench_ray_runs [--quick] [--steps 6] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dagster import (
    DagsterInstance,
    In,
    Nothing,
    execute_job,
    job,
    multiprocess_executor,
    op,
    reconstructable,
)
from dagster_ray import ray_executor

from prx_assets.defs.executors import ray_run_executor

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 0.5
STEPS = 6  # the chain's length (module level: the jobs must be importable by a Ray job)
ADDRESS_ENV = "PRX_BENCH_RAY_JOBS_ADDRESS"


@op
def first() -> None:
    """The chain's head."""


@op(ins={"after": In(Nothing)})
def step() -> None:
    """One no-op step after the previous one."""


def _chain() -> None:
    previous = first()
    for i in range(STEPS - 1):
        previous = step.alias(f"step_{i}")(previous)


@job(
    executor_def=ray_executor.configured(
        # each step's Ray job resolves this config again: it gets the address too
        {"ray": {"address": {"env": ADDRESS_ENV}, "env_vars": [ADDRESS_ENV]}}
    )
)
def chain_ray_executor() -> None:
    _chain()


@job(executor_def=ray_run_executor)
def chain_ray_runs() -> None:
    _chain()


@job(executor_def=multiprocess_executor.configured({"max_concurrent": 2}))
def chain_multiprocess() -> None:
    _chain()


def _steps_wall(instance: DagsterInstance, run_id: str) -> float:
    """Seconds from the first STEP_START to the last STEP_SUCCESS of a run."""
    starts, ends = [], []
    for record in instance.all_logs(run_id):
        event = record.dagster_event
        if event is None:
            continue
        if event.event_type_value == "STEP_START":
            starts.append(record.timestamp)
        elif event.event_type_value == "STEP_SUCCESS":
            ends.append(record.timestamp)
    assert len(ends) == STEPS, (run_id, len(ends))
    return max(ends) - min(starts)


def _run_local(instance: DagsterInstance, the_job) -> tuple[float, float]:  # noqa: ANN001
    """(run wall, step-phase wall) of one run executed from this process."""
    t0 = time.perf_counter()
    with execute_job(reconstructable(the_job), instance=instance) as result:
        assert result.success
        run_id = result.run_id
    return time.perf_counter() - t0, _steps_wall(instance, run_id)


def _run_launched(instance: DagsterInstance) -> tuple[float, float]:
    """(launch-to-success wall, step-phase wall) of one run launched by RayRunLauncher."""
    recon = reconstructable(chain_ray_runs)
    run = instance.create_run_for_job(
        job_def=chain_ray_runs, job_code_origin=recon.get_python_origin()
    )
    t0 = time.perf_counter()
    instance.launch_run(run.run_id, workspace=None)  # type: ignore[arg-type]
    while True:
        status = instance.get_run_by_id(run.run_id).status.value
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    assert status == "SUCCESS", status
    return wall, _steps_wall(instance, run.run_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run of each (<= 3 min)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each way")
    args = parser.parse_args(argv)
    repeat = 1 if args.quick else args.repeat

    from prx_assets.core.ray_local import LocalRayCluster

    work = Path(tempfile.mkdtemp(prefix="prx-bench-rr-"))
    env = {
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "DAGSTER_DISABLE_TELEMETRY": "1",
    }
    cluster = LocalRayCluster(work / "ray", cpus_per_node=2, env=env)
    t0 = time.perf_counter()
    cluster.start()
    print(f"cluster up in {time.perf_counter() - t0:.1f} s (head + 1 worker node, 2 CPUs each)")
    home = work / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\n"
        "run_launcher:\n  module: dagster_ray\n  class: RayRunLauncher\n"
        f"  config:\n    ray:\n      address: {cluster.dashboard_url}\n      num_cpus: 1\n"
        "      env_vars: [DAGSTER_DISABLE_TELEMETRY]\n"
    )
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ[ADDRESS_ENV] = str(cluster.dashboard_url)
    results: dict[str, list[float]] = {"ray_executor": [], "ray_runs": [], "multiprocess": []}
    launch: list[float] = []
    try:
        with DagsterInstance.get() as instance:
            # Warm: the first Ray job starts the job server's workers; not counted.
            _run_launched(instance)
            for _ in range(repeat):
                _, steps = _run_local(instance, chain_ray_executor)
                results["ray_executor"].append(steps / STEPS)
                wall, steps = _run_launched(instance)
                results["ray_runs"].append(steps / STEPS)
                launch.append(wall - steps)
                _, steps = _run_local(instance, chain_multiprocess)
                results["multiprocess"].append(steps / STEPS)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    per_step = {k: statistics.median(v) for k, v in results.items()}
    base = per_step["multiprocess"]
    summary = {
        "command": "python -m benchmarks.bench_ray_runs" + (" --quick" if args.quick else ""),
        "host": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "steps_per_run": STEPS,
        "repeat": repeat,
        "per_step_s": per_step,
        "ray_runs_launch_per_run_s": statistics.median(launch),
    }
    print(json.dumps(summary, indent=2))
    out = REPO / "benchmarks" / "results" / f"bench_ray_runs{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    for name, value in per_step.items():
        print(f"{name}: {value:.3f} s fixed cost per step ({value / base:.2f}x multiprocess)")
    print(f"ray_runs launch per run (Ray job + interpreter): {statistics.median(launch):.2f} s")
    print(f"ray_runs per-step fixed cost: {per_step['ray_runs']:.3f} s (target <= {TARGET_S} s)")
    return 0 if per_step["ray_runs"] <= TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
