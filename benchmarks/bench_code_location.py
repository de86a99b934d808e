"""What loading the code location costs a fresh process: every run and every step of
Dagster's multiprocess executor pays it before any work (issue 32's fan-out: one run per
partition; issue 31's fixed cost per step).

    python -m benchmarks.bench_code_location [--quick]

Side by side in this process, alternating, each a fresh interpreter timed from outside
(wall and CPU of the child, ``os.wait4``):

- ``ours``: ``import prx_assets.definitions`` and its ``defs`` (what a run worker loads);
- ``dagster``: ``import dagster`` alone, the floor no code location goes under;
- ``with dagster-k8s``: ``ours`` with ``dagster_k8s`` imported first, which the code location
  did at module level before stop 47 (the Kubernetes client, google-auth, cryptography).

Reports medians and the ratios to ``dagster``; writes
``benchmarks/results/bench_code_location.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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
    out = {
        "rounds": rounds,
        "medians": med,
        "ours_vs_dagster_cpu": round(med["ours"]["cpu_s"] / floor, 2),
        "with_k8s_vs_dagster_cpu": round(med["with dagster-k8s"]["cpu_s"] / floor, 2),
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


if __name__ == "__main__":
    main()
