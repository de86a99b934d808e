"""Training snapshots at 10,000 bucket x batch directories: creation and diff time.

Run from the repo root: ``python -m benchmarks.bench_snapshots [--quick] [--directories N]``
(``--quick``: 1,000 directories).

A synthetic shard tree (``<root>/mds/<tier>/<H>x<W>/<batch>/``): each directory holds an
``index.json`` naming one shard of ``SAMPLES`` samples, a placeholder shard file (snapshots
never read shard bytes) and a real skip-list generation (sidecar + ``skiplists.json``, 10 %
skipped); the lab holds the matching ``shard_samples`` rows. Measured, side by side:

- baseline: verifying every directory's live generation (``load_generation``), which is
  what any consumer of the tree pays to know its effective set;
- ``create_snapshot``: that, plus a pin per directory (atomic write), the key mapping and the
  ``snapshot_samples``/``training_snapshots`` commits;
- after 1 % of the directories get a new generation: a second snapshot, then
  ``diff_snapshots`` (baseline: the two membership reads and a set difference), with the
  peak of Python's heap during each (``tracemalloc``: the members a diff holds are Python
  objects) and how many batches the diff compared sample by sample;
- what one snapshot adds to the lab: the bytes ``snapshot_samples`` and
  ``snapshot_directories`` grew by with the second snapshot, per directory.

Ends with one line per headline figure and its target.

Prints a table and writes ``benchmarks/results/bench_snapshots.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from prx_assets.core.lab import Lab
from prx_assets.core.shards.tables import SHARD_SAMPLES
from prx_assets.core.skiplists.sidecars import (
    load_generation,
    update_skiplists,
    write_partition_skiplists,
)
from prx_assets.core.snapshots.diff import diff_snapshots
from prx_assets.core.snapshots.runner import create_snapshot

RESULTS = Path(__file__).resolve().parent / "results" / "bench_snapshots.json"
SAMPLES = 20
SHAPES = ("512x512", "448x576", "576x448", "384x672", "672x384")


def _index(shard: str, samples: int) -> bytes:
    obj = {
        "shards": [
            {
                "column_encodings": ["bytes", "str"],
                "column_names": ["image", "caption"],
                "column_sizes": [None, None],
                "compression": None,
                "format": "mds",
                "hashes": [],
                "raw_data": {"basename": shard, "bytes": 64, "hashes": {}},
                "samples": samples,
                "size_limit": 1 << 26,
                "version": 2,
                "zip_data": None,
            }
        ],
        "version": 2,
    }
    return json.dumps(obj, sort_keys=True).encode()


def build_tree(root: Path, lab: Lab, directories: int) -> list[Path]:
    rows: dict[str, list] = {f.name: [] for f in SHARD_SAMPLES.schema}
    dirs = []
    for n in range(directories):
        shape = SHAPES[n % len(SHAPES)]
        batch = f"src{n // 50:04d}.{n % 50:03d}"
        rel = f"mds/512/{shape}/{batch}"
        d = root / rel
        d.mkdir(parents=True)
        shard = "shard.00000.mds"
        (d / "index.json").write_bytes(_index(shard, SAMPLES))
        (d / shard).write_bytes(b"\0" * 64)
        write_partition_skiplists(d, {shard: {i: ["duplicate"] for i in range(0, SAMPLES, 10)}})
        for i in range(SAMPLES):
            key = hashlib.sha256(f"{rel}/{i}".encode()).hexdigest()
            for col, value in (
                ("key", key),
                ("batch", batch),
                ("tier", 512),
                ("shape", shape),
                ("relative_dir", rel),
                ("shard", shard),
                ("index_in_shard", i),
                ("sample_index", i),
                ("dir_digest", None),
                ("jpeg_sha256", None),
                ("jpeg_bytes", 64),
                ("caption_fingerprint", "alt_text-v1"),
            ):
                rows[col].append(value)
        dirs.append(d)
    table = pa.table(rows, schema=SHARD_SAMPLES.schema)
    lab.ensure(SHARD_SAMPLES)
    lab.append(SHARD_SAMPLES, table)
    return dirs


def _members(lab: Lab, snapshot_id: str) -> set[tuple[str, str]]:
    rows = lab.read("snapshot_samples", ["batch", "key"], f"snapshot_id = '{snapshot_id}'")
    return set(zip(rows.column("batch").to_pylist(), rows.column("key").to_pylist(), strict=True))


def _peak(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """``fn()``, its wall seconds and the peak of Python's heap while it ran (bytes)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = fn()
        seconds = time.perf_counter() - t0
        return out, seconds, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _table_bytes(lab_root: Path, names: tuple[str, ...]) -> int:
    """Bytes of the data and deletion files of ``names``' Lance tables."""
    return sum(
        f.stat().st_size
        for n in names
        for sub in ("data", "_deletions")
        for f in (lab_root / f"{n}.lance" / sub).glob("*")
        if f.is_file()
    )


SNAPSHOT_TABLES = ("snapshot_samples", "snapshot_directories")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 directories (seconds)")
    ap.add_argument("--directories", type=int, default=None, help="default 10,000 (--quick 1,000)")
    args = ap.parse_args()
    directories = args.directories or (1_000 if args.quick else 10_000)
    if directories < 100:
        ap.error("--directories must be >= 100 (1 % of them change)")
    with tempfile.TemporaryDirectory(prefix="bench-snapshots-") as tmp:
        root, lab = Path(tmp) / "shards", Lab(Path(tmp) / "lab")
        t0 = time.perf_counter()
        dirs = build_tree(root, lab, directories)
        build_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        kept = 0
        for d in dirs:
            gen = load_generation(d)
            kept += sum(SAMPLES - len(s) for s in gen.skiplists.values())
        verify_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        a = create_snapshot(lab, root, "bench-a").manifest
        create_s = time.perf_counter() - t0
        assert a.kept_samples == kept, (a.kept_samples, kept)

        for d in dirs[:: max(1, len(dirs) // (directories // 100))][: directories // 100]:
            update_skiplists(d, {"shard.00000.mds": {1: ["opt_out"]}})
        stored_a = _table_bytes(Path(tmp) / "lab", SNAPSHOT_TABLES)
        t0 = time.perf_counter()
        create_snapshot(lab, root, "bench-b")
        create_b_s = time.perf_counter() - t0
        per_snapshot = _table_bytes(Path(tmp) / "lab", SNAPSHOT_TABLES) - stored_a

        def baseline() -> int:
            members = [_members(lab, s) for s in ("bench-a", "bench-b")]
            return len(members[0] - members[1])

        removed_baseline, baseline_diff_s, baseline_peak = _peak(baseline)
        diff, diff_s, diff_peak = _peak(lambda: diff_snapshots(lab, "bench-a", "bench-b"))
        assert diff.count("removed") == removed_baseline == directories // 100

    out = {
        "machine": platform.platform(),
        "directories": directories,
        "samples": directories * SAMPLES,
        "build_tree_s": round(build_s, 2),
        "verify_every_generation_s": round(verify_s, 3),
        "create_snapshot_s": round(create_s, 3),
        "create_snapshot_vs_verify": round(create_s / verify_s, 2),
        "create_second_snapshot_s": round(create_b_s, 3),
        "diff_s": round(diff_s, 3),
        "membership_set_difference_s": round(baseline_diff_s, 3),
        "diff_vs_set_difference": round(diff_s / baseline_diff_s, 2),
        "diff_batches_compared": diff.batches_compared,
        "diff_batches_unchanged": diff.batches_unchanged,
        "diff_python_heap_peak_mb": round(diff_peak / 2**20, 2),
        "set_difference_python_heap_peak_mb": round(baseline_peak / 2**20, 2),
        "snapshot_table_bytes_per_directory": round(per_snapshot / directories, 1),
        "removed": diff.count("removed"),
    }
    print(f"{'measure':38} {'value':>12}")
    for k, v in out.items():
        print(f"{k:38} {v!s:>12}")
    per_dir = out["snapshot_table_bytes_per_directory"]
    print(
        f"storage per snapshot: {per_dir:.0f} B per directory "
        f"({SAMPLES} samples each; snapshot_samples + snapshot_directories) (target <= 200) "
        f"{'met' if per_dir <= 200 else 'MISSED'}"
    )
    print(
        f"diff after 1 % of directories changed: {diff_s:.2f} s, "
        f"{diff.batches_compared} of {diff.batches_compared + (diff.batches_unchanged or 0)} "
        f"batches read; Python heap peak {diff_peak / 2**20:.1f} MB vs "
        f"{baseline_peak / 2**20:.1f} MB for the two memberships alone "
        "(target: flat in samples)"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    target = RESULTS if not args.quick else RESULTS.with_name("bench_snapshots.quick.json")
    target.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
