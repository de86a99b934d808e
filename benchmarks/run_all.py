"""Run every benchmark in turn (each prints its own table and writes results/*.json)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))
    extra = sys.argv[1:]
    failed = []
    for name in names:
        print(f"\n=== benchmarks.{name} {' '.join(extra)}", flush=True)
        code = subprocess.call([sys.executable, "-m", f"benchmarks.{name}", *extra])
        if code:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
