"""Request each stale partition's rerun once, a bounded number per tick: the sensors' loop.

Why one helper: the dedup, model-swap and skip-dirty sensors all turn "what is stale now"
into run requests the same way. Each rerun has a run key that digests the stale state it
answers, so Dagster runs one state once and a new mark gives a new key. The cursor holds
the keys already requested that are still wanted: a partition beyond ``max_runs`` is
requested on a later tick, a requested one is not asked again, and a key that is no longer
wanted (its state was answered, or changed) drops out. A failed run is therefore not
requested again until its state changes: rerun it by hand.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from dagster import RunRequest, SensorResult, SkipReason


def check_max_runs(max_runs_per_tick: int) -> int:
    """``max_runs_per_tick``, refused below 1 when the sensor is built (not at a tick)."""
    if max_runs_per_tick < 1:
        raise ValueError(f"max_runs_per_tick must be >= 1, got {max_runs_per_tick}")
    return max_runs_per_tick


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
