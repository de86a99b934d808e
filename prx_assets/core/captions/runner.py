"""The caption stage's three runs: captions, their classes, their embeddings, one batch each.

Each run reads its inputs through ``Lab``, calls one backend, replaces the batch's rows in
one commit, keeps the table's index and (for classes and embeddings) checks what it stored
against the current captions; it returns a typed outcome the Dagster assets
(``defs/captions``) present as metadata and checks.

A backend failure is a failure of the whole batch, raised *before* anything is written
(``CaptionStageError``): the partition's previous rows stay exactly as they were, never a
partial partition. Backends are built by the run (``build``) once its inputs are known to
exist, and closed when it ends, however it ends.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa

from prx_assets.core.batching import chunked
from prx_assets.core.captions.models import (
    LABELS,
    BackendError,
    BackendIdentity,
    CaptionClassifier,
    Captioner,
    CaptionInput,
    CaptionResult,
    ClassProbs,
    TextEmbedder,
)
from prx_assets.core.captions.models.fleet import EndpointCounts
from prx_assets.core.captions.tables import (
    VECTOR_INDEX_MIN_ROWS,
    CaptionStats,
    caption_rows,
    caption_stats,
    class_rows,
    embedding_rows,
    ensure_caption_text_index,
    ensure_embedding_index,
)
from prx_assets.core.captions.verify import SyncReport, classes_sync, embeddings_sync
from prx_assets.core.lab import Lab, in_list, sql_literal
from prx_assets.core.progress import Progress
from prx_assets.core.tables import CAPTION_CLASSES, CAPTION_EMBEDDINGS, CAPTIONS, IMAGES, RESOLUTION
from prx_assets.core.workers import WorkerPool

B = TypeVar("B")


class CaptionStageError(RuntimeError):
    """The batch cannot be (re)made now; nothing was written and its previous rows stand.

    ``details``: small facts for the failure's metadata (backend, fingerprint), never a
    secret. A backend error is the ``__cause__``.
    """

    def __init__(self, message: str, details: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.details = dict(details or {})


def _quiet(message: str) -> None:
    return None


@contextlib.contextmanager
def _built(build: Callable[[], B]) -> Iterator[B]:
    """The backend for one run, closed (if it can be) when the run ends."""
    backend = build()
    try:
        yield backend
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()


def endpoint(base_url: str) -> str:
    """Scheme, host, port and path only (the URL can hold no credentials, but be sure)."""
    parts = urlsplit(base_url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


def endpoint_counts(backend: object) -> tuple[EndpointCounts, ...]:
    """Per-server request counts of an OpenAI-compatible backend; () for any other."""
    counts = getattr(backend, "endpoint_counts", None)
    return tuple(counts()) if callable(counts) else ()


def _fleet_details(backend: object) -> dict[str, str]:
    """How many servers a failed run had and how many were out of service (no URLs)."""
    counts = endpoint_counts(backend)
    if not counts:
        return {}
    down = sum(c.state != "closed" for c in counts)
    return {"endpoints": str(len(counts)), "endpoints_out_of_service": str(down)}


def _captions_of(lab: Lab, batch: str, columns: list[str]) -> pa.Table:
    if not lab.exists(CAPTIONS.name):
        raise CaptionStageError(f"no captions table yet: materialise captions for {batch} first")
    return lab.read_batch(CAPTIONS.name, batch, columns)


def _failed(
    what: str, identity: BackendIdentity, exc: Exception, backend: str, model: object = None
) -> CaptionStageError:
    return CaptionStageError(
        f"{what} with {identity.kind} ({identity.model_id}) failed: {type(exc).__name__}: {exc}.",
        {"backend": backend, "fingerprint": identity.fingerprint(), **_fleet_details(model)},
    )


# --------------------------------------------------------------------------- captions


@dataclass(frozen=True)
class CaptionOutcome:
    """What one batch's captions run wrote: who captioned, how many, how long, which index."""

    batch: str
    identity: BackendIdentity
    eligible: int
    stats: CaptionStats
    mean_words: float
    fts_index: str  # what Lab.ensure_text_index did
    version: int  # of captions after the write
    endpoint: str | None  # the server captioned on, when there was exactly one
    endpoints: tuple[EndpointCounts, ...] = ()  # per server (OpenAI-compatible backends)


class BatchCaptions:
    """One caption per eligible image of a batch, with per-row provenance.

    ``pixels=False`` for a backend that reads alt text only (the fallback): image bytes are
    then never read. Images are read and captioned ``chunk_size`` keys at a time.
    """

    def __init__(
        self,
        lab: Lab,
        batch: str,
        build: Callable[[], Captioner],
        *,
        backend: str,
        pixels: bool = True,
        chunk_size: int = 256,
        log: Callable[[str], None] = _quiet,
        prepare_pool: Callable[[], WorkerPool] | None = None,
    ) -> None:
        self.lab, self.batch, self.build = lab, batch, build
        self.backend, self.pixels, self.chunk_size, self.log = backend, pixels, chunk_size, log
        self.prepare_pool = prepare_pool  # a streaming backend's preparation off this process

    def _eligible(self) -> list[str]:
        if not self.lab.exists(RESOLUTION.name):
            raise CaptionStageError(
                f"no resolution table yet: materialise resolution_profile for {self.batch}"
            )
        profile = self.lab.read_batch(RESOLUTION.name, self.batch, ["key", "eligible"])
        pairs = zip(
            profile.column("key").to_pylist(), profile.column("eligible").to_pylist(), strict=True
        )
        return sorted(k for k, ok in pairs if ok)

    def _inputs(self, chunk: Sequence[str]) -> list[CaptionInput]:
        columns = ["key", "alt_text"] + (["image"] if self.pixels else [])
        where = f"batch = {sql_literal(self.batch)} AND {in_list('key', chunk)}"
        rows = {r["key"]: r for r in self.lab.read(IMAGES.name, columns, where).to_pylist()}
        missing = [k for k in chunk if k not in rows]
        if missing:
            raise CaptionStageError(
                f"{len(missing)} eligible image(s) of {self.batch} are not in `images` "
                f"(e.g. {missing[0]}): rematerialise raw_images and resolution_profile"
            )
        return [
            CaptionInput(k, image=rows[k].get("image"), alt_text=rows[k]["alt_text"]) for k in chunk
        ]

    def _stream_inputs(self, keys: list[str]) -> Iterator[CaptionInput]:
        for chunk in chunked(keys, self.chunk_size):
            yield from self._inputs(chunk)

    def _streamed(
        self,
        stream: Callable[..., Iterator[CaptionResult]],
        keys: list[str],
        pool: WorkerPool | None,
    ) -> list[CaptionResult]:
        results: list[CaptionResult] = []
        inputs = self._stream_inputs(keys)
        progress = Progress(f"{self.batch}: captioned", len(keys), self.log)
        for r in stream(inputs, pool=pool) if pool is not None else stream(inputs):
            if len(results) >= len(keys) or r.key != keys[len(results)]:
                raise CaptionStageError("the captioner returned results out of order")
            results.append(r)
            progress.advance()
        progress.finish(always=True)
        return results

    def _caption(self, captioner: Captioner, keys: list[str]) -> list[CaptionResult]:
        identity = captioner.identity
        results: list[CaptionResult] = []
        stream = getattr(captioner, "caption_stream", None)
        try:
            if callable(stream):
                # A fleet backend: images are read chunk by chunk as the stream consumes
                # them, prepared ahead and sent through a bounded window (no chunk barrier).
                pool = self.prepare_pool() if self.prepare_pool is not None else None
                try:
                    results = self._streamed(stream, keys, pool)
                finally:
                    if pool is not None:
                        pool.close()
                if len(results) != len(keys):
                    raise CaptionStageError(
                        f"{identity.kind} returned {len(results)} captions for {len(keys)} images"
                    )
            else:
                progress = Progress(f"{self.batch}: captioned", len(keys), self.log)
                for chunk in chunked(keys, self.chunk_size):
                    out = captioner.caption(self._inputs(chunk))
                    if [r.key for r in out] != list(chunk):
                        raise CaptionStageError(f"{identity.kind} returned results out of order")
                    results.extend(out)
                    progress.advance(len(out))
                progress.finish(always=True)
        except BackendError as exc:
            failure = _failed(f"captioning {self.batch}", identity, exc, self.backend, captioner)
            raise CaptionStageError(
                f"{failure} No rows were written; the partition's previous captions are unchanged.",
                failure.details,
            ) from exc
        return results

    def run(self) -> CaptionOutcome:
        keys = self._eligible()
        with _built(self.build) as captioner:
            identity = captioner.identity
            results = self._caption(captioner, keys)
            endpoints = endpoint_counts(captioner)
        table = caption_rows(self.batch, results, identity, self.backend, datetime.now(UTC))
        written = self.lab.replace_partition(CAPTIONS, self.batch, table)
        fts = ensure_caption_text_index(self.lab)
        words = table.column("word_count").to_numpy(zero_copy_only=False)
        stats = caption_stats(table)
        if stats.captions != len(keys):
            raise AssertionError(f"{self.batch}: {len(keys)} eligible, {stats.captions} captions")
        return CaptionOutcome(
            batch=self.batch,
            identity=identity,
            eligible=len(keys),
            stats=stats,
            mean_words=float(np.mean(words)) if len(words) else 0.0,
            fts_index=fts,
            version=written["version"],
            endpoint=endpoint(endpoints[0].url) if len(endpoints) == 1 else None,
            endpoints=endpoints,
        )


# --------------------------------------------------------------------------- caption_classes


@dataclass(frozen=True)
class ClassOutcome:
    """What one batch's caption_classes run wrote, and by which classifier."""

    batch: str
    identity: BackendIdentity
    captions: int  # caption rows of the batch (one class row each)
    classified: int  # of those, the non-empty ones (an empty caption has no class)
    label_counts: dict[str, int]  # every label, in LABELS order
    caption_fingerprints: list[str]  # the captioners whose captions were classified
    version: int  # of caption_classes after the write
    sync: SyncReport  # what was stored against the captions table now
    endpoints: tuple[EndpointCounts, ...] = ()  # per server (OpenAI-compatible backends)


class BatchClasses:
    """visual / text / nsfw probabilities for every caption of a batch (an empty caption
    gets a row with null label and probabilities: there is nothing to classify)."""

    def __init__(
        self,
        lab: Lab,
        batch: str,
        build: Callable[[], CaptionClassifier],
        *,
        backend: str,
        chunk_size: int = 512,
    ) -> None:
        self.lab, self.batch, self.build = lab, batch, build
        self.backend, self.chunk_size = backend, chunk_size

    def run(self) -> ClassOutcome:
        caps = _captions_of(self.lab, self.batch, ["key", "caption", "backend_fingerprint"])
        keys = caps.column("key").to_pylist()
        texts = caps.column("caption").to_pylist()
        cap_fps = caps.column("backend_fingerprint").to_pylist()
        todo = [i for i, t in enumerate(texts) if (t or "").strip()]
        probs: list[ClassProbs | None] = [None] * len(keys)
        with _built(self.build) as classifier:
            identity = classifier.identity
            stream = getattr(classifier, "classify_stream", None)
            try:
                if callable(stream):  # a fleet backend: one bounded stream, no chunk barrier
                    scored = list(stream(texts[i] for i in todo))
                    if len(scored) != len(todo):
                        raise CaptionStageError(
                            f"{identity.kind} returned {len(scored)} classes for {len(todo)}"
                        )
                    for i, p in zip(todo, scored, strict=True):
                        probs[i] = p
                else:
                    for chunk in chunked(todo, self.chunk_size):
                        scored = classifier.classify([texts[i] for i in chunk])
                        for i, p in zip(chunk, scored, strict=True):
                            probs[i] = p
                endpoints = endpoint_counts(classifier)
            except BackendError as exc:
                failure = _failed(
                    f"classifying {self.batch}", identity, exc, self.backend, classifier
                )
                raise CaptionStageError(
                    f"{failure} No rows were written.", failure.details
                ) from exc
        created = datetime.now(UTC)
        table = class_rows(self.batch, keys, cap_fps, probs, identity, self.backend, created)
        written = self.lab.replace_partition(CAPTION_CLASSES, self.batch, table)
        stored = self.lab.read_batch(
            CAPTION_CLASSES.name,
            self.batch,
            ["key", "caption_fingerprint", "label", "p_visual", "p_text", "p_nsfw"],
        )
        current = self.lab.read_batch(CAPTIONS.name, self.batch, ["key", "backend_fingerprint"])
        labels = Counter(p.label for p in probs if p is not None)
        return ClassOutcome(
            batch=self.batch,
            identity=identity,
            captions=len(keys),
            classified=sum(p is not None for p in probs),
            label_counts={label: labels[label] for label in LABELS},
            caption_fingerprints=sorted({fp for fp in cap_fps if fp}),
            version=written["version"],
            sync=classes_sync(current, stored),
            endpoints=endpoints,
        )


# --------------------------------------------------------------------------- caption_embeddings


@dataclass(frozen=True)
class EmbeddingOutcome:
    """What one batch's caption_embeddings run wrote, and by which text encoder."""

    batch: str
    identity: BackendIdentity
    embeddings: int
    skipped_empty: int  # captions without text: no meaningful embedding
    dim: int
    vector_index: str  # what Lab.ensure_vector_index did
    table_rows: int  # caption_embeddings over every batch
    version: int
    sync: SyncReport


class BatchEmbeddings:
    """One unit-norm vector per non-empty caption of a batch; the table's vector index kept."""

    def __init__(
        self,
        lab: Lab,
        batch: str,
        build: Callable[[], TextEmbedder],
        *,
        chunk_size: int = 2048,
        index_min_rows: int = VECTOR_INDEX_MIN_ROWS,
        index_type: str = "IVF_HNSW_SQ",
    ) -> None:
        self.lab, self.batch, self.build = lab, batch, build
        self.chunk_size, self.index_min_rows, self.index_type = (
            chunk_size,
            index_min_rows,
            index_type,
        )

    def run(self) -> EmbeddingOutcome:
        caps = _captions_of(self.lab, self.batch, ["key", "caption", "backend_fingerprint"])
        columns = (caps.column(c).to_pylist() for c in ("key", "caption", "backend_fingerprint"))
        rows = [(k, t, fp) for k, t, fp in zip(*columns, strict=True) if (t or "").strip()]
        parts: list[Any] = []
        with _built(self.build) as embedder:
            identity, dim = embedder.identity, embedder.dim
            try:
                for chunk in chunked(rows, self.chunk_size):
                    parts.append(embedder.embed([t for _, t, _ in chunk]))
            except BackendError as exc:
                raise CaptionStageError(
                    f"embedding {self.batch} failed: {type(exc).__name__}: {exc}. Nothing written."
                ) from exc
        vectors = np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)
        keys, fps = [k for k, _, _ in rows], [fp for _, _, fp in rows]
        table = embedding_rows(self.batch, keys, fps, vectors, identity, datetime.now(UTC))
        written = self.lab.replace_partition(CAPTION_EMBEDDINGS, self.batch, table)
        index = ensure_embedding_index(self.lab, self.index_min_rows, self.index_type)
        stored = self.lab.read_batch(
            CAPTION_EMBEDDINGS.name, self.batch, ["key", "caption_fingerprint", "vector"]
        )
        current = self.lab.read_batch(
            CAPTIONS.name, self.batch, ["key", "caption", "backend_fingerprint"]
        )
        return EmbeddingOutcome(
            batch=self.batch,
            identity=identity,
            embeddings=table.num_rows,
            skipped_empty=caps.num_rows - table.num_rows,
            dim=dim,
            vector_index=index,
            table_rows=self.lab.count(CAPTION_EMBEDDINGS.name),
            version=written["version"],
            sync=embeddings_sync(current, stored),
        )
