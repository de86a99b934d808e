"""Training snapshots at 10,000 bucket x batch directories: creation and diff time.

Run from the repo root: ``python -m benchmarks.bench_snapshots [--quick]`` (``--quick``:
1,000 directories).

A synthetic shard tree (``<root>/mds/<tier>/<H>x<W>/<batch>/``): each directory holds an
``index.json`` naming one shard of ``SAMPLES`` samples, a placeholder shard file (snapshots
never read shard bytes) and a real skip-list generation (sidecar + ``skiplists.json``, 10 %
skipped); the lab holds the matching ``shard_samples`` rows. Measured, side by side:

- baseline: verifying every directory's live generation (``load_generation``), which is
  what any consumer of the tree pays to know its effective set;
- ``create_snapshot``: that, plus a pin per directory (atomic write), the key mapping and the
  ``snapshot_samples``/``training_snapshots`` commits;
- after 1 % of the directories get a new generation: a second snapshot, then
  ``diff_snapshots`` (baseline: the two membership reads and a set difference).

Prints a table and writes ``benchmarks/results/bench_snapshots.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 directories (about a minute)")
    args = ap.parse_args()
    directories = 1_000 if args.quick else 10_000
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
        t0 = time.perf_counter()
        create_snapshot(lab, root, "bench-b")
        create_b_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        members = [_members(lab, s) for s in ("bench-a", "bench-b")]
        removed_baseline = len(members[0] - members[1])
        baseline_diff_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        diff = diff_snapshots(lab, "bench-a", "bench-b")
        diff_s = time.perf_counter() - t0
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
        "removed_by_opt_out": diff.count("removed", "opt-out"),
    }
    print(f"{'measure':34} {'value':>12}")
    for k, v in out.items():
        print(f"{k:34} {v!s:>12}")
    RESULTS.parent.mkdir(exist_ok=True)
    target = RESULTS if not args.quick else RESULTS.with_name("bench_snapshots.quick.json")
    target.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
