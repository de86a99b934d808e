"""raw_images: one batch from the landing zone into the lab's ``images``/``rejects``."""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from prx_assets.core.ingest.remote_landing import RemoteRead, landing_batch
from prx_assets.core.ingest.runner import BatchIngest, migrate_images_table
from prx_assets.core.ingest.tables import migrate_rejects_table
from prx_assets.core.tables import IMAGES, REJECTS
from prx_assets.defs.metadata import counts_table
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource


@asset(
    partitions_def=BATCHES,
    group_name="ingest",
    kinds={"lance"},
    # v3: captures opt-out headers (usage_signals); v4: rejects carry url/source_id (aliases)
    code_version="raw_images-v4",  # workers writing the rows (same rows) is no new version
    description=(
        "Every file of the batch validated by the decoding policy: accepted images "
        "(with original bytes) in Lance `images`, every refusal with its reason in `rejects`."
    ),
)
def raw_images(context: AssetExecutionContext, lab: LabResource) -> MaterializeResult:
    # A remote landing zone's batch is staged locally while it is ingested; when the lab is
    # on object storage too, its folder images stay there, read and stored by the workers.
    store = lab.lab()
    remote_sink = store.remote_blobs(IMAGES, "image")
    remote_reads: dict[bytes, RemoteRead] | None = {} if remote_sink is not None else None
    with landing_batch(
        lab.landing_uri, context.partition_key, lab.max_file_bytes, remote_reads
    ) as (ref, shown):
        migrate_images_table(store)  # an images table from before signal capture / thumbnails
        migrate_rejects_table(store)  # a rejects table from before aliases (url, source_id)
        run = BatchIngest(
            ref,
            max_pixels=lab.max_pixels,
            max_file_bytes=lab.max_file_bytes,
            workers=lab.workers,
            # workers store the bytes they hold
            blob_sink=store.local_blobs(IMAGES, "image") or remote_sink,
            remote_reads=remote_reads,
            report=context.log.info,
        )
        # Workers write the rows too where they reach the lab; one commit here.
        fragments = store.partition_fragments(IMAGES, ref.key, stored_blobs=run.stored_blobs)
        written_fragments = run.write_images(fragments)
        # A compaction the commit makes due rewrites the rows on the workers that wrote them.
        store.rewrite = run.rewrite_on_workers()
        try:
            written = store.commit_partition(IMAGES, ref.key, written_fragments)
        finally:
            store.rewrite = None  # the rejects are written here (small rows)
        rejected = store.replace_partition(REJECTS, ref.key, run.rejects)
    stats = run.stats
    context.log.info(
        f"{ref.key}: seen {stats.seen}, accepted {stats.accepted}, rejected {stats.rejected}"
    )
    return MaterializeResult(
        metadata={
            "seen": stats.seen,
            "accepted": stats.accepted,
            "rejected": stats.rejected,
            "accounted_for": stats.seen == stats.accepted + stats.rejected,
            "bytes_accepted": stats.bytes_accepted,
            "animated_first_frame_used": stats.animated,
            "batch_kind": ref.kind,
            "landing_path": shown,
            "max_file_bytes": lab.max_file_bytes,
            "reject_reasons": counts_table(stats.reasons, "reason"),
            "formats": counts_table(stats.formats, "format"),
            "colour_conversions": counts_table(stats.conversions, "conversion"),
            "images_lance_version": written["version"],
            "rejects_lance_version": rejected["version"],
            "lab": MetadataValue.path(store.uri(IMAGES.name)),
        }
    )
