"""Lance maintenance: compaction toward ~1M rows per fragment, index refresh, version cleanup,
removal of files no version references (left by killed writers), and collection of the
blobs no retained version names (replaced or deleted images).

The write path already keeps every table indexed, tiered-compacted and its versions bounded
(``core/lab/maintenance.py``); this job adds full compaction and orphaned-file removal."""

from datetime import timedelta

from dagster import (
    Config,
    DefaultScheduleStatus,
    MetadataValue,
    OpExecutionContext,
    Output,
    ScheduleDefinition,
    job,
    op,
)
from pydantic import Field

from prx_assets.core.lab import DEFAULT_POLICY, ORPHAN_MIN_AGE, TARGET_ROWS_PER_FRAGMENT
from prx_assets.core.tables import LAB_TABLES
from prx_assets.defs.resources import LabResource

# Below this, a long partition write still in flight could lose its fragments before its
# commit; the core API accepts 0 for offline use (no writer running), the job does not.
MIN_ORPHAN_AGE_HOURS = 1.0


class MaintenanceConfig(Config):
    """How far to compact, how long to keep old versions and unreferenced files."""

    # The seed found fragment size decides query speed; ~1M rows is its sweet spot.
    target_rows_per_fragment: int = TARGET_ROWS_PER_FRAGMENT
    retention_days: float = 7.0
    keep_versions: int = Field(
        default=DEFAULT_POLICY.keep_versions,
        ge=1,
        description="Versions beyond the newest this many go once older than the minimum age.",
    )
    version_min_age_minutes: float = Field(
        default=DEFAULT_POLICY.version_min_age.total_seconds() / 60,
        ge=0,
        description=(
            "No version younger than this is removed (one-shot readers may still use it); "
            "on a local lab the versions live views hold are kept whatever their age."
        ),
    )
    orphan_min_age_hours: float = Field(
        default=ORPHAN_MIN_AGE.total_seconds() / 3600,
        ge=MIN_ORPHAN_AGE_HOURS,
        description=(
            "Files no version references (a writer killed before its commit) and blobs no "
            "retained version names are deleted once this old. Must exceed the longest "
            "write from first fragment (or blob) to commit."
        ),
    )


@op(
    description=(
        "Compact every lab table, optimise its indexes, drop versions past retention, "
        "delete files no version references and blobs no retained version names, once "
        "older than orphan_min_age_hours."
    )
)
def compact_lab_tables(
    context: OpExecutionContext, config: MaintenanceConfig, lab: LabResource
) -> Output[list]:
    store = lab.lab()
    results = []
    for spec in LAB_TABLES:
        result = store.maintain(
            spec,
            target_rows_per_fragment=config.target_rows_per_fragment,
            retention=timedelta(days=config.retention_days),
            orphan_min_age=timedelta(hours=config.orphan_min_age_hours),
            keep_versions=config.keep_versions,
            version_min_age=timedelta(minutes=config.version_min_age_minutes),
        )
        if spec.blobs:  # after cleanup: blobs only dropped versions named go now
            result["blobs"] = store.sweep_blobs(
                spec, min_age=timedelta(hours=config.orphan_min_age_hours)
            )
        context.log.info(f"{spec.name}: {result}")
        results.append(result)
    return Output(results, metadata={"tables": MetadataValue.json(results)})


@job(description="Lance maintenance for every lab table.")
def lance_maintenance():
    compact_lab_tables()


lance_maintenance_schedule = ScheduleDefinition(
    job=lance_maintenance,
    cron_schedule="0 3 * * *",
    default_status=DefaultScheduleStatus.STOPPED,  # off until a data lead turns it on
    description="Nightly Lance compaction and cleanup (off by default).",
)
