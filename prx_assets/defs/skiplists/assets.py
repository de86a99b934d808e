"""skip_lists: one partition's skip-list generations and ``skip_audit`` rows (glue).

The run itself (read -> decide -> write -> verify, the order of effects and what a reader
can see meanwhile) is :class:`prx_assets.core.skiplists.runner.PartitionSkipLists`.

Built by :func:`build_skiplist_assets` so the policy fingerprint is part of the code version:
a policy change makes ``skip_lists`` (and nothing else) stale. The opt-out lists are *not* a
Dagster dependency: ``opt_outs`` is read at run time, so a new list never fans out over every
partition under eager automation; the opt-out sensor requests the affected partitions.
"""

import time
import warnings
from typing import Any

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    AssetMaterialization,
    AssetsDefinition,
    BackfillPolicy,
    BetaWarning,
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
from prx_assets.core.skiplists.reruns import DEFAULT_PARTITIONS_PER_RUN
from prx_assets.core.skiplists.runner import PartitionSkipLists, SkipListsError, SkipListsOutcome
from prx_assets.defs.metadata import bounded, counts_table, md_table
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.checks import (
    caption_coverage_over_range,
    caption_coverage_result,
    caption_coverage_spec,
)
from prx_assets.defs.skiplists.config import SkipPolicyResource
from prx_assets.defs.skiplists.intake import OPT_OUT_LISTS_ASSET, USAGE_POLICY_ASSET

SKIP_LISTS_ASSET = "skip_lists"
GROUP = "skiplists"
UPSTREAM: tuple[str, ...] = ("mds_shards", "caption_classes", "phash_clusters")
MAX_LISTED = 50
# Dagster's code-version tag on a materialisation (what the UI's staleness compares): set on
# the events this asset logs itself (see ``_materialize_each``).
CODE_VERSION_TAG = "dagster/code_version"

# skip_lists has a backfill policy (many partitions per run) and the other stages none, so
# Dagster warns on every load that a job holding several stages (batch_pipeline, the
# implicit asset job) resolves to one partition per run: what those jobs mean to do. Only
# that message is silenced.
warnings.filterwarnings(
    "ignore",
    message=r"Asset job .* materializes assets with varying BackfillPolicies",
    category=UserWarning,
)


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


def _metadata(out: SkipListsOutcome, seconds: float) -> dict[str, Any]:
    """``seconds``: the partition's own decision work (read, decide, write, verify), which
    a run over many partitions shares its fixed cost with."""
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
        "decision_seconds": round(seconds, 4),
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
    code = f"skip_lists-v2-{fp}"

    # backfill_policy is "beta" in Dagster 1.13: chosen knowingly (the batched reruns).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BetaWarning)

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
            code_version=code,
            # The batched reruns an opt-out or a policy change needs: a backfill of many
            # partitions runs as runs of up to this many, each partition its own materialisation.
            backfill_policy=BackfillPolicy.multi_run(DEFAULT_PARTITIONS_PER_RUN),
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
                "change, and the opt-out sensor reruns those (the list's `batches`), as "
                "skip_dirty_sensor does for batches whose training copy other batches' facts "
                "changed: in runs over ranges of partitions (up to 100 a run, each partition "
                "its own materialisation; a few partitions between two reached ones are "
                "re-decided too rather than starting another run). `PENDING` in "
                "`prx-assets compliance` says which are still to run."
            ),
        )
        def skip_lists(
            context: AssetExecutionContext, lab: LabResource, skip_policy: SkipPolicyResource
        ) -> MaterializeResult:
            policy = _policy(skip_policy, fp)
            share = skip_policy.max_no_caption_share
            return _materialize_each(context, lab, policy, share, code)

    return [skip_lists]


def _materialize_each(
    context: AssetExecutionContext,
    lab: LabResource,
    policy: SkipPolicy,
    max_no_caption_share: float,
    code_version: str,
) -> MaterializeResult:
    """The run's partition, or each partition of its range (the batched reruns of an
    opt-out or a policy change) decided and published alone, in order, exactly as its own
    run would, and materialised with its own metadata.

    In a range, a partition that fails does not stop the others. Dagster records a range
    run's materialisations only when the step succeeds, so when one fails the partitions
    that succeeded are recorded here, each its own event with the asset's code version, and
    the step fails naming the ones that did not: every partition's status is its own.
    """
    ranged = context.has_partition_key_range
    lab_ = lab.lab()
    outcomes: dict[str, SkipListsOutcome] = {}
    seconds: dict[str, float] = {}
    failed: dict[str, str] = {}
    for key in context.partition_keys:
        t0 = time.perf_counter()
        try:
            outcome = PartitionSkipLists(lab_, lab.shards_root, key, policy).run()
        except SkipListsError as exc:
            if not ranged:
                raise Failure(description=str(exc)) from None
            failed[key] = str(exc)
            context.log.error(f"{key}: {bounded(str(exc), 400)}")
            continue
        except Exception as exc:  # in a range, one partition's failure (a bug too) is its own
            if not ranged:
                raise
            failed[key] = f"{type(exc).__name__}: {exc}"
            context.log.error(f"{key}: {bounded(failed[key], 400)}")
            continue
        seconds[key] = time.perf_counter() - t0
        _log(context.log, outcome)
        outcomes[key] = outcome
    if not ranged:
        ((key, outcome),) = outcomes.items()
        coverage = caption_coverage_result(outcome.coverage, max_no_caption_share)
        return MaterializeResult(
            metadata=_metadata(outcome, seconds[key]), check_results=[coverage]
        )
    if failed:
        for key, outcome in outcomes.items():
            context.log_event(
                AssetMaterialization(
                    SKIP_LISTS_ASSET,
                    partition=key,
                    metadata=_metadata(outcome, seconds[key]),
                    tags={CODE_VERSION_TAG: code_version},
                )
            )
        names = ", ".join(list(failed)[:MAX_LISTED])
        first = next(iter(failed.values()))
        raise Failure(
            description=(
                f"skip_lists failed for {len(failed)} of {len(context.partition_keys)} "
                f"partition(s) of this run ({bounded(names, 2000)}); the other "
                f"{len(outcomes)} are materialised. First error: {bounded(first, 1000)}"
            )
        )
    for key, outcome in outcomes.items():
        context.add_asset_metadata(_metadata(outcome, seconds[key]), partition_key=key)
    coverages = {k: o.coverage for k, o in outcomes.items()}
    return MaterializeResult(
        metadata={"partitions_in_run": len(outcomes)},
        check_results=[caption_coverage_over_range(coverages, max_no_caption_share)],
    )
