"""Captioner backends: an OpenAI-compatible server, a local transformers VLM, and alt text.

Usage::

    cap = OpenAICaptioner(model="Qwen/Qwen3-VL-8B-Instruct", base_url="http://vllm:8000/v1")
    results = cap.caption([CaptionInput("k1", image=jpeg_bytes, alt_text="a dog")])
    code_version = cap.identity.fingerprint()

All backends load lazily (the identity is known without loading anything), keep input
order, and raise for the batch as a whole: a :class:`BackendError` from ``caption`` means
no result for any item, so the caller writes no partial partition.

:class:`AltTextCaptioner` is the offline fallback. Its results carry ``is_fallback=True``
and ``model_id="alt-text-fallback"`` so alt text can never pass for a VLM caption.
"""

from __future__ import annotations

import io
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Unpack

from PIL import Image

from prx_assets.core.captions.models.base import (
    RESIZES,
    BackendConfigError,
    BackendIdentity,
    BackendInputError,
    CaptionInput,
    CaptionResult,
    DataURL,
    EmptyContentError,
    check_caption_inputs,
    data_url,
    load_caption_image,
)
from prx_assets.core.captions.models.openai_http import (
    ClientOptions,
    OpenAIBackend,
    message_text,
)
from prx_assets.core.captions.models.passthrough import server_ready_url
from prx_assets.core.captions.models.prompts import (
    CAPTION_PROMPT_HASH,
    CAPTION_PROMPT_VERSION,
    CAPTION_SYSTEM_PROMPT,
    CAPTION_USER_PROMPT,
    clean_caption,
)
from prx_assets.core.workers import ItemFailed, WorkerPool

DEFAULT_VLM_ID = "Qwen/Qwen3-VL-8B-Instruct"
ALT_TEXT_MODEL_ID = "alt-text-fallback"
CAPTION_API_KEY_ENV = ("PRX_CAPTION_API_KEY", "OPENAI_API_KEY")
CAPTION_BASE_URL_ENV = ("PRX_CAPTION_BASE_URL", "OPENAI_BASE_URL")


def image_to_data_url(img: Image.Image, quality: int = 90) -> DataURL:
    """JPEG data URL; always re-encoded so requests are small and carry no metadata."""
    buf = io.BytesIO()
    (img if img.mode == "RGB" else img.convert("RGB")).save(buf, format="JPEG", quality=quality)
    return data_url(buf.getvalue())


#: One image's preparation as a worker-pool task: (key, image bytes, max_side, JPEG quality,
#: resize recipe).
PrepareJob = tuple[str, bytes, int, int, str]


#: What ``resize`` may be for a server backend: the in-process recipes, or ``"server"``: the
#: ingested JPEG as it is (metadata stripped) for the server's processor to resize, and the
#: ``"draft"`` recipe here for an image a server would decode otherwise (``passthrough``).
SERVER_RESIZES = (*RESIZES, "server")


def prepare_caption_url(key: str, data: bytes, max_side: int, quality: int, resize: str) -> DataURL:
    """The data URL sent for one image's bytes under a ``resize`` recipe."""
    if resize == "server":
        url = server_ready_url(data)
        if url is not None:
            return url
        resize = "draft"
    img = load_caption_image(CaptionInput(key, image=data), max_side, resize)
    return image_to_data_url(img, quality)


def prepare_caption_job(job: PrepareJob) -> tuple[str, str]:
    """(key, JPEG data URL) of one image's bytes, exactly as :meth:`OpenAICaptioner.prepare`
    makes it: module-level and picklable, so a worker pool (processes, or Ray actors on a
    cluster) can do the decode, resize and encode away from the caption step."""
    key, data, max_side, quality, resize = job
    return key, prepare_caption_url(key, data, max_side, quality, resize)


class OpenAICaptioner(OpenAIBackend):
    """Captions through any OpenAI-compatible chat-completions server (vLLM, SGLang).

    ``base_url`` (``.../v1``; several, comma-separated or a sequence, for a fleet) and
    ``api_key`` come from arguments or the environment (``PRX_CAPTION_BASE_URL``/
    ``OPENAI_BASE_URL``, ``PRX_CAPTION_API_KEY``/``OPENAI_API_KEY``); no key means no
    ``Authorization`` header. The identity holds the model, prompt and decoding/encoding
    parameters, not the URLs, key or concurrency: moving or resizing the fleet does not
    re-caption the lake. ``client``: timeouts, retries, concurrency per server and the
    circuit breaker (``ClientOptions``).
    """

    BASE_URL_ENV = CAPTION_BASE_URL_ENV
    API_KEY_ENV = CAPTION_API_KEY_ENV
    CLIENT_DEFAULTS: ClassVar[ClientOptions] = {"timeout_s": 120.0, "max_concurrency": 8}

    def __init__(
        self,
        model: str = DEFAULT_VLM_ID,
        *,
        base_url: str | Sequence[str] | None = None,
        api_key: str | None = None,
        max_tokens: int = 384,
        temperature: float = 0.0,
        max_side: int = 1024,
        jpeg_quality: int = 90,
        resize: str = "lanczos",
        prepare_workers: int | None = None,
        **client: Unpack[ClientOptions],
    ) -> None:
        if resize not in SERVER_RESIZES:
            raise BackendConfigError(f"resize must be one of {SERVER_RESIZES}, got {resize!r}")
        if prepare_workers is not None and prepare_workers < 1:
            raise BackendConfigError(f"prepare_workers must be >= 1, got {prepare_workers}")
        if max_tokens < 1:
            raise BackendConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        if not 1 <= jpeg_quality <= 100:
            raise BackendConfigError(f"jpeg_quality must be in 1..100, got {jpeg_quality}")
        if max_side < 32:
            raise BackendConfigError(f"max_side must be >= 32, got {max_side}")
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = float(temperature)
        self.max_side = max_side
        self.jpeg_quality = jpeg_quality
        self.resize = resize
        # Deployment, not identity: how many threads decode, resize and encode ahead.
        self.prepare_workers = prepare_workers or max(1, len(os.sched_getaffinity(0)))
        self._connect(base_url, api_key, client)
        self.identity = BackendIdentity.create(
            kind="openai_vlm",
            model_id=model,
            prompt_version=CAPTION_PROMPT_VERSION,
            prompt_hash=CAPTION_PROMPT_HASH,
            params={
                "max_tokens": max_tokens,
                "temperature": self.temperature,
                "max_side": max_side,
                "jpeg_quality": jpeg_quality,
                # Named only when not the original recipe: existing captions keep their
                # fingerprint; choosing "draft" (other pixels) is a swap.
                **({"resize": resize} if resize != "lanczos" else {}),
            },
        )

    @property
    def server_max_pixels(self) -> int:
        """The area the server's processor fits a passed-through image into
        (``resize="server"``): that of a 4:3 image whose long side is ``max_side``."""
        return self.max_side * self.max_side * 3 // 4

    def image_url(self, item: CaptionInput) -> DataURL:
        """The JPEG data URL sent for an input (bounded side, fixed quality; with
        ``resize="server"`` the ingested JPEG itself where a server decodes it alike)."""
        if self.resize == "server" and isinstance(item.image, bytes | bytearray | memoryview):
            data = bytes(item.image)
            return prepare_caption_url(item.key, data, self.max_side, self.jpeg_quality, "server")
        resize = "draft" if self.resize == "server" else self.resize
        img = load_caption_image(item, self.max_side, resize)
        return image_to_data_url(img, self.jpeg_quality)

    def request_body(self, url: DataURL) -> dict[str, Any]:
        """The chat-completions body for one image (public so it can be inspected)."""
        return {
            "model": self.model,
            "messages": [
                {"role": "system", "content": CAPTION_SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": CAPTION_USER_PROMPT},
                    ],
                },
            ],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            # vLLM's per-request processor arguments: bound the area it resizes a
            # passed-through original to (an image prepared here is already smaller).
            **(
                {"mm_processor_kwargs": {"max_pixels": self.server_max_pixels}}
                if self.resize == "server"
                else {}
            ),
        }

    def prepare(self, item: CaptionInput) -> tuple[str, str]:
        """(key, data URL) of one input: the CPU part of a request, run ahead of the requests."""
        if not isinstance(item, CaptionInput):
            raise BackendInputError(None, f"expected CaptionInput, got {type(item).__name__}")
        return item.key, self.image_url(item)

    def _one(self, job: tuple[str, str], cancel: threading.Event) -> CaptionResult:
        key, data_url = job
        body = self.request_body(data_url)

        def parse(data: dict[str, Any]) -> tuple[str, str | None]:
            content, finish = message_text(data)
            text = clean_caption(content)
            if not text:
                raise EmptyContentError("completion content is empty")
            return text, finish

        text, finish = self._client.complete(body, parse, label=f"caption {key}", cancel=cancel)
        return CaptionResult(
            key=key,
            caption=text,
            kind=self.identity.kind,
            model_id=self.model,
            prompt_version=CAPTION_PROMPT_VERSION,
            finish_reason=finish,
        )

    def caption_stream(
        self, images: Iterable[CaptionInput], pool: WorkerPool | None = None
    ) -> Iterator[CaptionResult]:
        """Captions of ``images`` (read lazily), in input order, as they come back.

        Each image is prepared (decoded, resized, JPEG-encoded) ahead of the requests, on
        ``prepare_workers`` threads here or, given a worker ``pool`` (``core/workers``:
        processes, or Ray actors on a cluster), there (image bytes only), and sent as soon as
        it is ready through the client's bounded window (:meth:`OpenAIChatClient.stream`):
        the fleet never waits for a chunk to be prepared or for a chunk's slowest request.
        A bad image or a failed request fails the stream (the caller keeps nothing); results
        already yielded are then void.
        """
        if pool is None:
            return self._client.stream(
                self._one, images, prepare=self.prepare, prepare_workers=self.prepare_workers
            )
        return self._client.stream(self._one, self._pool_prepared(images, pool))

    def _pool_prepared(
        self, images: Iterable[CaptionInput], pool: WorkerPool
    ) -> Iterator[tuple[str, str]]:
        keys: deque[str] = deque()  # the pool answers in order: the key of each answer

        def jobs() -> Iterator[PrepareJob]:
            for item in images:
                if not isinstance(item, CaptionInput):
                    raise BackendInputError(
                        None, f"expected CaptionInput, got {type(item).__name__}"
                    )
                if not isinstance(item.image, bytes | bytearray | memoryview):
                    raise BackendInputError(item.key, "a worker pool prepares image bytes only")
                keys.append(item.key)
                yield item.key, bytes(item.image), self.max_side, self.jpeg_quality, self.resize

        for out in pool.map_ordered(prepare_caption_job, jobs()):
            key = keys.popleft()
            if isinstance(out, ItemFailed):
                raise BackendInputError(key, f"preparation failed: {out.error}")
            if out[0] != key:
                raise BackendInputError(key, f"the pool answered for {out[0]!r} instead")
            yield out

    def caption(self, images: Sequence[CaptionInput]) -> list[CaptionResult]:
        return list(self.caption_stream(check_caption_inputs(images)))


class TransformersCaptioner:
    """A local VLM via ``AutoProcessor`` + ``AutoModelForImageTextToText``.

    ``model_id`` is a hub id or a local directory. bf16 on CUDA, float32 on CPU; greedy
    decoding by default; batches are left-padded so every row's new tokens start at the
    same column and only those are decoded.
    """

    def __init__(
        self,
        model_id: str | Path = DEFAULT_VLM_ID,
        *,
        max_new_tokens: int = 384,
        do_sample: bool = False,
        batch_size: int = 8,
        max_side: int = 1024,
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        if max_new_tokens < 1 or batch_size < 1:
            raise BackendConfigError("max_new_tokens and batch_size must be >= 1")
        self.model_id = str(model_id)
        self.max_new_tokens = max_new_tokens
        self.do_sample = do_sample
        self.batch_size = batch_size
        self.max_side = max_side
        self._device = device
        self._dtype = dtype
        self._model: Any = None
        self._processor: Any = None
        self._lock = threading.Lock()
        self.identity = BackendIdentity.create(
            kind="transformers_vlm",
            model_id=self.model_id,
            prompt_version=CAPTION_PROMPT_VERSION,
            prompt_hash=CAPTION_PROMPT_HASH,
            params={"max_new_tokens": max_new_tokens, "do_sample": do_sample, "max_side": max_side},
        )

    def __repr__(self) -> str:
        return (
            f"TransformersCaptioner(model_id={self.model_id!r}, "
            f"fingerprint={self.identity.fingerprint()!r})"
        )

    def _load(self) -> tuple[Any, Any]:
        with self._lock:
            if self._model is None:
                from transformers import AutoModelForImageTextToText, AutoProcessor

                processor, model = load_pretrained(
                    AutoProcessor,
                    AutoModelForImageTextToText,
                    self.model_id,
                    self._device,
                    self._dtype,
                    "VLM",
                )
                processor.tokenizer.padding_side = "left"
                self._processor, self._model = processor, model
            return self._processor, self._model

    @property
    def device(self) -> str:
        return str(self._load()[1].device)

    def caption(self, images: Sequence[CaptionInput]) -> list[CaptionResult]:
        items = check_caption_inputs(images)
        if not items:
            return []
        pixels = [load_caption_image(item, self.max_side) for item in items]
        processor, model = self._load()
        out: list[CaptionResult] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            texts = self._generate(processor, model, pixels[start : start + self.batch_size])
            for item, (text, finish) in zip(chunk, texts, strict=True):
                if not text:
                    raise EmptyContentError(f"caption {item.key}: the model generated no text")
                out.append(
                    CaptionResult(
                        key=item.key,
                        caption=text,
                        kind=self.identity.kind,
                        model_id=self.model_id,
                        prompt_version=CAPTION_PROMPT_VERSION,
                        finish_reason=finish,
                    )
                )
        return out

    def _generate(
        self, processor: Any, model: Any, imgs: list[Image.Image]
    ) -> list[tuple[str, str]]:
        import torch

        messages = [
            {"role": "system", "content": CAPTION_SYSTEM_PROMPT},
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": CAPTION_USER_PROMPT}],
            },
        ]
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(
            text=[prompt] * len(imgs), images=imgs, padding=True, return_tensors="pt"
        ).to(model.device)
        gen_kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
        }
        if not self.do_sample:  # silence the checkpoint's sampling defaults under greedy
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            generated = model.generate(**inputs, **gen_kwargs)
        new_tokens = generated[:, inputs["input_ids"].shape[1] :]
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        decoded = processor.batch_decode(new_tokens, skip_special_tokens=True)
        results = []
        for row, text in zip(new_tokens.tolist(), decoded, strict=True):
            finish = "stop" if eos_ids.intersection(row) else "length"
            results.append((clean_caption(text), finish))
        return results


def resolve_device_dtype(device: str | None, dtype: str | None) -> tuple[str, Any]:
    """CUDA + bf16 when available, else CPU + float32 (bf16 matmuls are slow on CPU)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    try:
        torch_dtype = getattr(torch, dtype)
    except AttributeError:
        raise BackendConfigError(f"unknown torch dtype {dtype!r}") from None
    if not isinstance(torch_dtype, torch.dtype):
        raise BackendConfigError(f"unknown torch dtype {dtype!r}")
    return device, torch_dtype


class AltTextCaptioner:
    """The offline fallback: the source's alt text, flagged as such.

    Whitespace is collapsed; a missing or blank alt text gives an empty caption with
    ``reason="no_alt_text"`` (the caller decides whether to keep such rows).
    """

    def __init__(self) -> None:
        self.identity = BackendIdentity.create(
            kind="alt_text",
            model_id=ALT_TEXT_MODEL_ID,
            params={"normalise_whitespace": True},
        )

    def __repr__(self) -> str:
        return f"AltTextCaptioner(fingerprint={self.identity.fingerprint()!r})"

    def caption(self, images: Sequence[CaptionInput]) -> list[CaptionResult]:
        out = []
        for item in check_caption_inputs(images):
            alt = item.alt_text
            if alt is not None and not isinstance(alt, str):
                raise BackendInputError(
                    item.key, f"alt_text must be str or None, got {type(alt).__name__}"
                )
            text = " ".join((alt or "").split())
            out.append(
                CaptionResult(
                    key=item.key,
                    caption=text,
                    kind="alt_text",
                    model_id=ALT_TEXT_MODEL_ID,
                    prompt_version=self.identity.prompt_version,
                    is_fallback=True,
                    reason=None if text else "no_alt_text",
                )
            )
        return out


def load_pretrained(
    preprocessor_cls: Any,
    model_cls: Any,
    model_id: str,
    device: str | None,
    dtype: str | None,
    what: str,
) -> tuple[Any, Any]:
    """A preprocessor (processor or tokenizer) and an eval-mode model on the chosen device.

    Shared by the local backends so a missing or broken checkpoint is one clear
    ``BackendConfigError`` whichever backend loads it.
    """
    device, torch_dtype = resolve_device_dtype(device, dtype)
    try:
        preprocessor = preprocessor_cls.from_pretrained(model_id)
        model = model_cls.from_pretrained(model_id, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise BackendConfigError(
            f"cannot load {what} {model_id!r}: {type(exc).__name__}: {exc}"
        ) from exc
    model.to(device).eval()
    return preprocessor, model
