"""skip_lists: one partition's skip-list sidecars and its ``skip_audit`` rows.

Built by :func:`build_skiplist_assets` so the policy fingerprint is part of the code version:
a policy change makes ``skip_lists`` (and nothing else) stale. The opt-out lists are *not* a
Dagster dependency: ``opt_outs`` is read at run time, so a new list never fans out over every
partition under eager automation; the opt-out sensor requests the affected partitions.

Order of effects: other batches whose recorded decisions this run's facts contradict are
listed in ``skip_dirty`` first (a crash later still reruns them); then every directory's new
skip-list generation is written (sidecars, not yet live), then each directory's manifest
flips (one atomic rename each: what training obeys), then the audit table (what it records)
is committed; then the decision is taken again and a difference (a fact changed meanwhile)
marks this batch itself; last, the marks this run answered are cleared.

What a reader can see at any instant, crashes included: every directory on exactly one
complete generation, either the one it had before this run (consistent with the
``skip_audit`` rows committed before it) or the one this run decided (consistent with the
audit this run commits, or its rerun commits after a crash); never a directory with a mix
of the two, never one without a generation. A crash between two flips leaves some
directories on each; the rerun brings every one to the new decisions and commits the audit.
"""

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from prx_assets.core.lab import Lab
from prx_assets.core.shards.mds import list_partition_dirs, partition_digest, partition_dir
from prx_assets.core.shards.tables import written_without_caption
from prx_assets.core.skiplists.decisions import (
    caption_coverage,
    changed_during_run,
    clear_skip_dirty,
    contradicted_elsewhere,
    decide_partition,
    ensure_audit_columns,
    mark_skip_dirty,
    read_skip_dirty,
)
from prx_assets.core.skiplists.policy import (
    WAITS_FOR_CLASS,
    WAITS_FOR_DEDUP,
    PartitionDecisions,
    SkipPolicyError,
    audit_rows,
    exclusion_changes,
    samples_from_rows,
)
from prx_assets.core.skiplists.sidecars import (
    SkipListError,
    publish_partition_skiplists,
    read_index_shards,
    skiplist_digest,
)
from prx_assets.core.tables import (
    CAPTION_CLASSES,
    CAPTIONS,
    IMAGES,
    PHASH_CLUSTERS,
    SHARD_SAMPLES,
    SKIP_AUDIT,
)
from prx_assets.defs.metadata import counts_table, md_table
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.checks import caption_coverage_result, caption_coverage_spec
from prx_assets.defs.skiplists.config import SkipPolicyResource

SKIP_LISTS_ASSET = "skip_lists"
GROUP = "skiplists"
UPSTREAM: tuple[str, ...] = ("mds_shards", "caption_classes", "phash_clusters")
# Table read -> the asset that writes it (for the "materialise X first" message).
_REQUIRED_TABLES: tuple[tuple[str, str], ...] = (
    (SHARD_SAMPLES.name, "mds_shards"),
    (CAPTIONS.name, "captions"),
    (CAPTION_CLASSES.name, "caption_classes"),
    (PHASH_CLUSTERS.name, "phash_clusters"),
    (IMAGES.name, "raw_images"),
)
MAX_LISTED = 50


def _require_tables(store: Lab, batch: str) -> None:
    missing = [(t, a) for t, a in _REQUIRED_TABLES if not store.exists(t)]
    if missing:
        raise Failure(
            description=(
                "skip_lists needs its upstream tables; missing: "
                + ", ".join(f"`{t}` (materialise {a} for {batch} first)" for t, a in missing)
            )
        )


def _shard_dirs(shards_root: str, batch: str, rows: list[dict[str, Any]]) -> dict[str, Path]:
    """relative_dir -> directory, after checking the tree is what shard_samples describes."""
    dirs: dict[str, Path] = {}
    digests: dict[str, str] = {}
    for r in rows:
        rel = r["relative_dir"]
        if rel in dirs:
            continue
        expected = partition_dir(shards_root, int(r["tier"]), r["shape"], batch)
        path = Path(shards_root) / rel
        if path != expected:
            raise Failure(
                description=f"shard_samples row of {r['key']} names {rel}, expected "
                f"{expected.relative_to(shards_root)}"
            )
        if not (path / "index.json").is_file():
            raise Failure(
                description=f"{path} is missing but shard_samples lists samples there: "
                f"rerun mds_shards for {batch}"
            )
        dirs[rel] = path
        digests[rel] = r["dir_digest"]
    for rel, path in dirs.items():
        if partition_digest(path) != digests[rel]:
            raise Failure(
                description=f"{path} was rewritten after shard_samples recorded it (dir_digest "
                f"differs): rerun mds_shards for {batch}, then skip_lists"
            )
    on_disk = {d.path for d in list_partition_dirs(shards_root, batch)}
    stray = sorted(str(p) for p in on_disk - set(dirs.values()))
    if stray:
        raise Failure(
            description=f"MDS directories of {batch} with no shard_samples rows: {stray[:5]}; "
            "shard_samples is stale: rerun mds_shards"
        )
    return dirs


def _previous(store: Lab, batch: str) -> dict[str, tuple[bool, datetime | None]]:
    if not store.exists(SKIP_AUDIT.name):
        return {}
    rows = store.read_batch(SKIP_AUDIT.name, batch, ["key", "excluded", "first_excluded_at"])
    return {r["key"]: (bool(r["excluded"]), r["first_excluded_at"]) for r in rows.to_pylist()}


def _buckets_markdown(decisions: PartitionDecisions) -> MetadataValue:
    rows = [(rel, k + s, k, s) for rel, (k, s) in decisions.bucket_counts().items()]
    return MetadataValue.md(md_table(["bucket directory", "samples", "kept", "skipped"], rows))


def _skip_lists(
    context: AssetExecutionContext, lab: LabResource, skip_policy: SkipPolicyResource, built_fp: str
) -> MaterializeResult:
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
    store = lab.lab()
    batch = context.partition_key
    _require_tables(store, batch)
    # Marks read before the facts: those cleared at the end are the ones this run answers.
    answered = read_skip_dirty(store, batch).column("dirty_id").to_pylist()
    rows = store.read_batch(SHARD_SAMPLES.name, batch).to_pylist()
    for r in rows:  # what the writer stored: an empty caption rules the sample out
        r["caption_usable"] = not written_without_caption(r)
    dirs = _shard_dirs(lab.shards_root, batch, rows)
    samples = samples_from_rows(rows)
    try:
        decisions = decide_partition(store, batch, samples, policy)
    except SkipPolicyError as exc:
        raise Failure(description=f"{batch}: {exc}") from None
    elsewhere = contradicted_elsewhere(store, decisions)
    mark_skip_dirty(store, elsewhere, batch)

    skips = decisions.skips_by_dir()
    try:  # every directory's generation is staged before the first manifest flips
        generations = publish_partition_skiplists(
            {dirs[rel]: skips.get(rel, {}) for rel in sorted(dirs)}
        )
    except SkipListError as exc:
        raise Failure(
            description=f"{batch}: shard_samples does not match the MDS tree ({exc}): "
            "rerun mds_shards, then skip_lists"
        ) from None
    for rel, path in dirs.items():  # a concurrent mds_shards rewrite would void the sidecars
        if partition_digest(path) != next(
            r["dir_digest"] for r in rows if r["relative_dir"] == rel
        ):
            raise Failure(description=f"{path} was rewritten while skip_lists ran: rerun it")

    ensure_audit_columns(store)
    previous = _previous(store, batch)
    decided_at = datetime.now(UTC)
    audit = audit_rows(batch, decisions, previous, decided_at)
    written = store.replace_partition(SKIP_AUDIT, batch, audit)
    raced = changed_during_run(batch, decisions, decide_partition(store, batch, samples, policy))
    mark_skip_dirty(store, raced, batch)
    cleared = clear_skip_dirty(store, answered)
    coverage = caption_coverage(store, batch)
    newly, gone = exclusion_changes(decisions, previous)
    lists = sorted({i for d in decisions.decisions for i in d.opt_out_list_ids})
    kept = sum(k for k, _ in decisions.bucket_counts().values())
    context.log.info(
        f"{batch}: {len(samples)} samples in {len(dirs)} directories, "
        f"skipped {len(samples) - kept} ({newly} newly, {gone} no longer)"
    )
    counts = decisions.reason_counts()
    if counts["pending"]:
        context.log.warning(
            f"{batch}: {counts['pending']} sample(s) skipped as pending until their facts "
            f"exist ({decisions.unclassified} without a current class label, "
            f"{decisions.undecided} without a current dedup decision, the rest waiting for "
            "another copy of their picture)"
        )
    if elsewhere:
        context.log.info(
            f"{batch}: recorded decisions of {len(elsewhere)} sample(s) in other batches "
            f"no longer hold ({', '.join(sorted({c.batch for c in elsewhere}))}); marked in "
            "skip_dirty for skip_dirty_sensor"
        )
    excluded = sorted(decisions.excluded_keys)
    return MaterializeResult(
        metadata={
            "samples": len(samples),
            "kept": kept,
            "skipped": len(samples) - kept,
            "skip_reasons": counts_table(counts, "reason", sort=False),
            "buckets": _buckets_markdown(decisions),
            "sidecars": sum(len(read_index_shards(p)) for p in dirs.values()),
            "skiplist_generations": MetadataValue.json(
                {rel: generations[str(dirs[rel])] for rel in sorted(dirs)}
            ),
            "directories": len(dirs),
            "newly_excluded": newly,
            "no_longer_excluded": gone,
            "no_caption": counts["no_caption"],
            "eligible_without_caption": coverage.without_caption,
            "pending": counts["pending"],
            "pending_on_class_label": decisions.waiting_for(WAITS_FOR_CLASS),
            "pending_on_dedup_decision": decisions.waiting_for(WAITS_FOR_DEDUP),
            "other_batches_marked": MetadataValue.json(sorted({c.batch for c in elsewhere})),
            "skip_dirty_marked": len(elsewhere) + len(raced),
            "skip_dirty_cleared": cleared,
            "changed_during_run": MetadataValue.json(
                [f"{c.key}: {c.before} -> {c.after}" for c in raced][:MAX_LISTED]
            ),
            "opt_out_lists_applied": MetadataValue.json(lists),
            "skipped_keys": MetadataValue.json(excluded[:MAX_LISTED]),
            "policy": MetadataValue.json(policy.as_dict()),
            "policy_fingerprint": policy.fingerprint(),
            "skiplist_digest": skiplist_digest([dirs[r] for r in sorted(dirs)]),
            "skip_audit_lance_version": written["version"],
        },
        check_results=[caption_coverage_result(coverage, skip_policy.max_no_caption_share)],
    )


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
        deps=list(UPSTREAM),
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
            "across batches: an opt-out of any copy skips every copy; one eligible copy "
            "trains. Unknown facts skip as `pending`. Policy: excluded classes "
            f"{what['excluded_classes']}, duplicates "
            f"{'skipped' if what['skip_duplicates'] else 'kept'}, low-information images "
            f"{'skipped' if what['skip_low_information'] else 'kept'}, no caption skipped; "
            "opt-outs always. Reads `opt_outs` and other batches' facts at run time (not "
            "dependencies): the opt-out and skip_dirty sensors request affected partitions."
        ),
    )
    def skip_lists(
        context: AssetExecutionContext, lab: LabResource, skip_policy: SkipPolicyResource
    ) -> MaterializeResult:
        return _skip_lists(context, lab, skip_policy, fp)

    return [skip_lists]
