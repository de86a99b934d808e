"""Reading image rows for the shard renderer: ``LabView.take_matching(...).to_pylist()``
against ``LabView.take_matching_rows``, side by side in one process.

    python -m benchmarks.bench_take_rows [--n 96] [--mb 1.5]

A lab with ``n`` rows of ``mb`` MB images in the blob store, read the way
``BucketRenderer._read`` does (chunks of 32 keys, ``batch`` and ``key IN (...)``), 7 rounds
alternating; median CPU seconds of each and the ratio. Both check every blob against its
sha256; the difference is the Arrow column each image's bytes went through and back.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa

from prx_assets.core.lab import Lab, TableSpec

SPEC = TableSpec(
    name="imgs",
    schema=pa.schema([("batch", pa.string()), ("key", pa.string()), ("image", pa.large_binary())]),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP")),
    blobs=("image",),
)
CHUNK = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=96)
    parser.add_argument("--mb", type=float, default=1.5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    keys = [f"k{i:04d}" for i in range(args.n)]
    with tempfile.TemporaryDirectory() as tmp:
        lab = Lab(tmp)
        images = [rng.bytes(int(args.mb * 1e6)) for _ in keys]
        lab.replace_partition(
            SPEC,
            "a",
            pa.table(
                {
                    "batch": ["a"] * args.n,
                    "key": keys,
                    "image": pa.array(images, pa.large_binary()),
                },
                schema=SPEC.schema,
            ),
        )
        view = lab.view()
        filters = [
            "batch = 'a' AND key IN ({})".format(",".join(f"'{k}'" for k in keys[s : s + CHUNK]))
            for s in range(0, args.n, CHUNK)
        ]

        def through_arrow() -> None:
            for f in filters:
                view.take_matching("imgs", ["key", "image"], f).to_pylist()

        def as_rows() -> None:
            for f in filters:
                view.take_matching_rows("imgs", ["key", "image"], f)

        times: dict[str, list[float]] = {
            "take_matching().to_pylist()": [],
            "take_matching_rows": [],
        }
        for _ in range(7):
            for name, fn in zip(times, (through_arrow, as_rows), strict=True):
                t = time.process_time()
                fn()
                times[name].append(time.process_time() - t)
    a, b = (statistics.median(v) for v in times.values())
    print(f"{args.n} rows x {args.mb} MB, CPU seconds (median of 7)")
    for name, v in times.items():
        print(f"  {name:<30} {statistics.median(v):.3f}")
    print(f"  ratio {a / b:.2f}x")


if __name__ == "__main__":
    main()
