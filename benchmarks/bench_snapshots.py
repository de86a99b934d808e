"""Training snapshots at 10,000 bucket x batch directories x 1,000 samples: storage per
snapshot, creation and diff.

Run from the repo root: ``python -m benchmarks.bench_snapshots [--quick]``
(``--quick``: 1,000 directories x 100 samples; ``--directories/--samples/--snapshots`` for
other sizes, which write no results file).

A synthetic shard tree (``<root>/mds/<tier>/<H>x<W>/<batch>/``): each directory holds an
``index.json`` naming one shard, a placeholder shard file (snapshots never read shard
bytes) and a real skip-list generation (sidecar + ``skiplists.json``) skipping 10-20 % of
its samples (the rate varies by directory); the lab holds the matching ``shard_samples``
rows. Then 10 snapshots, with 1 % of the directories given a new generation (one more
sample skipped, as an opt-out does) before each after the first. Measured:

- what each snapshot adds to the lab (``training_snapshots``, ``snapshot_directories``,
  ``skip_generations``; data, deletion and index files, and separately every file with the
  manifests of every version), per directory: the first snapshot records every generation
  once, later ones only the generations that changed;
- ``create_snapshot`` time against verifying every directory's live generation
  (``load_generation``), what any consumer of the tree pays to know its effective set;
- ``diff_snapshots`` between the last two snapshots and between the first and the last,
  against the baseline of deriving both whole memberships and taking their set difference,
  with the peak of Python's heap during each (``tracemalloc``) and the batches the diff read.
  Both sides are timed under ``tracemalloc`` (the ratio compares like with like; the
  allocation-heavy baseline pays more for it); the consecutive diff is timed once more
  without it (``diff_consecutive_untraced_s``).

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
from prx_assets.core.snapshots.members import frozen, iter_members
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


def _skips(n: int, samples: int) -> dict[int, list[str]]:
    """Directory ``n``'s skipped samples: 10-20 % of them (the rate varies by directory),
    spread over the shard, as real skip-lists are (duplicates, classes, quality)."""
    rate = 10 + n % 11
    return {i: ["duplicate"] for i in range(samples) if (i * 37 + n) % 100 < rate}


def build_tree(root: Path, lab: Lab, directories: int, samples: int) -> list[Path]:
    """The tree and its ``shard_samples`` rows (one Lance append per 1,000 directories)."""
    dirs = []
    shard = "shard.00000.mds"
    pending: list[pa.Table] = []

    def flush() -> None:
        if pending:
            lab.append(SHARD_SAMPLES, pa.concat_tables(pending))
            pending.clear()

    index = _index(shard, samples)
    for n in range(directories):
        shape = SHAPES[n % len(SHAPES)]
        batch = f"src{n // 50:04d}.{n % 50:03d}"
        rel = f"mds/512/{shape}/{batch}"
        d = root / rel
        d.mkdir(parents=True)
        (d / "index.json").write_bytes(index)
        (d / shard).write_bytes(b"\0" * 64)
        write_partition_skiplists(d, {shard: _skips(n, samples)})
        keys = [hashlib.sha256(f"{rel}/{i}".encode()).hexdigest() for i in range(samples)]
        idx = pa.array(range(samples), pa.int32())
        columns = {
            "key": pa.array(keys),
            "batch": pa.array([batch] * samples),
            "tier": pa.array([512] * samples, pa.int32()),
            "shape": pa.array([shape] * samples),
            "relative_dir": pa.array([rel] * samples),
            "shard": pa.array([shard] * samples),
            "index_in_shard": idx,
            "sample_index": idx,
            "jpeg_bytes": pa.array([64] * samples),
            "caption_fingerprint": pa.array(["alt_text-v1"] * samples),
        }
        pending.append(
            pa.table(
                {
                    f.name: columns[f.name].cast(f.type)
                    if f.name in columns
                    else pa.nulls(samples, f.type)
                    for f in SHARD_SAMPLES.schema
                },
                schema=SHARD_SAMPLES.schema,
            )
        )
        if len(pending) == 1_000:
            flush()
        dirs.append(d)
    flush()
    return dirs


def _members(lab: Lab, snapshot_id: str) -> set[tuple[str, str]]:
    """A snapshot's whole membership, derived (what a diff without digests would read)."""
    return {
        (r["batch"], r["key"]) for rows in iter_members(lab, frozen(lab, snapshot_id)) for r in rows
    }


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


def _table_bytes(lab_root: Path, names: tuple[str, ...], parts: tuple[str, ...] | None) -> int:
    """Bytes of ``names``' Lance tables: the files under ``parts`` (e.g. data, deletion and
    index files), or every file (``None``: manifests of every version too)."""
    total = 0
    for n in names:
        base = lab_root / f"{n}.lance"
        subs = [base / p for p in parts] if parts is not None else [base]
        total += sum(f.stat().st_size for sub in subs for f in sub.rglob("*") if f.is_file())
    return total


# What snapshots add to the lab (``snapshot_samples`` is no longer written: it stays 0).
SNAPSHOT_TABLES = (
    "training_snapshots",
    "snapshot_directories",
    "skip_generations",
    "snapshot_samples",
)
STORED = ("data", "_deletions", "_indices")


def _change(dirs: list[Path], samples: int, round_: int, share: float = 0.01) -> int:
    """Give ``share`` of the directories a new generation (one more sample skipped, as an
    opt-out would); how many changed."""
    step = max(1, round(1 / share))
    changed = dirs[round_ % step :: step]
    for d in changed:
        live = load_generation(d).skiplists["shard.00000.mds"].as_mapping()
        free = next(i for i in range(samples) if i not in live)
        update_skiplists(d, {"shard.00000.mds": {**live, free: ("opt_out",)}})
    return len(changed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 directories x 100 samples")
    ap.add_argument("--directories", type=int, default=None, help="default 10,000")
    ap.add_argument("--samples", type=int, default=None, help="per directory; default 1,000")
    ap.add_argument("--snapshots", type=int, default=10, help="default 10")
    args = ap.parse_args()
    directories = args.directories or (1_000 if args.quick else 10_000)
    samples = args.samples or (100 if args.quick else 1_000)
    if directories < 100 or args.snapshots < 2 or samples < 20:
        ap.error("--directories >= 100 (1 %% change per round), --snapshots >= 2, --samples >= 20")
    custom = args.directories is not None or args.samples is not None or args.snapshots != 10
    with tempfile.TemporaryDirectory(prefix="bench-snapshots-") as tmp:
        root, lab_root = Path(tmp) / "shards", Path(tmp) / "lab"
        lab = Lab(lab_root)
        t0 = time.perf_counter()
        dirs = build_tree(root, lab, directories, samples)
        build_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        kept = 0
        for d in dirs:
            gen = load_generation(d)
            kept += sum(samples - len(s) for s in gen.skiplists.values())
        verify_s = time.perf_counter() - t0
        skipped_share = 1 - kept / (directories * samples)

        create_s: list[float] = []
        stored: list[int] = []  # data + deletion + index bytes after each snapshot
        every_file: list[int] = []  # every file, manifests of every version included
        changed = opted_out = 0
        for n in range(args.snapshots):
            if n:
                changed = _change(dirs, samples, n)
                opted_out += changed
            t0 = time.perf_counter()
            made = create_snapshot(lab, root, f"bench-{n:02d}").manifest
            create_s.append(time.perf_counter() - t0)
            stored.append(_table_bytes(lab_root, SNAPSHOT_TABLES, STORED))
            every_file.append(_table_bytes(lab_root, SNAPSHOT_TABLES, None))
            if n == 0:
                assert made.kept_samples == kept, (made.kept_samples, kept)
        first_b, last_b = "bench-00", f"bench-{args.snapshots - 1:02d}"
        prev_b = f"bench-{args.snapshots - 2:02d}"

        def baseline() -> int:
            members = [_members(lab, s) for s in (prev_b, last_b)]
            return len(members[0] - members[1])

        removed_baseline, baseline_diff_s, baseline_peak = _peak(baseline)
        diff, diff_s, diff_peak = _peak(lambda: diff_snapshots(lab, prev_b, last_b))
        t0 = time.perf_counter()  # the same diff without tracemalloc's per-allocation cost
        diff_snapshots(lab, prev_b, last_b)
        diff_untraced_s = time.perf_counter() - t0
        assert diff.count("removed") == removed_baseline == changed, (diff.totals(), changed)
        far, far_s, far_peak = _peak(lambda: diff_snapshots(lab, first_b, last_b))
        assert far.count("removed") == opted_out, (far.totals(), opted_out)
        sample_rows = lab.count("snapshot_samples") if lab.exists("snapshot_samples") else 0

    later = [b - a for a, b in zip(stored, stored[1:], strict=False)]
    later_all = [b - a for a, b in zip(every_file, every_file[1:], strict=False)]
    out = {
        "machine": platform.platform(),
        "directories": directories,
        "samples_per_directory": samples,
        "samples": directories * samples,
        "skipped_share": round(skipped_share, 3),
        "snapshots": args.snapshots,
        "directories_changed_per_round": changed,
        "build_tree_s": round(build_s, 2),
        "verify_every_generation_s": round(verify_s, 3),
        "create_first_snapshot_s": round(create_s[0], 3),
        "create_later_snapshot_mean_s": round(sum(create_s[1:]) / len(create_s[1:]), 3),
        "create_snapshot_vs_verify": round(create_s[0] / verify_s, 2),
        "diff_consecutive_untraced_s": round(diff_untraced_s, 3),
        "diff_consecutive_s": round(diff_s, 3),  # under tracemalloc, as the baseline
        "membership_set_difference_s": round(baseline_diff_s, 3),
        "diff_vs_set_difference": round(diff_s / baseline_diff_s, 3),
        "diff_batches_compared": diff.batches_compared,
        "diff_batches_unchanged": diff.batches_unchanged,
        "diff_python_heap_peak_mb": round(diff_peak / 2**20, 2),
        "set_difference_python_heap_peak_mb": round(baseline_peak / 2**20, 2),
        "diff_first_to_last_s": round(far_s, 3),
        "diff_first_to_last_batches_compared": far.batches_compared,
        "diff_first_to_last_python_heap_peak_mb": round(far_peak / 2**20, 2),
        "first_snapshot_bytes_per_directory": round(stored[0] / directories, 1),
        "later_snapshot_bytes_per_directory_mean": round(sum(later) / len(later) / directories, 1),
        "later_snapshot_bytes_per_directory_max": round(max(later) / directories, 1),
        "snapshot_bytes_per_directory_mean_all": round(stored[-1] / len(stored) / directories, 1),
        "later_snapshot_all_files_per_directory_mean": round(
            sum(later_all) / len(later_all) / directories, 1
        ),
        "snapshot_samples_rows": sample_rows,
    }
    print(f"{'measure':44} {'value':>14}")
    for k, v in out.items():
        print(f"{k:44} {v!s:>14}")
    per_dir = out["later_snapshot_bytes_per_directory_mean"]
    print(
        f"storage per snapshot: {per_dir:.0f} B per directory (snapshots 2-{args.snapshots}, "
        f"{samples} samples per directory, 1 % of directories changed between snapshots; "
        f"data, deletion and index files) (target <= 200) {'met' if per_dir <= 200 else 'MISSED'}"
    )
    print(
        f"first snapshot: {out['first_snapshot_bytes_per_directory']:.0f} B per directory "
        f"(records every generation once); mean over all {args.snapshots}: "
        f"{out['snapshot_bytes_per_directory_mean_all']:.0f} B (target <= 200)"
    )
    print(
        f"create: {create_s[0]:.1f} s first, {out['create_later_snapshot_mean_s']:.1f} s later "
        f"({directories * samples:,} samples; verifying every generation alone {verify_s:.1f} s)"
    )
    print(
        f"diff after 1 % of directories changed: {diff_untraced_s:.2f} s "
        f"({diff_s:.2f} s under tracemalloc vs {baseline_diff_s:.1f} s for the baseline), "
        f"{diff.batches_compared} of {diff.batches_compared + (diff.batches_unchanged or 0)} "
        f"batches read; Python heap peak {diff_peak / 2**20:.1f} MB vs "
        f"{baseline_peak / 2**20:.1f} MB for the two memberships alone "
        "(target: flat in samples)"
    )
    if custom:
        return
    RESULTS.parent.mkdir(exist_ok=True)
    target = RESULTS if not args.quick else RESULTS.with_name("bench_snapshots.quick.json")
    target.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
