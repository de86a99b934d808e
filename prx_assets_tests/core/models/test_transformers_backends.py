"""TransformersCaptioner / TransformersClassifier on tiny random models built offline."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from prx_assets.core.captions.models import (
    CAPTION_PROMPT_VERSION,
    LABELS,
    BackendConfigError,
    BackendInputError,
    CaptionClassifier,
    Captioner,
    CaptionInput,
    TransformersCaptioner,
    TransformersClassifier,
)
from prx_assets.core.captions.models.classifiers import label_score, probs_from_scores


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir) -> TransformersCaptioner:
    return TransformersCaptioner(tiny_vlm_dir, max_new_tokens=6, batch_size=3, max_side=128)


@pytest.fixture(scope="module")
def lm(tiny_lm_dir) -> TransformersClassifier:
    return TransformersClassifier(tiny_lm_dir, batch_size=2)


def test_captioner_generates_for_demo_photos_in_batches(vlm, demo_photos):
    names = sorted(demo_photos)[:4]  # 4 inputs, batch_size 3: a full and a partial batch
    inputs = [CaptionInput(key=n, image=demo_photos[n], alt_text="ignored") for n in names]
    inputs[1] = CaptionInput(key=names[1], image=Image.open(io.BytesIO(demo_photos[names[1]])))
    results = vlm.caption(inputs)

    assert isinstance(vlm, Captioner)
    assert [r.key for r in results] == names
    for r in results:
        assert isinstance(r.caption, str) and r.caption == r.caption.strip()
        assert "\n" not in r.caption
        assert r.kind == "transformers_vlm" and r.model_id == str(vlm.model_id)
        assert r.prompt_version == CAPTION_PROMPT_VERSION and not r.is_fallback
        assert r.finish_reason in ("stop", "length")
    assert vlm.device == "cpu"
    assert str(vlm._model.dtype) == "torch.float32"  # no bf16 on CPU
    assert vlm._processor.tokenizer.padding_side == "left"


def test_captioner_is_deterministic_and_batching_does_not_change_output(vlm, demo_photos):
    """Greedy + left padding: a caption does not depend on its batch neighbours."""
    names = sorted(demo_photos)
    wide = next(n for n in names if n.startswith("rocket"))  # differently shaped images
    inputs = [CaptionInput(key=n, image=demo_photos[n]) for n in (names[0], wide, names[2])]
    batched = vlm.caption(inputs)
    alone = [vlm.caption([item])[0] for item in inputs]
    assert [r.caption for r in batched] == [r.caption for r in alone]
    assert len({r.caption for r in batched}) == 3  # the pixels reach the model
    assert vlm.caption(inputs) == batched


def test_captioner_rejects_bad_input_before_loading(tiny_vlm_dir):
    cap = TransformersCaptioner(tiny_vlm_dir, max_new_tokens=2)
    with pytest.raises(BackendInputError, match="no image"):
        cap.caption([CaptionInput(key="k")])
    assert cap._model is None  # identity and validation never load the model
    assert cap.caption([]) == []
    assert cap._model is None


def test_missing_model_is_a_config_error(tmp_path):
    cap = TransformersCaptioner(tmp_path / "nowhere", max_new_tokens=2)
    with pytest.raises(BackendConfigError, match="cannot load VLM"):
        cap.caption([CaptionInput(key="k", image=Image.new("RGB", (64, 64)))])


def test_identity_changes_with_model_and_decoding(tiny_vlm_dir):
    a = TransformersCaptioner(tiny_vlm_dir, max_new_tokens=6)
    assert (
        a.identity.fingerprint()
        == TransformersCaptioner(tiny_vlm_dir, max_new_tokens=6).identity.fingerprint()
    )
    assert (
        a.identity.fingerprint()
        != TransformersCaptioner(tiny_vlm_dir, max_new_tokens=7).identity.fingerprint()
    )
    assert (
        a.identity.fingerprint()
        != TransformersCaptioner("other/model", max_new_tokens=6).identity.fingerprint()
    )
    # the device is deployment, not identity
    assert (
        a.identity == TransformersCaptioner(tiny_vlm_dir, max_new_tokens=6, device="cpu").identity
    )


# --------------------------------------------------------------------------- classifier


CAPTIONS = [
    "A close-up photograph of a cat asleep on a sofa in soft window light.",
    "A screenshot of a document with paragraphs of small text.",
    "A watermark logo on a {braced} poster.",
]


def test_classifier_probabilities_are_a_distribution(lm):
    results = lm.classify(CAPTIONS)
    assert isinstance(lm, CaptionClassifier)
    assert len(results) == len(CAPTIONS)
    for r in results:
        probs = np.array([r.visual, r.text, r.nsfw])
        assert math.isclose(probs.sum(), 1.0, abs_tol=1e-6)
        assert (probs > 0).all()
        assert r.label in LABELS and r.label == LABELS[int(probs.argmax())]
        assert r.method == "logprob_mean" and not r.is_fallback
        np.testing.assert_allclose(probs, probs_from_scores(r.scores), atol=1e-9)


def test_labels_have_unequal_token_counts_in_the_tiny_tokenizer(lm):
    lengths = [len(ids) for ids in lm.label_token_ids]
    assert len(set(lengths)) > 1, lengths  # the normalisation tests below need this


def test_scores_are_per_token_means_matching_an_unpadded_forward_pass(lm):
    """Batched, left-padded scoring equals a direct single-sequence computation."""
    import torch

    tok, model = lm._load()
    results = lm.classify(CAPTIONS)
    for caption, result in zip(CAPTIONS, results, strict=True):
        prompt_ids = tok(lm.prompt_text(caption), add_special_tokens=False).input_ids
        expected = []
        for label_ids in lm.label_token_ids:
            ids = torch.tensor([prompt_ids + label_ids])
            with torch.inference_mode():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            start = len(prompt_ids)
            token_lps = [float(logp[start - 1 + t, label_ids[t]]) for t in range(len(label_ids))]
            expected.append(sum(token_lps) / len(token_lps))
        np.testing.assert_allclose(result.scores, expected, atol=1e-4)


def test_prompt_is_the_chat_template_with_the_caption(lm):
    text = lm.prompt_text("A {braced} caption.")
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert "A {braced} caption." in text and "Answer with exactly one word" in text


def test_summed_logprobs_would_pick_the_short_label():
    """Why scores are normalised: a confident 3-token label loses under the sum."""
    one_token = [-1.0]  # "text": a single, fairly unlikely token
    three_tokens = [-0.6, -0.3, -0.3]  # "nsfw" = "ns" "f" "w": each token likelier than "text"
    sums = [label_score(one_token, "sum"), label_score(three_tokens, "sum")]
    means = [label_score(one_token, "mean"), label_score(three_tokens, "mean")]
    assert np.argmax(sums) == 0  # -1.0 > -1.2: the sum prefers the shorter label
    assert np.argmax(means) == 1  # -1.0 < -0.4: per-token means prefer the likelier one
    assert label_score(three_tokens, "first") == -0.6
    with pytest.raises(ValueError):
        label_score([], "mean")
    with pytest.raises(ValueError):
        label_score([-1.0], "median")  # type: ignore[arg-type]


def test_first_token_scoring_mode(tiny_lm_dir, lm):
    first = TransformersClassifier(tiny_lm_dir, score="first")
    per_label = lm.token_logprobs(CAPTIONS[:1])[0]
    [result] = first.classify(CAPTIONS[:1])
    assert result.method == "logprob_first_token"
    np.testing.assert_allclose(result.scores, [lps[0] for lps in per_label], atol=1e-5)
    assert first.identity.fingerprint() != lm.identity.fingerprint()


def test_classifier_input_validation(lm):
    assert lm.classify([]) == []
    with pytest.raises(BackendInputError, match="single string"):
        lm.classify("a caption")  # type: ignore[arg-type]
    with pytest.raises(BackendInputError, match="item 1"):
        lm.classify(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(BackendConfigError):
        TransformersClassifier("x", score="sum")  # type: ignore[arg-type]
