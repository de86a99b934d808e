"""training_snapshots: freeze the effective training set (glue; the run is
``prx_assets.core.snapshots.runner.create_snapshot``), and the opt-out compliance check.

Not partitioned and with no Dagster dependency on the per-batch assets: a snapshot is taken
when a data lead (or a schedule) asks, over whatever is sharded and screened then; the runner
refuses a tree it cannot freeze (unscreened, stale, or a sample an opt-out names still kept).
"""

from datetime import UTC, datetime

from dagster import (
    AllPartitionMapping,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetDep,
    AssetExecutionContext,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)

from prx_assets.core.plots import bar_chart
from prx_assets.core.snapshots.compliance import all_reports
from prx_assets.core.snapshots.diff import diff_snapshots
from prx_assets.core.snapshots.manifest import SnapshotError
from prx_assets.core.snapshots.runner import create_snapshot, list_snapshots
from prx_assets.defs.metadata import md_code, md_table, png_markdown
from prx_assets.defs.resources import LabResource

GROUP = "snapshots"
MAX_LISTED = 20


class SnapshotConfig(Config):
    """The snapshot's name (a file name: letters, digits, '.', '_', '-'); empty: a UTC time."""

    name: str = ""
    # A training set with no sample kept is refused unless this is set (almost always a
    # mistake: an unsettled pipeline, a policy that skips everything).
    allow_empty: bool = False


def diff_metadata(lab, a: str, b: str) -> dict:
    """The diff from ``a`` to ``b`` as Dagster metadata: a table and a bar chart."""
    diff = diff_snapshots(lab, a, b)
    labels, values = diff.chart()
    out = {
        "diff_from": MetadataValue.text(a),
        "diff": MetadataValue.md(diff.to_markdown()),
        "diff_totals": MetadataValue.json({f"{d}: {r}": n for (d, r), n in diff.totals().items()}),
    }
    if labels:
        out["diff_chart"] = png_markdown(bar_chart(labels, values, f"{a} -> {b}"), "snapshot diff")
    return out


@asset(
    group_name=GROUP,
    # Lineage: a snapshot freezes the shards and the skip-list generations of every batch.
    # Taken on request (CLI, UI, a schedule), never because a batch changed.
    deps=[
        AssetDep("mds_shards", partition_mapping=AllPartitionMapping()),
        AssetDep("skip_lists", partition_mapping=AllPartitionMapping()),
    ],
    description=(
        "An immutable, named snapshot of the training set: every bucket x batch directory "
        "with its index digest and live skip-list generation (from mds_shards and "
        "skip_lists of every batch), the Lance versions it derives from, and the policy, "
        "model and code fingerprints. Made on request, never by automation, so a changed "
        "upstream partition is news for the next snapshot, not a stale one."
    ),
)
def training_snapshots(
    context: AssetExecutionContext, config: SnapshotConfig, lab: LabResource
) -> MaterializeResult:
    store = lab.lab()
    name = config.name or datetime.now(UTC).strftime("snap-%Y%m%dT%H%M%SZ")
    before = [s["snapshot_id"] for s in list_snapshots(store) if s["status"] == "live"]
    try:
        out = create_snapshot(store, lab.shards_root, name, allow_empty=config.allow_empty)
    except (SnapshotError, ValueError) as exc:
        raise Failure(description=f"snapshot {name[:80]!r} refused: {exc}") from None
    m = out.manifest
    context.log.info(f"snapshot {m.snapshot_id}: {len(m.directories)} dirs, {m.kept_samples} kept")
    metadata = {
        "snapshot": MetadataValue.text(m.snapshot_id),
        "created": out.created,
        "directories": len(m.directories),
        "samples": m.samples,
        "kept_samples": m.kept_samples,
        "manifest": MetadataValue.path(out.path),
        "lab_versions": MetadataValue.json(m.lab_versions),
        "fingerprints": MetadataValue.json(m.fingerprints),
    }
    previous = [s for s in before if s != m.snapshot_id]
    if previous:
        metadata.update(diff_metadata(store, previous[-1], m.snapshot_id))
    return MaterializeResult(metadata=metadata)


@asset_check(
    asset=training_snapshots,
    description=(
        "ERROR unless every recorded opt-out list is applied and holding (PASS): a rejected "
        "list (NOT APPLIED), an accepted one whose skip_lists has not yet excluded every "
        "sharded copy in the live skip-lists (PENDING), or a snapshot made after it arrived "
        "still holding one of its images (FAIL) fails it."
    ),
)
def opt_out_compliance(lab: LabResource) -> AssetCheckResult:
    reports = all_reports(lab.lab(), lab.shards_root)
    failing = [r for r in reports if not r.passed]
    rows = [
        (r.list_id, i.batch, i.key, i.via, " ".join(i.violations))
        for r in failing
        for i in r.violations
    ]
    pending = sorted({b for r in failing for b in r.pending_batches})
    return AssetCheckResult(
        passed=not failing,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "lists": len(reports),
            "failing_lists": len(failing),
            "violations": len(rows),
            "verdicts": MetadataValue.json(
                {
                    v: sum(r.verdict == v for r in reports)
                    for v in sorted({r.verdict for r in reports})
                }
            ),
            "not_passing": MetadataValue.md(
                md_table(
                    ["list", "verdict", "reason"],
                    [(r.list_id, r.verdict, r.reason) for r in failing[:MAX_LISTED]],
                )
                if failing
                else "none"
            ),
            "batches_to_rerun": MetadataValue.md(
                ", ".join(md_code(b, limit=120) for b in pending[:MAX_LISTED])
                + (f" (+{len(pending) - MAX_LISTED} more)" if len(pending) > MAX_LISTED else "")
                if pending
                else "none"
            ),
            "first_violations": MetadataValue.md(
                md_table(["list", "batch", "key", "via", "snapshots"], rows[:MAX_LISTED])
                if rows
                else "none"
            ),
            "checked_lists": MetadataValue.md(
                ", ".join(md_code(r.list_id, limit=120) for r in reports[:MAX_LISTED]) or "none"
            ),
        },
    )
