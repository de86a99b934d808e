"""Collate: JPEG bytes → one image tensor, captions → text latents from a pluggable encoder.

Text latents are computed on the fly rather than stored in the shards, so swapping the text
encoder (another checkpoint, pooling or sequence length) needs no data rewrite: the shards
keep only captions. The encoder is any callable ``captions -> (latents, attention_mask)``;
``HFTextEncoder`` wraps a transformers ``AutoTokenizer`` + ``AutoModel`` with either the
last hidden state ``(B, L, D)`` (what cross-attention conditioning wants) or a masked mean
``(B, D)``. Padding to ``max_length`` by default keeps the latent shape fixed across batches.

Images are decoded with the project's one decoding policy (``core.decode``), so training
sees the same pixels (orientation, colour conversion) that ingest validated. A batch mixing
shapes is an error here: it means the batches were not built by shape.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np
import torch
from PIL import Image

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS, decode_rgb, to_rgb

Pooling = Literal["last_hidden", "mean"]


class TextEncoder(Protocol):
    """Captions -> (latents, token mask): what the collator calls to encode text on the fly."""

    def __call__(self, captions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


class HFTextEncoder:
    """A transformers text model as a ``TextEncoder`` (inference mode, no gradients).

    ``pooling="last_hidden"``: latents ``(B, L, D)`` with the token ``attention_mask (B, L)``.
    ``pooling="mean"``: latents ``(B, D)``, the mean over real tokens; the token mask is still
    returned so callers can tell empty captions apart.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        pooling: Pooling = "last_hidden",
        max_length: int = 77,
        pad_to_max_length: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        if pooling not in ("last_hidden", "mean"):
            raise ValueError(f"pooling must be 'last_hidden' or 'mean', got {pooling!r}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.model = model.eval().to(device)
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_length = max_length
        self.pad_to_max_length = pad_to_max_length
        self.device = torch.device(device)

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> HFTextEncoder:
        """Load tokenizer and model by name or directory (offline: a saved directory)."""
        from transformers import AutoModel, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModel.from_pretrained(name_or_path)
        return cls(model, tokenizer, **kwargs)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def __call__(self, captions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizer(
            list(captions),
            padding="max_length" if self.pad_to_max_length else "longest",
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        ids = tokens["input_ids"].to(self.device)
        mask = tokens["attention_mask"].to(self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.pooling == "mean":
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            hidden = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return hidden, mask


def _to_array(value: Any, max_pixels: int) -> np.ndarray:
    if isinstance(value, bytes | bytearray | memoryview):
        img = decode_rgb(bytes(value), max_pixels=max_pixels)
    elif isinstance(value, Image.Image):  # an MDS 'jpeg' column decodes to a PIL image
        img, _ = to_rgb(value)
    else:
        raise TypeError(f"image column holds {type(value).__name__}, expected bytes or an image")
    return np.asarray(img, dtype=np.uint8)


class ImageTextCollate:
    """``DataLoader`` collate: ``{"image", "text_latents", "attention_mask", "key", "caption"}``.

    ``image`` is ``(B, 3, H, W)``, in [-1, 1] as ``dtype`` when ``normalize`` (else uint8).
    Without an encoder the text keys are absent. Other columns listed in ``extra_columns``
    are passed through as lists.
    """

    def __init__(
        self,
        encoder: TextEncoder | None = None,
        *,
        normalize: bool = True,
        dtype: torch.dtype = torch.float32,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        extra_columns: Sequence[str] = (),
    ) -> None:
        self.encoder = encoder
        self.normalize = normalize
        self.dtype = dtype
        self.max_pixels = max_pixels
        self.extra_columns = tuple(extra_columns)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        arrays = [_to_array(s["image"], self.max_pixels) for s in samples]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            keys = [s.get("key") for s in samples]
            raise ValueError(
                f"batch mixes image shapes {sorted(shapes)} (keys {keys[:4]}...): batches "
                f"must come from one bucket (use ShapeBatchedLoader)"
            )
        pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
        image = pixels.to(self.dtype) / 127.5 - 1.0 if self.normalize else pixels
        captions = [str(s["caption"]) for s in samples]
        batch: dict[str, Any] = {
            "image": image,
            "key": [str(s["key"]) for s in samples],
            "caption": captions,
        }
        if self.encoder is not None:
            latents, mask = self.encoder(captions)
            batch["text_latents"] = latents
            batch["attention_mask"] = mask
        for column in self.extra_columns:
            batch[column] = [s[column] for s in samples]
        return batch


def jpeg_bytes(img: Image.Image, quality: int = 90) -> bytes:
    """Encode an RGB image as JPEG bytes (helper for writers, tests and benchmarks)."""
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
