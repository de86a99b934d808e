"""The caption stage's table, row builders, index upkeep and model-swap detection.

Why swaps are detected from rows: every caption, class and embedding row records the
fingerprint of the backend that made it (and, downstream, the captioner fingerprint it was
made from). Dagster 1.13 offers no public way to ask "which partitions are stale because a
code version changed", so the project compares stored fingerprints with the configured
ones itself (:func:`stale_batches`, :func:`plan_reruns`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.core.captions.models.base import BackendIdentity, CaptionResult, ClassProbs
from prx_assets.core.captions.models.embeddings import MINILM_DIM
from prx_assets.core.captions.models.prompts import caption_word_count
from prx_assets.core.lab import TableSpec

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


# --------------------------------------------------------------------------- swap detection


@dataclass(frozen=True)
class ConfiguredFingerprints:
    """The fingerprints of the backends configured now (what fresh rows would carry)."""

    captioner: str
    classifier: str
    embedder: str


@dataclass(frozen=True)
class StaleBatch:
    """One partition whose stored rows were made by something other than the configuration.

    ``found`` lists the distinct stored values that differ (``"<null>"`` for a missing one);
    ``newest`` is the newest ``created_at`` of those rows: together they identify the stale
    materialisation, so a rerun request for it can be made exactly once.
    """

    batch: str
    rows: int
    found: tuple[str, ...]
    newest: str

    @property
    def marker(self) -> str:
        return f"{'|'.join(self.found)}@{self.newest}"


def stale_batches(rows: pa.Table, expected: Mapping[str, str]) -> dict[str, StaleBatch]:
    """Batches holding a row whose ``expected`` columns differ from the expected values.

    ``rows`` needs ``batch``, ``created_at`` and every column of ``expected``; any subset of
    a table's rows may be passed (a reader can pre-filter), the answer only depends on the
    rows that differ. A null fingerprint counts as different.
    """
    if not expected:
        raise ValueError("expected must name at least one column")
    if rows.num_rows == 0:
        return {}
    missing = [c for c in ("batch", "created_at", *expected) if c not in rows.column_names]
    if missing:
        raise ValueError(f"rows lack columns {missing}")
    mask = None
    for column, value in expected.items():
        col = rows.column(column)
        differs = pc.or_kleene(pc.not_equal(col, value), pc.is_null(col))
        mask = differs if mask is None else pc.or_(mask, differs)
    stale = rows.filter(mask)
    out: dict[str, StaleBatch] = {}
    if stale.num_rows == 0:
        return out
    by_batch: dict[str, list[int]] = {}
    for i, b in enumerate(stale.column("batch").to_pylist()):
        by_batch.setdefault(b, []).append(i)
    created = stale.column("created_at").to_pylist()
    values = {c: stale.column(c).to_pylist() for c in expected}
    for batch, idx in sorted(by_batch.items()):
        found = set()
        for i in idx:
            parts = []
            for column, want in expected.items():
                got = values[column][i]
                if got != want:
                    parts.append(f"{column}={'<null>' if got is None else got}")
            found.add(",".join(parts))
        stamps = [created[i] for i in idx if created[i] is not None]
        newest = max(stamps).isoformat() if stamps else "<null>"
        out[batch] = StaleBatch(batch, len(idx), tuple(sorted(found)), newest)
    return out


def plan_reruns(
    stale: Mapping[str, Iterable[str]], downstream: Mapping[str, Sequence[str]]
) -> dict[str, list[str]]:
    """Asset -> sorted batches to rerun: each stale asset plus everything downstream of it.

    ``downstream[a]`` lists the assets that must be rebuilt when ``a`` is (transitively
    closed here, so listing direct children is enough). Assets with nothing to rerun are
    left out.
    """
    plan: dict[str, set[str]] = {}
    for asset, batches in stale.items():
        batches = set(batches)
        if not batches:
            continue
        todo, seen = [asset], set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            plan.setdefault(current, set()).update(batches)
            todo.extend(downstream.get(current, ()))
    return {asset: sorted(b) for asset, b in sorted(plan.items()) if b}


def reruns_by_batch(
    plan: Mapping[str, Iterable[str]], order: Sequence[str]
) -> dict[str, list[str]]:
    """Batch -> the assets to rerun in it, in ``order`` (then by name for unknown ones)."""
    rank = {name: i for i, name in enumerate(order)}
    out: dict[str, set[str]] = {}
    for asset, batches in plan.items():
        for b in batches:
            out.setdefault(b, set()).add(asset)
    return {
        b: sorted(assets, key=lambda a: (rank.get(a, len(rank)), a))
        for b, assets in sorted(out.items())
    }


def swap_run_key(batch: str, assets: Sequence[str], markers: Sequence[str]) -> str:
    """A run key naming the partition, the assets and the stale materialisations it fixes."""
    digest = hashlib.sha256("\0".join([batch, *assets, *sorted(markers)]).encode()).hexdigest()
    return f"model-swap:{batch}:{digest[:16]}"


# --------------------------------------------------------------------------- indexes


def _has_index(ds: lance.LanceDataset, column: str, kinds: Iterable[str]) -> bool:
    wanted = {k.upper() for k in kinds}
    for ix in ds.list_indices():
        if ix["fields"] == [column] and str(ix["type"]).upper() in wanted:
            return True
    return False


def _with_retries(uri: str, action: Callable[[lance.LanceDataset], str], attempts: int = 3) -> str:
    """Run an index action; a conflicting concurrent commit is retried, then reported.

    Any other error is raised: only a lost race is an acceptable reason to skip.
    """
    last: Exception | None = None
    for attempt in range(attempts):
        try:
            return action(lance.dataset(uri))
        except (OSError, RuntimeError, ValueError) as exc:
            message = str(exc)
            if "already exists" in message:  # a concurrent writer built it
                return "exists"
            if "conflict" not in message.lower():
                raise
            last = exc
            time.sleep(0.05 * (2**attempt))
    return f"deferred ({type(last).__name__}: {str(last)[:160]})"


def ensure_fts_index(uri: str, column: str = "caption") -> str:
    """Create the INVERTED (full-text) index, or fold new fragments into it.

    Returns ``"created"``, ``"optimized"``, ``"empty"`` or ``"deferred (...)"`` when
    concurrent commits kept winning: unindexed fragments are still searched (flat), and
    the next write or the maintenance job indexes them.
    """

    def act(ds: lance.LanceDataset) -> str:
        if ds.count_rows() == 0:
            return "empty"
        if _has_index(ds, column, ("INVERTED", "FTS")):
            names = sorted({ix["name"] for ix in ds.list_indices() if ix["fields"] == [column]})
            ds.optimize.optimize_indices(index_names=names)
            return "optimized"
        ds.create_scalar_index(column, "INVERTED", name=FTS_INDEX_NAME, replace=False)
        return "created"

    return _with_retries(uri, act)


def ensure_vector_index(
    uri: str,
    column: str = "vector",
    min_rows: int = VECTOR_INDEX_MIN_ROWS,
    index_type: str = "IVF_HNSW_SQ",
) -> str:
    """Build a cosine vector index once the table has ``min_rows`` rows; then keep it fed.

    Returns ``"below_threshold (n < min)"``, ``"created"``, ``"optimized"`` or
    ``"deferred (...)"``. New data is assigned to the trained partitions (no retraining);
    retrain with ``optimize_indices(retrain=True)`` after the lab has grown many-fold.
    """
    if index_type not in VECTOR_INDEX_TYPES:
        raise ValueError(f"index_type must be one of {VECTOR_INDEX_TYPES}, got {index_type!r}")
    if min_rows < 256:
        raise ValueError(f"min_rows must be >= 256 (quantiser training), got {min_rows}")

    def act(ds: lance.LanceDataset) -> str:
        rows = ds.count_rows()
        if _has_index(ds, column, VECTOR_INDEX_TYPES):
            names = sorted({ix["name"] for ix in ds.list_indices() if ix["fields"] == [column]})
            ds.optimize.optimize_indices(index_names=names)
            return "optimized"
        if rows < min_rows:
            return f"below_threshold ({rows} < {min_rows})"
        kwargs = {"num_sub_vectors": MINILM_DIM // 8} if index_type == "IVF_PQ" else {}
        ds.create_index(column, index_type, name=VECTOR_INDEX_NAME, metric="cosine", **kwargs)
        return "created"

    return _with_retries(uri, act)
