"""bucket_assignments and mds_shards: from eligible, captioned images to MDS bucket shards."""

from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from prx_assets.core.buckets import bucket_table
from prx_assets.core.lab import sql_literal
from prx_assets.core.mds import (
    DEFAULT_SIZE_LIMIT,
    directory_bytes,
    list_partition_dirs,
    partition_digest,
    small_bucket_hazards,
    write_partition_streams,
)
from prx_assets.core.plots import bar_chart
from prx_assets.core.resize import JPEG_QUALITY, JPEG_SUBSAMPLING, JPEG_SUBSAMPLING_REASON
from prx_assets.core.shard_tables import (
    BUCKET_ASSIGNMENTS,
    CAPTION_COLUMNS,
    MDS_EXTRA_COLUMNS,
    SHARD_SAMPLES,
    BucketRenderer,
    assignment_rows,
    bucket_totals,
    placement_rows,
    plan_shards,
    summarise_assignments,
)
from prx_assets.core.tables import CAPTIONS, IMAGES, RESOLUTION
from prx_assets.defs.metadata import counts_table, png_markdown
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource

MAX_LISTED_KEYS = 50


def _fill_markdown(fill: dict[int, dict[str, int]]) -> MetadataValue:
    """One row per aspect slot (portrait to landscape), one column per tier: "shape: n"."""
    tiers = sorted(fill)
    n = len(next(iter(fill.values())))
    header = "| shape (aspect order) | " + " | ".join(str(t) for t in tiers) + " |"
    lines = [header, "|---|" + "---|" * len(tiers)]
    for i in range(n):
        cells = [f"{list(fill[t])[i]}: {list(fill[t].values())[i]}" for t in tiers]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    totals = [str(sum(fill[t].values())) for t in tiers]
    lines.append("| **total** | " + " | ".join(totals) + " |")
    return MetadataValue.md("\n".join(lines))


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
    """Run settings of ``mds_shards``; only the shard size changes what is written."""

    shard_size_limit: int = Field(
        default=DEFAULT_SIZE_LIMIT,
        description="Bytes per MDS shard (MDSWriter size_limit); 128 MiB by default.",
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


@asset(
    partitions_def=BATCHES,
    deps=[bucket_assignments, "captions"],
    group_name="shards",
    kinds={"mds"},
    code_version="mds_shards-v1",
    description=(
        "Every assigned, captioned image resized to its bucket, JPEG q92, written as MDS "
        "under <shards_root>/mds/<tier>/<H>x<W>/<batch>/; each sample's location in Lance "
        "`shard_samples`."
    ),
)
def mds_shards(
    context: AssetExecutionContext, config: MDSShardsConfig, lab: LabResource
) -> MaterializeResult:
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
    )
    placements = write_partition_streams(
        lab.shards_root,
        batch,
        {bucket: renderer.samples(rows) for bucket, rows in plan.buckets.items()},
        extra_columns=MDS_EXTRA_COLUMNS,
        size_limit=config.shard_size_limit,
        hashes=("sha256",),
    )
    dirs = list_partition_dirs(lab.shards_root, batch)
    digests = {f"mds/{d.tier}/{d.shape}/{batch}": partition_digest(d.path) for d in dirs}
    rows = placement_rows(placements, batch, digests, renderer.log, plan.captions)
    written = store.replace_partition(SHARD_SAMPLES, batch, rows)

    mine = bucket_totals(rows)
    everywhere = bucket_totals(
        store.read(SHARD_SAMPLES.name, columns=["tier", "shape", "relative_dir", "shard"])
    )
    mb = {f"mds/{d.tier}/{d.shape}/{batch}": directory_bytes(d.path) / 1e6 for d in dirs}
    lines = ["| bucket | samples | shards | MB | hazard (this batch) |", "|---|---|---|---|---|"]
    hazard_dirs = {}
    for (tier, shape), t in mine.items():
        rel = f"mds/{tier}/{shape}/{batch}"
        problems = small_bucket_hazards(
            t.samples, t.shards, config.canonical_nodes, config.device_batch_size
        )
        if problems:
            hazard_dirs[rel] = problems
        lines.append(
            f"| {tier}/{shape} | {t.samples} | {t.shards} | {mb[rel]:.2f} | "
            f"{'; '.join(problems) or 'ok'} |"
        )
    bucket_wide = {
        f"{tier}/{shape}": small_bucket_hazards(
            t.samples, t.shards, config.canonical_nodes, config.device_batch_size
        )
        for (tier, shape), t in everywhere.items()
        if (tier, shape) in mine
    }
    skipped = {reason: len(keys) for reason, keys in plan.skipped.items()}
    failures = renderer.log.failures
    for key, why in failures.items():
        context.log.warning(f"{batch}: image {key} not written: {why}")
    if failures:
        skipped["render_failed"] = len(failures)
    context.log.info(
        f"{batch}: wrote {len(placements)} samples in {len(dirs)} bucket directories, "
        f"skipped {sum(skipped.values())}"
    )
    skipped_keys = {r: sorted(k)[:MAX_LISTED_KEYS] for r, k in plan.skipped.items()}
    if failures:
        skipped_keys["render_failed"] = [
            f"{k}: {v}" for k, v in sorted(failures.items())[:MAX_LISTED_KEYS]
        ]
    return MaterializeResult(
        metadata={
            "assigned": assignments.num_rows,
            "samples_written": len(placements),
            "skipped": sum(skipped.values()),
            "skip_reasons": counts_table(skipped, "reason"),
            "skipped_keys": MetadataValue.json(skipped_keys),
            "buckets": MetadataValue.md("\n".join(lines)),
            "mb_written": round(sum(mb.values()), 3),
            "hazard_rule": (
                f"hazard when samples < canonical_nodes x device_batch_size = "
                f"{config.canonical_nodes} x {config.device_batch_size} (streaming repeats "
                f"samples) or shards < canonical_nodes = {config.canonical_nodes} (nodes "
                "share shards)"
            ),
            "small_bucket_hazards": MetadataValue.json(hazard_dirs),
            "small_bucket_hazards_all_batches": MetadataValue.json(
                {b: p for b, p in bucket_wide.items() if p}
            ),
            "tree": MetadataValue.json(sorted(mb)),
            "jpeg": f"quality {JPEG_QUALITY}, subsampling {JPEG_SUBSAMPLING}",
            "jpeg_subsampling_reason": JPEG_SUBSAMPLING_REASON,
            "shard_size_limit": config.shard_size_limit,
            "shards_root": MetadataValue.path(lab.shards_root),
            "shard_samples_lance_version": written["version"],
        }
    )
