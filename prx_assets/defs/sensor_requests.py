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

Wanted = Callable[..., list[RunRequest]]


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
) -> SensorDefinition:
    """A sensor whose tick requests, via :func:`request_once`, what ``wanted`` returns.

    ``wanted(context, **resources)``: every rerun wanted now; its parameters after the
    context name the resources it gets (``lab: LabResource`` gets the ``lab`` resource).
    ``targets``: the assets the requests may select. Each request is logged with its
    ``reason_tag`` value when it has one. ``max_runs_per_tick`` below 1 is refused here,
    when the sensor is built, not at a tick.
    """
    if max_runs_per_tick < 1:
        raise ValueError(f"max_runs_per_tick must be >= 1, got {max_runs_per_tick}")
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
        result = request_once(
            context.cursor, wanted(context, **resources), max_runs_per_tick, state=state
        )
        for r in result.run_requests or []:
            why = f": {r.tags[reason_tag]}" if reason_tag and reason_tag in r.tags else ""
            context.log.info(f"{name}: rerun of {r.partition_key}{why}")
        return result

    return _rerun_sensor
