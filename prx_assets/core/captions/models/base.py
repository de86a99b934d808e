"""Shared types for model backends: identities, inputs, results, protocols and errors.

Why a ``BackendIdentity``: the Dagster side derives each asset's ``code_version`` from
``identity.fingerprint()``, so swapping a model, a prompt or a decoding parameter makes the
asset stale, while deployment details (server URL, concurrency, timeouts, device, API key)
do not. Identities are computed from constructor arguments only, never by loading a
model, so building the asset graph stays cheap. They never hold secrets: parameter names
that look like credentials are refused outright.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from PIL import Image

from prx_assets.core.ingest.decode import DecodeRejected, decode_rgb, to_rgb

#: The caption classes, in the fixed order every classifier reports them.
LABELS: tuple[str, ...] = ("visual", "text", "nsfw")

Scalar = str | int | float | bool | None

_SECRET_PARAM = re.compile(
    r"(api[_-]?key|secret|passw(or)?d|authori[sz]ation|bearer|access[_-]?token|credential)",
    re.IGNORECASE,
)


# --------------------------------------------------------------------------- errors


class BackendError(RuntimeError):
    """Base class of every failure a model backend reports."""


class BackendConfigError(BackendError):
    """The backend is misconfigured (bad URL, missing model files, invalid parameter)."""


class BackendInputError(BackendError):
    """An input cannot be processed (no image, undecodable bytes, not a string)."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(f"{key}: {message}" if key is not None else message)
        self.key = key


class BackendRequestError(BackendError):
    """The server refused the request with a non-retryable status (400, 401, 404, ...)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class BackendUnavailableError(BackendError):
    """Retries exhausted on 429/5xx/connection failures."""

    def __init__(self, message: str, attempts: int, status: int | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.status = status


class BackendTimeoutError(BackendUnavailableError):
    """Retries exhausted and the last attempt timed out."""


class MalformedResponseError(BackendError):
    """The server answered 2xx but the body is not a usable completion (after retries)."""

    def __init__(self, message: str, attempts: int = 1) -> None:
        super().__init__(message)
        self.attempts = attempts


class EmptyContentError(MalformedResponseError):
    """The completion had no text (after retries)."""


class BackendCancelledError(BackendError):
    """A request was abandoned because another item of the same batch failed."""


# --------------------------------------------------------------------------- identity


def _check_scalar(name: str, value: object) -> Scalar:
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value  # type: ignore[return-value]
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"identity param {name!r} must be finite, got {value!r}")
        return value
    raise TypeError(
        f"identity param {name!r} must be str/int/float/bool/None, got {type(value).__name__}"
    )


@dataclass(frozen=True)
class BackendIdentity:
    """What determines a backend's output; its fingerprint versions the assets it feeds.

    ``params`` is a sorted tuple of ``(name, scalar)`` pairs (use :meth:`create`).
    """

    kind: str
    model_id: str
    prompt_version: str
    prompt_hash: str
    params: tuple[tuple[str, Scalar], ...] = ()

    def __post_init__(self) -> None:
        if not self.kind or not self.model_id:
            raise ValueError("BackendIdentity needs a kind and a model_id")
        names = [name for name, _ in self.params]
        if names != sorted(names) or len(set(names)) != len(names):
            raise ValueError("identity params must be sorted by name and unique")
        for name, value in self.params:
            if _SECRET_PARAM.search(name):
                raise ValueError(f"identity param {name!r} looks like a secret; never put it here")
            _check_scalar(name, value)

    @classmethod
    def create(
        cls,
        kind: str,
        model_id: str,
        prompt_version: str = "none",
        prompt_hash: str = "",
        params: Mapping[str, object] | None = None,
    ) -> BackendIdentity:
        items = tuple(sorted((str(k), _check_scalar(str(k), v)) for k, v in (params or {}).items()))
        return cls(kind, model_id, prompt_version, prompt_hash, items)

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "model_id": self.model_id,
            "prompt_version": self.prompt_version,
            "prompt_hash": self.prompt_hash,
            "params": dict(self.params),
        }

    def canonical_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def fingerprint(self) -> str:
        """Short, stable sha256 of the canonical JSON (16 hex chars)."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()[:16]

    def param(self, name: str) -> Scalar:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(name)


# --------------------------------------------------------------------------- inputs / results


@dataclass(frozen=True)
class CaptionInput:
    """One image to caption: encoded bytes or a decoded PIL image, plus the source's alt text."""

    key: str
    image: bytes | Image.Image | None = None
    alt_text: str | None = None


@dataclass(frozen=True)
class CaptionResult:
    """A caption with its provenance.

    ``is_fallback`` marks text that did not come from a vision-language model (alt text),
    so it can never be presented as a VLM caption. ``reason`` explains an empty or degraded
    caption (``"no_alt_text"``); ``finish_reason`` is the decoder's (``"stop"``/``"length"``).
    """

    key: str
    caption: str
    kind: str
    model_id: str
    prompt_version: str
    is_fallback: bool = False
    reason: str | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class ClassProbs:
    """Probabilities over :data:`LABELS` for one caption.

    ``method`` says how they were obtained (``"logprob_mean"``, ``"logprob_first_token"``,
    ``"constrained_choice"``, ``"embedding_cosine"``); ``scores`` are the per-label scores
    the softmax was taken over, when there were any.
    """

    visual: float
    text: float
    nsfw: float
    method: str
    scores: tuple[float, ...] | None = None
    is_fallback: bool = False

    @property
    def probs(self) -> dict[str, float]:
        return {"visual": self.visual, "text": self.text, "nsfw": self.nsfw}

    @property
    def label(self) -> str:
        """Argmax label; ties go to the earlier label in :data:`LABELS`."""
        values = (self.visual, self.text, self.nsfw)
        return LABELS[int(np.argmax(values))]

    @classmethod
    def from_array(
        cls,
        probs: Sequence[float] | np.ndarray,
        method: str,
        scores: Sequence[float] | None = None,
        is_fallback: bool = False,
    ) -> ClassProbs:
        p = [float(x) for x in probs]
        if len(p) != len(LABELS):
            raise ValueError(f"expected {len(LABELS)} probabilities, got {len(p)}")
        return cls(
            visual=p[0],
            text=p[1],
            nsfw=p[2],
            method=method,
            scores=tuple(float(s) for s in scores) if scores is not None else None,
            is_fallback=is_fallback,
        )


# --------------------------------------------------------------------------- protocols


@runtime_checkable
class Captioner(Protocol):
    """A model that writes one dense caption per image; its identity says which model and settings."""

    identity: BackendIdentity

    def caption(self, images: Sequence[CaptionInput]) -> list[CaptionResult]: ...


@runtime_checkable
class CaptionClassifier(Protocol):
    """A text model that gives each caption its visual/text/nsfw probabilities."""

    identity: BackendIdentity

    def classify(self, captions: Sequence[str]) -> list[ClassProbs]: ...


@runtime_checkable
class TextEmbedder(Protocol):
    """A text encoder that turns captions into ``dim``-wide vectors (for search, not training)."""

    identity: BackendIdentity
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


# --------------------------------------------------------------------------- helpers


class DataURL(str):
    """A ``data:<type>;base64,<payload>`` URL this package encoded itself (``data_url``).

    Why a type: a request body carries a megabyte of base64, which nothing in JSON needs
    to escape, yet ``json.dumps`` scans and copies it character by character: the caption
    client's largest single cost on 3-4 MP photos (86.4 % of an 80/s fleet before, 93.0 %
    after, ``benchmarks/bench_caption_fleet.py --quick``).
    A ``DataURL`` is spliced into the encoded body as it is
    (``openai_http.encode_body``). Only ASCII without quotes or backslashes is accepted (two
    fast checks), so splicing it is exactly what ``json.dumps`` would write.
    """

    __slots__ = ()

    def __new__(cls, value: str) -> DataURL:
        if not (value.isascii() and value.startswith("data:")) or ('"' in value or "\\" in value):
            raise ValueError("not a data URL this package encoded")
        return super().__new__(cls, value)


def data_url(data: bytes, media_type: str = "image/jpeg") -> DataURL:
    """``data`` as a base64 data URL (what an OpenAI-compatible server takes inline)."""
    return DataURL(f"data:{media_type};base64," + base64.b64encode(data).decode("ascii"))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64)
    z = z - z.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def load_caption_image(item: CaptionInput, max_side: int, resize: str = "lanczos") -> Image.Image:
    """RGB image for a VLM, no side longer than ``max_side`` (by the decode policy).

    Large inputs are shrunk here so requests stay small and every backend sees the
    same pixels for the same parameters. ``resize``: ``"lanczos"`` (the original recipe: a
    JPEG is DCT-scaled only while *both* sides stay >= ``max_side``, so a 3-4 MP photo is
    decoded in full, then Lanczos) or ``"draft"`` (DCT-scaled while the *long* side stays
    >= ``max_side``, then Lanczos: the same output size from a quarter of the pixels, about
    half the CPU on 3-4 MP photos; other pixels, so a backend's identity names it).
    """
    if resize not in RESIZES:
        raise BackendConfigError(f"resize must be one of {RESIZES}, got {resize!r}")
    if max_side < 32:
        raise BackendConfigError(f"max_side must be at least 32, got {max_side}")
    if item.image is None:
        raise BackendInputError(item.key, "no image given (only the alt-text captioner needs none)")
    owned = isinstance(item.image, bytes | bytearray | memoryview)  # a fresh decode: ours
    if owned:
        data = bytes(item.image)
        side = max_side if resize == "lanczos" else _long_side_draft(data, max_side)
        try:
            img = decode_rgb(data, draft_size=(side, side))
        except DecodeRejected as exc:
            raise BackendInputError(
                item.key, f"image rejected ({exc.reason}): {exc.detail}"
            ) from None
    elif isinstance(item.image, Image.Image):
        img, _ = to_rgb(item.image)
        owned = img is not item.image
    else:
        raise BackendInputError(
            item.key, f"image must be bytes or a PIL image, got {type(item.image).__name__}"
        )
    if max(img.size) > max_side:
        if not owned:  # never shrink the caller's image in place
            img = img.copy()
        img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    return img


RESIZES = ("lanczos", "draft")


def _long_side_draft(data: bytes, max_side: int) -> int:
    """The square draft target that keeps the long side >= ``max_side`` (orientation-free:
    a square asks the short side for ``max_side * short / long``, hence the long side for
    ``max_side``). ``max_side`` itself when the header cannot be read (decode_rgb refuses)."""
    try:
        w, h = Image.open(io.BytesIO(data)).size
    except Exception:  # noqa: BLE001 - the decode below reports the real refusal
        return max_side
    if min(w, h) < 1:
        return max_side
    return max(1, -(-max_side * min(w, h) // max(w, h)))


def check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise BackendInputError(None, "expected a sequence of strings, got a single string")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise BackendInputError(f"item {i}", f"expected str, got {type(t).__name__}")
    return out


def check_caption_inputs(images: Sequence[CaptionInput]) -> list[CaptionInput]:
    out = list(images)
    for i, item in enumerate(out):
        if not isinstance(item, CaptionInput):
            raise BackendInputError(
                f"item {i}", f"expected CaptionInput, got {type(item).__name__}"
            )
    return out
