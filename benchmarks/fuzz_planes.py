"""A long fuzz run of the JPEG planes extension under AddressSanitizer and UBSan.

The test suite runs 4,000 cases (``prx_assets_tests/core/test_planes_fuzz.py``); this runs
as many as asked, split over ``--jobs`` sanitized children, with a fresh mutation seed per
run if wanted. Not a speed benchmark (``run_all`` skips it: its name is not ``bench_*``):
it exits 1 on any sanitizer report, crash, unexpected exception or broken expectation, and
prints the case that did it. ``make fuzz`` runs ``--cases 50000 --jobs 2``.

    python -m benchmarks.fuzz_planes --cases N [--seed S] [--jobs J]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from prx_assets_tests.core import planes_fuzz


def main(argv: list[str] | None = None) -> int:
    """Build the sanitized extension, run the cases, print the outcomes; 1 on any finding."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=1, help="mutation seed (the suite uses 0)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="planes-asan-") as tmp:
        try:
            planes_fuzz.check_sanitizers_catch(Path(tmp))
            module = planes_fuzz.build_sanitized(Path(tmp))
        except planes_fuzz.SanitizerUnavailable as exc:
            print(f"cannot fuzz here: {exc}", file=sys.stderr)
            return 1
        t0 = time.monotonic()
        runs = planes_fuzz.run_fuzz(module, a.cases, seed=a.seed, jobs=a.jobs)
        seconds = time.monotonic() - t0
    outcomes: Counter = Counter()
    messages: Counter = Counter()
    failed = False
    for run in runs:
        outcomes.update(run.summary.get("outcomes", {}))
        messages.update(run.summary.get("messages", {}))
        if run.returncode != 0 or run.sanitizer_reports or run.summary.get("violation_count"):
            failed = True
            print(run.explain(), file=sys.stderr)
    done = sum(r.summary.get("cases", 0) for r in runs)
    print(json.dumps({
        "cases": a.cases, "completed": done, "seed": a.seed, "jobs": a.jobs,
        "seconds": round(seconds, 1), "outcomes": dict(sorted(outcomes.items())),
        "messages": dict(messages.most_common(15)), "findings": failed,
    }, indent=1))  # fmt: skip
    print("FAILED: see above" if failed else f"clean: {done} cases, no sanitizer report")
    return 1 if failed or done != a.cases else 0


if __name__ == "__main__":
    raise SystemExit(main())
