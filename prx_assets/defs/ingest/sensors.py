"""The landing sensor: each complete batch in the landing zone is registered exactly once."""

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from prx_assets.core.ingest.cursor import CursorError, decode_keys, encode_keys
from prx_assets.core.ingest.remote_landing import discover_landing
from prx_assets.core.ingest.sources import BatchError
from prx_assets.defs.jobs import batch_pipeline_job
from prx_assets.defs.metadata import bounded
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource


@sensor(
    job=batch_pipeline_job,
    minimum_interval_seconds=30,
    default_status=DefaultSensorStatus.RUNNING,
    description="Registers each new batch of the landing zone as a partition and runs it.",
)
def landing_sensor(context: SensorEvaluationContext, lab: LabResource):
    # The cursor holds every key this sensor registered (compactly: core/ingest/cursor.py):
    # a partition deleted by hand is not silently re-created, and no batch is requested twice.
    try:
        registered = decode_keys(context.cursor)
    except CursorError as exc:  # never forget what was registered: request nothing instead
        return SkipReason(f"landing cursor unreadable, nothing requested: {bounded(str(exc), 400)}")
    try:
        refs = discover_landing(lab.landing_uri)  # a local directory or an s3:// prefix
    except (BatchError, OSError) as exc:
        return SkipReason(f"landing zone unreadable: {exc}")
    existing = set(context.instance.get_dynamic_partitions(BATCHES.name))
    new = [r.key for r in refs if r.key not in registered and r.key not in existing]
    if not new:
        return SkipReason(f"no new batches in {lab.landing_uri} ({len(refs)} known)")
    context.log.info(f"registering {len(new)} new batch(es): {bounded(', '.join(new), 400)}")
    return SensorResult(
        run_requests=[RunRequest(partition_key=k, run_key=f"landing:{k}") for k in new],
        dynamic_partitions_requests=[BATCHES.build_add_request(new)],
        cursor=encode_keys(registered | set(new)),
    )
