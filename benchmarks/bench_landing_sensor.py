"""The landing sensor's tick at 10,000 and 100,000 landed batches: idle, and with one new.

What runs: the real ``landing_sensor`` (``build_sensor_context`` on a real sqlite Dagster
instance holding every batch as a dynamic partition) over a real local landing zone of
archives, manifests and folder batches in 4 sources, its cursor carried from tick to tick
as the daemon does. The baseline, in the same process on the same tree: the previous tick's
algorithm (``discover_batches`` over the whole landing zone, the cursor's keys decoded, the
instance's partitions read), which every tick paid whether anything landed or not.

    python -m benchmarks.bench_landing_sensor [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "bench_landing_sensor.json"
SOURCES = ("laion", "coyo", "studio", "partners")
TARGET_S = 0.3


def build_landing(root: Path, n: int) -> list[str]:
    """``n`` complete batches over 4 sources (3 in 4 archives or manifests, 1 in 4 folders);
    returns their keys. Each source numbers its own chunks (consecutive numbers: the cursor
    keeps them as ranges). Every directory is aged, as a landing zone at rest is."""
    from prx_assets.core.ingest.sources import READY_MARKER, discover_batches

    for i in range(n):  # each source numbers its own chunks, as producers do
        src = root / SOURCES[i % len(SOURCES)]
        src.mkdir(exist_ok=True)
        number = i // len(SOURCES)
        kind = number % 4
        if kind == 3:
            d = src / f"{number:07d}"
            d.mkdir()
            (d / READY_MARKER).touch()
        else:
            (src / f"{number:07d}{('.tar', '.csv', '.parquet')[kind]}").touch()
    old = time.time_ns() - 3_600 * 10**9
    for src in root.iterdir():
        os.utime(src, ns=(old, old))
    return [r.key for r in discover_batches(root)]


def old_tick(landing: Path, cursor: str, instance: Any) -> int:
    """What a tick cost before the watch: every entry stat-ed, keys decoded, partitions read."""
    from prx_assets.core.ingest.cursor import decode_keys, split_cursor
    from prx_assets.core.ingest.sources import discover_batches
    from prx_assets.defs.partitions import BATCHES

    registered = decode_keys(split_cursor(cursor)[0])
    refs = discover_batches(landing)
    existing = set(instance.get_dynamic_partitions(BATCHES.name))
    return len([r for r in refs if r.key not in registered and r.key not in existing])


def measure(n: int, repeats: int, tmp: Path) -> dict[str, Any]:
    from dagster import DagsterInstance, build_sensor_context

    from prx_assets.defs.ingest.sensors import landing_sensor
    from prx_assets.defs.partitions import BATCHES
    from prx_assets.defs.resources import LabResource

    root = tmp / f"n{n}"
    landing = root / "landing"
    landing.mkdir(parents=True)
    t = time.perf_counter()
    keys = build_landing(landing, n)
    built_s = time.perf_counter() - t
    lab = LabResource(data_root=str(root), landing_dir=str(landing))
    (root / "home").mkdir()
    with DagsterInstance.local_temp(str(root / "home")) as instance:
        for i in range(0, len(keys), 5000):
            instance.add_dynamic_partitions(BATCHES.name, keys[i : i + 5000])

        def tick(cursor: str | None) -> tuple[float, Any]:
            with build_sensor_context(
                instance=instance, cursor=cursor, resources={"lab": lab}
            ) as ctx:
                t = time.perf_counter()
                result = landing_sensor(ctx)
                return time.perf_counter() - t, result

        first_s, first = tick(None)  # registers nothing new (all are partitions already)
        cursor = first.cursor
        from prx_assets.core.ingest.cursor import encode_cursor, encode_keys, split_cursor

        keys_text = encode_keys(keys)  # as if this sensor had registered them all
        cursor = encode_cursor(keys_text, split_cursor(cursor)[1] or {})
        _, settled = tick(cursor)  # the first tick with the keys: lists once, settles
        cursor = settled.cursor
        idle, old, arrival = [], [], []
        for r in range(repeats):
            s, res = tick(cursor)
            idle.append(s)
            assert res.skip_reason is not None and not res.run_requests
            cursor = res.cursor
            t = time.perf_counter()
            assert old_tick(landing, cursor, instance) == 0
            old.append(time.perf_counter() - t)
            (landing / "laion" / f"new-{r:03d}.tar").touch()  # one batch lands
            s, res = tick(cursor)
            arrival.append(s)
            assert [q.partition_key for q in res.run_requests] == [f"laion.new-{r:03d}"]
            instance.add_dynamic_partitions(BATCHES.name, [f"laion.new-{r:03d}"])
            cursor = res.cursor
            old_mtime = time.time_ns() - 3_600 * 10**9  # at rest again before the next idle
            os.utime(landing / "laion", ns=(old_mtime, old_mtime))
            _, res = tick(cursor)
            cursor = res.cursor
    med = statistics.median
    return {
        "batches": n,
        "build_s": round(built_s, 1),
        "first_tick_s": round(first_s, 3),
        "idle_tick_s": round(med(idle), 4),
        "one_new_tick_s": round(med(arrival), 4),
        "previous_tick_s": round(med(old), 4),
        "ratio_idle_vs_previous": round(med(idle) / med(old), 4),
        "cursor_chars": len(cursor),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
    repeats = 3 if args.quick else 7
    out: dict[str, Any] = {"quick": args.quick, "cpus": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as d:
        for n in (10_000, 100_000):
            out[str(n)] = measure(n, repeats, Path(d))
            print(json.dumps(out[str(n)]), flush=True)
    lines = []
    for n in ("10000", "100000"):
        r = out[n]
        lines.append(
            f"landing sensor tick at {int(n):,} batches: idle {r['idle_tick_s']:.3f} s, one new "
            f"batch {r['one_new_tick_s']:.3f} s (target <= {TARGET_S} s); the previous full "
            f"scan {r['previous_tick_s']:.3f} s (ratio {r['ratio_idle_vs_previous']:.3f})"
        )
    out["summary"] = lines
    out["command"] = "python -m benchmarks.bench_landing_sensor" + (
        " --quick" if args.quick else ""
    )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
