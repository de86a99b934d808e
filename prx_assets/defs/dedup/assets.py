"""image_hashes and phash_clusters: one batch at a time, decided against the whole corpus.

Why no dependency on all partitions of image_hashes (measured with Dagster 1.13.27): an
``AllPartitionMapping`` under eager automation reran phash_clusters and the skip-lists of
every partition whenever one batch arrived (2,001 batches: 4,002 asset partitions). So
``phash_clusters(B)`` depends on ``image_hashes(B)`` only, and reads the other batches'
hashes as a table at run time, through the ``phash`` index. What its decision changes in
other batches is written to ``dedup_dirty``; the dedup sensor (``sensors.py``) reruns
exactly those partitions. The stage's logic is :mod:`prx_assets.core.dedup` (the runners in
:mod:`prx_assets.core.dedup.runner`); this module is glue: run, then metadata and checks.
"""

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    PreviewWarning,
    asset,
)

from prx_assets.core.dedup.checks import HashCoverage
from prx_assets.core.dedup.gallery import contact_sheet, gallery_groups
from prx_assets.core.dedup.runner import BatchClusters, BatchHashes, ClusterOutcome, InputNotReady
from prx_assets.core.lab import Lab
from prx_assets.core.tables import DEDUP_DIRTY, IMAGE_HASHES
from prx_assets.defs.dedup.config import DedupConfigResource
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.metadata import bounded, counts_table, png_markdown
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource

GROUP = "dedup"
IMAGE_HASHES_ASSET = "image_hashes"
PHASH_CLUSTERS_ASSET = "phash_clusters"
HASHES_COMPLETE = "image_hashes_complete"
ONE_KEEPER = "phash_clusters_one_keeper"
KEEPER_MOST_PIXELS = "phash_clusters_keeper_most_pixels"
_LIST_LIMIT = 20  # keys listed in metadata before "... and N more"


def _spec(name: str, asset: str, description: str) -> AssetCheckSpec:
    with warnings.catch_warnings():
        # Partitioned checks are "preview" in 1.13; chosen knowingly, as in the caption stage.
        warnings.simplefilter("ignore", PreviewWarning)
        return AssetCheckSpec(name, asset=asset, partitions_def=BATCHES, description=description)


def _some(items: list[str]) -> MetadataValue:
    more = len(items) - _LIST_LIMIT
    return MetadataValue.json(items[:_LIST_LIMIT] + ([f"... and {more} more"] if more > 0 else []))


@contextlib.contextmanager
def _upstream_required() -> Iterator[None]:
    """A missing upstream table or row fails the run with the runner's instruction."""
    try:
        yield
    except InputNotReady as exc:
        raise Failure(description=str(exc)) from None


# --------------------------------------------------------------------------- image_hashes


def _image_hashes(
    context: AssetExecutionContext, lab: LabResource, dedup: DedupConfigResource
) -> MaterializeResult:
    store, settings = lab.lab(), dedup.settings()
    with _upstream_required():
        out = BatchHashes(
            store,
            context.partition_key,
            settings,
            dedup.read_chunk,
            workers=lab.workers,
            report=context.log.info,
        ).run()
    if out.chunks_hashed_by_step:
        context.log.warning(
            f"{out.batch}: {out.chunks_hashed_by_step} chunk(s) hashed by the step, not a "
            f"worker (same rows, slower): {bounded(out.first_worker_error or '', 500)}"
        )
    context.log.info(
        f"{out.batch}: hashed {out.hashed}/{out.to_hash} ({out.ineligible} not eligible for "
        f"training, hashed so an opt-out naming them reaches their copies) in {out.seconds:.1f} s"
    )
    return MaterializeResult(
        metadata={
            "images_to_hash": out.to_hash,
            "ineligible_hashed_for_opt_outs": out.ineligible,
            "hashed": out.hashed,
            "undecodable": len(out.coverage.undecodable),
            "phash_mode": settings.phash_mode,
            "phash_version": settings.phash_version,
            "low_information": out.low_information,
            "low_info_threshold": settings.low_info_threshold,
            "ms_per_image": 1e3 * out.seconds / max(1, out.to_hash),
            "mb_read": round(out.bytes_read / 1e6, 3),
            "chunks_hashed_by_step": out.chunks_hashed_by_step,
            "first_worker_error": MetadataValue.text(bounded(out.first_worker_error or "", 500)),
            "image_hashes_lance_version": out.lance_version,
            "lab": MetadataValue.path(store.uri(IMAGE_HASHES.name)),
        },
        check_results=[hashes_complete_result(out.coverage)],
    )


def hashes_complete_result(coverage: HashCoverage) -> AssetCheckResult:
    return AssetCheckResult(
        check_name=HASHES_COMPLETE,
        passed=coverage.complete,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "expected": coverage.expected,
            "hashed": coverage.hashed,
            "missing": _some(coverage.missing),
            "unexpected": _some(coverage.unexpected),
            "other_phash_version": _some(coverage.other_phash_version),
            "undecodable": _some(coverage.undecodable),
        },
    )


# --------------------------------------------------------------------------- phash_clusters


def _phash_clusters(
    context: AssetExecutionContext, lab: LabResource, dedup: DedupConfigResource
) -> MaterializeResult:
    store = lab.lab()
    run = BatchClusters(store, context.partition_key, dedup.settings(), dedup.lookup_chunk)
    with _upstream_required():
        out = run.run()
    affected = out.plan.stats.affected_batches
    if affected:
        context.log.info(
            f"{out.batch}: decisions of {len(affected)} other batch(es) changed "
            f"({', '.join(affected)}); marked in {DEDUP_DIRTY.name}"
        )
    metadata = clusters_metadata(out)
    metadata["gallery"] = _gallery(store, out, dedup.gallery_clusters)
    return MaterializeResult(metadata=metadata, check_results=keeper_check_results(out))


def clusters_metadata(out: ClusterOutcome) -> dict[str, Any]:
    """The run's metadata: what it decided, what it changed elsewhere, how it looked up."""
    stats, settings = out.plan.stats, out.settings
    changes = [f"{c.batch}:{c.key}: {c.before} -> {c.after}" for c in out.plan.changes]
    return {
        "images": stats.images,
        "clusters_with_duplicates": stats.clusters_with_duplicates,
        "duplicates_within_batch": stats.within_batch_duplicates,
        "duplicates_of_other_batches": stats.duplicates_of_other_batches,
        "keepers_over_other_batches": stats.keepers_over_other_batches,
        "displaced_keepers_in_other_batches": stats.displaced_in_other_batches,
        "kept": out.kept,
        "cluster_sizes": counts_table(
            {str(k): v for k, v in sorted(stats.cluster_sizes.items())}, "size", sort=False
        ),
        "affected_other_batches": MetadataValue.json(stats.affected_batches),
        "n_affected_other_batches": len(stats.affected_batches),
        "changes_in_other_batches": _some(changes),
        "dirty_rows_marked": out.dirty_marked,
        "dirty_rows_cleared": out.dirty_cleared,
        "changed_during_run": _some(
            [f"{c.batch}:{c.key}: {c.before} -> {c.after}" for c in out.raced]
        ),
        "rechecked_after_write": out.rechecked,
        "low_information": stats.low_information,
        "low_info_threshold": settings.low_info_threshold,
        "low_information_for_review": _some(out.low_information_keys),
        "radius": settings.radius,
        "phash_version": settings.phash_version,
        "config_fingerprint": settings.fingerprint(),
        "members_not_decided_yet": stats.undecided_members,
        "members_under_other_config": stats.other_config_members,
        "lookups": MetadataValue.json(out.lookups),
        "decide_seconds": round(out.decide_seconds, 3),
        "phash_clusters_lance_version": out.lance_version,
    }


def _gallery(store: Lab, out: ClusterOutcome, max_clusters: int) -> MetadataValue:
    groups = gallery_groups(store, out.batch, out.plan.decisions, max_clusters)
    if not groups:
        return MetadataValue.text("no duplicate clusters touch this batch")
    png = contact_sheet(groups, title=f"{out.batch}: duplicate clusters (green = kept)")
    return png_markdown(png, f"duplicate clusters touching {out.batch}")


def keeper_check_results(out: ClusterOutcome) -> list[AssetCheckResult]:
    result = out.keepers
    common = {"clusters_checked": result.clusters, "pending_dirty_rows": out.pending_dirty}
    return [
        AssetCheckResult(
            check_name=ONE_KEEPER,
            passed=result.one_keeper,
            severity=AssetCheckSeverity.ERROR,
            metadata={
                **common,
                "no_keeper": _some(result.no_keeper),
                "several_keepers": _some(result.several_keepers),
                "low_information_not_own_keeper": _some(result.low_information_not_own_keeper),
            },
        ),
        AssetCheckResult(
            check_name=KEEPER_MOST_PIXELS,
            passed=result.keeper_largest,
            severity=AssetCheckSeverity.ERROR,
            metadata={**common, "keeper_not_largest": _some(result.keeper_not_largest)},
        ),
    ]


# --------------------------------------------------------------------------- builder


def build_dedup_assets(config: DedupConfigResource) -> list[AssetsDefinition]:
    """image_hashes and phash_clusters, versioned by ``config``.

    Pass the same resource object that ``Definitions`` binds to ``dedup``, so the code
    versions describe what will run: the hash version for image_hashes, the whole dedup
    fingerprint (radius, threshold, hash version, keeper rule) for phash_clusters.
    """
    settings = config.settings()
    fp = settings.fingerprint()

    @asset(
        name=IMAGE_HASHES_ASSET,
        partitions_def=BATCHES,
        deps=[raw_images, resolution_profile],
        group_name=GROUP,
        kinds={"lance"},
        # v2: every profiled image is hashed, copies under the size cutoff included.
        code_version=f"image_hashes-v2-{settings.phash_version}",
        check_specs=[
            _spec(
                HASHES_COMPLETE,
                IMAGE_HASHES_ASSET,
                "Every profiled image of the partition (copies under the size cutoff included) "
                "has exactly one hash row of the configured pHash version, and no other "
                "image has one.",
            )
        ],
        description=(
            f"64-bit pHash ({settings.phash_mode} mode, {settings.phash_version}) of every "
            "profiled image (also those under the size cutoff, so that an opt-out naming "
            "only a small copy reaches its larger copies through their cluster), with AC "
            "energy, pixels and file size for the keeper rule. "
            "BTREE index on phash for look-ups by hash."
        ),
    )
    def image_hashes(
        context: AssetExecutionContext, lab: LabResource, dedup: DedupConfigResource
    ) -> MaterializeResult:
        return _image_hashes(context, lab, dedup)

    radius_what = (
        "identical hashes (BTREE look-up)"
        if settings.radius == 0
        else f"hashes within Hamming {settings.radius}, transitively"
    )

    @asset(
        name=PHASH_CLUSTERS_ASSET,
        partitions_def=BATCHES,
        deps=[image_hashes],
        group_name=GROUP,
        kinds={"lance"},
        code_version=f"phash_clusters-v1-{fp}",
        check_specs=[
            _spec(
                ONE_KEEPER,
                PHASH_CLUSTERS_ASSET,
                "Each cluster touching the partition has exactly one keeper across all "
                "batches; low-information images are their own keeper.",
            ),
            _spec(
                KEEPER_MOST_PIXELS,
                PHASH_CLUSTERS_ASSET,
                "Each cluster's keeper has the most pixels among its stored members.",
            ),
        ],
        description=(
            f"Near-duplicate clusters ({radius_what}) of the partition's images against the "
            "whole corpus, and the keeper of each (most pixels, then larger file, then "
            "smallest key). Other batches whose decisions change are listed in dedup_dirty "
            "for the dedup sensor."
        ),
    )
    def phash_clusters(
        context: AssetExecutionContext, lab: LabResource, dedup: DedupConfigResource
    ) -> MaterializeResult:
        return _phash_clusters(context, lab, dedup)

    return [image_hashes, phash_clusters]
