"""What the lineage edge opt_out_lists -> skip_lists costs a skip_lists step.

``skip_lists`` depends on every ``opt_out_lists`` partition (``AllPartitionMapping``) so the
graph shows what feeds a decision. Dagster then looks up the data version of each upstream
partition when it records a materialisation's provenance, up to
``SKIP_PARTITION_DATA_VERSION_DEPENDENCY_THRESHOLD`` (100) partitions, and skips the
look-ups beyond. This measures that cost on a real sqlite instance: the same trivial
partitioned asset with and without the dependency, materialised side by side in this
process with N list partitions materialised upstream.

    python -m benchmarks.bench_lineage [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetMaterialization,
    DagsterInstance,
    DynamicPartitionsDefinition,
    asset,
    materialize,
)

RESULTS = Path(__file__).parent / "results" / "bench_lineage.json"
LISTS = DynamicPartitionsDefinition(name="lists")
BATCHES = DynamicPartitionsDefinition(name="batches")


@asset(partitions_def=LISTS)
def lists() -> None: ...


@asset(
    partitions_def=BATCHES,
    deps=[AssetDep("lists", partition_mapping=AllPartitionMapping())],
)
def with_lineage() -> None: ...


@asset(partitions_def=BATCHES)
def without_lineage() -> None: ...


def _step_seconds(instance: DagsterInstance, target, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.process_time()
        materialize([target, lists], selection=[target], instance=instance, partition_key="b0")
        out.append(time.process_time() - t)
    return out


def measure(lists_count: int, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as home:
        instance = DagsterInstance.local_temp(home)
        instance.add_dynamic_partitions("batches", ["b0"])
        keys = [f"list-{i}" for i in range(lists_count)]
        instance.add_dynamic_partitions("lists", keys)
        for key in keys:
            instance.report_runless_asset_event(AssetMaterialization("lists", partition=key))
        _step_seconds(instance, without_lineage, 1)  # warm-up
        plain, lineage = [], []
        for _ in range(repeat):  # interleaved: the host's drift hits both sides
            plain += _step_seconds(instance, without_lineage, 1)
            lineage += _step_seconds(instance, with_lineage, 1)
    a, b = statistics.median(plain), statistics.median(lineage)
    return {"lists": lists_count, "plain_cpu_s": a, "lineage_cpu_s": b, "ratio": b / a}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    args = parser.parse_args()
    repeat = 3 if args.quick else 7
    rows = [measure(n, repeat) for n in (0, 20, 99, 150)]
    for r in rows:
        extra = 1000 * (r["lineage_cpu_s"] - r["plain_cpu_s"])
        print(
            f"{r['lists']:4d} lists: step CPU {r['lineage_cpu_s']:.3f} s with the edge, "
            f"{r['plain_cpu_s']:.3f} s without ({r['ratio']:.2f}x, {extra:+.0f} ms)"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    command = "python -m benchmarks.bench_lineage" + (" --quick" if args.quick else "")
    RESULTS.write_text(json.dumps({"command": command, "repeat": repeat, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
