"""bucket_assignments and mds_shards: from eligible, captioned images to MDS bucket shards.

The stage's logic is ``core/shards/runner.py`` (``BatchAssignment``, ``BatchShards``); these
assets resolve the partition, call a runner and present its outcome as metadata.
"""

from typing import Any

from dagster import AssetExecutionContext, Config, Failure, MaterializeResult, MetadataValue, asset
from pydantic import Field

from prx_assets.core.plots import bar_chart, heat_map
from prx_assets.core.shards.mds import DEFAULT_SIZE_LIMIT
from prx_assets.core.shards.resize import (
    JPEG_QUALITY,
    JPEG_SUBSAMPLING,
    JPEG_SUBSAMPLING_REASON,
    RESAMPLE,
    RESAMPLE_DESCRIPTION,
)
from prx_assets.core.shards.runner import (
    AssignmentOutcome,
    BatchAssignment,
    BatchShards,
    ScreeningRefused,
    ShardOutcome,
    ShardSettings,
)
from prx_assets.core.shards.settings import PIECE_SAMPLES
from prx_assets.core.skiplists.policy import SkipPolicyError
from prx_assets.defs.metadata import counts_table, md_table, png_markdown
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.config import SkipPolicyResource

MAX_LISTED_KEYS = 50


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
    out = BatchAssignment(lab.lab(), context.partition_key).run()
    s = out.summary
    return MaterializeResult(
        metadata={
            "eligible": out.eligible,
            "assigned": s.assigned,
            "outside_aspect_range": s.outside_aspect_range,
            "upscaled": s.upscaled,
            "mean_crop_fraction": round(s.mean_crop_fraction, 4),
            "images_per_tier": counts_table(  # 512 before 1024: numeric order
                {str(t): sum(s.fill[t].values()) for t in sorted(s.fill, key=int)},
                "tier",
                sort=False,
            ),
            "bucket_fill": _fill_markdown(s.fill),
            **_fill_pictures(out),
            "bucket_assignments_lance_version": out.version,
        }
    )


class MDSShardsConfig(Config):
    """Run settings of ``mds_shards``; shard size, piece size and resample change what is
    written."""

    shard_size_limit: int = Field(
        default=DEFAULT_SIZE_LIMIT,
        description="Bytes per MDS shard (MDSWriter size_limit); 128 MiB by default.",
    )
    resample: str = Field(
        default=RESAMPLE,
        description=(
            "'lanczos' (default: literal Lanczos-3 over the crop box on a JPEG's own Y, Cb and "
            "Cr planes, from a libjpeg-turbo raw decode at 1/8, 1/4, 1/2 or full size, "
            "encoded from the planes; Pillow's Lanczos-3 for other sources), "
            "'lanczos-pillow' (Pillow's Lanczos-3 from RGB, the reference) or 'bicubic-aa' "
            "(torch's antialiased bicubic; differs from Lanczos by less than the q92 loss)."
        ),
    )
    max_render_failures: int = Field(
        default=20,
        description="Images that may fail to render (skipped, reported) before the run fails.",
    )
    read_chunk: int = Field(
        default=32, description="Images whose lab rows are read from Lance at once."
    )
    piece_samples: int = Field(
        default=PIECE_SAMPLES,
        description=(
            "Samples one worker task renders into its own shard file(s): the most a shard "
            "holds (fewer when shard_size_limit cuts first). Changes the shard layout; more "
            "samples per piece means fewer, larger shards and coarser work units."
        ),
    )
    canonical_nodes: int = Field(
        default=64,
        description="Loader canonical node count the small-bucket hazard is judged against.",
    )
    device_batch_size: int = Field(
        default=1, description="Per-device batch size for the small-bucket hazard rule."
    )

    def settings(self, max_pixels: int, workers: int | None = None) -> ShardSettings:
        return ShardSettings(
            size_limit=self.shard_size_limit,
            resample=self.resample,
            max_render_failures=self.max_render_failures,
            read_chunk=self.read_chunk,
            workers=workers,
            max_pixels=max_pixels,
            canonical_nodes=self.canonical_nodes,
            device_batch_size=self.device_batch_size,
            piece_samples=self.piece_samples,
        )


@asset(
    partitions_def=BATCHES,
    deps=[bucket_assignments, "captions"],
    group_name="shards",
    kinds={"mds"},
    # No policy fingerprint here, on purpose: the shards do not depend on the policy, only
    # their first skip-list generation does, and skip_lists (versioned by the fingerprint)
    # refreshes that; a policy change must not re-render every shard.
    # v3: Lanczos from a DCT-scaled decode, libjpeg-turbo encoder (other bytes than v2).
    # v4: JPEG sources resampled and encoded on their own YCbCr planes (other bytes).
    # v5: index.json published for prx_assets.loader only (plain streaming refuses it), so
    # directories written before are rewritten; the loader refuses them until then.
    # v6: shards written per worker piece (core/shards/pieces.py: at most `piece_samples`
    # = 256 samples per shard, the index merged by the step), so shard boundaries differ.
    code_version="mds_shards-v6",
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
    batch = context.partition_key
    try:
        policy = skip_policy.policy()
    except SkipPolicyError as exc:
        raise Failure(description=f"invalid skip policy: {exc}") from None
    run = BatchShards(
        lab.lab(),
        lab.shards_root,
        batch,
        policy,
        config.settings(lab.max_pixels, lab.workers),
        report=context.log.info,
    )
    try:
        out = run.run()
    except ScreeningRefused as exc:
        raise Failure(description=str(exc)) from None
    for key, why in out.failures.items():
        context.log.warning(f"{batch}: image {key} not written: {why}")
    context.log.info(
        f"{batch}: wrote {out.written} samples in {len(out.directories)} bucket directories "
        f"({len(out.uncaptioned)} without a usable caption), {out.excluded} excluded by their "
        f"first skip-lists, {len(out.failures)} not written (render failures)"
    )
    return MaterializeResult(metadata=_shard_metadata(out, lab.shards_root))


# --------------------------------------------------------------------------- presentation


def _fill_markdown(fill: dict[int, dict[str, int]]) -> MetadataValue:
    """One row per aspect slot (portrait to landscape), one column per tier: "shape: n"."""
    tiers = sorted(fill)
    n = len(next(iter(fill.values())))
    rows: list[list[object]] = [
        [i, *(f"{list(fill[t])[i]}: {list(fill[t].values())[i]}" for t in tiers)] for i in range(n)
    ]
    rows.append(["total", *(sum(fill[t].values()) for t in tiers)])
    return MetadataValue.md(md_table(["shape (aspect order)", *map(str, tiers)], rows))


def _aspect_label(shape: str) -> str:
    """A bucket's aspect ratio (width / height) from its ``HxW`` name."""
    h, _, w = shape.partition("x")
    return f"{int(w) / int(h):.2f}"


def _fill_heat_map(out: AssignmentOutcome) -> MetadataValue:
    """The bucket fill at a glance: one row per tier, one column per aspect slot."""
    fill = out.summary.fill
    tiers = sorted(fill, key=int, reverse=True)  # the largest on top
    slots = [_aspect_label(shape) for shape in fill[tiers[-1]]]
    picture = heat_map(
        [str(t) for t in tiers],
        slots,
        [[float(v) for v in fill[t].values()] for t in tiers],
        f"{out.batch}: {sum(sum(f.values()) for f in fill.values())} images by tier x aspect",
        "aspect (width / height), portrait to landscape",
    )
    return png_markdown(picture, "bucket fill: tier x aspect")


def _fill_pictures(out: AssignmentOutcome) -> dict[str, MetadataValue]:
    """The fill as one heat map (tier x aspect), and one bar chart per tier."""
    return {
        "bucket_fill_map": _fill_heat_map(out),
        **_fill_bars(out),
    }


def _fill_bars(out: AssignmentOutcome) -> dict[str, MetadataValue]:
    """One bar chart of the bucket fill per tier."""
    return {
        f"fill_tier_{tier}": png_markdown(
            bar_chart(
                list(shapes),
                [float(v) for v in shapes.values()],
                f"{out.batch}: tier {tier}, {sum(shapes.values())} images",
                "bucket (H x W)",
            ),
            f"bucket fill, tier {tier}",
        )
        for tier, shapes in out.summary.fill.items()
    }


def _by_cause(uncaptioned: dict[str, str]) -> dict[str, list[str]]:
    """cause -> (up to MAX_LISTED_KEYS) keys written without a usable caption."""
    out: dict[str, list[str]] = {}
    for key, why in sorted(uncaptioned.items()):
        out.setdefault(why, []).append(key)
    return {why: keys[:MAX_LISTED_KEYS] for why, keys in out.items()}


def _shard_metadata(out: ShardOutcome, shards_root: str) -> dict[str, Any]:
    s = out.settings
    floor = s.canonical_nodes * s.device_batch_size

    def hazard(samples: int, shards: int) -> str:
        # Short flags per row; the rule is stated once (hazard_rule), the full sentences
        # per directory are in small_bucket_hazards.
        flags = ["few samples"] * (samples < floor) + ["few shards"] * (shards < s.canonical_nodes)
        return ", ".join(flags)

    buckets = [
        (
            f"{d.tier}/{d.shape}",
            d.samples,
            d.shards,
            round(d.bytes / 1e6, 2),
            hazard(d.samples, d.shards),
        )
        for d in out.directories
    ]
    return {
        "assigned": out.assigned,
        "samples_written": out.written,
        "not_written": len(out.failures),
        "not_written_keys": MetadataValue.json(
            [f"{k}: {v}" for k, v in sorted(out.failures.items())][:MAX_LISTED_KEYS]
        ),
        "written_without_caption": len(out.uncaptioned),
        "uncaptioned_keys": MetadataValue.json(_by_cause(out.uncaptioned)),
        "excluded_by_first_skiplists": out.excluded,
        "first_skiplist_reasons": counts_table(out.decisions.reason_counts(), "reason", sort=False),
        "skip_policy_fingerprint": out.policy_fingerprint,
        "skiplist_generations": MetadataValue.json(
            {d.relative_dir: d.generation for d in out.directories}
        ),
        "buckets": MetadataValue.md(
            md_table(
                ["bucket", "samples", "shards", "MB", "hazard (this batch)"],
                [(*row[:4], row[4] or "ok") for row in buckets],
            )
        ),
        "mb_written": round(out.bytes_written / 1e6, 3),
        "hazard_rule": (
            f"hazard when samples < canonical_nodes x device_batch_size = "
            f"{s.canonical_nodes} x {s.device_batch_size} (streaming repeats "
            f"samples) or shards < canonical_nodes = {s.canonical_nodes} (nodes "
            "share shards)"
        ),
        "small_bucket_hazards": MetadataValue.json(
            {d.relative_dir: list(d.hazards) for d in out.directories if d.hazards}
        ),
        "small_bucket_hazards_all_batches": MetadataValue.json(out.hazards_all_batches),
        "tree": MetadataValue.json(sorted(d.relative_dir for d in out.directories)),
        "jpeg": f"quality {JPEG_QUALITY}, subsampling {JPEG_SUBSAMPLING}",
        "resample": s.resample + (f": {RESAMPLE_DESCRIPTION}" if s.resample == RESAMPLE else ""),
        "jpeg_subsampling_reason": JPEG_SUBSAMPLING_REASON,
        "shard_size_limit": s.size_limit,
        "shards_root": MetadataValue.path(shards_root),
        "shard_samples_lance_version": out.version,
    }
