"""Resources that choose and configure the caption stage's model backends.

Each resource builds one backend of ``prx_assets.core.captions.models``. ``identity()`` is computed
from configuration alone (no model load, no network, no secret), so ``build_caption_assets``
can derive code versions from it when the graph is defined, and the swap sensor can compare
it with the fingerprints stored in the lab. API keys come from the environment
(``api_key=EnvVar("PRX_CAPTION_API_KEY")`` or, unset, the variables the backend reads); they
are sent as a header and never reach metadata, identities or tables.
"""

from collections.abc import Callable
from typing import Any, Literal, cast

from dagster import ConfigurableResource, EnvVar

from prx_assets.core.captions.models import (
    AltTextCaptioner,
    BackendIdentity,
    CaptionClassifier,
    Captioner,
    EmbeddingClassifier,
    MiniLMEmbedder,
    OpenAICaptioner,
    OpenAIClassifier,
    TextEmbedder,
    TransformersCaptioner,
    TransformersClassifier,
)
from prx_assets.core.captions.models.captioners import DEFAULT_VLM_ID
from prx_assets.core.captions.models.classifiers import DEFAULT_LM_ID
from prx_assets.core.captions.models.embeddings import MINILM_MODEL_ID
from prx_assets.core.captions.models.openai_http import ClientOptions
from prx_assets.core.captions.tables import VECTOR_INDEX_MIN_ROWS
from prx_assets.core.workers import WorkerPool, make_pool

ALT_TEXT_NOTE = "offline fallback: source alt text, not a VLM caption"
EMBEDDING_NOTE = "offline fallback: embedding zero-shot"


def _plain(value: Any) -> Any:
    """A field's value outside a run: an ``EnvVar`` is read now (inside a run it already is)."""
    return value.get_value() if isinstance(value, EnvVar) else value


def _servers(base_url: str | None, base_urls: list[str] | None) -> str | list[str] | None:
    """The configured servers: ``base_url`` (one URL or a comma-separated list) or
    ``base_urls``; both set is ambiguous and refused."""
    if base_url and base_urls:
        raise ValueError("set base_url or base_urls, not both")
    return list(base_urls) if base_urls else base_url


#: The pool of steps that run a model in process (they hold a GPU): ``dagster.yaml``'s
#: pool limit (``dagster instance concurrency set gpu N``) caps them across runs.
GPU_POOL = "gpu"


class _ServerFleetConfig(ConfigurableResource):
    """The client settings both model resources expose for OpenAI-compatible servers.

    Declared once here and passed through as ``ClientOptions`` (the backends' ``**client``);
    the resources differ only in their defaults for concurrency and timeout.
    """

    max_concurrency: int = 8  # per server
    timeout_s: float = 120.0
    max_attempts: int = 5
    backoff_base_s: float = 0.5
    circuit_failures: int = 3  # consecutive connection errors/timeouts/5xx that eject a server
    circuit_cooldown_s: float = 5.0  # before an ejected server is probed (doubles, to 60 s)
    max_fleet_down_s: float = 120.0  # every server out this long: the batch fails
    window: int | None = None  # openai: items in the stream at once (None: 4 x fleet slots)

    def client_options(self) -> ClientOptions:
        """These fields, by name (each is a ``ClientPolicy`` field: a typo fails the build)."""
        return cast(ClientOptions, {k: getattr(self, k) for k in _ServerFleetConfig.model_fields})


class CaptionerResource(_ServerFleetConfig):
    """The captioning backend: ``alt_text`` (offline fallback), ``openai`` or ``transformers``.

    ``model`` defaults to Qwen3-VL-8B-Instruct for the model backends. ``openai`` talks to
    vLLM/SGLang servers at ``base_url`` (``.../v1``, or several comma-separated: a fleet,
    balanced by the client) or ``base_urls``; ``transformers`` loads ``model`` in process.
    Decoding parameters are part of the identity; deployment ones (URLs, their number and
    order, key, concurrency per server, timeouts, retries, circuit breaker, device) are not.
    """

    backend: Literal["alt_text", "openai", "transformers"] = "alt_text"
    model: str | None = None
    base_url: str | None = None
    base_urls: list[str] | None = None
    api_key: str | None = None
    max_tokens: int = 384
    temperature: float = 0.0
    do_sample: bool = False
    max_side: int = 1024
    jpeg_quality: int = 90
    # openai: "draft" halves preparation CPU; "server" sends the ingested JPEG for the
    # server's processor to resize (a few ms CPU per photo, more bytes on the wire).
    resize: Literal["lanczos", "draft", "server"] = "lanczos"
    batch_size: int = 8
    device: str | None = None
    dtype: str | None = None
    chunk_size: int = 256  # images read (bytes) at a time; captioned at a time in process
    prepare_workers: int | None = None  # openai: threads (or pool workers) preparing ahead
    # openai: where images are decoded, resized and encoded: "threads" in the step's process,
    # or "pool": the per-image worker pool (PRX_EXECUTOR: processes, or Ray actors on a
    # cluster), so the caption step itself only streams requests.
    prepare_on: Literal["threads", "pool"] = "threads"

    @property
    def is_fallback(self) -> bool:
        return self.backend == "alt_text"

    @property
    def pool(self) -> str | None:
        """The ``gpu`` pool for an in-process model only. A remote fleet's step makes HTTP
        calls (its servers hold the GPUs and its client bounds the requests per server),
        and the alt-text fallback runs no model: those steps take no pool, so several
        batches can caption at once (bounded by the run queue's limits)."""
        return GPU_POOL if self.backend == "transformers" else None

    def _make(self, secrets: bool) -> Captioner:
        model = _plain(self.model) or DEFAULT_VLM_ID
        if self.backend == "alt_text":
            return AltTextCaptioner()
        if self.backend == "openai":
            return OpenAICaptioner(
                model,
                base_url=_servers(self.base_url, self.base_urls) if secrets else None,
                api_key=self.api_key if secrets else None,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                max_side=self.max_side,
                jpeg_quality=self.jpeg_quality,
                resize=self.resize,
                prepare_workers=self.prepare_workers,
                **self.client_options(),
            )
        return TransformersCaptioner(
            model,
            max_new_tokens=self.max_tokens,
            do_sample=self.do_sample,
            batch_size=self.batch_size,
            max_side=self.max_side,
            device=self.device,
            dtype=self.dtype,
        )

    def prepare_pool(self) -> Callable[[], WorkerPool] | None:
        """The worker pool a run prepares its images on (``prepare_on="pool"``), else None."""
        if self.backend != "openai" or self.prepare_on != "pool":
            return None
        workers = self.prepare_workers
        return lambda: make_pool(workers=workers)

    def identity(self) -> BackendIdentity:
        """What the captions depend on; safe outside a run (no URL or key is resolved)."""
        return self._make(secrets=False).identity

    def build(self) -> Captioner:
        """The backend for a run (models load lazily on first use)."""
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        return self._make(secrets=True)


class ClassifierResource(_ServerFleetConfig):
    """The caption classifier: ``embedding`` (offline fallback), ``transformers`` or ``openai``.

    ``model`` defaults to Qwen3-8B for the LM backends; the embedding backend always uses
    the bundled all-MiniLM-L6-v2 (``embedding_model_path`` overrides its directory).
    ``openai`` servers are configured as for :class:`CaptionerResource` (a fleet too).
    """

    backend: Literal["embedding", "transformers", "openai"] = "embedding"
    model: str | None = None
    base_url: str | None = None
    base_urls: list[str] | None = None
    api_key: str | None = None
    temperature: float = 0.05  # embedding zero-shot softmax temperature
    score: Literal["mean", "first"] = "mean"  # transformers label scoring
    mode: Literal["auto", "logprobs", "choice"] = "auto"  # openai
    top_logprobs: int = 10
    choice_field: Literal["structured_outputs", "guided_choice"] = "structured_outputs"
    max_concurrency: int = 16  # per server (short prompts: more in flight than captioning)
    timeout_s: float = 60.0
    batch_size: int = 16
    device: str | None = None
    dtype: str | None = None
    embedding_model_path: str | None = None
    chunk_size: int = 512  # captions classified at a time in process

    @property
    def is_fallback(self) -> bool:
        return self.backend == "embedding"

    @property
    def pool(self) -> str | None:
        """The ``gpu`` pool for an in-process model (the transformers LM, and the MiniLM
        fallback, which uses a GPU where there is one); none for a remote fleet."""
        return None if self.backend == "openai" else GPU_POOL

    def _make(self, secrets: bool) -> CaptionClassifier:
        model = _plain(self.model) or DEFAULT_LM_ID
        if self.backend == "embedding":
            embedder = MiniLMEmbedder(_plain(self.embedding_model_path), device=self.device)
            return EmbeddingClassifier(embedder, temperature=self.temperature)
        if self.backend == "openai":
            return OpenAIClassifier(
                model,
                base_url=_servers(self.base_url, self.base_urls) if secrets else None,
                api_key=self.api_key if secrets else None,
                mode=self.mode,
                top_logprobs=self.top_logprobs,
                choice_field=self.choice_field,
                **self.client_options(),
            )
        return TransformersClassifier(
            model,
            score=self.score,
            batch_size=self.batch_size,
            device=self.device,
            dtype=self.dtype,
        )

    def identity(self) -> BackendIdentity:
        return self._make(secrets=False).identity

    def build(self) -> CaptionClassifier:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        return self._make(secrets=True)


class EmbedderResource(ConfigurableResource):
    """all-MiniLM-L6-v2 caption embeddings (bundled weights; ``model_path`` overrides).

    ``index_min_rows``: the table gets a cosine ``index_type`` vector index once it holds
    that many rows (see ``VECTOR_INDEX_MIN_ROWS`` for why not sooner).
    """

    model_path: str | None = None
    model_id: str = MINILM_MODEL_ID
    device: str | None = None
    batch_size: int = 64
    chunk_size: int = 2048
    index_min_rows: int = VECTOR_INDEX_MIN_ROWS
    index_type: Literal["IVF_HNSW_SQ", "IVF_PQ"] = "IVF_HNSW_SQ"

    def _make(self) -> TextEmbedder:
        return MiniLMEmbedder(
            _plain(self.model_path),
            model_id=_plain(self.model_id),
            device=self.device,
            batch_size=self.batch_size,
        )

    def identity(self) -> BackendIdentity:
        return self._make().identity

    def build(self) -> TextEmbedder:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.index_min_rows < 256:
            raise ValueError(f"index_min_rows must be >= 256, got {self.index_min_rows}")
        return self._make()
