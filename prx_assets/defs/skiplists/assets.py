"""skip_lists: one partition's skip-list generations and ``skip_audit`` rows (glue).

The run itself (read -> decide -> write -> verify, the order of effects and what a reader
can see meanwhile) is :class:`prx_assets.core.skiplists.runner.PartitionSkipLists`.

Built by :func:`build_skiplist_assets` so the policy fingerprint is part of the code version:
a policy change makes ``skip_lists`` (and nothing else) stale. The opt-out lists are *not* a
Dagster dependency: ``opt_outs`` is read at run time, so a new list never fans out over every
partition under eager automation; the opt-out sensor requests the affected partitions.
"""

from typing import Any

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from prx_assets.core.skiplists.policy import (
    WAITS_FOR_CLASS,
    WAITS_FOR_DEDUP,
    SkipPolicy,
    SkipPolicyError,
)
from prx_assets.core.skiplists.runner import PartitionSkipLists, SkipListsError, SkipListsOutcome
from prx_assets.defs.metadata import counts_table, md_table
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.checks import caption_coverage_result, caption_coverage_spec
from prx_assets.defs.skiplists.config import SkipPolicyResource
from prx_assets.defs.skiplists.intake import OPT_OUT_LISTS_ASSET, USAGE_POLICY_ASSET

SKIP_LISTS_ASSET = "skip_lists"
GROUP = "skiplists"
UPSTREAM: tuple[str, ...] = ("mds_shards", "caption_classes", "phash_clusters")
MAX_LISTED = 50


def _policy(skip_policy: SkipPolicyResource, built_fp: str) -> SkipPolicy:
    """The run's policy, refused unless it is the one the asset was built (versioned) with."""
    try:
        policy = skip_policy.policy()
    except SkipPolicyError as exc:
        raise Failure(description=f"invalid skip policy: {exc}") from None
    if policy.fingerprint() != built_fp:
        raise Failure(
            description=(
                f"skip_policy resource {policy.as_dict()} (fingerprint {policy.fingerprint()}) "
                f"differs from the policy the asset was built with ({built_fp}): pass the same "
                "SkipPolicyResource to build_skiplist_assets and to Definitions"
            )
        )
    return policy


def _log(log: Any, out: SkipListsOutcome) -> None:
    d, batch = out.decisions, out.batch
    log.info(
        f"{batch}: {out.samples} samples in {out.directories} directories, skipped "
        f"{out.skipped} ({out.newly_excluded} newly, {out.no_longer_excluded} no longer)"
    )
    pending = d.reason_counts()["pending"]
    if pending:
        log.warning(
            f"{batch}: {pending} sample(s) skipped as pending until their facts exist "
            f"({d.unclassified} without a current class label, {d.undecided} without a "
            "current dedup decision, the rest waiting for another copy of their picture)"
        )
    if out.marked_elsewhere:
        log.info(
            f"{batch}: recorded decisions of {len(out.marked_elsewhere)} sample(s) in other "
            f"batches no longer hold ({', '.join(out.other_batches)}); marked in skip_dirty "
            "for skip_dirty_sensor"
        )


def _metadata(out: SkipListsOutcome) -> dict[str, Any]:
    d = out.decisions
    counts = d.reason_counts()
    buckets = [(rel, k + s, k, s) for rel, (k, s) in d.bucket_counts().items()]
    return {
        "samples": out.samples,
        "kept": out.kept,
        "skipped": out.skipped,
        "skip_reasons": counts_table(counts, "reason", sort=False),
        "buckets": MetadataValue.md(
            md_table(["bucket directory", "samples", "kept", "skipped"], buckets)
        ),
        "sidecars": out.sidecars,
        "skiplist_generations": MetadataValue.json(out.generations),
        "directories": out.directories,
        "newly_excluded": out.newly_excluded,
        "no_longer_excluded": out.no_longer_excluded,
        "no_caption": counts["no_caption"],
        "eligible_without_caption": out.coverage.without_caption,
        "pending": counts["pending"],
        "pending_on_class_label": d.waiting_for(WAITS_FOR_CLASS),
        "pending_on_dedup_decision": d.waiting_for(WAITS_FOR_DEDUP),
        "other_batches_marked": MetadataValue.json(out.other_batches),
        "skip_dirty_marked": len(out.marked_elsewhere) + len(out.changed_during_run),
        "skip_dirty_cleared": out.cleared,
        "changed_during_run": MetadataValue.json(
            [f"{c.key}: {c.before} -> {c.after}" for c in out.changed_during_run][:MAX_LISTED]
        ),
        "opt_out_lists_applied": MetadataValue.json(out.lists_applied),
        "skipped_keys": MetadataValue.json(sorted(d.excluded_keys)[:MAX_LISTED]),
        "policy": MetadataValue.json(out.policy.as_dict()),
        "policy_fingerprint": out.policy.fingerprint(),
        "skiplist_digest": out.skiplist_digest,
        "skip_audit_lance_version": out.audit_version,
    }


def build_skiplist_assets(policy: SkipPolicyResource | None = None) -> list[AssetsDefinition]:
    """``skip_lists`` versioned by ``policy``'s fingerprint (default policy when None).

    Pass the same ``SkipPolicyResource`` that ``Definitions`` binds to ``skip_policy``; a run
    whose resource disagrees fails before writing anything.
    """
    policy = policy or SkipPolicyResource()
    try:
        fp = policy.fingerprint()
    except SkipPolicyError as exc:
        raise ValueError(f"invalid skip policy: {exc}") from None
    what = policy.policy().as_dict()

    @asset(
        name=SKIP_LISTS_ASSET,
        partitions_def=BATCHES,
        deps=[
            *UPSTREAM,
            # Lineage only (what feeds the decision): the sensors choose which partitions
            # rerun, see the description.
            AssetDep(OPT_OUT_LISTS_ASSET, partition_mapping=AllPartitionMapping()),
            USAGE_POLICY_ASSET,
        ],
        group_name=GROUP,
        kinds={"json", "lance"},
        code_version=f"skip_lists-v2-{fp}",
        check_specs=[caption_coverage_spec(SKIP_LISTS_ASSET)],
        description=(
            "A new skip-list generation (per-shard sidecars named by a skiplists.json manifest, "
            "published by one rename per directory, after every directory's files are "
            "written) for every MDS directory of the batch, and one `skip_audit` row per "
            "written sample (reasons, opt-out list ids and "
            "the copy they named, the training copy, since when). Decided per pHash cluster "
            "across batches: an opt-out of any copy, or an opt-out header captured at ingest "
            "(X-Robots-Tag noai, tdm-reservation 1, Content-Usage train-ai=n) that the copy's "
            "source honours (usage_policy.json), skips every copy; one eligible copy "
            "trains. Unknown facts skip as `pending`. Policy: excluded classes "
            f"{what['excluded_classes']}, duplicates "
            f"{'skipped' if what['skip_duplicates'] else 'kept'}, low-information images "
            f"{'skipped' if what['skip_low_information'] else 'kept'}, no caption skipped; "
            "opt-outs always. Every opt_out_lists partition and usage_policy feed each "
            "partition (the lineage edges), so after a new list the UI shows every partition "
            "as having a changed upstream; only the batches holding a copy of a listed image "
            "change, and the opt-out sensor reruns exactly those (the list's `batches`), as "
            "skip_dirty_sensor does for batches whose training copy other batches' facts "
            "changed. `PENDING` in `prx-assets compliance` says which are still to run."
        ),
    )
    def skip_lists(
        context: AssetExecutionContext, lab: LabResource, skip_policy: SkipPolicyResource
    ) -> MaterializeResult:
        run = PartitionSkipLists(
            lab.lab(), lab.shards_root, context.partition_key, _policy(skip_policy, fp)
        )
        try:
            outcome = run.run()
        except SkipListsError as exc:
            raise Failure(description=str(exc)) from None
        _log(context.log, outcome)
        coverage = caption_coverage_result(outcome.coverage, skip_policy.max_no_caption_share)
        return MaterializeResult(metadata=_metadata(outcome), check_results=[coverage])

    return [skip_lists]
