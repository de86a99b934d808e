"""captions, caption_classes and caption_embeddings: one batch at a time, into the lab.

Built by :func:`build_caption_assets` from the configured resources, so each asset's
``code_version`` carries its backend's fingerprint: swapping a model, prompt or decoding
parameter changes the code version (and the fingerprints stored per row, which the swap
sensor in ``reconcile.py`` compares). A backend failure fails the whole partition before
anything is written; the previous rows of the partition stay as they were.
"""

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa
from dagster import (
    AssetExecutionContext,
    AssetsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from prx_assets.core.batching import chunked
from prx_assets.core.captions.models import LABELS, BackendError, BackendIdentity, CaptionInput
from prx_assets.core.captions.tables import (
    caption_rows,
    caption_stats,
    class_rows,
    embedding_rows,
    ensure_fts_index,
    ensure_vector_index,
)
from prx_assets.core.lab import Lab, in_list, sql_literal
from prx_assets.core.tables import CAPTION_CLASSES, CAPTION_EMBEDDINGS, CAPTIONS, IMAGES, RESOLUTION
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
from prx_assets.defs.metadata import counts_table
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


def _endpoint(base_url: str) -> str:
    """Scheme, host, port and path only (the URL can hold no credentials, but be sure)."""
    parts = urlsplit(base_url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


def _close(backend: object) -> None:
    close = getattr(backend, "close", None)
    if callable(close):
        close()


def _read_captions(store: Lab, batch: str, columns: list[str]) -> pa.Table:
    if not store.exists(CAPTIONS.name):
        raise Failure(
            description=f"no captions table yet: materialise captions for {batch} first",
        )
    return store.read_batch(CAPTIONS.name, batch, columns)


# --------------------------------------------------------------------------- captions


def _captions(
    context: AssetExecutionContext, lab: LabResource, captioner: CaptionerResource
) -> MaterializeResult:
    store = lab.lab()
    batch = context.partition_key
    if not store.exists(RESOLUTION.name):
        raise Failure(
            description=f"no resolution table yet: materialise resolution_profile for {batch}"
        )
    profile = store.read_batch(RESOLUTION.name, batch, ["key", "eligible"])
    keys = sorted(
        k
        for k, ok in zip(
            profile.column("key").to_pylist(), profile.column("eligible").to_pylist(), strict=True
        )
        if ok
    )
    backend = captioner.build()
    identity = backend.identity
    # Only the model backends need pixels: the fallback reads alt text alone.
    columns = ["key", "alt_text"] + ([] if captioner.is_fallback else ["image"])
    results = []
    try:
        for chunk in chunked(keys, captioner.chunk_size):
            where = f"batch = {sql_literal(batch)} AND {in_list('key', chunk)}"
            rows = {r["key"]: r for r in store.read(IMAGES.name, columns, where).to_pylist()}
            missing = [k for k in chunk if k not in rows]
            if missing:
                raise Failure(
                    description=(
                        f"{len(missing)} eligible image(s) of {batch} are not in `images` "
                        f"(e.g. {missing[0]}): rematerialise raw_images and resolution_profile"
                    )
                )
            inputs = [
                CaptionInput(k, image=rows[k].get("image"), alt_text=rows[k]["alt_text"])
                for k in chunk
            ]
            out = backend.caption(inputs)
            if [r.key for r in out] != list(chunk):
                raise Failure(description=f"{identity.kind} returned results out of order")
            results.extend(out)
            context.log.info(f"{batch}: captioned {len(results)}/{len(keys)}")
    except BackendError as exc:
        raise Failure(
            description=(
                f"captioning {batch} with {identity.kind} ({identity.model_id}) failed: "
                f"{type(exc).__name__}: {exc}. No rows were written; the partition's "
                "previous captions are unchanged."
            ),
            metadata={"backend": captioner.backend, "fingerprint": identity.fingerprint()},
        ) from exc
    finally:
        _close(backend)

    table = caption_rows(batch, results, identity, captioner.backend, datetime.now(UTC))
    written = store.replace_partition(CAPTIONS, batch, table)
    fts = ensure_fts_index(store.uri(CAPTIONS.name), "caption")
    stats = caption_stats(table)
    words = table.column("word_count").to_numpy(zero_copy_only=False)
    metadata: dict[str, Any] = {
        **_identity_metadata(identity, captioner.backend),
        "captions": stats.captions,
        "eligible_images": len(keys),
        "fallback_captions": stats.fallback,
        "vlm_captions": stats.captions - stats.fallback,
        "outside_100_200_words": stats.outside,
        "too_short": stats.too_short,
        "too_long": stats.too_long,
        "empty_captions": stats.empty,
        "mean_words": float(np.mean(words)) if len(words) else 0.0,
        "fts_index": fts,
        "captions_lance_version": written["version"],
        "lab": MetadataValue.path(store.uri(CAPTIONS.name)),
    }
    if captioner.is_fallback:
        metadata["caption_source"] = MetadataValue.text(ALT_TEXT_NOTE)
    if captioner.backend == "openai":
        metadata["endpoint"] = _endpoint(backend.base_url)  # type: ignore[attr-defined]
    return MaterializeResult(
        metadata=metadata,
        check_results=[length_window_result(stats, captioner.is_fallback)],
    )


# --------------------------------------------------------------------------- caption_classes


def _caption_classes(
    context: AssetExecutionContext, lab: LabResource, classifier: ClassifierResource
) -> MaterializeResult:
    store = lab.lab()
    batch = context.partition_key
    caps = _read_captions(store, batch, ["key", "caption", "backend_fingerprint"])
    keys = caps.column("key").to_pylist()
    texts = caps.column("caption").to_pylist()
    cap_fps = caps.column("backend_fingerprint").to_pylist()
    todo = [i for i, t in enumerate(texts) if (t or "").strip()]  # nothing to classify in ""
    backend = classifier.build()
    identity = backend.identity
    probs: list[Any] = [None] * len(keys)
    try:
        for chunk in chunked(todo, classifier.chunk_size):
            for i, p in zip(chunk, backend.classify([texts[i] for i in chunk]), strict=True):
                probs[i] = p
    except BackendError as exc:
        raise Failure(
            description=(
                f"classifying {batch} with {identity.kind} ({identity.model_id}) failed: "
                f"{type(exc).__name__}: {exc}. No rows were written."
            ),
            metadata={"backend": classifier.backend, "fingerprint": identity.fingerprint()},
        ) from exc
    finally:
        _close(backend)

    table = class_rows(batch, keys, cap_fps, probs, identity, classifier.backend, datetime.now(UTC))
    written = store.replace_partition(CAPTION_CLASSES, batch, table)
    labels = [p.label for p in probs if p is not None]
    stored = store.read_batch(
        CAPTION_CLASSES.name,
        batch,
        ["key", "caption_fingerprint", "label", "p_visual", "p_text", "p_nsfw"],
    )
    current = store.read_batch(CAPTIONS.name, batch, ["key", "backend_fingerprint"])
    metadata: dict[str, Any] = {
        **_identity_metadata(identity, classifier.backend),
        "classified": len(labels),
        "unclassified_empty_captions": len(keys) - len(labels),
        "label_counts": counts_table({lbl: labels.count(lbl) for lbl in LABELS}, "label"),
        **{f"n_{lbl}": labels.count(lbl) for lbl in LABELS},
        "caption_fingerprints": MetadataValue.json(sorted({fp for fp in cap_fps if fp})),
        "caption_classes_lance_version": written["version"],
    }
    if classifier.is_fallback:
        metadata["classifier_source"] = MetadataValue.text(EMBEDDING_NOTE)
    return MaterializeResult(
        metadata=metadata, check_results=[classes_in_sync_result(current, stored)]
    )


# --------------------------------------------------------------------------- caption_embeddings


def _caption_embeddings(
    context: AssetExecutionContext, lab: LabResource, embedder: EmbedderResource
) -> MaterializeResult:
    store = lab.lab()
    batch = context.partition_key
    caps = _read_captions(store, batch, ["key", "caption", "backend_fingerprint"])
    rows = [
        (k, t, fp)
        for k, t, fp in zip(
            caps.column("key").to_pylist(),
            caps.column("caption").to_pylist(),
            caps.column("backend_fingerprint").to_pylist(),
            strict=True,
        )
        if (t or "").strip()  # an empty caption has no meaningful embedding
    ]
    backend = embedder.build()
    identity = backend.identity
    parts = []
    try:
        for chunk in chunked(rows, embedder.chunk_size):
            parts.append(backend.embed([t for _, t, _ in chunk]))
    except BackendError as exc:
        raise Failure(
            description=f"embedding {batch} failed: {type(exc).__name__}: {exc}. Nothing written."
        ) from exc
    vectors = np.concatenate(parts) if parts else np.zeros((0, backend.dim), np.float32)
    table = embedding_rows(
        batch,
        [k for k, _, _ in rows],
        [fp for _, _, fp in rows],
        vectors,
        identity,
        datetime.now(UTC),
    )
    written = store.replace_partition(CAPTION_EMBEDDINGS, batch, table)
    index = ensure_vector_index(
        store.uri(CAPTION_EMBEDDINGS.name),
        min_rows=embedder.index_min_rows,
        index_type=embedder.index_type,
    )
    stored = store.read_batch(
        CAPTION_EMBEDDINGS.name, batch, ["key", "caption_fingerprint", "vector"]
    )
    current = store.read_batch(CAPTIONS.name, batch, ["key", "caption", "backend_fingerprint"])
    return MaterializeResult(
        metadata={
            **_identity_metadata(identity, "sentence_transformers"),
            "embeddings": table.num_rows,
            "skipped_empty_captions": caps.num_rows - table.num_rows,
            "dim": backend.dim,
            "vector_index": index,
            "vector_index_min_rows": embedder.index_min_rows,
            "table_rows": store.dataset(CAPTION_EMBEDDINGS.name).count_rows(),
            "caption_embeddings_lance_version": written["version"],
        },
        check_results=[embeddings_in_sync_result(current, stored)],
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
        pool="gpu",
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
        pool="gpu",
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
