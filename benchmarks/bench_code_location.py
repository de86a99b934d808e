"""What loading the code location costs a fresh process: every run and every step of
Dagster's multiprocess executor pays it before any work (issue 32's fan-out: one run per
partition; issue 31's fixed cost per step), and what a real run pays with each way of
starting its steps.

    python -m benchmarks.bench_code_location [--quick]

Side by side in this process, alternating, each a fresh interpreter timed from outside
(wall and CPU of the child, ``os.wait4``):

- ``ours``: ``import prx_assets.definitions`` and its ``defs`` (what a run worker loads);
- ``dagster``: ``import dagster`` alone, the floor no code location goes under;
- ``with dagster-k8s``: ``ours`` with ``dagster_k8s`` imported first, which the code location
  did at module level before stop 47 (the Kubernetes client, google-auth, cryptography).

Then a real ``batch_pipeline`` run of a 4-photo partition through Dagster's multiprocess
executor (``execute_job`` on the code location, a fresh sqlite instance, each run in a fresh
interpreter), its steps started as Dagster's default does (``PRX_STEP_START=spawn``: a new
interpreter per step) and as the code location now does (a fork of a server that loaded
it once per run), alternating; wall seconds per run, and that the two runs' shards have the
same bytes.

Then one-step runs on that partition (``skip_lists`` again, as an opt-out's rerun of one
partition is), each in a fresh interpreter as a run worker is, timed whole (loading the
code location included): its step in a process of its own (``PRX_ONE_STEP_IN_RUN=0``,
forked as above) against in the run's own process (the default), alternating.

Reports medians and ratios; writes ``benchmarks/results/bench_code_location.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "bench_code_location.json"
COMMANDS = {
    "ours": "import prx_assets.definitions as d; d.defs",
    "dagster": "import dagster",
    "with dagster-k8s": "import dagster_k8s, prx_assets.definitions as d; d.defs",
}


def run_once(code: str) -> tuple[float, float]:
    """(wall s, CPU s) of a fresh interpreter running ``code``."""
    env = {k: v for k, v in os.environ.items() if k != "PRX_EXECUTOR"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{code!r} failed: {proc.stderr.read().decode()[-2000:]}")
    proc.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime


RUN_SCRIPT = """
import os, sys, time
from pathlib import Path

def job():
    from prx_assets.definitions import defs
    return defs.resolve_job_def("batch_pipeline")

if __name__ == "__main__":
    from dagster import AssetKey, execute_job, instance_for_test, reconstructable
    from prx_assets.defs.partitions import BATCHES
    key, only = sys.argv[1], sys.argv[2:]  # only: ["skip_lists"] for a one-step run
    selection = [AssetKey(a) for a in only] or None
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, [key])
        t0 = time.perf_counter()
        result = execute_job(
            reconstructable(job), instance, tags={"dagster/partition": key},
            asset_selection=selection,
        )
        wall = time.perf_counter() - t0
        steps = sum(e.event_type_value == "STEP_SUCCESS" for e in result.all_events)
        print(f"RESULT {int(result.success)} {steps} {wall:.3f}")
"""


def run_pipeline(
    start: str, root: Path, key: str, only: tuple[str, ...] = (), one_step_in_run: str = "1"
) -> tuple[float, int, float]:
    """One run of ``batch_pipeline`` (or of the assets ``only``) for partition ``key`` under
    ``root``, in a fresh interpreter as a run worker is: (wall s of ``execute_job``, steps,
    wall s of the whole process: loading the code location included)."""
    script = root / "run_batch.py"
    script.write_text(RUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PRX_EXECUTOR"}
    env.update(
        PRX_STEP_START=start,
        PRX_ONE_STEP_IN_RUN=one_step_in_run,
        PRX_DATA_ROOT=str(root),
        PYTHONPATH=str(REPO),
    )
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(script), key, *only], env=env, capture_output=True, text=True, cwd=root
    )
    process_wall = time.perf_counter() - t0
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None or line.split()[1] != "1":
        raise RuntimeError(f"{start} run failed: {(out.stdout + out.stderr)[-3000:]}")
    _, _, steps, wall = line.split()
    return float(wall), int(steps), process_wall


def shard_digests(root: Path) -> list[str]:
    return sorted(
        hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / "shards").rglob("*.mds")
    )


def compare_runs(rounds: int) -> dict[str, Any]:
    """The same 4-photo partition run with each step start, alternating, fresh data each."""
    from prx_assets.demo.photo_batch import write_photo_batch

    walls: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    one_step: dict[str, list[float]] = {"own process": [], "in the run": []}
    steps: dict[str, int] = {}
    digests: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
        for r in range(rounds):
            for start in walls:
                root = Path(tmp) / f"{start}-{r}"
                write_photo_batch(root / "landing" / "photos" / "four", 4, 800)
                wall, steps[start], _ = run_pipeline(start, root, "photos.four")
                walls[start].append(wall)
                digests[start] = shard_digests(root)
                if start != "forkserver":
                    continue
                # skip_lists again, as an opt-out reruns one partition: a run of one step,
                # each in a fresh run worker, alternating which goes first.
                for flag in ("0", "1") if r % 2 == 0 else ("1", "0"):
                    _, _, process_wall = run_pipeline(
                        start, root, "photos.four", ("skip_lists",), flag
                    )
                    one_step["in the run" if flag == "1" else "own process"].append(process_wall)
    med = {k: statistics.median(v) for k, v in walls.items()}
    one_med = {k: statistics.median(v) for k, v in one_step.items()}
    return {
        "one_step_run_wall_s": {k: round(v, 2) for k, v in one_med.items()},
        "one_step_runs": one_step,
        "one_step_in_run_vs_own_process": round(one_med["in the run"] / one_med["own process"], 2),
        "run_wall_s": {k: round(v, 2) for k, v in med.items()},
        "runs": walls,
        "steps": steps,
        "forkserver_vs_spawn_wall": round(med["forkserver"] / med["spawn"], 2),
        "same_shard_bytes": digests["spawn"] == digests["forkserver"] and bool(digests["spawn"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    args = parser.parse_args()
    rounds = 3 if args.quick else 7
    for code in COMMANDS.values():  # warm-up: the file cache, .pyc files
        run_once(code)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, code in COMMANDS.items():
            runs[name].append(run_once(code))
    med = {
        name: {
            "wall_s": round(statistics.median(w for w, _ in v), 3),
            "cpu_s": round(statistics.median(c for _, c in v), 3),
        }
        for name, v in runs.items()
    }
    floor = med["dagster"]["cpu_s"]
    runs_compared = compare_runs(1 if args.quick else 3)
    out = {
        "rounds": rounds,
        "medians": med,
        "ours_vs_dagster_cpu": round(med["ours"]["cpu_s"] / floor, 2),
        "with_k8s_vs_dagster_cpu": round(med["with dagster-k8s"]["cpu_s"] / floor, 2),
        "batch_pipeline_4_photos": runs_compared,
        "command": "python -m benchmarks.bench_code_location" + (" --quick" if args.quick else ""),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    target = RESULTS if not args.quick else RESULTS.with_name("bench_code_location.quick.json")
    target.write_text(json.dumps(out, indent=2) + "\n")
    for name, m in med.items():
        print(f"{name:18} wall {m['wall_s']:.2f} s  CPU {m['cpu_s']:.2f} s")
    print(
        f"code location load: {med['ours']['cpu_s']:.2f} s CPU = {out['ours_vs_dagster_cpu']:.2f}x "
        f"import dagster ({floor:.2f} s); with dagster-k8s imported as before "
        f"{med['with dagster-k8s']['cpu_s']:.2f} s ({out['with_k8s_vs_dagster_cpu']:.2f}x) "
        "(no target: paid once per run and per multiprocess step)"
    )
    rw = runs_compared["run_wall_s"]
    print(
        f"batch_pipeline run of 4 photos ({runs_compared['steps']['forkserver']} steps, "
        f"multiprocess executor): {rw['forkserver']:.1f} s with steps forked from a server "
        f"that loaded the code location vs {rw['spawn']:.1f} s spawned "
        f"({runs_compared['forkserver_vs_spawn_wall']:.2f}x; same shard bytes: "
        f"{runs_compared['same_shard_bytes']}) (no target)"
    )
    ow = runs_compared["one_step_run_wall_s"]
    print(
        f"one-step run (skip_lists of that partition, a fresh run worker timed whole): "
        f"{ow['in the run']:.2f} s with its step in the run's process vs "
        f"{ow['own process']:.2f} s in a process of its own "
        f"({runs_compared['one_step_in_run_vs_own_process']:.2f}x) (no target)"
    )


if __name__ == "__main__":
    main()
