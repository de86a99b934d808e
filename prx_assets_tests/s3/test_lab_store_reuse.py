"""A process's Lance opens on ``s3://`` reuse one object store per bucket.

Each new Lance object store loads the system's CA certificates (~880 KB of files read and
~6 ms of CPU here); a store the session's registry no longer holds is built again at the
next open. ``core/lab/io.py`` keeps one dataset per bucket open, so a step's many opens,
counts and commits (and a worker's fragment writes) build the store once.
"""

from __future__ import annotations

import pyarrow as pa

from prx_assets.core.ingest.tables import IMAGES, REJECTS
from prx_assets.core.lab import Lab

CERT_BYTES = 200_000  # well under one load of the system's certificates (~880 KB here)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def test_opens_and_fragment_writes_on_s3_build_the_buckets_store_once(s3_prefix):
    lab = Lab(f"{s3_prefix}/lab")
    lab.ensure(IMAGES)
    lab.ensure(REJECTS)
    fragments = lab.partition_fragments(REJECTS, "b1")
    fragments.write(pa.Table.from_pylist([], schema=fragments.stored))  # the writer's path

    before = _rchar()
    for _ in range(5):
        Lab(f"{s3_prefix}/lab").count(IMAGES.name)
        lab.dataset(REJECTS.name)  # another table of the same bucket
        lab.partition_fragments(IMAGES, "b1")
        fragments.write(pa.Table.from_pylist([], schema=fragments.stored))
    read = _rchar() - before
    assert read < CERT_BYTES, f"{read} bytes read from local files: the store was rebuilt"
