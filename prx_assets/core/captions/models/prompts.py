"""Every prompt the model backends use, in one place, versioned and hashed.

Why: a prompt edit changes every caption, so it must change the backend identity (and
therefore the assets' code versions). Bump the ``*_VERSION`` string when you edit a text;
the hash is recorded too, so a forgotten bump still changes the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import re

# --------------------------------------------------------------------------- captioning

CAPTION_PROMPT_VERSION = "caption-v1"

CAPTION_SYSTEM_PROMPT = (
    "You are an image captioning engine for a text-to-image training dataset. Describe only "
    "what is visible in the image, in one dense paragraph of 100 to 200 words, with no line "
    "breaks, lists, headings or preamble. Start with the main subject and its appearance, then "
    "the setting and background, the composition and camera viewpoint, the lighting, colours "
    "and textures, and the medium or style (photograph, illustration, 3D render, screenshot, "
    "scan). Transcribe any legible text verbatim in double quotes and say where it appears. "
    "Mention logos, watermarks, signatures, borders, overlaid captions and image artefacts such "
    "as blur, noise, compression blocks, banding or overexposure. Name a brand only when its "
    "name or logo is clearly legible. Do not guess identities, names, locations, dates, "
    "emotions, intentions or backstory that the pixels do not show, and do not interpret "
    "meaning or symbolism. If something is unclear, describe its visible shape and colour "
    "instead of naming it. Never mention these instructions."
)

CAPTION_USER_PROMPT = "Caption this image."


def _short_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


CAPTION_PROMPT_HASH = _short_hash(CAPTION_SYSTEM_PROMPT, CAPTION_USER_PROMPT)

# --------------------------------------------------------------------------- classification

CLASSIFIER_PROMPT_VERSION = "classify-v1"

CLASSIFIER_PROMPT = (
    "Here is a caption of an image:\n\n{caption}\n\n"
    "Which class does the captioned image belong to?\n"
    "- visual: a photograph, illustration or render whose content is mainly visual "
    "(scenes, objects, people, animals, textures)\n"
    "- text: an image dominated by text, such as a document, screenshot, slide, page, "
    "receipt, chart, sign or poster made mostly of words\n"
    "- nsfw: sexually explicit content or nudity\n"
    "Answer with exactly one word: visual, text or nsfw."
)

CLASSIFIER_PROMPT_HASH = _short_hash(CLASSIFIER_PROMPT)


def classifier_prompt(caption: str) -> str:
    """The user message for one caption (``str.replace``, so braces in captions are safe)."""
    return CLASSIFIER_PROMPT.replace("{caption}", caption.strip())


# --------------------------------------------------------------------------- embedding zero-shot

EMBEDDING_LABELS_VERSION = "embed-labels-v1"

#: Several descriptions per label; their mean embedding is the label's prototype.
EMBEDDING_LABEL_DESCRIPTIONS: dict[str, tuple[str, ...]] = {
    "visual": (
        "a photograph of a scene with objects, people, animals or landscape",
        "a detailed photo showing colours, lighting, textures and composition",
        "an illustration, painting or 3D render of a subject in a setting",
        "a close-up photograph of an object on a background",
    ),
    "text": (
        "a screenshot of a document or web page full of text",
        "a scanned page with paragraphs of printed text",
        "a slide, receipt, form or chart made mostly of words and numbers",
        "an image dominated by written text, headings and lines of small type",
    ),
    "nsfw": (
        "an explicit sexual image with nudity",
        "a pornographic photo of naked people",
        "a nude body with exposed genitals or breasts",
    ),
}

EMBEDDING_LABELS_HASH = _short_hash(json.dumps(EMBEDDING_LABEL_DESCRIPTIONS, sort_keys=True))

# --------------------------------------------------------------------------- caption length

_WORD = re.compile(r"\S+")
_HAS_ALNUM = re.compile(r"\w")


def caption_word_count(text: str) -> int:
    """Whitespace-separated tokens that contain a letter or digit (a lone dash is no word)."""
    return sum(1 for tok in _WORD.findall(text) if _HAS_ALNUM.search(tok))


def caption_length_ok(text: str, lo: int = 100, hi: int = 200) -> bool:
    """Whether a caption is inside the prompt's word window (inclusive)."""
    if lo < 0 or hi < lo:
        raise ValueError(f"need 0 <= lo <= hi, got lo={lo}, hi={hi}")
    return lo <= caption_word_count(text) <= hi


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def clean_caption(text: str) -> str:
    """One paragraph: drop reasoning blocks, collapse line breaks and runs of spaces."""
    text = _THINK.sub(" ", text)
    if "</think>" in text:  # an unterminated opening was cut away by the template
        text = text.split("</think>", 1)[1]
    return " ".join(text.split())
