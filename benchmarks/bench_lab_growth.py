"""Lab cost as batches accumulate: every operation a stage, sensor or the browser performs,
at N = 100, 1,000, 3,000, 10,000 partitions, through the real write path.

Each table shape (a registered ``TableSpec``) is grown one ``Lab.replace_partition`` per
partition (``--rows`` rows each, synthetic values of the spec's schema) with the default
write-path maintenance. At each checkpoint N it prints, per operation, the median time and
its ratio to N = 100: a new batch's ``replace_partition``, a rerun's ``replace_partition``
of an old batch, ``read_batch``, a key look-up (each BTREE column of the spec), ``count``
of a batch. The N = 100 figure is measured again at every checkpoint, side by side: a copy
of the table as it was at N = 100 runs each operation in turn with the grown table, so the
ratio does not carry the machine's drift between checkpoints (minutes apart). Then
``_versions`` size, fragments, unindexed fragments, the growth time so far (wall and CPU),
a full ``Lab.maintain`` on a copy of the table (time and its peak RSS, in a child process)
and this process's peak RSS (the write path's own maintenance included). The build's
linearity is measured the same way: a second table is built to 1,000 partitions beside the
long build, one of its commits after every N/1,000 of the long build's, and the two
builds' times are compared (``build_side_by_side``). Then, with ~0.5 MB image rows, the
bytes one maintenance run rewrites, for ``images`` as stored before (inline bytes) and as
stored now (blob store).

    python -m benchmarks.bench_lab_growth [--quick] [--rows 10] [--tables images,skip_audit]

The shard tree's side of the same issue (directory writes against their siblings, loader
construction at 100 ... 10,000 directories against the plain ``StreamingDataset``, the
landing cursor) is ``benchmarks/bench_tree_growth.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa

from prx_assets.core.lab import MANUAL, Lab, TableSpec
from prx_assets.core.tables import BY_NAME, IMAGES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "bench_lab_growth.json"
CHECKPOINTS = (100, 1_000, 3_000, 10_000)
DEFAULT_TABLES = ("images", "shard_samples", "skip_audit")
REPEATS = 7


# The build every longer one is compared with ("linear: <= 12x the time to 1,000").
REFERENCE_BUILD = 1_000
# Reads take about a millisecond: more samples keep their median steady on a shared machine.
READ_REPEATS = 22
# The side-by-side writes, each on a batch of its own (a rerun of an old batch, a new batch):
# with 7 the median of one write moved by +-0.3x between runs on this machine. Both counts
# even: each table runs first in half the pairs (``_side_by_side_ms``).
WRITE_REPEATS = 22


def inline_per_image_bytes(photos: int = 8) -> dict[str, int]:
    """The inline binary columns of ``images`` at their real sizes, for ``blob_rewrites``:
    what ingest's ``check_candidate`` stores for ``bench_pipeline``'s 3-4 MP photos (the
    pHash thumbnail, the gallery preview; mean bytes)."""
    from benchmarks.bench_pipeline import make_images
    from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS
    from prx_assets.core.ingest.runner import check_candidate

    made = [check_candidate((d, DEFAULT_MAX_PIXELS))[1] for d in make_images(photos, False, 1)]
    return {
        column: round(statistics.fmean(len(m[i]) for m in made))
        for i, column in ((1, "phash_thumbnail"), (2, "preview"))
    }


def _value(field: pa.Field, batch: str, i: int, image_bytes: int, rng: random.Random):
    t = field.type
    name = field.name
    if name == "batch":
        return batch
    if pa.types.is_string(t):
        if name in ("key", "jpeg_sha256", "keeper_key"):
            return f"{rng.getrandbits(256):064x}"
        if name == "url":
            return f"https://example.org/{batch}/{i}.jpg"
        if name == "source":
            return f"src{i % 4}"
        return f"{name}-{batch}-{i}"
    if pa.types.is_large_binary(t) or pa.types.is_binary(t):
        return rng.randbytes(image_bytes)
    if pa.types.is_boolean(t):
        return bool(i % 2)
    if pa.types.is_integer(t):
        return i % 100
    if pa.types.is_floating(t):
        return rng.random()
    if pa.types.is_timestamp(t):
        return datetime(2026, 1, 1, tzinfo=UTC)
    if pa.types.is_fixed_size_list(t):
        return [rng.random() for _ in range(t.list_size)]
    if pa.types.is_list(t):
        return [f"r{i % 3}"]
    raise TypeError(f"no synthetic value for {name}: {t}")


def _low_cardinality(field: pa.Field, i: int):
    t = field.type
    if pa.types.is_list(t):
        return [f"r{i % 3}"]
    if pa.types.is_boolean(t):
        return bool(i % 2)
    if pa.types.is_integer(t):
        return i % 4
    return f"{field.name}-{i % 8}"


def make_rows(spec: TableSpec, batch: str, n: int, image_bytes: int, seed: int) -> pa.Table:
    rng = random.Random(seed)
    # BITMAP / LABEL_LIST columns are low-cardinality by design (a tier, a label, a policy
    # fingerprint): few distinct values, as the stages write them.
    low = {c for c, kind in spec.indexes if kind in ("BITMAP", "LABEL_LIST") and c != "batch"}
    rows = [
        {
            f.name: _low_cardinality(f, i)
            if f.name in low
            else _value(f, batch, i, image_bytes, rng)
            for f in spec.schema
        }
        for i in range(n)
    ]
    return pa.Table.from_pylist(rows, schema=spec.schema)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_MAINTAIN_CHILD = """
import json, resource, sys, time
from datetime import timedelta
from pathlib import Path

from prx_assets.core.lab import Lab
from prx_assets.core.lab.maintenance import cleanup_versions
from prx_assets.core.tables import BY_NAME

root, name = sys.argv[1], sys.argv[2]
lab = Lab(root)
t = time.perf_counter()
r = lab.maintain(BY_NAME[name], retention=timedelta(days=7))
s = time.perf_counter() - t
# VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's RSS at fork.
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")]
rss = int(hwm[0].split()[1]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
# What the same retention keeps once the build's versions are older than the minimum age
# (a benchmark build of minutes keeps them all; a real one spans days).
cleanup_versions(lab.uri(name), lab.policy.keep_versions, timedelta(0), timedelta(days=7))
aged = sum(f.stat().st_size for f in (Path(lab.uri(name)) / "_versions").iterdir()) / 1e6
print(json.dumps({"s": s, "rss_mb": rss, "fragments_after": r.get("fragments_after"), "aged_mb": aged}))
"""


def _maintain_copy(lab: Lab, spec: TableSpec) -> dict:
    """A full ``Lab.maintain`` on a copy of the table, in a child (its own peak RSS: the
    high-water mark of its memory map, which a fork does not carry over)."""
    with tempfile.TemporaryDirectory(dir=lab.root) as tmp:
        shutil.copytree(Path(lab.uri(spec.name)), Path(tmp) / f"{spec.name}.lance")
        code = _MAINTAIN_CHILD
        out = subprocess.run(
            [sys.executable, "-c", code, tmp, spec.name],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        return json.loads(out.stdout.strip().splitlines()[-1])


ORDERS = ("alternate", "grown-first", "reference-first")


def _side_by_side_ms(ops: dict, repeats: int, order: str = "alternate") -> dict[str, float]:
    """Median ms of each op, the ops run in turn within every repeat: the reference lab and
    the grown one see the same machine state, so drift on a shared machine cancels out of
    their ratio. The order flips every repeat, so neither table always runs first: with the
    grown table first in every pair, a table against its own copy at N = 100 read up to
    1.41x for writes (``--stop 100 --order grown-first``; the other orders keep one order
    throughout, to measure that)."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for repeat in range(repeats):
        flip = order == "reference-first" or (order == "alternate" and repeat % 2 == 1)
        names = list(ops)[::-1] if flip else list(ops)
        for name in names:
            fn = ops[name]
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _timed_ops(lab: Lab, spec: TableSpec, n: int, rows: int, image_bytes: int, tag: str) -> dict:
    """The operations a stage, sensor or the browser performs on ``lab`` (grown to ``n``
    partitions), as zero-argument callables: op name -> (callable, repeats)."""
    rng = random.Random(n)
    old = [f"b{i:05d}" for i in rng.sample(range(n), WRITE_REPEATS)]
    picks = {k: itertools.cycle(old) for k in ("rerun", "read", "count")}
    rerun_rows = {b: make_rows(spec, b, rows, image_bytes, seed=int(b[1:]) + 7) for b in old}
    # Rows made up front: the timed call is the write alone.
    fresh = iter(
        [
            (f"{tag}{j:05d}", make_rows(spec, f"{tag}{j:05d}", rows, image_bytes, seed=10_000 + j))
            for j in range(WRITE_REPEATS)
        ]
    )

    def new_batch() -> None:
        lab.replace_partition(spec, *next(fresh))

    ops: dict = {
        "new_batch_replace_side_ms": (new_batch, WRITE_REPEATS),
        "rerun_replace_ms": (
            lambda: lab.replace_partition(spec, (b := next(picks["rerun"])), rerun_rows[b]),
            WRITE_REPEATS,
        ),
        "read_batch_ms": (lambda: lab.read_batch(spec.name, next(picks["read"])), READ_REPEATS),
        "count_batch_ms": (
            lambda: lab.count(spec.name, f"batch = '{next(picks['count'])}'"),
            READ_REPEATS,
        ),
    }
    probe = lab.read_batch(spec.name, old[0])
    for column, kind in spec.indexes:
        if kind != "BTREE" or column not in probe.column_names:
            continue
        value = probe.column(column)[0].as_py()
        literal = f"'{value}'" if isinstance(value, str) else str(value)
        ops[f"lookup_{column}_ms"] = (
            lambda c=column, v=literal: lab.read(spec.name, ["batch", c], f"{c} = {v}"),
            READ_REPEATS,
        )
    return ops


def measure(
    lab: Lab,
    spec: TableSpec,
    n: int,
    rows: int,
    image_bytes: int,
    recent: list,
    reference: Lab | None,
    order: str = "alternate",
) -> dict:
    """Every operation at ``n``; with a ``reference`` lab (a fresh copy of the table as it
    was at N = 100), each op alternates with the same op there, and ``ratio_side_by_side``
    holds their ratios."""
    out: dict = {"new_batch_replace_ms": statistics.median(recent[-50:]) * 1e3}
    # The mean of the last 100 commits carries the write path's own maintenance.
    out["new_batch_replace_mean100_ms"] = statistics.fmean(recent[-100:]) * 1e3
    grown = _timed_ops(lab, spec, n, rows, image_bytes, tag=f"m{n}_")
    base = (
        _timed_ops(reference, spec, CHECKPOINTS[0], rows, image_bytes, tag=f"m{n}_")
        if reference is not None
        else {}
    )
    for name, (fn, repeats) in grown.items():
        pair = {"grown": fn}
        if name in base:
            pair["reference"] = base[name][0]
        ms = _side_by_side_ms(pair, repeats, order)
        out[name] = ms["grown"]
        if "reference" in ms:
            out.setdefault("reference_ms", {})[name] = ms["reference"]
            out.setdefault("ratio_side_by_side", {})[name[:-3]] = ms["grown"] / ms["reference"]
    ds = lab.dataset(spec.name)
    out["fragments"] = len(ds.get_fragments())
    out["unindexed_fragments"] = max(
        (ds.stats.index_stats(ix["name"])["num_unindexed_fragments"] for ix in ds.list_indices()),
        default=0,
    )
    segments: dict[str, int] = {}
    for ix in ds.list_indices():
        segments[ix["name"]] = segments.get(ix["name"], 0) + 1
    out["index_segments_max"] = max(segments.values(), default=0)
    out["versions"] = len(list((Path(lab.uri(spec.name)) / "_versions").iterdir()))
    out["versions_mb"] = _dir_bytes(Path(lab.uri(spec.name)) / "_versions") / 1e6
    out["table_mb"] = _dir_bytes(Path(lab.uri(spec.name))) / 1e6
    maintenance = _maintain_copy(lab, spec)
    out["maintain_s"] = maintenance["s"]
    out["maintain_peak_rss_mb"] = maintenance["rss_mb"]
    out["versions_mb_once_min_age_passed"] = maintenance["aged_mb"]
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def _reference_copy(snapshot: Path, policy: str) -> tuple[Lab, Path]:
    """A fresh lab from the N = 100 snapshot: the baseline each checkpoint runs beside."""
    root = Path(tempfile.mkdtemp(prefix="lab_growth_reference_"))
    shutil.copytree(snapshot, root, dirs_exist_ok=True)
    return Lab(root, policy=MANUAL if policy == "manual" else Lab(root).policy), root


def grow(
    spec: TableSpec, stop: int, rows: int, image_bytes: int, policy: str, order: str = "alternate"
) -> dict:
    results: dict = {}
    root = Path(tempfile.mkdtemp(prefix=f"lab_growth_{spec.name}_"))
    snapshot = Path(tempfile.mkdtemp(prefix=f"lab_growth_{spec.name}_at100_"))
    lab = Lab(root, policy=MANUAL if policy == "manual" else Lab(root).policy)
    recent: list[float] = []
    building = building_cpu = cleaning = 0.0
    # The build to REFERENCE_BUILD partitions, run beside the long one: one of its commits
    # after every ``every`` of the long build's, so both builds see the same machine over
    # the same minutes (a build to 10,000 takes minutes; the machine's speed moves by more
    # than the target's margin in that time).
    every = stop // REFERENCE_BUILD if stop > REFERENCE_BUILD else 0
    side_root = Path(tempfile.mkdtemp(prefix=f"lab_growth_{spec.name}_side_")) if every else None
    side_lab = Lab(side_root, policy=lab.policy) if side_root is not None else None
    side_n, side_wall, side_cpu, side_cleaning = 0, 0.0, 0.0, 0.0
    try:
        for i in range(stop):
            batch = f"b{i:05d}"
            data = make_rows(spec, batch, rows, image_bytes, seed=i)
            t, c = time.perf_counter(), time.process_time()
            done = lab.replace_partition(spec, batch, data)["maintenance"]
            dt = time.perf_counter() - t
            building += dt
            building_cpu += time.process_time() - c  # every thread of this process
            cleaning += done.get("cleanup_s", 0.0)  # the write path's version cleanups
            recent.append(dt)
            n = i + 1
            if side_lab is not None and n % every == 0 and side_n < REFERENCE_BUILD:
                b = f"b{side_n:05d}"
                rows_b = make_rows(spec, b, rows, image_bytes, seed=side_n)
                t, c = time.perf_counter(), time.process_time()
                side_done = side_lab.replace_partition(spec, b, rows_b)["maintenance"]
                side_wall += time.perf_counter() - t
                side_cpu += time.process_time() - c
                side_cleaning += side_done.get("cleanup_s", 0.0)
                side_n += 1
            if n == CHECKPOINTS[0]:
                shutil.copytree(root, snapshot, dirs_exist_ok=True)
            if n in CHECKPOINTS:
                reference, reference_root = _reference_copy(snapshot, policy)
                try:
                    m = measure(lab, spec, n, rows, image_bytes, recent, reference, order)
                finally:
                    shutil.rmtree(reference_root, ignore_errors=True)
                m["build_s"] = building
                m["build_cpu_s"] = building_cpu
                m["cleanup_s_in_build"] = round(cleaning, 3)
                results[n] = m
                base = results[CHECKPOINTS[0]]
                side = m["ratio_side_by_side"]
                ratios = "  ".join(f"{k} {m[k + '_ms']:.1f} ({r:.2f}x)" for k, r in side.items())
                print(
                    f"{spec.name:>14} N={n:>6}  vs N=100 side by side: {ratios}\n"
                    f"{'':>14}   build {building:.1f} s wall, {building_cpu:.1f} s CPU "
                    f"({building / base['build_s']:.1f}x / {building_cpu / base['build_cpu_s']:.1f}x"
                    f" of N=100, cleanups {cleaning:.1f} s)  fragments {m['fragments']} "
                    f"unindexed {m['unindexed_fragments']}  segments {m['index_segments_max']}  _versions {m['versions']} files "
                    f"{m['versions_mb']:.1f} MB ({m['versions_mb_once_min_age_passed']:.1f} MB once past "
                    f"the min age)  maintain {m['maintain_s']:.2f} s "
                    f"(peak {m['maintain_peak_rss_mb']:.0f} MB)  peak RSS {m['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
                recent.clear()
        if side_lab is not None:
            results["build_side_by_side"] = {
                "partitions": stop,
                "reference_partitions": side_n,
                "build_s": building,
                "build_cpu_s": building_cpu,
                "reference_build_s": side_wall,
                "reference_build_cpu_s": side_cpu,
                "cleanup_s": round(cleaning, 3),
                "reference_cleanup_s": round(side_cleaning, 3),
                "ratio": building / side_wall,
                "ratio_cpu": building_cpu / side_cpu,
            }
            print(
                f"{spec.name:>14} build to {stop} against the build to {side_n} run beside it: "
                f"{building:.1f} s / {side_wall:.1f} s = {building / side_wall:.1f}x wall, "
                f"{building_cpu / side_cpu:.1f}x CPU (cleanups {cleaning:.1f} s / "
                f"{side_cleaning:.1f} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(snapshot, ignore_errors=True)
        if side_root is not None:
            shutil.rmtree(side_root, ignore_errors=True)
    return results


def _files(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def blob_rewrites(partitions: int, rows: int, image_bytes: int) -> dict:
    """Bytes one maintenance run writes, as a share of the image bytes, with ~0.5 MB rows:
    ``images`` as stored before (inline) and now (blob store). The other columns are
    small synthetic values, but the inline binary ones have their real sizes
    (``inline_per_image_bytes``)."""
    inline_bytes = inline_per_image_bytes()
    out: dict = {"inline_per_image_bytes": inline_bytes}
    inline = replace(IMAGES, blobs=())
    for label, spec in (("inline", inline), ("blob_store", IMAGES)):
        root = Path(tempfile.mkdtemp(prefix=f"lab_blobs_{label}_"))
        try:
            lab = Lab(root, policy=MANUAL)
            rng = np.random.default_rng(0)
            total = 0
            for p in range(partitions):
                data = make_rows(spec, f"b{p:04d}", rows, 1, seed=p)
                images = [rng.bytes(image_bytes) for _ in range(rows)]
                total += sum(map(len, images))
                idx = data.schema.get_field_index("image")
                data = data.set_column(idx, "image", pa.array(images, pa.large_binary()))
                # The inline per-image columns at their real sizes: compaction rewrites them.
                for column, size in inline_bytes.items():
                    at = data.schema.get_field_index(column)
                    blob = pa.array([rng.bytes(size) for _ in range(rows)], pa.binary())
                    data = data.set_column(at, column, blob)
                lab.replace_partition(spec, f"b{p:04d}", data)
            before = _files(root)
            t = time.perf_counter()
            result = lab.maintain(spec, retention=timedelta(days=7))
            seconds = time.perf_counter() - t
            lab.add_columns(spec.name, [pa.field("bench_extra", pa.int32())])
            after = _files(root)
            written = sum(s for p, s in after.items() if before.get(p) != s)
            out[label] = {
                "image_bytes": total,
                "bytes_written": written,
                "share_of_image_bytes": written / total,
                "maintain_s": seconds,
                "fragments": [result["fragments_before"], result["fragments_after"]],
            }
            print(
                f"maintenance, {partitions} partitions x {rows} rows x {image_bytes / 1e6:.1f} MB, "
                f"{label}: wrote {written / 1e6:.1f} MB = {100 * written / total:.1f} % of "
                f"{total / 1e6:.0f} MB image bytes in {seconds:.2f} s "
                f"(fragments {result['fragments_before']} -> {result['fragments_after']})",
                flush=True,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="stop at N = 1,000")
    ap.add_argument("--rows", type=int, default=10, help="rows per partition")
    ap.add_argument("--tables", default=",".join(DEFAULT_TABLES), help="comma list or 'all'")
    ap.add_argument("--image-bytes", type=int, default=2_000, help="image size while growing")
    ap.add_argument("--stop", type=int, help="grow only to this N (a smoke run)")
    ap.add_argument("--policy", choices=("default", "manual"), default="default")
    ap.add_argument("--blob-partitions", type=int, default=24)
    ap.add_argument("--blob-rows", type=int, default=4)
    ap.add_argument(
        "--order", choices=ORDERS, default="alternate", help="which table runs first in a pair"
    )
    args = ap.parse_args()
    stop = args.stop or (1_000 if args.quick else CHECKPOINTS[-1])
    names = (
        [n for n, s in BY_NAME.items() if "batch" in s.identity]
        if args.tables == "all"
        else args.tables.split(",")
    )
    report: dict = {
        "command": " ".join(["python -m benchmarks.bench_lab_growth", *sys.argv[1:]]),
        "rows_per_partition": args.rows,
        "policy": args.policy,
        "order": args.order,
        "tables": {},
    }
    for name in names:
        report["tables"][name] = grow(
            BY_NAME[name], stop, args.rows, args.image_bytes, args.policy, args.order
        )
    report["blob_rewrites"] = blob_rewrites(args.blob_partitions, args.blob_rows, 500_000)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    # Only the full default run is the one the docs quote; the others keep their own file.
    stem = "bench_lab_growth" + (f"_stop{stop}" if args.stop else "_quick" if args.quick else "")
    stem += "" if args.order == "alternate" else "_" + args.order.replace("-", "_")
    target = RESULTS.with_name(stem + ".json")
    target.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {target.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
