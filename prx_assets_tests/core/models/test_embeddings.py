"""MiniLMEmbedder and EmbeddingClassifier on the real bundled all-MiniLM-L6-v2."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prx_assets.core.captions.models import (
    LABELS,
    BackendConfigError,
    BackendInputError,
    CaptionClassifier,
    EmbeddingClassifier,
    MiniLMEmbedder,
    TextEmbedder,
    minilm_model_path,
)

VISUAL = [
    "A close-up photograph of a ginger cat curled up asleep on a grey wool blanket, soft "
    "window light from the left, shallow depth of field, warm tones, fur texture visible.",
    "A wide landscape photo of snow-capped mountains above a turquoise lake at sunrise, pine "
    "trees along the shore, pink clouds and a mirror-like reflection on the water.",
]
TEXT = [
    "A screenshot of a word processor document with several paragraphs of small black text on "
    'a white page, a bold heading reading "Quarterly Report" and a numbered list.',
    "A scanned printed page of a textbook filled with dense lines of text in two columns, a "
    "page number at the bottom, slightly skewed and grey.",
]


def test_bundled_model_path_is_the_real_minilm():
    path = minilm_model_path()
    assert (path / "model.safetensors").stat().st_size > 80_000_000
    assert (path / "modules.json").is_file()


def test_embeddings_are_unit_float32_and_semantic(minilm):
    vecs = minilm.embed(["a dog runs on the beach", "a puppy playing by the sea", "tax form 1040"])
    assert isinstance(minilm, TextEmbedder)
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32 and minilm.dim == 384
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2] + 0.3
    assert minilm.embed([]).shape == (0, 384)
    np.testing.assert_allclose(minilm.embed(["tax form 1040"])[0], vecs[2], atol=1e-5)


def test_embed_rejects_non_strings(minilm):
    with pytest.raises(BackendInputError):
        minilm.embed("one string")  # type: ignore[arg-type]
    with pytest.raises(BackendInputError, match="item 0"):
        minilm.embed([None])  # type: ignore[list-item]


def test_embedder_refuses_a_missing_model_dir(tmp_path):
    with pytest.raises(BackendConfigError, match="no sentence-transformers model"):
        MiniLMEmbedder(tmp_path).embed(["x"])


def test_zero_shot_on_clear_cases(minilm):
    clf = EmbeddingClassifier(minilm)
    results = clf.classify(VISUAL + TEXT)
    assert isinstance(clf, CaptionClassifier)
    assert [r.label for r in results] == ["visual", "visual", "text", "text"]
    for r in results:
        assert math.isclose(sum(r.probs.values()), 1.0, abs_tol=1e-6)
        assert r.method == "embedding_cosine" and r.is_fallback
        assert r.probs[r.label] > 0.5
        assert len(r.scores) == len(LABELS) and all(-1.0 <= s <= 1.0 for s in r.scores)


def test_temperature_sharpens_without_changing_the_argmax(minilm):
    warm = EmbeddingClassifier(minilm, temperature=1.0).classify(TEXT[:1])[0]
    cold = EmbeddingClassifier(minilm, temperature=0.02).classify(TEXT[:1])[0]
    assert warm.label == cold.label == "text"
    assert cold.text > warm.text
    assert warm.scores == pytest.approx(cold.scores, abs=1e-6)


def test_identity_names_the_fallback_and_its_label_set(minilm):
    clf = EmbeddingClassifier(minilm)
    assert clf.identity.kind == "embedding"
    assert clf.identity.model_id == "sentence-transformers/all-MiniLM-L6-v2"
    custom = EmbeddingClassifier(
        minilm, descriptions={"visual": ["a photo"], "text": ["a document"], "nsfw": ["nudity"]}
    )
    assert custom.identity.prompt_version == "custom"
    assert custom.identity.fingerprint() != clf.identity.fingerprint()
    assert EmbeddingClassifier(minilm, temperature=0.1).identity != clf.identity
    with pytest.raises(BackendConfigError, match="exactly the labels"):
        EmbeddingClassifier(minilm, descriptions={"visual": ["a photo"], "text": ["doc"]})
    with pytest.raises(BackendConfigError, match="at least one text"):
        EmbeddingClassifier(minilm, descriptions={"visual": ["a"], "text": ["b"], "nsfw": []})
    with pytest.raises(BackendConfigError):
        EmbeddingClassifier(minilm, temperature=0.0)
    assert clf.classify([]) == []
