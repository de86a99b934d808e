"""The caption stage's row builders, length statistics and index upkeep, on real Lance."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
import pytest

from prx_assets.core.captions.models import BackendIdentity, CaptionResult, ClassProbs
from prx_assets.core.captions.tables import (
    CAPTION_CLASSES,
    CAPTION_EMBEDDINGS,
    CAPTIONS,
    SOURCE_ALT_TEXT,
    caption_rows,
    caption_stats,
    class_rows,
    embedding_rows,
    ensure_caption_text_index,
    ensure_embedding_index,
)
from prx_assets.core.lab import Lab

T0 = datetime(2024, 1, 1, tzinfo=UTC)
IDENTITY = BackendIdentity.create(
    kind="test", model_id="m", prompt_version="v1", prompt_hash="h", params={"b": 2, "a": 1}
)


def _words(n: int) -> str:
    return " ".join(["word"] * n)


def test_caption_rows_carry_provenance_and_the_length_window():
    results = [
        CaptionResult("k0", _words(150), "test", "m", "v1"),
        CaptionResult("k1", _words(99), "test", "m", "v1"),
        CaptionResult("k2", "an alt text", "alt_text", "alt", "", is_fallback=True),
        CaptionResult("k3", "", "alt_text", "alt", "", is_fallback=True, reason="no_alt_text"),
        CaptionResult("k4", _words(201), "test", "m", "v1"),
    ]
    rows = caption_rows("b0", results, IDENTITY, "openai", T0)
    assert rows.schema == CAPTIONS.schema
    got = rows.to_pylist()
    assert [r["word_count"] for r in got] == [150, 99, 3, 0, 201]
    assert [r["length_ok"] for r in got] == [True, False, False, False, False]
    assert [r["fallback_reason"] for r in got] == [None, None, SOURCE_ALT_TEXT, "no_alt_text", None]
    for r in got:
        assert (r["batch"], r["backend"], r["prompt_version"], r["prompt_hash"]) == (
            "b0",
            "openai",
            "v1",
            "h",
        )
        assert json.loads(r["params"]) == {"a": 1, "b": 2} and r["params"] == '{"a": 1, "b": 2}'
        assert r["backend_fingerprint"] == IDENTITY.fingerprint() and r["created_at"] == T0
    assert [r["model_id"] for r in got] == ["m", "m", "alt", "alt", "m"]
    stats = caption_stats(rows)
    assert (stats.captions, stats.empty, stats.fallback) == (5, 1, 2)
    assert (stats.too_short, stats.too_long, stats.outside, stats.inside) == (3, 1, 4, 1)
    with pytest.raises(ValueError, match="timezone-aware"):
        caption_rows("b0", results, IDENTITY, "openai", datetime(2024, 1, 1))


def test_class_and_embedding_rows_refuse_what_would_not_read_back():
    probs = [ClassProbs.from_array([0.7, 0.2, 0.1], "test"), None]
    rows = class_rows("b0", ["k0", "k1"], ["fp0", "fp1"], probs, IDENTITY, "embedding", T0)
    assert rows.schema == CAPTION_CLASSES.schema
    first, empty = rows.to_pylist()
    assert first["label"] == "visual" and first["p_visual"] == pytest.approx(0.7)
    assert first["caption_fingerprint"] == "fp0"
    assert first["backend_fingerprint"] == IDENTITY.fingerprint()
    assert [empty[c] for c in ("label", "p_visual", "p_text", "p_nsfw")] == [None] * 4
    with pytest.raises(ValueError, match="same length"):
        class_rows("b0", ["k0"], ["fp0", "fp1"], probs, IDENTITY, "embedding", T0)

    vectors = np.eye(2, 384, dtype=np.float32)
    table = embedding_rows("b0", ["k0", "k1"], ["fp0", "fp1"], vectors, IDENTITY, T0)
    assert table.schema == CAPTION_EMBEDDINGS.schema
    assert np.array_equal(np.asarray(table.column("vector").to_pylist(), np.float32), vectors)
    with pytest.raises(ValueError, match="shape"):
        embedding_rows("b0", ["k0"], ["fp0"], vectors, IDENTITY, T0)
    with pytest.raises(ValueError, match="same length"):
        embedding_rows("b0", ["k0", "k1"], ["fp0"], vectors, IDENTITY, T0)
    vectors[1, 5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        embedding_rows("b0", ["k0", "k1"], ["fp0", "fp1"], vectors, IDENTITY, T0)


def test_the_caption_text_index_is_kept_through_the_lab(tmp_path):
    lab = Lab(tmp_path / "lab")
    assert ensure_caption_text_index(lab) == "absent"
    lab.ensure(CAPTIONS)
    assert ensure_caption_text_index(lab) == "empty"
    first = [CaptionResult("k0", "a red bicycle leaning on a wall", "test", "m", "v1")]
    lab.replace_partition(CAPTIONS, "b0", caption_rows("b0", first, IDENTITY, "openai", T0))
    assert ensure_caption_text_index(lab) == "created"
    second = [CaptionResult("k1", "a blue bicycle in the snow", "test", "m", "v1")]
    lab.replace_partition(CAPTIONS, "b1", caption_rows("b1", second, IDENTITY, "openai", T0))
    assert ensure_caption_text_index(lab) == "optimized"
    view = lab.view()
    assert "INVERTED" in view.indexed_columns(CAPTIONS.name)["caption"]
    hits = view.read(CAPTIONS.name, ["key"], full_text_query="bicycle").column("key").to_pylist()
    assert sorted(hits) == ["k0", "k1"]
    with pytest.raises(ValueError, match="min_rows"):
        ensure_embedding_index(lab, min_rows=10)
