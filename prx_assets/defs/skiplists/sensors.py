"""The skip-list stage's sensors: each decides (in ``core.skiplists.reruns``) and requests
runs; none writes a table.

- the opt-out sensor, in two steps: a new list file -> the intake run of its
  ``opt_out_lists`` partition (which records it); on a later tick, the recorded list ->
  ``skip_lists`` for the partitions holding a copy it names, or any other copy of that
  picture (its pHash cluster, any batch);
- the skip-policy sensor: partitions decided under another policy;
- the skip-dirty sensor: partitions whose recorded decisions another batch's ``skip_lists``
  run found contradicted (``skip_dirty``: e.g. their copy became the training copy because
  the keeper was reclassified).

Why a sensor (measured with Dagster 1.13.27): with the opt-outs as an upstream asset of
``skip_lists`` under eager automation every new list reran ``skip_lists`` for every
partition; a sensor that resolves the affected batches and requests ``skip_lists`` for
those partition keys runs exactly those.

Why runs over ranges of partitions: a run costs far more than a small partition's decision
work (3.5–4.4 s per run here, the run worker loading the code location and the run's
events, against ~0.1 s of decision work for a partition of a few samples:
``python -m benchmarks.bench_optout_fanout``), so one run per partition made a list reaching
1,000 partitions cost about an hour of runs, one at a time. The affected partitions are requested as runs over ranges of the partition keys
(``plan_partition_runs``: at most ``max_partitions_per_run`` per run, bridging gaps of at
most ``max_bridge`` unaffected partitions, which are re-decided, idempotently); the
``skip_lists`` asset materialises each partition of its range on its own, with its own
metadata and status. A range of one partition is a plain partition run. Each run key names
the list ids and digests the exact partitions, so every run is traceable to the lists that
caused it and Dagster never requests the same (lists, partitions) twice, even when the
cursor is lost. The intake's run key is the list id, so each list is taken in once.

Why the opt-out sensor waits for the intake instead of requesting both at once: which
partitions a list affects is known only once its identifiers are parsed and resolved, and
that is the intake's (recorded, rerunnable) work, not a sensor tick's.

Opt-out formats and rules: see :mod:`prx_assets.core.skiplists.optouts`.
"""

from pathlib import Path

from dagster import (
    AssetKey,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from prx_assets.core.skiplists.intake import list_partition_key
from prx_assets.core.skiplists.reruns import (
    DEFAULT_MAX_BRIDGE,
    DEFAULT_PARTITIONS_PER_RUN,
    OptOutCursor,
    OptOutTick,
    SkipRerun,
    intake_run_key,
    opt_out_range_run_key,
    opt_out_run_key,
    plan_opt_out_tick,
    plan_partition_runs,
    skip_dirty_reruns,
    stale_policy_batches,
)
from prx_assets.defs.metadata import bounded
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.sensor_requests import partition_run_tags, rerun_sensor
from prx_assets.defs.skiplists.assets import SKIP_LISTS_ASSET
from prx_assets.defs.skiplists.config import OptOutResource, SkipPolicyResource
from prx_assets.defs.skiplists.intake import OPT_OUT_LISTS, OPT_OUT_LISTS_ASSET
from prx_assets.defs.skiplists.jobs import opt_out_intake_job, opt_out_skip_lists_job
from prx_assets.defs.tags import TRIGGER_TAG

SKIP_DIRTY_REASON_TAG = "prx/skip_dirty_reason"

# Re-exported for the CLI's settling (defs/dedup/settle.py) and older imports.
__all__ = ["SKIP_LISTS_ASSET", "SkipRerun", "skip_dirty_reruns", "stale_policy_batches"]

LISTS_TAG = "prx/opt_out_lists"
MAX_TAG_CHARS = 2000


def _joined(ids: list[str]) -> str:
    text = ",".join(ids)
    if len(text) <= MAX_TAG_CHARS:
        return text
    return text[: MAX_TAG_CHARS - 40].rsplit(",", 1)[0] + f",... ({len(ids)} lists)"


def build_opt_out_sensor(
    *,
    name: str = "opt_out_sensor",
    minimum_interval_seconds: int = 60,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """The opt-out sensor; ``minimum_interval_seconds`` is how often it looks for lists."""

    @sensor(
        name=name,
        jobs=[opt_out_intake_job, opt_out_skip_lists_job],
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            "Requests the intake (opt_out_lists partition) of each new opt-out list file once; "
            "once intake has recorded a list, requests skip_lists for the partitions holding "
            "any copy of an image it names, only."
        ),
    )
    def _opt_out_sensor(
        context: SensorEvaluationContext, lab: LabResource, optouts: OptOutResource
    ) -> SensorResult:
        cursor = OptOutCursor.load(context.cursor)
        # Read once: the partitions a tick plans for are exactly the ones it orders into runs
        # (a partition added or removed between two reads would be planned but not run).
        ordered = context.instance.get_dynamic_partitions(BATCHES.name)
        registered = set(ordered)
        directory = optouts.directory(lab)
        limit = max(1, optouts.max_lists_per_tick)
        tick = plan_opt_out_tick(lab.lab(), directory, cursor, limit, registered)
        for r in tick.recorded:
            if not r.accepted:
                reason = bounded(r.reason or "", 400)
                context.log.warning(f"opt-out list {r.list_id} rejected: {reason}")
        if tick.waiting:
            context.log.info(
                f"matched but not requested (no shards yet or not a partition): {tick.waiting}; "
                "skip_lists applies the lists when those batches reach it"
            )
        keys = [list_partition_key(f.list_id) for f in tick.intake]
        requests = [
            RunRequest(
                run_key=intake_run_key(f.list_id),
                job_name=opt_out_intake_job.name,
                partition_key=key,
                asset_selection=[AssetKey(OPT_OUT_LISTS_ASSET)],
                tags={TRIGGER_TAG: "opt_out", LISTS_TAG: f.list_id},
            )
            for f, key in zip(tick.intake, keys, strict=True)
        ]
        runs = plan_partition_runs(
            ordered, tick.skip_lists, optouts.max_partitions_per_run, optouts.max_bridge
        )
        for run in runs:
            lists = sorted({i for b in run.wanted for i in tick.skip_lists[b]})
            single = len(run.batches) == 1
            requests.append(
                RunRequest(
                    run_key=(
                        opt_out_run_key(lists, run.first)
                        if single
                        else opt_out_range_run_key(lists, run)
                    ),
                    job_name=opt_out_skip_lists_job.name,
                    partition_key=run.first if single else None,
                    asset_selection=[AssetKey(SKIP_LISTS_ASSET)],
                    tags={
                        TRIGGER_TAG: "opt_out",
                        LISTS_TAG: _joined(lists),
                        **partition_run_tags(run),
                    },
                )
            )
        if not requests:
            why = SkipReason(_quiet(tick, directory))
            return SensorResult(skip_reason=why, cursor=cursor.dump())
        return SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[OPT_OUT_LISTS.build_add_request(keys)] if keys else [],
            cursor=cursor.dump(),
        )

    return _opt_out_sensor


def _quiet(tick: OptOutTick, directory: Path) -> str:
    """The skip reason of a tick that requests nothing."""
    if tick.recorded:
        accepted = sum(r.accepted for r in tick.recorded)
        return (
            f"{len(tick.recorded)} list(s) recorded ({accepted} accepted); "
            "no sharded partition affected"
        )
    waiting = f"; {len(tick.awaiting)} awaiting their intake run" if tick.awaiting else ""
    return f"no new opt-out lists in {directory}{waiting}"


opt_out_sensor = build_opt_out_sensor()


# --------------------------------------------------------------------------- policy


def build_skip_policy_sensor(
    *,
    name: str = "skip_policy_sensor",
    minimum_interval_seconds: int = 300,
    max_runs_per_tick: int = 50,
    max_partitions_per_run: int = DEFAULT_PARTITIONS_PER_RUN,
    max_bridge: int = DEFAULT_MAX_BRIDGE,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """Reruns skip_lists (only) where ``skip_audit`` was decided under another policy.

    Eager automation ignores code-version changes, so the policy fingerprint in the code
    version marks the asset stale in the UI but reruns nothing; this sensor does, as runs
    over ranges of partitions (a policy change reaches every partition). Each partition's
    state key names the configured policy and its stale rows' own marker, so a partition is
    requested once per state (not again while its run is pending), and again after a policy
    switched back and forth.
    """

    def wanted(
        context: SensorEvaluationContext, lab: LabResource, skip_policy: SkipPolicyResource
    ) -> list[RunRequest]:
        fp = skip_policy.fingerprint()
        registered = set(context.instance.get_dynamic_partitions(BATCHES.name))
        return [
            RunRequest(
                run_key=f"skip_policy:{fp}:{batch}:{marker}",
                partition_key=batch,
                asset_selection=[AssetKey(SKIP_LISTS_ASSET)],
                tags={TRIGGER_TAG: "skip_policy"},
            )
            for batch, marker in stale_policy_batches(lab.lab(), fp).items()
            if batch in registered
        ]

    return rerun_sensor(
        wanted,
        name=name,
        targets=[SKIP_LISTS_ASSET],
        description="Reruns skip_lists for partitions decided under another skip policy.",
        max_runs_per_tick=max_runs_per_tick,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        state="policy-stale",
        max_partitions_per_run=max_partitions_per_run,
        max_bridge=max_bridge,
    )


skip_policy_sensor = build_skip_policy_sensor()


# --------------------------------------------------------------------------- skip_dirty


def build_skip_dirty_sensor(
    *,
    name: str = "skip_dirty_sensor",
    max_runs_per_tick: int = 25,
    max_partitions_per_run: int = DEFAULT_PARTITIONS_PER_RUN,
    max_bridge: int = DEFAULT_MAX_BRIDGE,
    minimum_interval_seconds: int = 60,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """Reruns skip_lists of exactly the partitions ``skip_dirty`` lists (see the module doc).

    Runs over ranges of partitions (``max_partitions_per_run``, ``max_bridge``: as the
    opt-out sensor's); each partition's state is a key digesting its marks, so the same
    state is requested once and a new mark gives a new request. The cursor keeps the state
    keys requested and still marked, so runs beyond ``max_runs_per_tick`` are requested on
    later ticks. A failed rerun is not requested again until its marks change: rerun it by
    hand. ``max_partitions_per_run=1``: one run per partition, its run key the state key.
    """

    def wanted(context: SensorEvaluationContext, lab: LabResource) -> list[RunRequest]:
        registered = set(context.instance.get_dynamic_partitions(BATCHES.name))
        return [
            RunRequest(
                run_key=rerun.run_key,
                partition_key=rerun.batch,
                asset_selection=[AssetKey(SKIP_LISTS_ASSET)],
                tags={TRIGGER_TAG: "skip_dirty", SKIP_DIRTY_REASON_TAG: rerun.reason[:200]},
            )
            for rerun in skip_dirty_reruns(lab.lab(), registered).values()
        ]

    return rerun_sensor(
        wanted,
        name=name,
        targets=[SKIP_LISTS_ASSET],
        description=(
            "Reruns skip_lists for the partitions whose recorded skip decisions another "
            "batch's skip_lists run contradicts (skip_dirty): e.g. a copy that must now be "
            "the training copy because its cluster's keeper was excluded, or stop being it."
        ),
        max_runs_per_tick=max_runs_per_tick,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        state="marked",
        reason_tag=SKIP_DIRTY_REASON_TAG,
        max_partitions_per_run=max_partitions_per_run,
        max_bridge=max_bridge,
    )


skip_dirty_sensor = build_skip_dirty_sensor()
