"""The caption stage's tables, their row builders, length statistics and index upkeep.

Every row records the fingerprint of the backend that made it (and, for classes and
embeddings, of the captioner whose caption it was made from): what model-swap detection
(``swaps.py``) and the in-sync checks (``verify.py``) compare. The indexes are kept through
``Lab`` (``ensure_caption_text_index``, ``ensure_embedding_index``); this module only holds
what is specific to captions: names, kinds and the vector index's parameters.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pyarrow as pa

from prx_assets.core.captions.models.base import BackendIdentity, CaptionResult, ClassProbs
from prx_assets.core.captions.models.embeddings import MINILM_DIM
from prx_assets.core.captions.models.prompts import caption_word_count
from prx_assets.core.lab import Lab, TableSpec

CAPTIONS = TableSpec(
    name="captions",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("caption", pa.string()),
            pa.field("word_count", pa.int32()),
            pa.field("length_ok", pa.bool_()),  # inside the prompt's 100-200 word window
            pa.field("is_fallback", pa.bool_()),  # True: alt text, not a VLM caption
            pa.field("fallback_reason", pa.string()),
            # Provenance: which backend wrote it, with what prompt and parameters.
            pa.field("backend", pa.string()),  # openai | transformers | alt_text
            pa.field("model_id", pa.string()),
            pa.field("prompt_version", pa.string()),
            pa.field("prompt_hash", pa.string()),
            pa.field("params", pa.string()),  # canonical JSON
            pa.field("backend_fingerprint", pa.string()),
            pa.field("created_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("backend_fingerprint", "BITMAP")),
)

CAPTION_CLASSES = TableSpec(
    name="caption_classes",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("label", pa.string()),  # visual | text | nsfw (argmax)
            pa.field("p_visual", pa.float32()),
            pa.field("p_text", pa.float32()),
            pa.field("p_nsfw", pa.float32()),
            pa.field("backend", pa.string()),
            pa.field("model_id", pa.string()),
            pa.field("prompt_version", pa.string()),
            pa.field("backend_fingerprint", pa.string()),
            pa.field("caption_fingerprint", pa.string()),  # the captioner it classified
            pa.field("created_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("label", "BITMAP")),
)

CAPTION_EMBEDDINGS = TableSpec(
    name="caption_embeddings",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), MINILM_DIM)),  # unit norm
            pa.field("model_id", pa.string()),
            pa.field("backend_fingerprint", pa.string()),  # the embedder's
            pa.field("caption_fingerprint", pa.string()),  # the captioner it embedded
            pa.field("created_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("backend_fingerprint", "BITMAP")),
)

#: The caption prompt asks for 100-200 words (inclusive).
WORD_WINDOW: tuple[int, int] = (100, 200)

#: Below this many embeddings a brute-force scan answers a query in milliseconds and an
#: IVF index has too few vectors per partition to train well, so none is built.
VECTOR_INDEX_MIN_ROWS = 10_000

FTS_INDEX_NAME = "caption_idx"  # Lance's default name, so Lab.ensure_indexes agrees
VECTOR_INDEX_NAME = "vector_idx"
VECTOR_INDEX_TYPES = ("IVF_HNSW_SQ", "IVF_PQ")

SOURCE_ALT_TEXT = "source_alt_text"


def _utc_column(created_at: datetime, n: int) -> pa.Array:
    if created_at.tzinfo is None:
        raise ValueError("created_at must be timezone-aware (UTC)")
    return pa.array([created_at] * n, type=pa.timestamp("us", tz="UTC"))


# --------------------------------------------------------------------------- rows


def caption_rows(
    batch: str,
    results: Sequence[CaptionResult],
    identity: BackendIdentity,
    backend: str,
    created_at: datetime,
    window: tuple[int, int] = WORD_WINDOW,
) -> pa.Table:
    """``captions`` rows with provenance; alt-text rows say so in ``fallback_reason``."""
    lo, hi = window
    counts = [caption_word_count(r.caption) for r in results]
    reasons = [r.reason or (SOURCE_ALT_TEXT if r.is_fallback else None) for r in results]
    n = len(results)
    return pa.table(
        {
            "key": [r.key for r in results],
            "batch": [batch] * n,
            "caption": [r.caption for r in results],
            "word_count": pa.array(counts, type=pa.int32()),
            "length_ok": [lo <= c <= hi for c in counts],
            "is_fallback": [r.is_fallback for r in results],
            "fallback_reason": reasons,
            "backend": [backend] * n,
            "model_id": [r.model_id for r in results],
            "prompt_version": [identity.prompt_version] * n,
            "prompt_hash": [identity.prompt_hash] * n,
            "params": [json.dumps(dict(identity.params), sort_keys=True)] * n,
            "backend_fingerprint": [identity.fingerprint()] * n,
            "created_at": _utc_column(created_at, n),
        },
        schema=CAPTIONS.schema,
    )


def class_rows(
    batch: str,
    keys: Sequence[str],
    caption_fingerprints: Sequence[str],
    probs: Sequence[ClassProbs | None],
    identity: BackendIdentity,
    backend: str,
    created_at: datetime,
) -> pa.Table:
    """``caption_classes`` rows; ``None`` (an empty caption) stores null label and probabilities."""
    if not len(keys) == len(caption_fingerprints) == len(probs):
        raise ValueError("keys, caption_fingerprints and probs must have the same length")
    n = len(keys)

    def col(name: str) -> pa.Array:
        return pa.array([getattr(p, name) if p else None for p in probs], type=pa.float32())

    return pa.table(
        {
            "key": list(keys),
            "batch": [batch] * n,
            "label": [p.label if p else None for p in probs],
            "p_visual": col("visual"),
            "p_text": col("text"),
            "p_nsfw": col("nsfw"),
            "backend": [backend] * n,
            "model_id": [identity.model_id] * n,
            "prompt_version": [identity.prompt_version] * n,
            "backend_fingerprint": [identity.fingerprint()] * n,
            "caption_fingerprint": list(caption_fingerprints),
            "created_at": _utc_column(created_at, n),
        },
        schema=CAPTION_CLASSES.schema,
    )


def embedding_rows(
    batch: str,
    keys: Sequence[str],
    caption_fingerprints: Sequence[str],
    vectors: np.ndarray,
    identity: BackendIdentity,
    created_at: datetime,
) -> pa.Table:
    """``caption_embeddings`` rows; refuses vectors of the wrong shape or with NaN/inf."""
    vecs = np.ascontiguousarray(vectors, dtype=np.float32)
    n = len(keys)
    if vecs.shape != (n, MINILM_DIM):
        raise ValueError(f"expected vectors of shape ({n}, {MINILM_DIM}), got {vecs.shape}")
    if len(caption_fingerprints) != n:
        raise ValueError("keys and caption_fingerprints must have the same length")
    if not np.isfinite(vecs).all():
        raise ValueError("embedding vectors contain NaN or infinity")
    flat = pa.array(vecs.reshape(-1), type=pa.float32())
    return pa.table(
        {
            "key": list(keys),
            "batch": [batch] * n,
            "vector": pa.FixedSizeListArray.from_arrays(flat, MINILM_DIM),
            "model_id": [identity.model_id] * n,
            "backend_fingerprint": [identity.fingerprint()] * n,
            "caption_fingerprint": list(caption_fingerprints),
            "created_at": _utc_column(created_at, n),
        },
        schema=CAPTION_EMBEDDINGS.schema,
    )


# --------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class CaptionStats:
    """Length facts of one partition's captions (``empty`` are also ``too_short``)."""

    captions: int
    empty: int
    fallback: int
    too_short: int
    too_long: int
    window: tuple[int, int] = WORD_WINDOW

    @property
    def outside(self) -> int:
        return self.too_short + self.too_long

    @property
    def inside(self) -> int:
        return self.captions - self.outside


def caption_stats(rows: pa.Table, window: tuple[int, int] = WORD_WINDOW) -> CaptionStats:
    """From ``captions`` rows (needs ``caption``, ``word_count`` and ``is_fallback``)."""
    lo, hi = window
    wc = np.asarray(rows.column("word_count").to_numpy(zero_copy_only=False), dtype=np.int64)
    texts = rows.column("caption").to_pylist()
    fallback = rows.column("is_fallback").to_pylist()
    return CaptionStats(
        captions=rows.num_rows,
        empty=sum(1 for t in texts if not (t or "").strip()),
        fallback=sum(1 for f in fallback if f),
        too_short=int((wc < lo).sum()),
        too_long=int((wc > hi).sum()),
        window=window,
    )


# --------------------------------------------------------------------------- indexes


def ensure_caption_text_index(lab: Lab) -> str:
    """The full-text (INVERTED) index on ``captions.caption``, created or fed new fragments.

    ``Lab.ensure_text_index`` answers ``"created"``, ``"optimized"``, ``"empty"``, ``"absent"``
    or ``"deferred (...)"`` (unindexed fragments are still searched, flat).
    """
    return lab.ensure_text_index(CAPTIONS.name, "caption", FTS_INDEX_NAME)


def ensure_embedding_index(
    lab: Lab, min_rows: int = VECTOR_INDEX_MIN_ROWS, index_type: str = "IVF_HNSW_SQ"
) -> str:
    """A cosine vector index on ``caption_embeddings.vector`` once ``min_rows`` rows exist.

    Returns ``"below_threshold (n < min)"``, ``"created"``, ``"optimized"`` or ``"deferred
    (...)"``. New data is assigned to the trained partitions (no retraining); retrain with
    ``optimize_indices(retrain=True)`` after the lab has grown many-fold.
    """
    if index_type not in VECTOR_INDEX_TYPES:
        raise ValueError(f"index_type must be one of {VECTOR_INDEX_TYPES}, got {index_type!r}")
    if min_rows < 256:
        raise ValueError(f"min_rows must be >= 256 (quantiser training), got {min_rows}")
    params = {"num_sub_vectors": MINILM_DIM // 8} if index_type == "IVF_PQ" else {}
    return lab.ensure_vector_index(
        CAPTION_EMBEDDINGS.name,
        "vector",
        VECTOR_INDEX_NAME,
        min_rows=min_rows,
        index_type=index_type,
        index_types=VECTOR_INDEX_TYPES,
        metric="cosine",
        **params,
    )
