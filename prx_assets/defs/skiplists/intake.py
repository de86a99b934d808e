"""opt_out_lists: take one opt-out list into the lab (glue over ``core.skiplists.intake``).

One partition per list (a dynamic partitions definition of its own, keyed by the list id:
``<file name>@<sha256[:16]>``), added by the opt-out sensor when it notices the file. So the
UI shows every list ever received as a partition of this asset, with what its intake
recorded (accepted, what it matched, or the rejection reason) and a red check for a rejected
list; a failed intake (its file vanished) is a failed partition, rerun by hand.
"""

from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetSpec,
    DynamicPartitionsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from prx_assets.core.skiplists.intake import (
    IntakeError,
    IntakeOutcome,
    ListIntake,
    list_id_of_partition,
)
from prx_assets.defs.metadata import bounded
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.checks import list_accepted_result, list_accepted_spec
from prx_assets.defs.skiplists.config import OptOutResource

OPT_OUT_LISTS_ASSET = "opt_out_lists"
INTAKE_GROUP = "optouts"
OPT_OUT_LISTS = DynamicPartitionsDefinition(name="opt_out_lists")
MAX_BATCHES_LISTED = 50
USAGE_POLICY_ASSET = "usage_policy"

#: ``<data_root>/usage_policy.json`` in the lineage graph: edited by hand, never
#: materialised here; ``skip_lists`` depends on it and ``skip_policy_sensor`` reruns
#: ``skip_lists`` when its fingerprint changes.
usage_policy = AssetSpec(
    USAGE_POLICY_ASSET,
    group_name=INTAKE_GROUP,
    kinds={"json"},
    description=(
        "`<data_root>/usage_policy.json`: which opt-out headers captured at ingest each "
        "source honours (X-Robots-Tag, tdm-reservation, Content-Usage) and how a malformed "
        "one is read. Edited by hand (not materialised here); part of the skip policy's "
        "fingerprint, so skip_policy_sensor reruns skip_lists after an edit."
    ),
)


def _metadata(out: IntakeOutcome) -> dict[str, Any]:
    """What the partition shows: the outcome, as text and numbers (never markdown)."""
    return {
        "list_id": out.list_id,
        "status": out.status,
        "reason": MetadataValue.text(out.reason or ""),
        "format": out.format or "",
        "identifiers": out.identifiers,
        "matched_images": out.matched_images,
        "malformed_entries": out.malformed,
        "withdrawals": out.withdrawals,
        "partitions_to_rerun": len(out.reach_sharded),
        "source": MetadataValue.text(out.source),
        "batches": MetadataValue.json(list(out.batches[:MAX_BATCHES_LISTED])),
        "path": MetadataValue.text(out.path),
        "sha256": out.sha256,
        "received_at": out.received_at.isoformat(),
        "opt_outs_lance_version": (
            MetadataValue.null() if out.opt_outs_version is None else out.opt_outs_version
        ),
        "opt_out_lists_lance_version": out.opt_out_lists_version,
    }


@asset(
    name=OPT_OUT_LISTS_ASSET,
    partitions_def=OPT_OUT_LISTS,
    group_name=INTAKE_GROUP,
    kinds={"lance"},
    code_version="opt_out_lists-v1",
    check_specs=[list_accepted_spec(OPT_OUT_LISTS_ASSET, OPT_OUT_LISTS)],
    description=(
        "One opt-out list (partition: its id, file name @ sha256 prefix), streamed in chunks "
        "(any size unless its source sets a cap; memory follows the chunk) and recorded: its `opt_out_lists` row (accepted, or rejected "
        "with the reason) and, when accepted, one `opt_outs` row per identifier and image it "
        "names. A rejected list is recorded as such and its partition FAILS (red), with "
        "the reason: none of it is applied, and compliance says NOT APPLIED. Requested by "
        "the opt-out sensor, which then requests skip_lists for the partitions holding any "
        "copy of an accepted list's images."
    ),
)
def opt_out_lists(
    context: AssetExecutionContext, lab: LabResource, optouts: OptOutResource
) -> MaterializeResult:
    list_id = list_id_of_partition(context.partition_key)
    source = optouts.source_for(list_id.rsplit("@", 1)[0])
    intake = ListIntake(
        lab.lab(),
        optouts.directory(lab),
        list_id,
        max_list_bytes=source.max_list_bytes,
        max_line_bytes=optouts.max_line_bytes,
        on_malformed=source.on_malformed,
        source=source.name,
        allow_withdrawals=source.allow_withdrawals,
    )
    try:
        out = intake.run()
    except IntakeError as exc:
        raise Failure(description=bounded(str(exc), 2_000)) from None
    if not out.accepted:
        # Recorded (``opt_out_lists``: rejected, with the reason; compliance says NOT
        # APPLIED), and the partition fails: a green "Materialized" beside a failed check
        # read as "applied" to a data lead, for a legal request that is not.
        why = bounded(out.reason or "", 400)
        context.log.error(f"opt-out list {out.list_id} rejected: {why}; none of it is applied")
        raise Failure(
            description=(
                f"opt-out list {out.list_id} was REJECTED and none of it is applied: {why}. "
                "Fix the file and drop it again: its new bytes are a new list."
            ),
            metadata=_metadata(out),
        )
    context.log.info(
        f"opt-out list {out.list_id}: {out.identifiers} identifier(s), "
        f"{out.matched_images} image(s) matched"
        + (f", {out.malformed} malformed entr(ies) recorded and skipped" if out.malformed else "")
        + (f", {out.withdrawals} withdrawal(s) of source {out.source}" if out.withdrawals else "")
    )
    return MaterializeResult(metadata=_metadata(out), check_results=[list_accepted_result(out)])
