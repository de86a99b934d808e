"""What a kill-test child runs: one writer, with ``PRX_CRASH_AT`` armed or not.

Imported once by the forkserver (``test_kill.py`` preloads this module), so each child is a
fork of an interpreter that already holds streaming, Lance and Dagster: it starts in
milliseconds instead of seconds. Nothing here runs a writer at import time, and nothing
touches Lance before the fork (Lance starts its runtime threads lazily, in the child).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import streaming  # noqa: F401 - preloaded: core.mds imports it lazily, and it pulls in torch
from dagster import DagsterInstance, materialize

import prx_assets.core.ingest.runner as ingest
from prx_assets.core import crashpoints
from prx_assets.core.ingest.sources import resolve_batch
from prx_assets.core.lab import Lab
from prx_assets.core.shards.mds import MDSSample, Placement, write_partition_buckets
from prx_assets.core.skiplists.sidecars import publish_partition_skiplists
from prx_assets.core.snapshots.runner import create_snapshot
from prx_assets.core.tables import IMAGES, REJECTS
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.shards.assets import mds_shards
from prx_assets.defs.skiplists.assets import build_skiplist_assets
from prx_assets.defs.skiplists.config import SkipPolicyResource
from prx_assets.loader import ShapeBatchedLoader, discover_streams

Decisions = Mapping[str, Sequence[str]]  # key -> reason codes (absent: kept)


def skips_from(decisions: Decisions):  # noqa: ANN201 - a skips_for callback
    """A ``skips_for`` callback applying fixed per-key decisions (what a policy decided)."""

    def skips_for(placements: Sequence[Placement]) -> dict[str, dict[int, list[str]]]:
        out: dict[str, dict[int, list[str]]] = {}
        for p in placements:
            if decisions.get(p.key):
                out.setdefault(p.shard, {})[p.index_in_shard] = list(decisions[p.key])
        return out

    return skips_for


def write_shards(
    root: str, batch: str, samples: list[MDSSample], decisions: Decisions, size_limit: int
) -> None:
    """``mds_shards``' writer: every bucket of a partition, each with its first generation."""
    write_partition_buckets(
        root, batch, samples, skips_for=skips_from(decisions), size_limit=size_limit
    )


def refresh_skiplists(skips_by_dir: Mapping[str, Mapping[str, Mapping[int, list[str]]]]) -> None:
    """``skip_lists``' writer: stage every directory's generation, then flip the manifests."""
    publish_partition_skiplists(skips_by_dir)


def ingest_batch(lab_root: str, landing: str, batch: str, rows_per_record_batch: int) -> None:
    """``raw_images``' writes: the batch's ``images`` rows, then its ``rejects`` rows."""
    ingest.ROWS_PER_RECORD_BATCH = rows_per_record_batch  # several batches per fragment write
    ingest.INGEST_CHUNK = rows_per_record_batch  # several chunks (fragments) per batch
    ref = resolve_batch(Path(landing), batch)
    store = Lab(lab_root)
    # As raw_images writes: blobs stored and rows written by the (here: inline) worker, one
    # fragment per chunk, then one commit.
    run = ingest.BatchIngest(ref, workers=1, blob_sink=store.local_blobs(IMAGES, "image"))
    fragments = store.partition_fragments(IMAGES, ref.key, stored_blobs=run.stored_blobs)
    store.commit_partition(IMAGES, ref.key, run.write_images(fragments))
    store.replace_partition(REJECTS, ref.key, run.rejects)


def take_in_list(lab_root: str, directory: str, list_id: str, chunk_entries: int) -> None:
    """One opt-out list's intake, streamed in chunks of ``chunk_entries`` identifiers."""
    from prx_assets.core.skiplists.intake import ListIntake

    ListIntake(Lab(lab_root), directory, list_id, chunk_entries=chunk_entries).run()


def materialize_asset(
    asset: str, data_root: str, batch: str, policy: dict[str, Any], run_config: dict[str, Any]
) -> None:
    """A real Dagster ``materialize`` of ``mds_shards`` or ``skip_lists`` (one partition)."""
    skip_policy = SkipPolicyResource(**policy)
    assets = [mds_shards] if asset == "mds_shards" else build_skiplist_assets(skip_policy)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(BATCHES.name, [batch])
        result = materialize(
            assets,
            partition_key=batch,
            instance=instance,
            resources={"lab": LabResource(data_root=data_root), "skip_policy": skip_policy},
            run_config=run_config,
        )
        if not result.success:
            raise RuntimeError(f"{asset} failed for {batch}")


def make_snapshot(lab_root: str, shards_root: str, name: str) -> None:
    """``snapshot create``: pins, generations and directory rows, staged manifest, row,
    published."""
    create_snapshot(Lab(lab_root), shards_root, name)


def _construct(buckets: list) -> ShapeBatchedLoader:
    """The default loader; streaming registers its shared-memory prefix by "first free
    number", which races with any other process on the machine doing the same (the loser
    gets FileExistsError): retry that, and only that."""
    for attempt in range(20):
        try:
            return ShapeBatchedLoader(buckets, batch_size=1, shuffle=False, num_canonical_nodes=1)
        except FileExistsError:
            if attempt == 19:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def loader_keys(shards_root: str, out: str) -> None:
    """The keys the default loader yields over ``shards_root`` (or its error), as JSON.

    Run in a child because streaming keeps every ``SharedMemory`` it opens alive until
    exit (an atexit handler per segment): in one long-lived process each loader leaks file
    descriptors. A forked child never runs atexit, so its handlers run here, by hand.
    """
    handlers: list[tuple[Any, tuple, dict]] = []
    real_register = atexit.register
    atexit.register = lambda f, *a, **k: handlers.append((f, a, k)) or f  # type: ignore[assignment]
    loader = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tiny buckets, all-skipped partitions: expected
            buckets = discover_streams(shards_root)
            keys: list[str] = []
            if buckets:
                loader = _construct(buckets)
                keys = [k for batch in loader for k in batch["key"]]
        result: dict[str, Any] = {"keys": keys}
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the trial
        result = {"error": traceback.format_exc()}
    finally:
        atexit.register = real_register
    del loader
    gc.collect()
    for f, a, k in reversed(handlers):
        try:
            f(*a, **k)
        except Exception:  # noqa: BLE001 - best-effort cleanup of shared memory
            pass
    Path(out).write_text(json.dumps(result))


JOBS = {
    "write_shards": write_shards,
    "refresh_skiplists": refresh_skiplists,
    "ingest_batch": ingest_batch,
    "materialize_asset": materialize_asset,
    "take_in_list": take_in_list,
    "loader_keys": loader_keys,
    "make_snapshot": make_snapshot,
}


def run_job(job: str, crash_at: str | None, kwargs: dict[str, Any]) -> None:
    """Child entry point: arm the crashpoint (if any), then run the writer."""
    gc.freeze()  # the inherited heap is not this child's garbage: keep collections cheap
    if crash_at:
        os.environ[crashpoints.ENV_VAR] = crash_at
        crashpoints.parse_spec(crash_at)  # a bad spec fails loudly, not "never crashed"
    else:
        os.environ.pop(crashpoints.ENV_VAR, None)
    crashpoints.reset()
    JOBS[job](**kwargs)
