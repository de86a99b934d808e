"""Carry out sensor run requests in process (the demo and the tests; the daemon does it live)."""

from dagster import (
    AssetKey,
    DagsterInstance,
    Definitions,
    RunRequest,
    SensorDefinition,
    SensorResult,
    build_sensor_context,
)

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def console_logs(verbose: bool = False) -> dict:
    """Run config for a run in this process: by default the console shows the steps' own
    lines (summaries and progress: count, rate, ETA) and warnings; ``verbose`` also every
    Dagster event (DEBUG: ~60 lines per batch). Every event is in the instance either way."""
    return {"loggers": {"console": {"config": {"log_level": "DEBUG" if verbose else "INFO"}}}}


def evaluate_sensor(
    defs: Definitions, instance: DagsterInstance, name: str, cursor: str | None = None
) -> tuple[list[RunRequest], str | None]:
    """One tick of a sensor; dynamic-partition requests are applied, like the daemon does."""
    sensor: SensorDefinition = defs.resolve_sensor_def(name)
    resources = defs.resources or {}
    with build_sensor_context(
        instance=instance, cursor=cursor, resources=resources, definitions=defs
    ) as ctx:
        result = sensor(ctx)
        new_cursor = ctx.cursor
    if result is None or not isinstance(result, SensorResult | RunRequest | list):
        return [], new_cursor
    if isinstance(result, RunRequest):
        return [result], new_cursor
    if isinstance(result, list):
        return [r for r in result if isinstance(r, RunRequest)], new_cursor
    for req in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return list(result.run_requests or []), result.cursor or new_cursor


def execute_run_request(
    defs: Definitions, instance: DagsterInstance, request: RunRequest, job_name: str | None
) -> bool:
    """Run what a request asks for: its job, or its asset selection, for its partition."""
    if request.asset_selection:
        keys = [AssetKey.from_coercible(k) for k in request.asset_selection]
        job = defs.resolve_implicit_global_asset_job_def()
        result = job.execute_in_process(
            instance=instance,
            partition_key=request.partition_key,
            asset_selection=keys,
            run_config=QUIET,
            raise_on_error=False,
            tags=dict(request.tags or {}),
        )
    else:
        job = defs.resolve_job_def(request.job_name or job_name)
        result = job.execute_in_process(
            instance=instance,
            partition_key=request.partition_key,
            run_config=QUIET,
            raise_on_error=False,
            tags=dict(request.tags or {}),
        )
    return result.success
