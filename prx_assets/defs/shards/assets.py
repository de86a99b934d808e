"""bucket_assignments and mds_shards: from eligible, captioned images to MDS bucket shards."""

from dagster import AssetExecutionContext, Config, Failure, MaterializeResult, MetadataValue, asset
from pydantic import Field

from prx_assets.core.lab import sql_literal
from prx_assets.core.plots import bar_chart
from prx_assets.core.shards.buckets import bucket_table
from prx_assets.core.shards.mds import (
    DEFAULT_SIZE_LIMIT,
    directory_bytes,
    list_partition_dirs,
    partition_digest,
    small_bucket_hazards,
    write_partition_streams,
)
from prx_assets.core.shards.resize import (
    JPEG_QUALITY,
    JPEG_SUBSAMPLING,
    JPEG_SUBSAMPLING_REASON,
    RESAMPLE,
    RESAMPLE_DESCRIPTION,
)
from prx_assets.core.shards.screening import ShardScreener
from prx_assets.core.shards.tables import (
    CAPTION_COLUMNS,
    MDS_EXTRA_COLUMNS,
    BucketRenderer,
    BucketTotals,
    assignment_rows,
    bucket_totals,
    placement_rows,
    plan_shards,
    summarise_assignments,
)
from prx_assets.core.skiplists.policy import SkipPolicyError
from prx_assets.core.skiplists.sidecars import current_generation
from prx_assets.core.tables import BUCKET_ASSIGNMENTS, CAPTIONS, IMAGES, RESOLUTION, SHARD_SAMPLES
from prx_assets.defs.metadata import counts_table, md_table, png_markdown
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.config import SkipPolicyResource

MAX_LISTED_KEYS = 50


def _fill_markdown(fill: dict[int, dict[str, int]]) -> MetadataValue:
    """One row per aspect slot (portrait to landscape), one column per tier: "shape: n"."""
    tiers = sorted(fill)
    n = len(next(iter(fill.values())))
    rows: list[list[object]] = [
        [i, *(f"{list(fill[t])[i]}: {list(fill[t].values())[i]}" for t in tiers)] for i in range(n)
    ]
    rows.append(["total", *(sum(fill[t].values()) for t in tiers)])
    return MetadataValue.md(md_table(["shape (aspect order)", *map(str, tiers)], rows))


@asset(
    partitions_def=BATCHES,
    deps=[resolution_profile],
    group_name="shards",
    kinds={"lance"},
    code_version="bucket_assignments-v1",
    description=(
        "Tier, shape, scale and crop box for every eligible image (default bucket table), "
        "from the resolution table's sizes only: no image bytes are read."
    ),
)
def bucket_assignments(context: AssetExecutionContext, lab: LabResource) -> MaterializeResult:
    store = lab.lab()
    batch = context.partition_key
    eligible = store.read(
        RESOLUTION.name,
        columns=["key", "batch", "width", "height"],
        filter=f"batch = {sql_literal(batch)} AND eligible = true",
    )
    table = bucket_table()
    if eligible.num_rows:
        rows = assignment_rows(eligible, table)
    else:
        rows = BUCKET_ASSIGNMENTS.schema.empty_table()
    written = store.replace_partition(BUCKET_ASSIGNMENTS, batch, rows)
    summary = summarise_assignments(rows, table)
    pictures = {
        f"fill_tier_{tier}": png_markdown(
            bar_chart(
                list(shapes),
                [float(v) for v in shapes.values()],
                f"{batch}: tier {tier}, {sum(shapes.values())} images",
                "bucket (H x W)",
            ),
            f"bucket fill, tier {tier}",
        )
        for tier, shapes in summary.fill.items()
    }
    return MaterializeResult(
        metadata={
            "eligible": eligible.num_rows,
            "assigned": summary.assigned,
            "outside_aspect_range": summary.outside_aspect_range,
            "upscaled": summary.upscaled,
            "mean_crop_fraction": round(summary.mean_crop_fraction, 4),
            "images_per_tier": counts_table(
                {str(t): sum(s.values()) for t, s in summary.fill.items()}, "tier"
            ),
            "bucket_fill": _fill_markdown(summary.fill),
            **pictures,
            "bucket_assignments_lance_version": written["version"],
        }
    )


class MDSShardsConfig(Config):
    """Run settings of ``mds_shards``; shard size and resample change what is written."""

    shard_size_limit: int = Field(
        default=DEFAULT_SIZE_LIMIT,
        description="Bytes per MDS shard (MDSWriter size_limit); 128 MiB by default.",
    )
    resample: str = Field(
        default=RESAMPLE,
        description=(
            "'bicubic-aa' (default; torch uint8 kernel, differs from Lanczos by less than "
            "the q92 loss) or 'lanczos' (Pillow; faster on CPUs without AVX2)."
        ),
    )
    max_render_failures: int = Field(
        default=20,
        description="Images that may fail to render (skipped, reported) before the run fails.",
    )
    read_chunk: int = Field(
        default=32, description="Images whose source bytes are read from Lance at once."
    )
    render_threads: int = Field(
        default=2, description="Threads resizing/encoding a chunk (output order is fixed)."
    )
    canonical_nodes: int = Field(
        default=64,
        description="Loader canonical node count the small-bucket hazard is judged against.",
    )
    device_batch_size: int = Field(
        default=1, description="Per-device batch size for the small-bucket hazard rule."
    )


def _bucket_report(
    batch: str,
    mine: dict[tuple[int, str], BucketTotals],
    everywhere: dict[tuple[int, str], BucketTotals],
    mb: dict[str, float],
    config: MDSShardsConfig,
) -> tuple[MetadataValue, dict[str, list[str]], dict[str, list[str]]]:
    """Per-bucket table, and small-bucket hazards for this batch and for all batches."""
    rule = (config.canonical_nodes, config.device_batch_size)
    rows: list[tuple[object, ...]] = []
    hazards: dict[str, list[str]] = {}
    for (tier, shape), t in mine.items():
        rel = f"mds/{tier}/{shape}/{batch}"
        problems = small_bucket_hazards(t.samples, t.shards, *rule)
        if problems:
            hazards[rel] = problems
        hazard = "; ".join(problems) or "ok"
        rows.append((f"{tier}/{shape}", t.samples, t.shards, round(mb[rel], 2), hazard))
    header = ["bucket", "samples", "shards", "MB", "hazard (this batch)"]
    hazards_all = {
        f"{tier}/{shape}": problems
        for (tier, shape), t in everywhere.items()
        if (tier, shape) in mine and (problems := small_bucket_hazards(t.samples, t.shards, *rule))
    }
    return MetadataValue.md(md_table(header, rows)), hazards, hazards_all


def _by_cause(uncaptioned: dict[str, str]) -> dict[str, list[str]]:
    """cause -> (up to MAX_LISTED_KEYS) keys written without a usable caption."""
    out: dict[str, list[str]] = {}
    for key, why in sorted(uncaptioned.items()):
        out.setdefault(why, []).append(key)
    return {why: keys[:MAX_LISTED_KEYS] for why, keys in out.items()}


@asset(
    partitions_def=BATCHES,
    deps=[bucket_assignments, "captions"],
    group_name="shards",
    kinds={"mds"},
    # No policy fingerprint here, on purpose: the shards do not depend on the policy, only
    # their first skip-list generation does, and skip_lists (versioned by the fingerprint)
    # refreshes that; a policy change must not re-render every shard.
    code_version="mds_shards-v2",
    description=(
        "Every assigned image resized to its bucket, JPEG q92, written as MDS under "
        "<shards_root>/mds/<tier>/<H>x<W>/<batch>/ together with its first skip-list "
        "generation (decided by the skip policy from the lab at write time; an image "
        "without a usable caption is written with an empty one and skipped as "
        "`no_caption`), so no directory is ever visible unscreened. Each sample's location "
        "in Lance `shard_samples` (committed after the directories are in place; a crash in "
        "between leaves it stale, which its `dir_digest` reveals and a rerun repairs)."
    ),
)
def mds_shards(
    context: AssetExecutionContext,
    config: MDSShardsConfig,
    lab: LabResource,
    skip_policy: SkipPolicyResource,
) -> MaterializeResult:
    try:
        policy = skip_policy.policy()
    except SkipPolicyError as exc:
        raise Failure(description=f"invalid skip policy: {exc}") from None
    store = lab.lab()
    batch = context.partition_key
    assignments = store.read_batch(BUCKET_ASSIGNMENTS.name, batch)
    if assignments.num_rows == 0:
        assignments = BUCKET_ASSIGNMENTS.schema.empty_table()
    captions = store.read_batch(CAPTIONS.name, batch, columns=list(CAPTION_COLUMNS))
    plan = plan_shards(assignments, captions)
    renderer = BucketRenderer(
        store.dataset(IMAGES.name) if plan.buckets else None,
        batch,
        plan.captions,
        chunk_size=config.read_chunk,
        threads=config.render_threads,
        max_pixels=lab.max_pixels,
        resample=config.resample,
        max_failures=config.max_render_failures,
    )
    try:
        screener = ShardScreener(
            store,
            batch,
            policy,
            {bucket: [r["key"] for r in rows] for bucket, rows in plan.buckets.items()},
            plan.uncaptioned,
        )
    except SkipPolicyError as exc:
        raise Failure(description=f"{batch}: cannot decide its skip-lists: {exc}") from None
    placements = write_partition_streams(
        lab.shards_root,
        batch,
        {bucket: renderer.samples(rows) for bucket, rows in plan.buckets.items()},
        skips_for=screener,
        extra_columns=MDS_EXTRA_COLUMNS,
        size_limit=config.shard_size_limit,
        hashes=("sha256",),
    )
    dirs = list_partition_dirs(lab.shards_root, batch)
    digests = {f"mds/{d.tier}/{d.shape}/{batch}": partition_digest(d.path) for d in dirs}
    rows = placement_rows(placements, batch, digests, renderer.log, plan.captions)
    written = store.replace_partition(SHARD_SAMPLES, batch, rows)

    mb = {f"mds/{d.tier}/{d.shape}/{batch}": directory_bytes(d.path) / 1e6 for d in dirs}
    everywhere = bucket_totals(
        store.read(SHARD_SAMPLES.name, columns=["tier", "shape", "relative_dir", "shard"])
    )
    table, hazards, hazards_all = _bucket_report(batch, bucket_totals(rows), everywhere, mb, config)
    failures = renderer.log.failures
    for key, why in failures.items():
        context.log.warning(f"{batch}: image {key} not written: {why}")
    decisions = screener.decisions()
    excluded = len(decisions.excluded_keys)
    context.log.info(
        f"{batch}: wrote {len(placements)} samples in {len(dirs)} bucket directories "
        f"({len(plan.uncaptioned)} without a usable caption), {excluded} excluded by their "
        f"first skip-lists, {len(failures)} not written (render failures)"
    )
    return MaterializeResult(
        metadata={
            "assigned": assignments.num_rows,
            "samples_written": len(placements),
            "not_written": len(failures),
            "not_written_keys": MetadataValue.json(
                [f"{k}: {v}" for k, v in sorted(failures.items())][:MAX_LISTED_KEYS]
            ),
            "written_without_caption": len(plan.uncaptioned),
            "uncaptioned_keys": MetadataValue.json(_by_cause(plan.uncaptioned)),
            "excluded_by_first_skiplists": excluded,
            "first_skiplist_reasons": counts_table(decisions.reason_counts(), "reason", sort=False),
            "skip_policy_fingerprint": policy.fingerprint(),
            "skiplist_generations": MetadataValue.json(
                {f"mds/{d.tier}/{d.shape}/{batch}": current_generation(d.path) for d in dirs}
            ),
            "buckets": table,
            "mb_written": round(sum(mb.values()), 3),
            "hazard_rule": (
                f"hazard when samples < canonical_nodes x device_batch_size = "
                f"{config.canonical_nodes} x {config.device_batch_size} (streaming repeats "
                f"samples) or shards < canonical_nodes = {config.canonical_nodes} (nodes "
                "share shards)"
            ),
            "small_bucket_hazards": MetadataValue.json(hazards),
            "small_bucket_hazards_all_batches": MetadataValue.json(hazards_all),
            "tree": MetadataValue.json(sorted(mb)),
            "jpeg": f"quality {JPEG_QUALITY}, subsampling {JPEG_SUBSAMPLING}",
            "resample": config.resample
            + (f": {RESAMPLE_DESCRIPTION}" if config.resample == RESAMPLE else ""),
            "jpeg_subsampling_reason": JPEG_SUBSAMPLING_REASON,
            "shard_size_limit": config.shard_size_limit,
            "shards_root": MetadataValue.path(lab.shards_root),
            "shard_samples_lance_version": written["version"],
        }
    )
