"""Jobs on training snapshots: retire one, diff two (launch from the UI with config)."""

from dagster import Config, MetadataValue, OpExecutionContext, Output, job, op

from prx_assets.core.snapshots.runner import retire_snapshot
from prx_assets.defs.resources import LabResource
from prx_assets.defs.snapshots.assets import diff_metadata


class RetireConfig(Config):
    """Which snapshot to retire: its files and Lance versions may be cleaned up afterwards."""

    name: str


class DiffConfig(Config):
    """Two snapshot names: what changed from ``a`` to ``b``."""

    a: str
    b: str


@op(description="Retire a training snapshot: unpin its files and Lance versions.")
def retire_one_snapshot(context: OpExecutionContext, config: RetireConfig, lab: LabResource):
    out = retire_snapshot(lab.lab(), lab.shards_root, config.name)
    context.log.info(f"retired {config.name[:80]!r}: {out.pins_removed} directory pins removed")
    return Output(
        out.snapshot_id,
        metadata={
            "pins_removed": out.pins_removed,
            "retained_copies_removed": len(out.retained_removed),
            "already_retired": out.already_retired,
        },
    )


@op(description="Samples added, removed and changed between two snapshots, by reason.")
def diff_two_snapshots(config: DiffConfig, lab: LabResource):
    return Output(
        None,
        metadata={
            "b": MetadataValue.text(config.b),
            **diff_metadata(lab.lab(), config.a, config.b),
        },
    )


@job(description="Retire a training snapshot (config: name).")
def retire_training_snapshot():
    retire_one_snapshot()


@job(description="Diff two training snapshots (config: a, b).")
def snapshot_diff():
    diff_two_snapshots()
