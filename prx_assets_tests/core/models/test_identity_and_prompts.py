"""BackendIdentity, the versioned prompts, caption-length helpers and the alt-text fallback."""

from __future__ import annotations

import pytest
from PIL import Image

from prx_assets.core.captions.models import (
    ALT_TEXT_MODEL_ID,
    CAPTION_PROMPT_HASH,
    CAPTION_SYSTEM_PROMPT,
    AltTextCaptioner,
    BackendIdentity,
    BackendInputError,
    Captioner,
    CaptionInput,
    ClassProbs,
    caption_length_ok,
    caption_word_count,
)
from prx_assets.core.captions.models.base import load_caption_image
from prx_assets.core.captions.models.prompts import (
    CLASSIFIER_PROMPT,
    EMBEDDING_LABEL_DESCRIPTIONS,
    _short_hash,
    classifier_prompt,
    clean_caption,
)
from prx_assets.demo.jpegs import encoded


def test_fingerprint_is_stable_and_sensitive():
    a = BackendIdentity.create("k", "m", "v1", "h", {"b": 2, "a": 1.5, "c": None})
    b = BackendIdentity.create("k", "m", "v1", "h", {"c": None, "a": 1.5, "b": 2})
    assert a == b and hash(a) == hash(b)
    assert a.params == (("a", 1.5), ("b", 2), ("c", None))
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 16
    # pinned: the fingerprint must not drift between runs or Python versions
    assert a.canonical_json() == (
        '{"kind":"k","model_id":"m","params":{"a":1.5,"b":2,"c":null},'
        '"prompt_hash":"h","prompt_version":"v1"}'
    )
    variants = [
        BackendIdentity.create("k2", "m", "v1", "h", {"b": 2, "a": 1.5, "c": None}),
        BackendIdentity.create("k", "m2", "v1", "h", {"b": 2, "a": 1.5, "c": None}),
        BackendIdentity.create("k", "m", "v2", "h", {"b": 2, "a": 1.5, "c": None}),
        BackendIdentity.create("k", "m", "v1", "h2", {"b": 2, "a": 1.5, "c": None}),
        BackendIdentity.create("k", "m", "v1", "h", {"b": 3, "a": 1.5, "c": None}),
        BackendIdentity.create("k", "m", "v1", "h", {"b": "2", "a": 1.5, "c": None}),
    ]
    assert len({v.fingerprint() for v in variants} | {a.fingerprint()}) == len(variants) + 1


@pytest.mark.parametrize(
    "name", ["api_key", "OPENAI_API_KEY", "password", "authorization", "secret"]
)
def test_identity_refuses_secret_like_params(name):
    with pytest.raises(ValueError, match="looks like a secret"):
        BackendIdentity.create("k", "m", params={name: "x"})


def test_identity_refuses_unhashable_or_non_finite_params():
    with pytest.raises(TypeError, match="must be str/int/float/bool/None"):
        BackendIdentity.create("k", "m", params={"a": [1, 2]})
    with pytest.raises(ValueError, match="finite"):
        BackendIdentity.create("k", "m", params={"a": float("nan")})
    with pytest.raises(ValueError, match="sorted"):
        BackendIdentity("k", "m", "v", "h", (("b", 1), ("a", 2)))
    assert BackendIdentity.create("k", "m", params={"max_tokens": 5}).param("max_tokens") == 5


def test_prompt_is_versioned_and_hashed():
    assert CAPTION_PROMPT_HASH == _short_hash(CAPTION_SYSTEM_PROMPT, "Caption this image.")
    for phrase in ("100 to 200 words", "legible text", "logos", "watermarks", "artefacts"):
        assert phrase in CAPTION_SYSTEM_PROMPT
    assert "{caption}" in CLASSIFIER_PROMPT
    assert all(label in CLASSIFIER_PROMPT for label in ("visual", "text", "nsfw"))
    assert classifier_prompt("  a {x} b ") == CLASSIFIER_PROMPT.replace("{caption}", "a {x} b")
    assert set(EMBEDDING_LABEL_DESCRIPTIONS) == {"visual", "text", "nsfw"}


def test_word_count_and_length_window():
    assert caption_word_count("A red, brick wall - with 2 windows.") == 7  # the dash is no word
    assert caption_word_count("") == 0
    assert caption_word_count("— … !!") == 0
    assert caption_length_ok(" ".join(["word"] * 150))
    assert caption_length_ok(" ".join(["word"] * 100)) and caption_length_ok(" ".join(["w"] * 200))
    assert not caption_length_ok(" ".join(["word"] * 99))
    assert not caption_length_ok(" ".join(["word"] * 201))
    assert caption_length_ok("a b c", lo=3, hi=3)
    with pytest.raises(ValueError):
        caption_length_ok("x", lo=10, hi=5)


def test_clean_caption_makes_one_paragraph():
    assert clean_caption("<think>hmm\nok</think>\n\nA  cat.\nOn a mat. ") == "A cat. On a mat."
    assert clean_caption("reasoning cut short</think>A dog.") == "A dog."
    assert clean_caption(" \n ") == ""


def test_class_probs_label_and_validation():
    p = ClassProbs.from_array([0.2, 0.7, 0.1], "m")
    assert p.label == "text" and p.probs == {"visual": 0.2, "text": 0.7, "nsfw": 0.1}
    assert ClassProbs.from_array([0.5, 0.5, 0.0], "m").label == "visual"  # ties: first label
    with pytest.raises(ValueError):
        ClassProbs.from_array([0.5, 0.5], "m")


def test_alt_text_captioner_is_a_flagged_fallback(demo_photos):
    cap = AltTextCaptioner()
    assert isinstance(cap, Captioner)
    assert cap.identity.kind == "alt_text" and cap.identity.model_id == ALT_TEXT_MODEL_ID
    results = cap.caption(
        [
            CaptionInput("a", image=demo_photos["coffee.png"], alt_text="  A cup of\n coffee "),
            CaptionInput("b", alt_text=None),
            CaptionInput("c", alt_text="   "),
        ]
    )
    assert [r.caption for r in results] == ["A cup of coffee", "", ""]
    assert [r.reason for r in results] == [None, "no_alt_text", "no_alt_text"]
    assert all(r.is_fallback and r.model_id == ALT_TEXT_MODEL_ID for r in results)
    assert all(r.kind == "alt_text" for r in results)
    with pytest.raises(BackendInputError, match="alt_text must be str"):
        cap.caption([CaptionInput("d", alt_text=b"bytes")])  # type: ignore[arg-type]
    with pytest.raises(BackendInputError, match="expected CaptionInput"):
        cap.caption(["not an input"])  # type: ignore[list-item]


def test_load_caption_image_bounds_size_and_applies_the_decode_policy(demo_photos):
    big = load_caption_image(CaptionInput("x", image=demo_photos["rocket.jpg"]), max_side=200)
    assert big.mode == "RGB" and max(big.size) == 200
    rgba = Image.new("RGBA", (40, 30), (255, 0, 0, 0))  # fully transparent
    small = load_caption_image(CaptionInput("y", image=rgba), max_side=1024)
    assert small.size == (40, 30) and small.getpixel((0, 0)) == (255, 255, 255)  # alpha on white
    icon = encoded(Image.new("RGB", (10, 10)), "ICO")
    with pytest.raises(BackendInputError, match="format_not_allowed"):
        load_caption_image(CaptionInput("z", image=icon), max_side=256)
