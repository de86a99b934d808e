"""What an S3 kill-test child runs: ``mds_shards``' and ``skip_lists``' remote writes, and
the default loader over the remote tree. Each job gets the S3 environment explicitly (a
forkserver started earlier in the session does not have it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prx_assets.core.shards.mds import MDSSample, write_partition_buckets
from prx_assets.core.shards.remote import RemoteShardTree
from prx_assets.core.skiplists.sidecars import publish_partition_generations
from prx_assets_tests import kill_jobs


def write_shards_s3(
    uri: str,
    batch: str,
    samples: list[MDSSample],
    decisions: Mapping[str, list[str]],
    size_limit: int,
) -> None:
    """``mds_shards``' writer on object storage: local work copy, then versions + pointers."""
    with RemoteShardTree(uri, batch) as tree:
        write_partition_buckets(
            tree.local_root,
            batch,
            samples,
            skips_for=kill_jobs.skips_from(decisions),
            size_limit=size_limit,
        )
        tree.publish_shards()


def refresh_skiplists_s3(
    uri: str, batch: str, skips_by_rel: Mapping[str, Mapping[str, Mapping[int, list[str]]]]
) -> None:
    """``skip_lists``' writer on object storage: pull, stage every generation, push as one."""
    with RemoteShardTree(uri, batch) as tree:
        pulled = tree.pull_generations()
        order = sorted(pulled)
        local = Path(tree.local_root)
        publish_partition_generations({local / rel: skips_by_rel.get(rel, {}) for rel in order})
        tree.publish_skiplists(order)


def loader_keys_s3(uri: str, cache: str, out: str) -> None:
    """``kill_jobs.loader_keys`` over an ``s3://`` tree (streamed into ``cache``)."""
    real = kill_jobs.discover_streams
    kill_jobs.discover_streams = lambda root: real(root, cache_dir=cache)  # type: ignore[assignment]
    try:
        kill_jobs.loader_keys(uri, out)
    finally:
        kill_jobs.discover_streams = real  # type: ignore[assignment]


JOBS = {
    "write_shards_s3": write_shards_s3,
    "refresh_skiplists_s3": refresh_skiplists_s3,
    "loader_keys_s3": loader_keys_s3,
}


def run_job(job: str, crash_at: str | None, kwargs: dict[str, Any]) -> None:
    """Child entry point: the S3 environment, then ``kill_jobs.run_job``'s arming."""
    os.environ.update(kwargs.pop("env"))
    kill_jobs.JOBS.update(JOBS)
    kill_jobs.run_job(job, crash_at, kwargs)
