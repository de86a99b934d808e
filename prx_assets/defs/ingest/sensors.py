"""The landing sensor: each complete batch in the landing zone is registered exactly once."""

from pathlib import Path

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from prx_assets.core.ingest.cursor import (
    CursorError,
    RegisteredKeys,
    encode_cursor,
    split_cursor,
)
from prx_assets.core.ingest.remote_landing import discover_landing
from prx_assets.core.ingest.sources import BatchError
from prx_assets.core.ingest.watch import WatchState, WatchStateError, scan_landing
from prx_assets.core.storage import is_remote
from prx_assets.defs.jobs import batch_pipeline_job
from prx_assets.defs.metadata import bounded
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource

PER_KEY_LOOKUPS = 64


@sensor(
    job=batch_pipeline_job,
    minimum_interval_seconds=30,
    default_status=DefaultSensorStatus.RUNNING,
    description="Registers each new batch of the landing zone as a partition and runs it.",
)
def landing_sensor(context: SensorEvaluationContext, lab: LabResource):
    # The cursor holds every key this sensor registered (compactly: core/ingest/cursor.py):
    # a partition deleted by hand is not silently re-created, and no batch is requested twice.
    # With it, what the last scan of a local landing zone saw (core/ingest/watch.py): an
    # unchanged source is not listed again, so an idle tick costs O(sources + pending).
    try:
        keys_text, watch = split_cursor(context.cursor)
        state = WatchState.from_json(watch) if watch is not None else WatchState()
    except (CursorError, WatchStateError) as exc:  # never forget: request nothing instead
        return SkipReason(f"landing cursor unreadable, nothing requested: {bounded(str(exc), 400)}")
    registered: RegisteredKeys | None = None

    def is_known(key: str) -> bool:
        nonlocal registered
        if registered is None:  # decoded only when a listing has an entry to look up
            registered = RegisteredKeys.from_text(keys_text)
        return key in registered

    landing = lab.landing_uri
    try:
        if is_remote(landing):  # object storage has no directory mtimes: listed in full,
            scan = None  # but only new folders' markers are asked about
            new_refs = discover_landing(landing, known=is_known)
        else:
            scan = scan_landing(Path(landing), state, is_known)
            new_refs = scan.new
    except CursorError as exc:
        return SkipReason(f"landing cursor unreadable, nothing requested: {bounded(str(exc), 400)}")
    except (BatchError, OSError) as exc:
        return SkipReason(f"landing zone unreadable: {bounded(str(exc), 400)}")
    new = [r.key for r in new_refs]
    # Registered by hand (not through this sensor): not requested again. One look-up per new
    # key when few are new, the instance's whole partition list when many are (a first tick).
    if len(new) > PER_KEY_LOOKUPS:
        existing = set(context.instance.get_dynamic_partitions(BATCHES.name))
        new = [k for k in new if k not in existing]
    else:
        new = [k for k in new if not context.instance.has_dynamic_partition(BATCHES.name, k)]
    if new:
        known = registered if registered is not None else RegisteredKeys.from_text(keys_text)
        known.add(new)
        keys_out = known.to_text()
    else:
        keys_out = keys_text
    cursor = encode_cursor(keys_out, (scan.state if scan else WatchState()).to_json())
    seen = (
        f"{scan.listed_sources} source(s) listed, {scan.skipped_sources} unchanged" if scan else ""
    )
    if not new:
        why = f"no new batches in {bounded(landing, 200)}" + (f" ({seen})" if seen else "")
        return SensorResult(skip_reason=SkipReason(why), cursor=cursor)
    context.log.info(f"registering {len(new)} new batch(es): {bounded(', '.join(new), 400)}")
    return SensorResult(
        run_requests=[RunRequest(partition_key=k, run_key=f"landing:{k}") for k in new],
        dynamic_partitions_requests=[BATCHES.build_add_request(new)],
        cursor=cursor,
    )
