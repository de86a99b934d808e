"""MDS partition write throughput vs a plain sequential write of the same bytes.

Payload: real bucketed q92 JPEGs of the demo photos, repeated under distinct keys to a few
hundred MB, spread over the buckets they fall in. Both sides fsync their files (the MDS
writer does, for atomicity), run interleaved in the same process, best of N.

    python -m benchmarks.bench_mds_write [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from prx_assets.core.shards.mds import (
    DEFAULT_SIZE_LIMIT,
    MDSSample,
    skip_nothing,
    write_partition_buckets,
)
from prx_assets.demo.jpegs import bucketed_photos

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "bench_mds_write.json"


def make_samples(total_mb: float) -> list[MDSSample]:
    """The bucketed demo photos, cycled under distinct keys until they reach ``total_mb``."""
    photos = bucketed_photos()
    samples: list[MDSSample] = []
    size = 0
    i = 0
    while size < total_mb * 1e6:
        p = photos[i % len(photos)]
        samples.append(p.sample(f"{p.stem}/{i:07d}", f"a photo of {p.stem}, copy {i}"))
        size += len(p.jpeg)
        i += 1
    return samples


def plain_write(out: Path, samples: list[MDSSample], size_limit: int) -> None:
    """Baseline: image bytes appended to sequential files of ``size_limit``, fsynced."""
    out.mkdir(parents=True)
    n, f, written = 0, None, 0
    try:
        for s in samples:
            if f is None or written + len(s.image) > size_limit:
                if f is not None:
                    f.flush()
                    os.fsync(f.fileno())
                    f.close()
                f = open(out / f"part.{n:05d}", "wb")
                n, written = n + 1, 0
            f.write(s.image)
            written += len(s.image)
    finally:
        if f is not None:
            f.flush()
            os.fsync(f.fileno())
            f.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 MB payload, 2 repeats")
    args = parser.parse_args()
    total_mb, repeats = (40, 2) if args.quick else (300, 3)
    samples = make_samples(total_mb)
    payload = sum(len(s.image) for s in samples)
    t_mds, t_plain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):  # interleaved: the machine is shared
            root = Path(tmp) / f"mds{r}"
            t0 = time.perf_counter()
            placements = write_partition_buckets(root, "bench.b0", samples, skips_for=skip_nothing)
            t1 = time.perf_counter()
            plain_write(Path(tmp) / f"plain{r}", samples, DEFAULT_SIZE_LIMIT)
            t2 = time.perf_counter()
            t_mds.append(t1 - t0)
            t_plain.append(t2 - t1)
            on_disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
            shutil.rmtree(root)
            shutil.rmtree(Path(tmp) / f"plain{r}")
    mds_mb_s = payload / 1e6 / min(t_mds)
    plain_mb_s = payload / 1e6 / min(t_plain)
    buckets = len({(p.tier, p.shape) for p in placements})
    shards = len({(p.tier, p.shape, p.shard) for p in placements})
    result = {
        "quick": args.quick,
        "samples": len(samples),
        "payload_bytes": payload,
        "on_disk_bytes": on_disk,
        "buckets": buckets,
        "shards": shards,
        "mds_s": t_mds,
        "plain_s": t_plain,
        "mds_mb_s": mds_mb_s,
        "plain_mb_s": plain_mb_s,
        "ratio": mds_mb_s / plain_mb_s,
    }
    print(
        f"{len(samples)} samples, {payload / 1e6:.0f} MB of JPEG in {buckets} buckets / "
        f"{shards} shards (on disk {on_disk / 1e6:.0f} MB)\n"
        f"{'writer':22} {'best s':>7} {'MB/s':>7}\n"
        f"{'MDS partition buckets':22} {min(t_mds):>7.2f} {mds_mb_s:>7.0f}\n"
        f"{'plain sequential':22} {min(t_plain):>7.2f} {plain_mb_s:>7.0f}\n"
        f"ratio MDS / plain: {mds_mb_s / plain_mb_s:.2f}x"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
