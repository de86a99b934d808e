"""image_hashes and phash_clusters: one batch at a time, decided against the whole corpus.

Why no dependency on all partitions of image_hashes (measured with Dagster 1.13.27): an
``AllPartitionMapping`` under eager automation reran phash_clusters and the skip-lists of
every partition whenever one batch arrived (2,001 batches: 4,002 asset partitions). So
``phash_clusters(B)`` depends on ``image_hashes(B)`` only, and reads the other batches'
hashes as a table at run time, through the ``phash`` index. What its decision changes in
other batches is written to ``dedup_dirty``; the dedup sensor (``sensors.py``) reruns
exactly those partitions. See :mod:`prx_assets.core.dedup.decisions` for the logic.
"""

import time
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
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

from prx_assets.core.batching import chunked
from prx_assets.core.dedup.decisions import (
    DECISION_FIELDS,
    BatchPlan,
    DecisionChange,
    DedupSettings,
    check_keepers,
    clear_dirty,
    contact_sheet,
    describe_decision,
    gallery_groups,
    gather_corpus,
    mark_dirty,
    plan_batch,
    read_cluster_members,
    read_dirty,
    state_row,
)
from prx_assets.core.dedup.phash import hash_to_int64, phash_many
from prx_assets.core.ingest.decode import DecodeRejected
from prx_assets.core.lab import Lab, in_list, sql_literal
from prx_assets.core.tables import (
    DEDUP_DIRTY,
    DEDUP_STATE,
    IMAGE_HASHES,
    IMAGES,
    PHASH_CLUSTERS,
    RESOLUTION,
)
from prx_assets.defs.dedup.config import DedupConfigResource
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.metadata import counts_table, png_markdown
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


def _some(items: list[str]) -> list[str]:
    more = len(items) - _LIST_LIMIT
    return items[:_LIST_LIMIT] + ([f"... and {more} more"] if more > 0 else [])


# --------------------------------------------------------------------------- image_hashes


def _eligible_keys(store: Lab, batch: str) -> list[str]:
    if not store.exists(RESOLUTION.name):
        raise Failure(
            description=f"no resolution table yet: materialise resolution_profile for {batch}"
        )
    profile = store.read_batch(RESOLUTION.name, batch, ["key", "eligible"])
    return sorted(
        k
        for k, ok in zip(
            profile.column("key").to_pylist(), profile.column("eligible").to_pylist(), strict=True
        )
        if ok
    )


class _Hasher:
    """Streams the batch's hash rows chunk by chunk (only one chunk's bytes in memory)."""

    def __init__(self, store: Lab, batch: str, keys: list[str], dedup: DedupConfigResource):
        self.store, self.batch, self.keys, self.dedup = store, batch, keys, dedup
        self.rejected: dict[str, str] = {}
        self.hashed = 0
        self.low_information = 0
        self.bytes_read = 0

    def batches(self) -> Iterator[pa.RecordBatch]:
        settings = self.dedup.settings()
        columns = ["key", "image", "file_size", "width", "height"]
        kw = {"mode": settings.phash_mode, "low_info_threshold": settings.low_info_threshold}
        for chunk in chunked(self.keys, self.dedup.read_chunk):
            where = f"batch = {sql_literal(self.batch)} AND {in_list('key', chunk)}"
            rows = {r["key"]: r for r in self.store.read(IMAGES.name, columns, where).to_pylist()}
            chunk_rows = [rows[k] for k in chunk]
            self.bytes_read += sum(len(r["image"]) for r in chunk_rows)
            try:  # one batched DCT per chunk
                results = phash_many([r["image"] for r in chunk_rows], **kw)
                good = chunk_rows
            except DecodeRejected:  # ingest accepted these bytes, so this is rare: find which
                good, results = [], []
                for row in chunk_rows:
                    try:
                        results += phash_many([row["image"]], **kw)
                        good.append(row)
                    except DecodeRejected as exc:
                        self.rejected[row["key"]] = f"{exc.reason}: {exc.detail}"
            self.hashed += len(good)
            self.low_information += sum(r.low_information for r in results)
            yield pa.RecordBatch.from_pylist(
                [
                    {
                        "key": row["key"],
                        "batch": self.batch,
                        "phash": hash_to_int64(res.hash),
                        "phash_mode": res.mode,
                        "phash_version": res.version,
                        "ac_energy": res.ac_energy,
                        "low_information": res.low_information,
                        "pixels": int(row["width"]) * int(row["height"]),
                        "file_size": int(row["file_size"]),
                    }
                    for row, res in zip(good, results, strict=True)
                ],
                schema=IMAGE_HASHES.schema,
            )


def _image_hashes(
    context: AssetExecutionContext, lab: LabResource, dedup: DedupConfigResource
) -> MaterializeResult:
    store = lab.lab()
    batch = context.partition_key
    settings = dedup.settings()
    keys = _eligible_keys(store, batch)
    present = set(store.read_batch(IMAGES.name, batch, ["key"]).column("key").to_pylist())
    missing = [k for k in keys if k not in present]
    if missing:
        raise Failure(
            description=(
                f"{len(missing)} eligible image(s) of {batch} are not in `images` "
                f"(e.g. {missing[0]}): rematerialise raw_images and resolution_profile"
            )
        )
    hasher = _Hasher(store, batch, keys, dedup)
    t0 = time.perf_counter()
    written = store.replace_partition(IMAGE_HASHES, batch, hasher.batches())
    elapsed = time.perf_counter() - t0
    stored = store.read_batch(IMAGE_HASHES.name, batch, ["key", "phash_version"])
    check = hashes_complete_result(keys, stored, settings.phash_version, hasher.rejected)
    context.log.info(f"{batch}: hashed {hasher.hashed}/{len(keys)} in {elapsed:.1f} s")
    return MaterializeResult(
        metadata={
            "eligible_images": len(keys),
            "hashed": hasher.hashed,
            "undecodable": len(hasher.rejected),
            "phash_mode": settings.phash_mode,
            "phash_version": settings.phash_version,
            "low_information": hasher.low_information,
            "low_info_threshold": settings.low_info_threshold,
            "ms_per_image": 1e3 * elapsed / max(1, len(keys)),
            "mb_read": round(hasher.bytes_read / 1e6, 3),
            "image_hashes_lance_version": written["version"],
            "lab": MetadataValue.path(store.uri(IMAGE_HASHES.name)),
        },
        check_results=[check],
    )


def hashes_complete_result(
    eligible: list[str], stored: pa.Table, version: str, rejected: dict[str, str]
) -> AssetCheckResult:
    versions = dict(
        zip(
            stored.column("key").to_pylist(),
            stored.column("phash_version").to_pylist(),
            strict=True,
        )
    )
    missing = [k for k in eligible if k not in versions]
    extra = sorted(set(versions) - set(eligible))
    other_version = sorted(k for k, v in versions.items() if v != version)
    return AssetCheckResult(
        check_name=HASHES_COMPLETE,
        passed=not (missing or extra or other_version),
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "eligible": len(eligible),
            "hashed": len(versions),
            "missing": MetadataValue.json(_some(missing)),
            "not_eligible_but_hashed": MetadataValue.json(_some(extra)),
            "other_phash_version": MetadataValue.json(_some(other_version)),
            "undecodable": MetadataValue.json(
                _some([f"{k}: {why}" for k, why in sorted(rejected.items())])
            ),
        },
    )


# --------------------------------------------------------------------------- phash_clusters


def _phash_clusters(
    context: AssetExecutionContext, lab: LabResource, dedup: DedupConfigResource
) -> MaterializeResult:
    store = lab.lab()
    batch = context.partition_key
    settings = dedup.settings()
    if not store.exists(IMAGE_HASHES.name):
        raise Failure(
            description=f"no image_hashes table yet: materialise image_hashes for {batch}"
        )
    # The pending marks for this batch are read before the corpus, so the rows cleared below
    # are exactly those this run's decisions account for; later marks stay for a later run.
    pending = read_dirty(store, batch).column("dirty_id").to_pylist()
    t0 = time.perf_counter()
    gathered = gather_corpus(store, batch, settings, dedup.lookup_chunk)
    plan = plan_batch(batch, gathered.corpus, gathered.stored, settings)
    elapsed = time.perf_counter() - t0
    written = store.replace_partition(PHASH_CLUSTERS, batch, plan.rows)
    store.replace_partition(DEDUP_STATE, batch, state_row(batch, plan, settings, datetime.now(UTC)))
    marked = mark_dirty(store, plan.changes, batch)
    raced = _recheck(store, batch, plan, settings, dedup.lookup_chunk)
    marked += len(raced)
    cleared = clear_dirty(store, pending)
    checks = _keeper_checks(store, plan, settings, dedup.lookup_chunk)
    stats = plan.stats
    low_keys = [r["key"] for r in plan.rows.to_pylist() if r["low_information"]]
    metadata: dict[str, Any] = {
        "images": stats.images,
        "clusters_with_duplicates": stats.clusters_with_duplicates,
        "duplicates_within_batch": stats.within_batch_duplicates,
        "duplicates_of_other_batches": stats.duplicates_of_other_batches,
        "keepers_over_other_batches": stats.keepers_over_other_batches,
        "displaced_keepers_in_other_batches": stats.displaced_in_other_batches,
        "kept": int(np.sum(plan.rows.column("is_keeper").to_numpy(zero_copy_only=False))),
        "cluster_sizes": counts_table(
            {str(k): v for k, v in sorted(stats.cluster_sizes.items())}, "size", sort=False
        ),
        "affected_other_batches": MetadataValue.json(stats.affected_batches),
        "n_affected_other_batches": len(stats.affected_batches),
        "changes_in_other_batches": MetadataValue.json(
            _some([f"{c.batch}:{c.key}: {c.before} -> {c.after}" for c in plan.changes])
        ),
        "dirty_rows_marked": marked,
        "dirty_rows_cleared": cleared,
        "changed_during_run": MetadataValue.json(
            _some([f"{c.batch}:{c.key}: {c.before} -> {c.after}" for c in raced])
        ),
        "low_information": stats.low_information,
        "low_info_threshold": settings.low_info_threshold,
        "low_information_for_review": MetadataValue.json(_some(low_keys)),
        "radius": settings.radius,
        "phash_version": settings.phash_version,
        "config_fingerprint": settings.fingerprint(),
        "members_not_decided_yet": stats.undecided_members,
        "members_under_other_config": stats.other_config_members,
        "lookups": MetadataValue.json(gathered.lookups),
        "decide_seconds": round(elapsed, 3),
        "phash_clusters_lance_version": written["version"],
    }
    groups = gallery_groups(store, batch, plan.decisions, dedup.gallery_clusters)
    if groups:
        png = contact_sheet(groups, title=f"{batch}: duplicate clusters (green = kept)")
        metadata["gallery"] = png_markdown(png, f"duplicate clusters touching {batch}")
    else:
        metadata["gallery"] = MetadataValue.text("no duplicate clusters touch this batch")
    if stats.affected_batches:
        context.log.info(
            f"{batch}: decisions of {len(stats.affected_batches)} other batch(es) changed "
            f"({', '.join(stats.affected_batches)}); marked in {DEDUP_DIRTY.name}"
        )
    return MaterializeResult(metadata=metadata, check_results=checks)


def _recheck(
    store: Lab, batch: str, plan: BatchPlan, settings: DedupSettings, chunk: int
) -> list[DecisionChange]:
    """Decide again after writing; mark what hashes written meanwhile by other runs changed.

    Closes the race of two new batches deciding at once: a batch whose hashes land after
    this run read the corpus sees this run's rows when it decides (they were written
    before this second read), or this second read sees its hashes. Changes to this batch's
    own rows are marked against itself, so the sensor reruns it.
    """
    again = gather_corpus(store, batch, settings, chunk)
    fresh = plan_batch(batch, again.corpus, again.stored, settings)
    seen = {(c.batch, c.key, c.after) for c in plan.changes}
    raced = [c for c in fresh.changes if (c.batch, c.key, c.after) not in seen]
    before = {r["key"]: r for r in plan.rows.to_pylist()}
    for r in fresh.rows.to_pylist():
        old = before.get(r["key"])
        if old is None or any(old[f] != r[f] for f in DECISION_FIELDS):
            was = describe_decision(old) if old else "absent"
            raced.append(
                DecisionChange(batch, r["key"], r["cluster_id"], was, describe_decision(r))
            )
    mark_dirty(store, raced, batch)
    return raced


def _keeper_checks(
    store: Lab, plan: BatchPlan, settings: DedupSettings, chunk: int
) -> list[AssetCheckResult]:
    ids = plan.rows.column("cluster_id").to_pylist()
    members, pixels = read_cluster_members(store, ids, settings, chunk)
    result = check_keepers(members, pixels)
    pending = read_dirty(store).num_rows
    common = {"clusters_checked": result.clusters, "pending_dirty_rows": pending}
    return [
        AssetCheckResult(
            check_name=ONE_KEEPER,
            passed=result.one_keeper,
            severity=AssetCheckSeverity.ERROR,
            metadata={
                **common,
                "no_keeper": MetadataValue.json(_some(result.no_keeper)),
                "several_keepers": MetadataValue.json(_some(result.several_keepers)),
                "low_information_not_own_keeper": MetadataValue.json(
                    _some(result.low_information_not_own_keeper)
                ),
            },
        ),
        AssetCheckResult(
            check_name=KEEPER_MOST_PIXELS,
            passed=result.keeper_largest,
            severity=AssetCheckSeverity.ERROR,
            metadata={
                **common,
                "keeper_not_largest": MetadataValue.json(_some(result.keeper_not_largest)),
            },
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
        code_version=f"image_hashes-v1-{settings.phash_version}",
        check_specs=[
            _spec(
                HASHES_COMPLETE,
                IMAGE_HASHES_ASSET,
                "Every eligible image of the partition has exactly one hash row of the "
                "configured pHash version, and no other image has one.",
            )
        ],
        description=(
            f"64-bit pHash ({settings.phash_mode} mode, {settings.phash_version}) of every "
            "eligible image, with AC energy, pixels and file size for the keeper rule. "
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
