"""The dedup sensor: rerun exactly the partitions whose stored dedup decisions are stale.

Two sources, both tiny tables, so a tick costs what is stale (plus a row per batch), never
a scan of the decisions themselves:

- ``dedup_dirty``: rows that ``phash_clusters(B)`` wrote for *other* batches whose stored
  decisions its corpus-wide computation contradicts (e.g. B brought a higher-resolution
  copy, so an old keeper is now a duplicate). Those partitions get ``phash_clusters`` and
  the downstream assets (the skip-lists); their shards are never rewritten for dedup.
- ``dedup_state`` (one row per decided batch): batches decided under another
  configuration. A radius or threshold change reruns phash_clusters + downstream for every
  such partition and nothing upstream; a pHash mode change reruns image_hashes too.

One run per partition; its run key digests the stale state (dirty row ids, fingerprints
found, the configured fingerprint), so the same state is requested once, and a new mark
for a partition gives a new request. The cursor keeps the keys still stale, so partitions
beyond ``max_runs_per_tick`` are requested on later ticks. A failed rerun is not requested
again until the state changes: rerun it by hand.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dagster import (
    AssetKey,
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from prx_assets.core.dedup import (
    DedupSettings,
    dedup_run_key,
    read_dirty,
    stale_decisions,
)
from prx_assets.core.lab import Lab
from prx_assets.defs.dedup.assets import IMAGE_HASHES_ASSET, PHASH_CLUSTERS_ASSET
from prx_assets.defs.dedup.config import DedupConfigResource
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource

TRIGGER_TAG = "prx/trigger"


@dataclass(frozen=True)
class DedupRerun:
    batch: str
    assets: tuple[str, ...]
    run_key: str
    reasons: tuple[str, ...]  # human-readable, for the run's tags and the log


def dedup_reruns(
    lab: Lab,
    settings: DedupSettings,
    downstream: Sequence[str] = (),
    registered: set[str] | None = None,
) -> dict[str, DedupRerun]:
    """Batch -> what to rerun there, for every partition whose dedup rows are stale.

    ``registered``: the partitions that exist (others are ignored: a deleted partition's
    leftover rows must not resurrect it).
    """
    markers: dict[str, list[str]] = {}
    reasons: dict[str, list[str]] = {}
    by_batch: dict[str, list[dict]] = {}
    for row in read_dirty(lab).to_pylist():
        by_batch.setdefault(row["batch"], []).append(row)
    for batch, rows in by_batch.items():
        markers[batch] = [f"dirty:{r['dirty_id']}" for r in rows]
        by = ", ".join(sorted({r["detected_by"] for r in rows}))
        reasons[batch] = [f"{len(rows)} decision(s) changed by {by}"]
    stale = stale_decisions(lab, settings)
    for batch, found in stale.items():
        markers.setdefault(batch, []).append(f"decided:{found.config_fingerprint}")
        reasons.setdefault(batch, []).append(f"decided under {found.config_fingerprint}")
    out = {}
    for batch in sorted(markers):
        if registered is not None and batch not in registered:
            continue
        rehash = batch in stale and stale[batch].needs_rehash
        assets = ((IMAGE_HASHES_ASSET,) if rehash else ()) + (PHASH_CLUSTERS_ASSET, *downstream)
        assets = tuple(dict.fromkeys(assets))
        keyed = [*markers[batch], f"configured:{settings.fingerprint()}"]
        out[batch] = DedupRerun(
            batch=batch,
            assets=assets,
            run_key=dedup_run_key(batch, assets, keyed),
            reasons=tuple(reasons[batch]),
        )
    return out


def build_dedup_sensor(
    downstream: Sequence[str] = (),
    *,
    name: str = "dedup_sensor",
    max_runs_per_tick: int = 25,
    minimum_interval_seconds: int = 60,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """The dedup sensor; ``downstream`` are the assets rerun after phash_clusters.

    Pass ``("skip_lists",)`` in the full pipeline: a partition whose keepers changed needs its
    skip-list rewritten, never its shards.
    """
    if max_runs_per_tick < 1:
        raise ValueError(f"max_runs_per_tick must be >= 1, got {max_runs_per_tick}")
    downstream = tuple(downstream)
    targets = list(dict.fromkeys([IMAGE_HASHES_ASSET, PHASH_CLUSTERS_ASSET, *downstream]))

    @sensor(
        name=name,
        target=AssetSelection.assets(*targets),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            "Reruns phash_clusters (and the skip-lists) of exactly the partitions whose stored "
            "dedup decisions a newer batch contradicts (dedup_dirty), or that were decided "
            "under another dedup configuration."
        ),
    )
    def _dedup_sensor(
        context: SensorEvaluationContext, lab: LabResource, dedup: DedupConfigResource
    ) -> SensorResult:
        settings = dedup.settings()
        registered = set(context.instance.get_dynamic_partitions(BATCHES.name))
        wanted = dedup_reruns(lab.lab(), settings, downstream, registered)
        keys = {r.run_key for r in wanted.values()}
        pending = set(json.loads(context.cursor)) & keys if context.cursor else set()
        requests = []
        for rerun in wanted.values():
            if rerun.run_key in pending:
                continue
            if len(requests) == max_runs_per_tick:
                break
            requests.append(
                RunRequest(
                    run_key=rerun.run_key,
                    partition_key=rerun.batch,
                    asset_selection=[AssetKey(a) for a in rerun.assets],
                    tags={TRIGGER_TAG: "dedup", "prx/dedup_reason": "; ".join(rerun.reasons)[:200]},
                )
            )
            pending.add(rerun.run_key)
        cursor = json.dumps(sorted(pending))
        if not requests:
            why = f"{len(wanted)} stale partition(s), all requested" if wanted else "none stale"
            return SensorResult(skip_reason=SkipReason(why), cursor=cursor)
        for r in requests:
            context.log.info(f"dedup rerun of {r.partition_key}: {r.tags['prx/dedup_reason']}")
        return SensorResult(run_requests=requests, cursor=cursor)

    return _dedup_sensor


dedup_sensor = build_dedup_sensor()


def settle_dedup(
    lab: Lab,
    settings: DedupSettings,
    registered: set[str],
    execute: Callable[[str, list[AssetKey]], bool],
    downstream: Sequence[str] = (),
    max_rounds: int = 3,
) -> list[DedupRerun]:
    """Run what the dedup sensor would request, in process, until nothing is stale.

    For the demo and tests, where no daemon ticks the sensor: ``execute(batch, asset_keys)``
    materialises one partition (e.g. ``job.execute_in_process``) and returns success.
    Returns the reruns done; a failed one raises, naming the partition.
    """
    done: list[DedupRerun] = []
    for _ in range(max_rounds):
        wanted = dedup_reruns(lab, settings, downstream, registered)
        if not wanted:
            return done
        for rerun in wanted.values():
            if not execute(rerun.batch, [AssetKey(a) for a in rerun.assets]):
                raise RuntimeError(f"dedup rerun of {rerun.batch} ({rerun.assets}) failed")
            done.append(rerun)
    left = sorted(dedup_reruns(lab, settings, downstream, registered))
    if left:
        raise RuntimeError(f"dedup decisions still stale after {max_rounds} rounds: {left}")
    return done
