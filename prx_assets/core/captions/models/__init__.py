"""Captioner, caption-classifier and text-embedding backends (no Dagster here).

One small protocol per kind (:class:`Captioner`, :class:`CaptionClassifier`,
:class:`TextEmbedder`), each implementation carrying a :class:`BackendIdentity` whose
``fingerprint()`` versions the assets it feeds. Heavy libraries (torch, transformers,
sentence-transformers) are imported only when a model is first used.

Choosing a backend:

- captions: :class:`OpenAICaptioner` (a vLLM/SGLang server) or
  :class:`TransformersCaptioner` (in-process); :class:`AltTextCaptioner` is the offline
  fallback and flags every result ``is_fallback=True``;
- classification: :class:`TransformersClassifier` or :class:`OpenAIClassifier`;
  :class:`EmbeddingClassifier` is the offline fallback;
- embeddings: :class:`MiniLMEmbedder` (bundled all-MiniLM-L6-v2, 384-d).

The OpenAI-compatible backends take one server or a fleet (``fleet.py``: client-side
balancing, a dead server ejected and probed again, :class:`FleetDownError` when all are
out); :class:`EndpointCounts` are their per-server request counts.
"""

from prx_assets.core.captions.models.base import (
    LABELS,
    BackendCancelledError,
    BackendConfigError,
    BackendError,
    BackendIdentity,
    BackendInputError,
    BackendRequestError,
    BackendTimeoutError,
    BackendUnavailableError,
    CaptionClassifier,
    Captioner,
    CaptionInput,
    CaptionResult,
    ClassProbs,
    EmptyContentError,
    MalformedResponseError,
    TextEmbedder,
)
from prx_assets.core.captions.models.captioners import (
    ALT_TEXT_MODEL_ID,
    AltTextCaptioner,
    OpenAICaptioner,
    TransformersCaptioner,
)
from prx_assets.core.captions.models.classifiers import (
    EmbeddingClassifier,
    OpenAIClassifier,
    TransformersClassifier,
)
from prx_assets.core.captions.models.embeddings import MINILM_DIM, MiniLMEmbedder, minilm_model_path
from prx_assets.core.captions.models.fleet import EndpointCounts, FleetDownError
from prx_assets.core.captions.models.prompts import (
    CAPTION_PROMPT_HASH,
    CAPTION_PROMPT_VERSION,
    CAPTION_SYSTEM_PROMPT,
    CLASSIFIER_PROMPT_VERSION,
    caption_length_ok,
    caption_word_count,
)

__all__ = [
    "ALT_TEXT_MODEL_ID",
    "CAPTION_PROMPT_HASH",
    "CAPTION_PROMPT_VERSION",
    "CAPTION_SYSTEM_PROMPT",
    "CLASSIFIER_PROMPT_VERSION",
    "LABELS",
    "MINILM_DIM",
    "AltTextCaptioner",
    "BackendCancelledError",
    "BackendConfigError",
    "BackendError",
    "BackendIdentity",
    "BackendInputError",
    "BackendRequestError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "CaptionClassifier",
    "CaptionInput",
    "CaptionResult",
    "Captioner",
    "ClassProbs",
    "EmbeddingClassifier",
    "EmptyContentError",
    "EndpointCounts",
    "FleetDownError",
    "MalformedResponseError",
    "MiniLMEmbedder",
    "OpenAICaptioner",
    "OpenAIClassifier",
    "TextEmbedder",
    "TransformersCaptioner",
    "TransformersClassifier",
    "caption_length_ok",
    "caption_word_count",
    "minilm_model_path",
]
