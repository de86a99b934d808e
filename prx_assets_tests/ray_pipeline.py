"""One batch through every stage (the ``batch_pipeline`` job, in process), for the Ray tests:
run by the test process itself and by a fresh interpreter (``python -m``) for the default
path, which then reports whether anything imported Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def materialize_batch(data_root: str | Path, key: str) -> bool:
    """Every per-batch asset of ``key`` under ``data_root``; True when the run succeeded."""
    from dagster import instance_for_test

    from prx_assets.definitions import build_defs
    from prx_assets.defs.partitions import BATCHES

    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, [key])
        job = build_defs(str(data_root)).resolve_job_def("batch_pipeline")
        return job.execute_in_process(partition_key=key, instance=instance).success


def late_square(x: int) -> int:
    """``x * x``, finishing later the smaller ``x`` is: completion order is not input order."""
    import time

    time.sleep(0.02 * (10 - x % 10))
    return x * x


def refuse_seven(x: int) -> int:
    """``x``, except for 7: a deterministic failure of the work itself."""
    if x == 7:
        raise ValueError("seven is refused")
    return x


if __name__ == "__main__":
    ok = materialize_batch(sys.argv[1], sys.argv[2])
    ray_modules = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
    print(json.dumps({"success": ok, "ray_modules": ray_modules[:20]}))
