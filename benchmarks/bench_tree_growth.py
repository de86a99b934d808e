"""The shard tree as it grows: directory writes, loader construction, the landing cursor.

    python -m benchmarks.bench_tree_growth [--quick] [--sizes 100,1000,3000,10000]

At each P (bucket × batch directories, all in one bucket: the worst case for siblings):

1. Directory write time vs siblings: ``writes`` new batch directories written through the
   real writer (``write_partition_buckets``: MDS shards, first skip-list generation, fsyncs,
   renames) into the bucket holding P directories, plus as many rewrites of one of them;
   median ms, and the ratio to P = 100 (flat is the target). Beside it, what the previous
   recovery cost on its own at that P: two listings of the bucket, filtered by name.
2. Loader construction vs plain ``streaming.StreamingDataset`` over the same directories:
   ``discover_streams`` + ``ShapeBatchedLoader`` against ``StreamingDataset(streams=[Stream
   (local=d) ...])`` over plain twins of the directories (shards hard-linked, the index with
   version 2: plain streaming refuses a published one), alternating in this process, ``gc.collect()`` before each, streaming's
   shared memory released after each; median CPU seconds (less sensitive to other tenants
   than wall time, also printed) and the ratio (target ≤ 1.5× at 10,000).
3. The landing cursor for P batch keys: numbered chunks and arbitrary names, against the
   previous cursor (a JSON list of every key).

The tree grows by hard-linked copies of one directory the real writer wrote (its index,
shard and skip-list generation are valid where they are copied); the measured writes and
reads are real. ``TMPDIR`` is pointed at a fresh directory first: streaming probes its file
locks there for every dataset, and stale locks other processes left in ``/tmp`` would
otherwise dominate both sides. Writes ``benchmarks/results/bench_tree_growth.json``.
"""

from __future__ import annotations

import os
import tempfile

_FRESH_TMP = tempfile.mkdtemp(prefix="bench-tree-tmp-")
os.environ["TMPDIR"] = _FRESH_TMP
tempfile.tempdir = None  # re-read TMPDIR

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from prx_assets.core.ingest.cursor import encode_keys  # noqa: E402
from prx_assets.core.shards.mds import (  # noqa: E402
    MDSSample,
    partition_dir,
    skip_nothing,
    write_partition_buckets,
)
from prx_assets.demo.jpegs import solid_jpeg  # noqa: E402
from prx_assets_tests.streaming_memory import streaming_memory_released  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "bench_tree_growth.json"
TIER, SHAPE = 512, "16x24"
SAMPLES_PER_DIR = 4
SKIP_EVERY = 0  # the template's skip-lists: 1 sample in this many skipped (0: none)


def _skips(placements: list) -> dict[str, dict[int, list[str]]]:
    """Realistic skip-lists for the template: every SKIP_EVERY-th sample skipped, reasons
    as the screen writes them (opt-outs, duplicates, classes), one sidecar per shard."""
    if not SKIP_EVERY:
        return skip_nothing(placements)
    codes = (["duplicate"], ["opt_out"], ["class_text", "quality"])
    out: dict[str, dict[int, list[str]]] = {}
    for p in placements:
        if p.sample_index % SKIP_EVERY == 0:
            out.setdefault(p.shard, {})[p.index_in_shard] = codes[p.sample_index % len(codes)]
    return out


def _samples(batch: str) -> list[MDSSample]:
    jpeg = solid_jpeg((24, 16), (90, 120, 150), quality=90)
    return [
        MDSSample(f"{batch}/{i}", jpeg, f"c {i}", 24, 16, TIER, SHAPE, "bench", "cc0")
        for i in range(SAMPLES_PER_DIR)
    ]


def _grow(root: Path, template: Path, have: int, want: int) -> None:
    """Siblings ``t000000`` ... as hard-linked copies of ``template`` (a real directory)."""
    bucket = template.parent
    files = sorted(p.name for p in template.iterdir())
    for i in range(have, want):
        d = bucket / f"t{i:06d}"
        d.mkdir()
        for name in files:
            os.link(template / name, d / name)


def _plain_template(template: Path, bucket: Path) -> Path:
    """The plain side's copy of ``template``: its files hard-linked, its index with the
    version 2 plain streaming reads (a published index is refused by it:
    ``core/shards/published.py``). Same shard bytes, same index size."""
    d = bucket / template.name
    d.mkdir(parents=True)
    for f in template.iterdir():
        if f.name == "index.json":
            index = json.loads(f.read_bytes())
            index["version"] = 2
            (d / f.name).write_text(json.dumps(index, sort_keys=True))
        else:
            os.link(f, d / f.name)
    return d


def _legacy_recovery_listing(bucket: Path, batch: str) -> None:
    """What the previous recovery did per write besides its renames: list the bucket twice."""
    for mark in (".tmp-", ".old-"):
        pattern = re.compile(re.escape(f".{batch}{mark}") + r"[0-9a-f]{32}$")
        sorted(p for p in bucket.iterdir() if pattern.match(p.name))


def measure_writes(root: Path, writes: int) -> dict[str, float]:
    new_ms, rewrite_ms = [], []
    for i in range(writes):
        batch = f"w{i:03d}"
        t0 = time.perf_counter()
        write_partition_buckets(root, batch, _samples(batch), skips_for=skip_nothing)
        new_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        write_partition_buckets(root, batch, _samples(batch)[:-1], skips_for=skip_nothing)
        rewrite_ms.append((time.perf_counter() - t0) * 1e3)
    for i in range(writes):  # back to exactly P directories
        write_partition_buckets(root, f"w{i:03d}", [], skips_for=skip_nothing)
    bucket = partition_dir(root, TIER, SHAPE, "x").parent
    legacy = []
    for _ in range(writes):
        t0 = time.perf_counter()
        _legacy_recovery_listing(bucket, "w000")
        legacy.append((time.perf_counter() - t0) * 1e3)
    return {
        "new_dir_ms": statistics.median(new_ms),
        "rewrite_ms": statistics.median(rewrite_ms),
        "previous_recovery_listing_ms": statistics.median(legacy),
    }


def _plain(dirs: list[str]) -> None:
    from streaming import Stream, StreamingDataset

    StreamingDataset(
        streams=[Stream(local=d) for d in dirs], batch_size=4, shuffle=True, num_canonical_nodes=1
    )


def _ours(root: Path) -> None:
    from prx_assets.loader import ShapeBatchedLoader, discover_streams

    ShapeBatchedLoader(discover_streams(root), batch_size=4, num_canonical_nodes=1)


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    gc.collect()
    with streaming_memory_released():
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return cpu, wall


def measure_loader(root: Path, plain_bucket: Path, reps: int, warm_up: bool) -> dict[str, float]:
    dirs = sorted(str(plain_bucket / n) for n in os.listdir(plain_bucket))
    plain, ours = [], []
    if warm_up:  # imports and first allocations, paid once by neither side's numbers
        _timed(lambda: _plain(dirs))
        _timed(lambda: _ours(root))
    for _ in range(reps):
        plain.append(_timed(lambda: _plain(dirs)))
        ours.append(_timed(lambda: _ours(root)))
    p_cpu, o_cpu = statistics.median(c for c, _ in plain), statistics.median(c for c, _ in ours)
    p_wall, o_wall = statistics.median(w for _, w in plain), statistics.median(w for _, w in ours)
    return {
        "plain_cpu_s": p_cpu,
        "ours_cpu_s": o_cpu,
        "ratio_cpu": o_cpu / p_cpu,
        "plain_wall_s": p_wall,
        "ours_wall_s": o_wall,
        "ratio_wall": o_wall / p_wall,
    }


def measure_cursor(p: int) -> dict[str, int]:
    numbered = [f"laion-2b.{i:06d}" for i in range(p)]
    named = [f"src{i % 7}.{secrets.token_hex(6)}" for i in range(p)]
    return {
        "numbered_bytes": len(encode_keys(numbered)),
        "numbered_previous_bytes": len(json.dumps(sorted(numbered))),
        "named_bytes": len(encode_keys(named)),
        "named_previous_bytes": len(json.dumps(sorted(named))),
    }


def main() -> None:
    global SAMPLES_PER_DIR, SKIP_EVERY
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="P = 100, 1000; fewer repeats")
    parser.add_argument("--sizes", help="comma-separated P values (default 100,1000,3000,10000)")
    parser.add_argument(
        "--samples-per-dir", type=int, default=SAMPLES_PER_DIR, help="samples per directory"
    )
    parser.add_argument(
        "--skip-every",
        type=int,
        default=SKIP_EVERY,
        help="skip 1 sample in N in every directory (7: ~14 %%, as real trees; 0: none)",
    )
    args = parser.parse_args()
    SAMPLES_PER_DIR, SKIP_EVERY = args.samples_per_dir, args.skip_every
    sizes = [100, 1000] if args.quick else [100, 1000, 3000, 10000]
    if args.sizes:
        sizes = sorted(int(v) for v in args.sizes.split(","))
    writes, reps = (10, 3) if args.quick else (20, 5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tree-") as tmp:
        root = Path(tmp)
        write_partition_buckets(root, "template", _samples("template"), skips_for=_skips)
        template = partition_dir(root, TIER, SHAPE, "template")
        plain_template = _plain_template(template, Path(tmp, "plain", str(TIER), SHAPE))
        measure_writes(root, 3)  # warm-up: first writes pay imports and cold caches
        have = 1
        for p in sizes:
            _grow(root, template, have - 1, p - 1)  # the template counts as one
            _grow(root, plain_template, have - 1, p - 1)
            have = p
            row: dict[str, Any] = {"P": p}
            row.update(measure_writes(root, writes))
            row.update(measure_loader(root, plain_template.parent, reps, warm_up=p == sizes[0]))
            row.update(measure_cursor(p))
            rows.append(row)
            print(f"P={p}: {json.dumps({k: round(v, 4) for k, v in row.items()})}", flush=True)
    base = rows[0]
    print(
        f"\n{'P':>6} | {'new dir ms':>10} {'x P0':>5} {'rewrite ms':>10} {'x P0':>5} "
        f"{'old recov ms':>12} | {'plain s':>7} {'ours s':>7} {'ratio':>5} {'(wall)':>6} | "
        f"{'cursor B':>8} {'was B':>7} {'named B':>8} {'was B':>7}"
    )
    for r in rows:
        print(
            f"{r['P']:>6} | {r['new_dir_ms']:>10.2f} {r['new_dir_ms'] / base['new_dir_ms']:>5.2f} "
            f"{r['rewrite_ms']:>10.2f} {r['rewrite_ms'] / base['rewrite_ms']:>5.2f} "
            f"{r['previous_recovery_listing_ms']:>12.2f} | {r['plain_cpu_s']:>7.3f} "
            f"{r['ours_cpu_s']:>7.3f} {r['ratio_cpu']:>5.2f} {r['ratio_wall']:>6.2f} | "
            f"{r['numbered_bytes']:>8} {r['numbered_previous_bytes']:>7} "
            f"{r['named_bytes']:>8} {r['named_previous_bytes']:>7}"
        )
    print(
        "write ratio = median write at P / at the first P (flat = 1); loader ratio = "
        "discover_streams + ShapeBatchedLoader / plain StreamingDataset (CPU s; wall beside)"
    )
    shutil.rmtree(_FRESH_TMP, ignore_errors=True)
    result = {
        "quick": args.quick,
        "samples_per_dir": SAMPLES_PER_DIR,
        "skip_every": SKIP_EVERY,
        "rows": rows,
    }
    out = RESULTS if not SKIP_EVERY else RESULTS.with_name("bench_tree_growth_skips.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
