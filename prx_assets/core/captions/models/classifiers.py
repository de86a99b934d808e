"""Caption classifiers: which of ``visual`` / ``text`` / ``nsfw`` a caption describes.

Three backends, one output (:class:`ClassProbs`, probabilities over :data:`LABELS`):

- :class:`TransformersClassifier` scores each label as a continuation of a fixed,
  versioned prompt with a local causal LM (default ``Qwen/Qwen3-8B``).
- :class:`OpenAIClassifier` asks an OpenAI-compatible server for the first answer token's
  ``top_logprobs``; when the server gives none it falls back to a constrained choice.
- :class:`EmbeddingClassifier` is the offline fallback: zero-shot cosine similarity of
  MiniLM sentence embeddings against label descriptions.

Why label scores are normalised by length: a label's summed log-probability is the
log-probability of *all* its tokens, and every extra token adds another negative term.
A label that tokenises into three pieces (``"ns" "f" "w"``) is then penalised against a
one-token label (``"text"``) for its spelling, not its meaning. The default score is the
mean log-probability per label token (``score="mean"``); ``score="first"`` uses only the
first token, which needs labels with distinct first tokens (true for these three).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Unpack

import numpy as np

from prx_assets.core.captions.models.base import (
    LABELS,
    BackendConfigError,
    BackendIdentity,
    BackendInputError,
    BackendRequestError,
    ClassProbs,
    MalformedResponseError,
    check_texts,
    softmax,
)
from prx_assets.core.captions.models.embeddings import MiniLMEmbedder
from prx_assets.core.captions.models.openai_http import (
    ClientOptions,
    OpenAIBackend,
    message_text,
)
from prx_assets.core.captions.models.prompts import (
    CLASSIFIER_PROMPT_HASH,
    CLASSIFIER_PROMPT_VERSION,
    EMBEDDING_LABEL_DESCRIPTIONS,
    EMBEDDING_LABELS_HASH,
    EMBEDDING_LABELS_VERSION,
    _short_hash,
    classifier_prompt,
)

DEFAULT_LM_ID = "Qwen/Qwen3-8B"
CLASSIFIER_API_KEY_ENV = ("PRX_CLASSIFIER_API_KEY", "OPENAI_API_KEY")
CLASSIFIER_BASE_URL_ENV = ("PRX_CLASSIFIER_BASE_URL", "OPENAI_BASE_URL")

ScoreMode = Literal["mean", "first", "sum"]


def label_score(token_logprobs: Sequence[float], how: ScoreMode = "mean") -> float:
    """One label's score from the log-probs of its tokens.

    ``"sum"`` (the joint log-probability) is offered only for comparison: it favours the
    label with the fewest tokens (see the module docstring).
    """
    if len(token_logprobs) == 0:
        raise ValueError("a label has at least one token")
    if how == "mean":
        return float(sum(token_logprobs) / len(token_logprobs))
    if how == "first":
        return float(token_logprobs[0])
    if how == "sum":
        return float(sum(token_logprobs))
    raise ValueError(f"unknown score mode {how!r}; use 'mean', 'first' or 'sum'")


def probs_from_scores(scores: Sequence[float]) -> np.ndarray:
    """Softmax across the label scores."""
    return softmax(np.asarray(scores, dtype=np.float64))


# --------------------------------------------------------------------------- transformers


class TransformersClassifier:
    """Local causal LM (``AutoTokenizer`` + ``AutoModelForCausalLM``) label scoring.

    Each caption becomes the chat prompt of :data:`CLASSIFIER_PROMPT` (thinking disabled
    for Qwen3); each label's tokens are appended and scored in one left-padded forward
    pass (3 rows per caption, only the last few positions' logits materialised), then
    ``score`` normalises per label and a softmax gives probabilities.
    """

    def __init__(
        self,
        model_id: str | Path = DEFAULT_LM_ID,
        *,
        score: Literal["mean", "first"] = "mean",
        batch_size: int = 16,
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        if score not in ("mean", "first"):
            raise BackendConfigError(f"score must be 'mean' or 'first', got {score!r}")
        if batch_size < 1:
            raise BackendConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.model_id = str(model_id)
        self.score = score
        self.batch_size = batch_size
        self._device = device
        self._dtype = dtype
        self._tok: Any = None
        self._model: Any = None
        self._label_ids: list[list[int]] = []
        self._lock = threading.Lock()
        self.identity = BackendIdentity.create(
            kind="transformers_lm",
            model_id=self.model_id,
            prompt_version=CLASSIFIER_PROMPT_VERSION,
            prompt_hash=CLASSIFIER_PROMPT_HASH,
            params={"score": score, "labels": ",".join(LABELS)},
        )

    def __repr__(self) -> str:
        return (
            f"TransformersClassifier(model_id={self.model_id!r}, score={self.score!r}, "
            f"fingerprint={self.identity.fingerprint()!r})"
        )

    def _load(self) -> tuple[Any, Any]:
        with self._lock:
            if self._model is None:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                from prx_assets.core.captions.models.captioners import load_pretrained

                tok, model = load_pretrained(
                    AutoTokenizer,
                    AutoModelForCausalLM,
                    self.model_id,
                    self._device,
                    self._dtype,
                    "LM",
                )
                self._label_ids = [tok(lbl, add_special_tokens=False).input_ids for lbl in LABELS]
                if any(len(ids) == 0 for ids in self._label_ids):
                    raise BackendConfigError(f"{self.model_id}: a label tokenises to nothing")
                firsts = [ids[0] for ids in self._label_ids]
                if self.score == "first" and len(set(firsts)) != len(firsts):
                    raise BackendConfigError(
                        "score='first' needs labels with distinct first tokens"
                    )
                self._tok, self._model = tok, model
            return self._tok, self._model

    @property
    def label_token_ids(self) -> list[list[int]]:
        """Token ids of each label, as scored (after loading)."""
        self._load()
        return [list(ids) for ids in self._label_ids]

    def prompt_text(self, caption: str) -> str:
        """The exact text each label continues (chat template applied when there is one)."""
        tok, _ = self._load()
        user = classifier_prompt(caption)
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(
                [{"role": "user", "content": user}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
        return user + "\nAnswer: "

    def token_logprobs(self, captions: Sequence[str]) -> list[list[list[float]]]:
        """Per caption, per label: the log-prob of each label token after the prompt."""
        import torch

        items = check_texts(captions)
        tok, model = self._load()
        out: list[list[list[float]]] = []
        n_labels = len(LABELS)
        m = max(len(ids) for ids in self._label_ids)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            prompts = [tok(self.prompt_text(c), add_special_tokens=False).input_ids for c in chunk]
            seqs = [p + ids for p in prompts for ids in self._label_ids]
            width = max(len(s) for s in seqs)
            input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for r, s in enumerate(seqs):  # left padding: every label ends at the last column
                input_ids[r, width - len(s) :] = torch.tensor(s)
                mask[r, width - len(s) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                logits = model(
                    input_ids=input_ids.to(model.device),
                    attention_mask=mask.to(model.device),
                    position_ids=positions.to(model.device),
                    logits_to_keep=m + 1,
                ).logits
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            for i in range(len(chunk)):
                per_label = []
                for j, ids in enumerate(self._label_ids):
                    r = i * n_labels + j
                    n = len(ids)
                    # kept column c holds the prediction for sequence position width-m-1+c;
                    # label token t sits at width-n+t, so it is predicted by column m-n+t.
                    per_label.append([float(logprobs[r, m - n + t, ids[t]]) for t in range(n)])
                out.append(per_label)
        return out

    def classify(self, captions: Sequence[str]) -> list[ClassProbs]:
        items = check_texts(captions)
        if not items:
            return []
        method = "logprob_mean" if self.score == "mean" else "logprob_first_token"
        results = []
        for per_label in self.token_logprobs(items):
            scores = [label_score(lps, self.score) for lps in per_label]
            results.append(ClassProbs.from_array(probs_from_scores(scores), method, scores))
        return results


# --------------------------------------------------------------------------- OpenAI-compatible


def first_token_label_logprobs(top_logprobs: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """Per-label log-probs from the first answer token's ``top_logprobs``.

    A top-k entry counts for a label when its text (stripped, lower-cased) is a non-empty
    prefix of the label (``"vis"`` -> visual, ``" text"`` -> text); several matching
    surface forms are summed in probability space. A label absent from the top-k gets an
    upper bound: the smaller of the lowest listed log-prob and the log of the probability
    mass the top-k leaves over. Returns None when no label appears at all.
    """
    entries = []
    for e in top_logprobs:
        token, lp = e.get("token"), e.get("logprob")
        if isinstance(token, str) and isinstance(lp, int | float) and math.isfinite(lp):
            entries.append((token.strip().lower(), float(lp)))
    if not entries:
        return None
    found: list[float | None] = []
    for label in LABELS:
        lps = [lp for t, lp in entries if t and label.startswith(t)]
        found.append(float(np.logaddexp.reduce(lps)) if lps else None)
    if all(x is None for x in found):
        return None
    listed_mass = min(1.0, sum(math.exp(lp) for _, lp in entries))
    rest = math.log(max(1.0 - listed_mass, 1e-12))
    floor = min(min(lp for _, lp in entries), rest)
    return [x if x is not None else floor for x in found]


class OpenAIClassifier(OpenAIBackend):
    """Label probabilities from an OpenAI-compatible server (vLLM/SGLang).

    ``mode="auto"`` (default): ask for one token with ``logprobs: true, top_logprobs: k``
    and score labels from that first token (``method="logprob_first_token"``); if the
    server returns no usable logprobs, or rejects the request (400/422), ask again with a
    constrained choice and report a one-hot result (``method="constrained_choice"``).
    ``mode="logprobs"`` never falls back; ``mode="choice"`` always constrains. The choice
    is sent as vLLM's ``structured_outputs: {"choice": [...]}`` or, for older servers,
    ``guided_choice`` (``choice_field="guided_choice"``). ``client``: timeouts, retries and
    concurrency (``ClientOptions``).
    """

    BASE_URL_ENV = CLASSIFIER_BASE_URL_ENV
    API_KEY_ENV = CLASSIFIER_API_KEY_ENV
    CLIENT_DEFAULTS: ClassVar[ClientOptions] = {"timeout_s": 60.0, "max_concurrency": 16}

    def __init__(
        self,
        model: str = DEFAULT_LM_ID,
        *,
        base_url: str | Sequence[str] | None = None,
        api_key: str | None = None,
        mode: Literal["auto", "logprobs", "choice"] = "auto",
        top_logprobs: int = 10,
        choice_field: Literal["structured_outputs", "guided_choice"] = "structured_outputs",
        enable_thinking: bool | None = False,
        **client: Unpack[ClientOptions],
    ) -> None:
        if mode not in ("auto", "logprobs", "choice"):
            raise BackendConfigError(f"mode must be auto/logprobs/choice, got {mode!r}")
        if choice_field not in ("structured_outputs", "guided_choice"):
            raise BackendConfigError(f"unknown choice_field {choice_field!r}")
        if not 1 <= top_logprobs <= 20:
            raise BackendConfigError(f"top_logprobs must be in 1..20, got {top_logprobs}")
        self.model = model
        self.mode = mode
        self.top_logprobs = top_logprobs
        self.choice_field = choice_field
        self.enable_thinking = enable_thinking
        self._logprobs_ok = mode != "choice"
        self._connect(base_url, api_key, client)
        self.identity = BackendIdentity.create(
            kind="openai_lm",
            model_id=model,
            prompt_version=CLASSIFIER_PROMPT_VERSION,
            prompt_hash=CLASSIFIER_PROMPT_HASH,
            params={
                "mode": mode,
                "top_logprobs": top_logprobs,
                "choice_field": choice_field,
                "enable_thinking": enable_thinking,
                "labels": ",".join(LABELS),
            },
        )

    def _repr_extra(self) -> str:
        return f", mode={self.mode!r}"

    def _base_body(self, caption: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": classifier_prompt(caption)}],
            "temperature": 0.0,
        }
        if self.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.enable_thinking}
        return body

    def logprobs_body(self, caption: str) -> dict[str, Any]:
        body = self._base_body(caption)
        body.update(max_tokens=1, logprobs=True, top_logprobs=self.top_logprobs)
        return body

    def choice_body(self, caption: str) -> dict[str, Any]:
        body = self._base_body(caption)
        body["max_tokens"] = 8
        if self.choice_field == "structured_outputs":
            body["structured_outputs"] = {"choice": list(LABELS)}
        else:
            body["guided_choice"] = list(LABELS)
        return body

    def _by_logprobs(self, caption: str, label: str, cancel: threading.Event) -> ClassProbs | None:
        def parse(data: dict[str, Any]) -> list[float] | None:
            message_text(data)  # validates the choices structure
            lp = data["choices"][0].get("logprobs")
            content = lp.get("content") if isinstance(lp, dict) else None
            if not content:
                self._logprobs_ok = self.mode == "logprobs"  # unsupported: stop asking
                return None
            first = content[0] if isinstance(content[0], dict) else {}
            tops = list(first.get("top_logprobs") or [])
            if "token" in first and "logprob" in first:
                tops.append({"token": first["token"], "logprob": first["logprob"]})
            # the chosen token is usually also in top_logprobs: de-duplicate by token text
            seen: dict[str, Any] = {}
            for e in tops:
                if isinstance(e, dict):
                    seen.setdefault(str(e.get("token")), e)
            return first_token_label_logprobs(list(seen.values()))

        scores = self._client.complete(
            self.logprobs_body(caption), parse, label=f"classify {label}", cancel=cancel
        )
        if scores is None:
            return None
        return ClassProbs.from_array(probs_from_scores(scores), "logprob_first_token", scores)

    def _by_choice(self, caption: str, label: str, cancel: threading.Event) -> ClassProbs:
        def parse(data: dict[str, Any]) -> str:
            content, _ = message_text(data)
            answer = content.strip().strip(".").lower()
            if answer not in LABELS:
                raise MalformedResponseError(f"answer {content[:40]!r} is not one of {LABELS}")
            return answer

        answer = self._client.complete(
            self.choice_body(caption), parse, label=f"classify {label}", cancel=cancel
        )
        return ClassProbs.from_array(
            [1.0 if lbl == answer else 0.0 for lbl in LABELS], "constrained_choice"
        )

    def _one(self, job: tuple[int, str], cancel: threading.Event) -> ClassProbs:
        i, caption = job
        label = f"caption #{i}"
        if self._logprobs_ok:
            try:
                result = self._by_logprobs(caption, label, cancel)
            except BackendRequestError as exc:
                if self.mode == "logprobs" or exc.status not in (400, 422):
                    raise
                self._logprobs_ok = False  # the server rejects logprobs: stop asking
                result = None
            if result is not None:
                return result
            if self.mode == "logprobs":
                raise MalformedResponseError(f"{label}: the server returned no label logprobs")
        return self._by_choice(caption, label, cancel)

    def classify_stream(self, captions: Iterable[str]) -> Iterator[ClassProbs]:
        """Classes of ``captions`` (read lazily), in input order, through the client's
        bounded window: no chunk barrier, so a text fleet stays busy (fail-fast as
        :meth:`classify`)."""

        def jobs() -> Iterator[tuple[int, str]]:
            for i, caption in enumerate(captions):
                if not isinstance(caption, str):
                    raise BackendInputError(
                        f"item {i}", f"expected str, got {type(caption).__name__}"
                    )
                yield i, caption

        return self._client.stream(self._one, jobs())

    def classify(self, captions: Sequence[str]) -> list[ClassProbs]:
        items = check_texts(captions)
        return self._client.map(self._one, list(enumerate(items)))


# --------------------------------------------------------------------------- embedding fallback


class EmbeddingClassifier:
    """Offline zero-shot fallback on MiniLM sentence embeddings (kind ``"embedding"``).

    Each label's prototype is the normalised mean embedding of its descriptions
    (:data:`EMBEDDING_LABEL_DESCRIPTIONS`); a caption's cosine similarity to the three
    prototypes, divided by ``temperature``, goes through a softmax. Results are flagged
    ``is_fallback=True``: this is a coarse filter, not a substitute for the LM classifier.
    """

    def __init__(
        self,
        embedder: MiniLMEmbedder | None = None,
        *,
        temperature: float = 0.05,
        descriptions: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        if not temperature > 0:
            raise BackendConfigError(f"temperature must be > 0, got {temperature}")
        self.embedder = embedder or MiniLMEmbedder()
        self.temperature = float(temperature)
        if descriptions is None:
            descs = {k: tuple(v) for k, v in EMBEDDING_LABEL_DESCRIPTIONS.items()}
            version, digest = EMBEDDING_LABELS_VERSION, EMBEDDING_LABELS_HASH
        else:
            if set(descriptions) != set(LABELS):
                raise BackendConfigError(
                    f"descriptions must have exactly the labels {LABELS}, got {sorted(descriptions)}"
                )
            descs = {k: tuple(descriptions[k]) for k in LABELS}
            version = "custom"
            digest = _short_hash(*(f"{k}={d}" for k in LABELS for d in descs[k]))
        if set(descs) != set(LABELS) or any(not descs[k] for k in LABELS):
            raise BackendConfigError(f"descriptions need at least one text for each of {LABELS}")
        self.descriptions = descs
        self._prototypes: np.ndarray | None = None
        self.identity = BackendIdentity.create(
            kind="embedding",
            model_id=self.embedder.identity.model_id,
            prompt_version=version,
            prompt_hash=digest,
            params={"temperature": self.temperature, "aggregate": "prototype_mean"},
        )

    def __repr__(self) -> str:
        return (
            f"EmbeddingClassifier(model_id={self.identity.model_id!r}, "
            f"temperature={self.temperature}, fingerprint={self.identity.fingerprint()!r})"
        )

    @property
    def prototypes(self) -> np.ndarray:
        """(3, dim) unit vectors, one per label, in :data:`LABELS` order."""
        if self._prototypes is None:
            rows = []
            for label in LABELS:
                mean = self.embedder.embed(list(self.descriptions[label])).mean(axis=0)
                rows.append(mean / np.linalg.norm(mean))
            self._prototypes = np.stack(rows).astype(np.float32)
        return self._prototypes

    def similarities(self, captions: Sequence[str]) -> np.ndarray:
        """(n, 3) cosine similarities to the label prototypes."""
        items = check_texts(captions)
        if not items:
            return np.zeros((0, len(LABELS)), dtype=np.float32)
        return self.embedder.embed(items) @ self.prototypes.T

    def classify(self, captions: Sequence[str]) -> list[ClassProbs]:
        sims = self.similarities(captions)
        probs = softmax(sims.astype(np.float64) / self.temperature, axis=1)
        return [
            ClassProbs.from_array(p, "embedding_cosine", s, is_fallback=True)
            for p, s in zip(probs, sims, strict=True)
        ]
