"""Sensors that request each stale partition's rerun once, a bounded number per tick.

Why one helper: the dedup, model-swap and skip-dirty sensors all turn "what is stale now"
into run requests the same way; only *what is stale* differs. Each rerun has a run key that
digests the stale state it answers, so Dagster runs one state once and a new mark gives a
new key. The cursor holds the keys already requested that are still wanted: a partition
beyond ``max_runs_per_tick`` is requested on a later tick, a requested one is not asked
again, and a key that is no longer wanted (its state was answered, or changed) drops out. A
failed run is therefore not requested again until its state changes: rerun it by hand.

A stage writes ``wanted(context, <resources>) -> list[RunRequest]`` (its decision, with the
resources it needs as typed parameters) and builds the sensor with :func:`rerun_sensor`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

from dagster import (
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
)

from prx_assets.core.skiplists.reruns import PartitionRun, plan_partition_runs
from prx_assets.defs.partitions import BATCHES

Wanted = Callable[..., list[RunRequest]]

PARTITIONS_TAG = "prx/partitions"  # how many partitions a range run covers
BRIDGED_TAG = "prx/bridged_partitions"  # of which not wanted by what caused the run


def partition_run_tags(run: PartitionRun) -> dict[str, str]:
    """A range run's tags: the range (what Dagster materialises) and its size; a run of one
    partition is a plain partition run (no tags)."""
    if len(run.batches) == 1:
        return {}
    return {
        ASSET_PARTITION_RANGE_START_TAG: run.first,
        ASSET_PARTITION_RANGE_END_TAG: run.last,
        PARTITIONS_TAG: str(len(run.batches)),
        BRIDGED_TAG: str(len(run.bridged)),
    }


def request_ranges_once(
    cursor: str | None,
    wanted: Sequence[RunRequest],
    max_runs: int,
    ordered: Sequence[str],
    max_per_run: int,
    max_bridge: int,
    *,
    state: str = "stale",
    reason_tag: str | None = None,
) -> SensorResult:
    """:func:`request_once` for partition requests of one asset selection, as runs over
    ranges of ``ordered`` (``plan_partition_runs``): a run costs seconds before its work.

    Each wanted request is one partition's state (its run key); the cursor holds the state
    keys requested and still wanted, so a partition is requested once per state, never
    again while its run is pending. A range run's key digests the state keys it answers;
    its tags are the first member's plus the range's (``reason_tag``'s value then says how
    many partitions and the first one's reason). With ``max_per_run`` 1 this is
    :func:`request_once`.
    """
    if max_per_run <= 1:
        return request_once(cursor, wanted, max_runs, state=state)
    if any(r.run_key is None or r.partition_key is None for r in wanted):
        raise ValueError("every request needs a run key and a partition")
    selections = {tuple(r.asset_selection or ()) for r in wanted}
    if len(selections) > 1 or len({r.job_name for r in wanted}) > 1:
        raise ValueError("a range run needs one asset selection and job for every request")
    by_batch = {r.partition_key: r for r in wanted}
    if len(by_batch) != len(wanted):
        raise ValueError("one state per partition: two requests name the same partition")
    keys = {r.run_key for r in wanted}
    pending = set(json.loads(cursor)) & keys if cursor else set()
    todo = {b: r for b, r in by_batch.items() if r.run_key not in pending}
    requests: list[RunRequest] = []
    runs = plan_partition_runs(ordered, todo, max_per_run, max_bridge)
    known = set(ordered)
    # A partition not (or no longer) in the order is requested alone, as before batching:
    # Dagster says what became of it rather than the sensor leaving it out unsaid.
    runs += [PartitionRun(b, b, (b,), (b,)) for b in todo if b not in known]
    for run in runs[:max_runs]:
        members = [todo[b] for b in run.wanted]
        first = members[0]
        if len(run.batches) == 1:
            requests.append(first)
        else:
            digest = hashlib.sha256("\0".join(m.run_key for m in members).encode()).hexdigest()
            prefix = first.run_key.split(":", 1)[0]
            tags = dict(first.tags)
            if reason_tag and reason_tag in tags:
                tags[reason_tag] = f"{len(members)} partition(s); {tags[reason_tag]}"[:200]
            requests.append(
                RunRequest(
                    run_key=f"{prefix}:{run.first}..{run.last}:{digest[:16]}",
                    job_name=first.job_name,
                    asset_selection=first.asset_selection,
                    tags={**tags, **partition_run_tags(run)},
                )
            )
        pending |= {m.run_key for m in members}
    new_cursor = json.dumps(sorted(pending))
    if not requests:
        why = f"{len(wanted)} {state} partition(s), all requested" if wanted else f"none {state}"
        return SensorResult(skip_reason=SkipReason(why), cursor=new_cursor)
    return SensorResult(run_requests=requests, cursor=new_cursor)


def request_once(
    cursor: str | None,
    wanted: Sequence[RunRequest],
    max_runs: int,
    *,
    state: str = "stale",
) -> SensorResult:
    """The ``wanted`` requests not requested yet, at most ``max_runs``, and the new cursor.

    Each request must carry its run key; ``cursor`` is the previous tick's (a JSON list of
    keys). Building every wanted request is cheap (a few microseconds each), so callers
    pass them all. The skip reason says ``"none <state>"`` or ``"<n> <state> partition(s),
    all requested"``.
    """
    if any(r.run_key is None for r in wanted):
        raise ValueError("every request needs a run key: it is how a state is requested once")
    keys = {r.run_key for r in wanted}
    pending = set(json.loads(cursor)) & keys if cursor else set()
    requests: list[RunRequest] = []
    for request in wanted:
        if request.run_key in pending:
            continue
        if len(requests) == max_runs:
            break
        requests.append(request)
        pending.add(request.run_key)
    new_cursor = json.dumps(sorted(pending))
    if not requests:
        why = f"{len(wanted)} {state} partition(s), all requested" if wanted else f"none {state}"
        return SensorResult(skip_reason=SkipReason(why), cursor=new_cursor)
    return SensorResult(run_requests=requests, cursor=new_cursor)


def _resource_keys(wanted: Wanted) -> list[str]:
    """The parameters of ``wanted`` after the context: the resource keys it is given."""
    params = list(inspect.signature(wanted).parameters.values())
    if not params or params[0].kind not in (
        params[0].POSITIONAL_ONLY,
        params[0].POSITIONAL_OR_KEYWORD,
    ):
        raise TypeError("wanted(context, ...) must take the sensor context first")
    return [p.name for p in params[1:]]


def rerun_sensor(
    wanted: Wanted,
    *,
    name: str,
    targets: Sequence[str],
    description: str,
    max_runs_per_tick: int,
    minimum_interval_seconds: int,
    default_status: DefaultSensorStatus,
    state: str = "stale",
    reason_tag: str | None = None,
    max_partitions_per_run: int = 1,
    max_bridge: int = 0,
) -> SensorDefinition:
    """A sensor whose tick requests, via :func:`request_once`, what ``wanted`` returns.

    ``wanted(context, **resources)``: every rerun wanted now; its parameters after the
    context name the resources it gets (``lab: LabResource`` gets the ``lab`` resource).
    ``targets``: the assets the requests may select. Each request is logged with its
    ``reason_tag`` value when it has one. ``max_runs_per_tick`` below 1 is refused here,
    when the sensor is built, not at a tick. ``max_partitions_per_run`` above 1: the
    partitions are requested as runs over ranges (:func:`request_ranges_once`).
    """
    if max_runs_per_tick < 1:
        raise ValueError(f"max_runs_per_tick must be >= 1, got {max_runs_per_tick}")
    if max_partitions_per_run < 1 or max_bridge < 0:
        raise ValueError(
            f"max_partitions_per_run must be >= 1 and max_bridge >= 0, got "
            f"{max_partitions_per_run} and {max_bridge}"
        )
    keys = _resource_keys(wanted)

    @sensor(
        name=name,
        target=AssetSelection.assets(*dict.fromkeys(targets)),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=description,
        required_resource_keys=set(keys),
    )
    def _rerun_sensor(context: SensorEvaluationContext, **_passed: Any) -> SensorResult:
        # Dagster passes required resources as keywords when a sensor is invoked directly,
        # not on a daemon tick; both paths hold them on the context, so read them there.
        resources = {k: getattr(context.resources, k) for k in keys}
        asked = wanted(context, **resources)
        if max_partitions_per_run > 1:
            ordered = context.instance.get_dynamic_partitions(BATCHES.name)
            result = request_ranges_once(
                context.cursor,
                asked,
                max_runs_per_tick,
                ordered,
                max_partitions_per_run,
                max_bridge,
                state=state,
                reason_tag=reason_tag,
            )
        else:
            result = request_once(context.cursor, asked, max_runs_per_tick, state=state)
        for r in result.run_requests or []:
            why = f": {r.tags[reason_tag]}" if reason_tag and reason_tag in r.tags else ""
            what = r.partition_key or f"{r.tags.get(PARTITIONS_TAG)} partitions"
            context.log.info(f"{name}: rerun of {what}{why}")
        return result

    return _rerun_sensor
