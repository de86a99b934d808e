"""Whether a partition's classes and embeddings are in sync with its current captions.

Run by the caption runners right after their write, on what was stored: every caption (for
embeddings: every non-empty one) must have exactly one derived row, made from the caption
fingerprint the ``captions`` table holds now, with well-formed values. The counts are
plain data; ``defs/captions/checks.py`` reports them as Dagster asset checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from prx_assets.core.captions.models.base import LABELS


@dataclass(frozen=True)
class SyncReport:
    """Derived rows against the captions they should cover; ``counts`` are problem counts
    except those named in ``informational``."""

    derived_rows: int
    expected: int
    counts: dict[str, int]
    informational: tuple[str, ...] = ()

    @property
    def problems(self) -> dict[str, int]:
        return {k: v for k, v in self.counts.items() if v and k not in self.informational}

    @property
    def in_sync(self) -> bool:
        return not self.problems


def _coverage(expected: Mapping[str, str], derived: pa.Table) -> dict[str, int]:
    """Counts of missing, extra, duplicated and fingerprint-mismatched derived rows."""
    keys = derived.column("key").to_pylist()
    fps = derived.column("caption_fingerprint").to_pylist()
    seen: dict[str, int] = {}
    mismatched = 0
    for k, fp in zip(keys, fps, strict=True):
        seen[k] = seen.get(k, 0) + 1
        if k in expected and expected[k] != fp:
            mismatched += 1
    return {
        "missing": sum(1 for k in expected if k not in seen),
        "extra": sum(1 for k in seen if k not in expected),
        "duplicated": sum(1 for n in seen.values() if n > 1),
        "fingerprint_mismatch": mismatched,
    }


def classes_sync(captions: pa.Table, classes: pa.Table) -> SyncReport:
    """``captions``: key, backend_fingerprint; ``classes``: key, caption_fingerprint, p_*, label.

    A class row of an empty caption has null probabilities (``unclassified``, not a problem).
    """
    expected = dict(
        zip(
            captions.column("key").to_pylist(),
            captions.column("backend_fingerprint").to_pylist(),
            strict=True,
        )
    )
    counts = _coverage(expected, classes)
    probs = np.stack(
        [
            np.asarray(classes.column(c).to_numpy(zero_copy_only=False), dtype=np.float64)
            for c in ("p_visual", "p_text", "p_nsfw")
        ],
        axis=1,
    ).reshape(-1, 3)
    labels = np.array(classes.column("label").to_pylist(), dtype=object)
    scored = ~np.isnan(probs).any(axis=1)
    bad_sum = int((np.abs(probs[scored].sum(axis=1) - 1.0) > 1e-3).sum())
    argmax = np.array(LABELS, dtype=object)[np.argmax(probs[scored], axis=1)]
    bad_label = int((labels[scored] != argmax).sum())
    counts.update(probabilities_not_summing_to_1=bad_sum, label_not_argmax=bad_label)
    counts["unclassified"] = int((~scored).sum())
    return SyncReport(classes.num_rows, len(expected), counts, informational=("unclassified",))


def embeddings_sync(captions: pa.Table, embeddings: pa.Table) -> SyncReport:
    """``captions``: key, caption, backend_fingerprint; ``embeddings``: key,
    caption_fingerprint, vector. An empty caption has no embedding (not expected)."""
    expected = {
        k: fp
        for k, text, fp in zip(
            captions.column("key").to_pylist(),
            captions.column("caption").to_pylist(),
            captions.column("backend_fingerprint").to_pylist(),
            strict=True,
        )
        if (text or "").strip()
    }
    counts = _coverage(expected, embeddings)
    if embeddings.num_rows:
        vectors = np.asarray(
            embeddings.column("vector").combine_chunks().flatten().to_numpy(zero_copy_only=False),
            dtype=np.float32,
        ).reshape(embeddings.num_rows, -1)
        norms = np.linalg.norm(vectors, axis=1)
        counts["not_unit_norm"] = int((np.abs(norms - 1.0) > 1e-3).sum())
    else:
        counts["not_unit_norm"] = 0
    return SyncReport(embeddings.num_rows, len(expected), counts)
