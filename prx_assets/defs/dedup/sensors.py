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

from collections.abc import Callable, Sequence

from dagster import AssetKey, DefaultSensorStatus, RunRequest, SensorDefinition

from prx_assets.core.dedup import reruns as core_reruns
from prx_assets.core.dedup.decisions import DedupSettings
from prx_assets.core.dedup.reruns import DedupRerun
from prx_assets.core.lab import Lab
from prx_assets.defs.dedup.assets import IMAGE_HASHES_ASSET, PHASH_CLUSTERS_ASSET
from prx_assets.defs.dedup.config import DedupConfigResource
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.sensor_requests import rerun_sensor
from prx_assets.defs.tags import TRIGGER_TAG

REASON_TAG = "prx/dedup_reason"


def dedup_reruns(
    lab: Lab,
    settings: DedupSettings,
    downstream: Sequence[str] = (),
    registered: set[str] | None = None,
) -> dict[str, DedupRerun]:
    """The sensor's decision (:func:`prx_assets.core.dedup.reruns.dedup_reruns`), this stage's assets."""
    return core_reruns.dedup_reruns(
        lab,
        settings,
        downstream,
        registered,
        hashes_asset=IMAGE_HASHES_ASSET,
        clusters_asset=PHASH_CLUSTERS_ASSET,
    )


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
    downstream = tuple(downstream)

    def wanted(context, lab: LabResource, dedup: DedupConfigResource) -> list[RunRequest]:
        registered = set(context.instance.get_dynamic_partitions(BATCHES.name))
        stale = dedup_reruns(lab.lab(), dedup.settings(), downstream, registered)
        return [
            RunRequest(
                run_key=rerun.run_key,
                partition_key=rerun.batch,
                asset_selection=[AssetKey(a) for a in rerun.assets],
                tags={TRIGGER_TAG: "dedup", REASON_TAG: "; ".join(rerun.reasons)[:200]},
            )
            for rerun in stale.values()
        ]

    return rerun_sensor(
        wanted,
        name=name,
        targets=[IMAGE_HASHES_ASSET, PHASH_CLUSTERS_ASSET, *downstream],
        description=(
            "Reruns phash_clusters (and the skip-lists) of exactly the partitions whose stored "
            "dedup decisions a newer batch contradicts (dedup_dirty), or that were decided "
            "under another dedup configuration."
        ),
        max_runs_per_tick=max_runs_per_tick,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        reason_tag=REASON_TAG,
    )


dedup_sensor = build_dedup_sensor()


def settle_dedup(
    lab: Lab,
    settings: DedupSettings,
    registered: set[str],
    execute: Callable[[str, list[AssetKey]], bool],
    downstream: Sequence[str] = (),
    max_rounds: int = 3,
) -> list[DedupRerun]:
    """:func:`prx_assets.core.dedup.reruns.settle_dedup` with asset keys; raises unless settled.

    ``execute(batch, asset_keys)`` materialises one partition and returns success.
    """
    report = core_reruns.settle_dedup(
        lab,
        settings,
        registered,
        lambda rerun: execute(rerun.batch, [AssetKey(a) for a in rerun.assets]),
        downstream,
        max_rounds,
        hashes_asset=IMAGE_HASHES_ASSET,
        clusters_asset=PHASH_CLUSTERS_ASSET,
    )
    if report.failed:
        failed = report.failed[0]
        raise RuntimeError(f"dedup rerun of {failed.batch} ({failed.assets}) failed")
    if report.still_stale:
        raise RuntimeError(
            f"dedup decisions still stale after {max_rounds} rounds: {report.still_stale}"
        )
    return report.reruns
