"""Settle cross-batch decisions without a daemon: run what ``dedup_sensor`` and
``skip_dirty_sensor`` would request.

The CLI (``register-batch --materialize``) and the demo call this after materialising, so
a user who never starts the daemon still reaches the settled state: every partition whose
stored keepers a newer batch contradicts gets its ``phash_clusters`` and skip-lists rerun.
The decision of what to rerun is the sensor's own (:func:`prx_assets.core.dedup.reruns.dedup_reruns`
via :func:`prx_assets.core.dedup.reruns.settle_dedup`); only the execution differs (in process).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from dagster import AssetKey, DagsterInstance, Definitions

from prx_assets.core.dedup.reruns import (
    DEFAULT_SETTLE_ROUNDS,
    DedupRerun,
    SettleReport,
    settle_dedup,
)
from prx_assets.defs.dedup.assets import IMAGE_HASHES_ASSET, PHASH_CLUSTERS_ASSET
from prx_assets.defs.dedup.sensors import REASON_TAG
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.run_requests import QUIET
from prx_assets.defs.tags import TRIGGER_TAG


def settle_dedup_in_process(
    defs: Definitions,
    instance: DagsterInstance,
    downstream: Sequence[str],
    *,
    tags: Mapping[str, str] | None = None,
    max_rounds: int = DEFAULT_SETTLE_ROUNDS,
    log: Callable[[str], None] = print,
) -> SettleReport:
    """Rerun every stale registered partition in process, at most ``max_rounds`` rounds.

    ``downstream``: what the project's dedup sensor reruns after ``phash_clusters``
    (``DOWNSTREAM_OF_DEDUP``). Each rerun is logged with its reason; the report says what
    ran, what failed and what is still stale.
    """
    resources = defs.resources or {}
    lab = resources["lab"].lab()
    settings = resources["dedup"].settings()
    registered = set(instance.get_dynamic_partitions(BATCHES.name))
    job = defs.resolve_implicit_global_asset_job_def()

    def execute(rerun: DedupRerun) -> bool:
        reason = "; ".join(rerun.reasons)
        log(f"dedup: rerunning {', '.join(rerun.assets)} for {rerun.batch} ({reason})")
        result = job.execute_in_process(
            partition_key=rerun.batch,
            asset_selection=[AssetKey(a) for a in rerun.assets],
            instance=instance,
            run_config=QUIET,
            raise_on_error=False,
            tags={TRIGGER_TAG: "dedup", REASON_TAG: reason[:200], **(tags or {})},
        )
        return result.success

    def skip_dirty() -> dict[str, DedupRerun]:
        # Batches whose training copy another batch's skip_lists run changed: what
        # skip_dirty_sensor would request (skip_lists only).
        from prx_assets.defs.skiplists.sensors import SKIP_LISTS_ASSET, skip_dirty_reruns

        return {
            batch: DedupRerun(batch, (SKIP_LISTS_ASSET,), r.run_key, (r.reason,))
            for batch, r in skip_dirty_reruns(lab, registered).items()
        }

    return settle_dedup(
        lab,
        settings,
        registered,
        execute,
        downstream,
        max_rounds,
        hashes_asset=IMAGE_HASHES_ASSET,
        clusters_asset=PHASH_CLUSTERS_ASSET,
        also_stale=skip_dirty,
    )


def describe_settle(report: SettleReport) -> str:
    """One line for the console: settled or not, and what was rerun."""
    batches = sorted({r.batch for r in report.reruns})
    if report.settled:
        if not batches:
            return "dedup: settled (no partition's decisions were stale)"
        return (
            f"dedup: settled after rerunning {len(batches)} partition(s) in "
            f"{report.rounds} round(s): {', '.join(batches)}"
        )
    failed = ", ".join(sorted({r.batch for r in report.failed})) or "none"
    return (
        f"dedup: NOT settled (failed: {failed}; still stale: "
        f"{', '.join(report.still_stale) or 'none'}); the dedup sensor or a rerun of "
        "this command retries them"
    )
