"""captions, caption_classes and caption_embeddings: one batch at a time, into the lab.

The stage's logic is ``core/captions/runner.py`` (``BatchCaptions``, ``BatchClasses``,
``BatchEmbeddings``); these assets build the configured backend, call a runner and present
its outcome as metadata and check results. Built by :func:`build_caption_assets` from the
configured resources, so each asset's ``code_version`` carries its backend's fingerprint:
swapping a model, prompt or decoding parameter changes the code version (and the
fingerprints stored per row, which the swap sensor in ``reconcile.py`` compares). A backend
failure fails the whole partition before anything is written; the previous rows of the
partition stay as they were.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from prx_assets.core.captions.models import BackendIdentity
from prx_assets.core.captions.runner import (
    BatchCaptions,
    BatchClasses,
    BatchEmbeddings,
    CaptionOutcome,
    CaptionStageError,
)
from prx_assets.core.tables import CAPTIONS
from prx_assets.defs.captions.checks import (
    classes_in_sync_result,
    classes_in_sync_spec,
    embeddings_in_sync_result,
    embeddings_in_sync_spec,
    length_window_result,
    length_window_spec,
)
from prx_assets.defs.captions.resources import (
    ALT_TEXT_NOTE,
    EMBEDDING_NOTE,
    CaptionerResource,
    ClassifierResource,
    EmbedderResource,
)
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.metadata import counts_table, endpoint_metadata
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource

GROUP = "captions"
CAPTIONS_ASSET = "captions"
CLASSES_ASSET = "caption_classes"
EMBEDDINGS_ASSET = "caption_embeddings"


def _identity_metadata(identity: BackendIdentity, backend: str) -> dict[str, Any]:
    return {
        "backend": backend,
        "backend_kind": identity.kind,
        "model_id": identity.model_id,
        "prompt_version": identity.prompt_version,
        "prompt_hash": identity.prompt_hash,
        "params": MetadataValue.json(dict(identity.params)),
        "fingerprint": identity.fingerprint(),
    }


@contextlib.contextmanager
def _failing_the_run() -> Iterator[None]:
    """A batch the runner refuses fails its run; a backend error stays the cause."""
    try:
        yield
    except CaptionStageError as exc:
        failure = Failure(description=str(exc), metadata=exc.details or None)
        raise failure from exc.__cause__


# --------------------------------------------------------------------------- captions


def _captions(
    context: AssetExecutionContext, lab: LabResource, captioner: CaptionerResource
) -> MaterializeResult:
    store, batch = lab.lab(), context.partition_key
    run = BatchCaptions(
        store,
        batch,
        captioner.build,
        backend=captioner.backend,
        pixels=not captioner.is_fallback,  # the fallback reads alt text alone
        chunk_size=captioner.chunk_size,
        log=context.log.info,
        prepare_pool=captioner.prepare_pool(),
    )
    with _failing_the_run():
        out = run.run()
    check = length_window_result(out.stats, captioner.is_fallback)
    return MaterializeResult(
        metadata=_caption_metadata(out, captioner, store.uri(CAPTIONS.name)), check_results=[check]
    )


def _caption_metadata(
    out: CaptionOutcome, captioner: CaptionerResource, uri: str
) -> dict[str, Any]:
    stats = out.stats
    metadata: dict[str, Any] = {
        **_identity_metadata(out.identity, captioner.backend),
        "captions": stats.captions,
        "eligible_images": out.eligible,
        "fallback_captions": stats.fallback,
        "vlm_captions": stats.captions - stats.fallback,
        "outside_100_200_words": stats.outside,
        "too_short": stats.too_short,
        "too_long": stats.too_long,
        "empty_captions": stats.empty,
        "mean_words": out.mean_words,
        "fts_index": out.fts_index,
        "captions_lance_version": out.version,
        "lab": MetadataValue.path(uri),
    }
    if captioner.is_fallback:
        metadata["caption_source"] = MetadataValue.text(ALT_TEXT_NOTE)
    if out.endpoint is not None:
        metadata["endpoint"] = out.endpoint
    return {**metadata, **endpoint_metadata(out.endpoints)}


# --------------------------------------------------------------------------- caption_classes


def _caption_classes(
    context: AssetExecutionContext, lab: LabResource, classifier: ClassifierResource
) -> MaterializeResult:
    run = BatchClasses(
        lab.lab(),
        context.partition_key,
        classifier.build,
        backend=classifier.backend,
        chunk_size=classifier.chunk_size,
    )
    with _failing_the_run():
        out = run.run()
    metadata: dict[str, Any] = {
        **_identity_metadata(out.identity, classifier.backend),
        "classified": out.classified,
        "unclassified_empty_captions": out.captions - out.classified,
        "label_counts": counts_table(out.label_counts, "label"),
        **{f"n_{label}": n for label, n in out.label_counts.items()},
        "caption_fingerprints": MetadataValue.json(out.caption_fingerprints),
        "caption_classes_lance_version": out.version,
        **endpoint_metadata(out.endpoints),
    }
    if classifier.is_fallback:
        metadata["classifier_source"] = MetadataValue.text(EMBEDDING_NOTE)
    return MaterializeResult(metadata=metadata, check_results=[classes_in_sync_result(out.sync)])


# --------------------------------------------------------------------------- caption_embeddings


def _caption_embeddings(
    context: AssetExecutionContext, lab: LabResource, embedder: EmbedderResource
) -> MaterializeResult:
    run = BatchEmbeddings(
        lab.lab(),
        context.partition_key,
        embedder.build,
        chunk_size=embedder.chunk_size,
        index_min_rows=embedder.index_min_rows,
        index_type=embedder.index_type,
    )
    with _failing_the_run():
        out = run.run()
    return MaterializeResult(
        metadata={
            **_identity_metadata(out.identity, "sentence_transformers"),
            "embeddings": out.embeddings,
            "skipped_empty_captions": out.skipped_empty,
            "dim": out.dim,
            "vector_index": out.vector_index,
            "vector_index_min_rows": embedder.index_min_rows,
            "table_rows": out.table_rows,
            "caption_embeddings_lance_version": out.version,
        },
        check_results=[embeddings_in_sync_result(out.sync)],
    )


# --------------------------------------------------------------------------- builder


def build_caption_assets(
    captioner_resource: CaptionerResource,
    classifier_resource: ClassifierResource,
    embedder_resource: EmbedderResource,
) -> list[AssetsDefinition]:
    """The three caption assets, versioned by the configured backends' fingerprints.

    Pass the same resource objects that ``Definitions`` binds to ``captioner``,
    ``classifier`` and ``embedder`` so the code versions describe what will run.
    """
    cap = captioner_resource.identity()
    clf = classifier_resource.identity()
    emb = embedder_resource.identity()
    cap_fp, clf_fp, emb_fp = cap.fingerprint(), clf.fingerprint(), emb.fingerprint()

    cap_what = (
        f"Backend alt_text: {ALT_TEXT_NOTE}."
        if captioner_resource.is_fallback
        else f"VLM captions from {cap.model_id} ({captioner_resource.backend}, {cap.prompt_version})."
    )

    @asset(
        name=CAPTIONS_ASSET,
        partitions_def=BATCHES,
        deps=[raw_images, resolution_profile],
        group_name=GROUP,
        kinds={"lance"},
        pool=captioner_resource.pool,  # "gpu" for an in-process model, none for a fleet
        code_version=f"captions-v1-{cap_fp}",
        check_specs=[length_window_spec(CAPTIONS_ASSET)],
        description=(
            f"One caption per eligible image, with per-row provenance. {cap_what} "
            "Full-text (INVERTED) index on `caption`."
        ),
    )
    def captions(
        context: AssetExecutionContext, lab: LabResource, captioner: CaptionerResource
    ) -> MaterializeResult:
        return _captions(context, lab, captioner)

    clf_what = (
        f"Backend embedding: {EMBEDDING_NOTE} (MiniLM cosine to label prototypes)."
        if classifier_resource.is_fallback
        else f"{clf.model_id} ({classifier_resource.backend}, {clf.prompt_version})."
    )

    @asset(
        name=CLASSES_ASSET,
        partitions_def=BATCHES,
        deps=[captions],
        group_name=GROUP,
        kinds={"lance"},
        pool=classifier_resource.pool,
        code_version=f"caption_classes-v1-{clf_fp}-{cap_fp}",
        check_specs=[classes_in_sync_spec(CLASSES_ASSET)],
        description=(
            "visual / text / nsfw probabilities and argmax label per caption, with the "
            f"classifier's provenance and the captioner fingerprint it classified. {clf_what}"
        ),
    )
    def caption_classes(
        context: AssetExecutionContext, lab: LabResource, classifier: ClassifierResource
    ) -> MaterializeResult:
        return _caption_classes(context, lab, classifier)

    @asset(
        name=EMBEDDINGS_ASSET,
        partitions_def=BATCHES,
        deps=[captions],
        group_name=GROUP,
        kinds={"lance"},
        code_version=f"caption_embeddings-v1-{emb_fp}",
        check_specs=[embeddings_in_sync_spec(EMBEDDINGS_ASSET)],
        description=(
            f"{emb.model_id} vectors (384-d, unit norm) of each non-empty caption; a cosine "
            f"{embedder_resource.index_type} index once the table holds "
            f"{embedder_resource.index_min_rows} rows (brute force is fast below that)."
        ),
    )
    def caption_embeddings(
        context: AssetExecutionContext, lab: LabResource, embedder: EmbedderResource
    ) -> MaterializeResult:
        return _caption_embeddings(context, lab, embedder)

    return [captions, caption_classes, caption_embeddings]
