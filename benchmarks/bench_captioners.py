"""Throughput of the offline caption backends.

- EmbeddingClassifier captions/s at batch 64 against MiniLMEmbedder.embed alone on the
  same captions (ratio = the classifier's overhead over the embedding it is built on);
- AltTextCaptioner images/s against a bare whitespace-normalising loop (ratio = the cost
  of validation and provenance);
- TransformersCaptioner images/s, only where a CUDA device is present (skipped otherwise).

Runs are interleaved and repeated; the median is reported. ``--quick`` for small sizes.

    python -m benchmarks.bench_captioners [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from prx_assets.core.captions.models import (  # noqa: E402
    AltTextCaptioner,
    CaptionInput,
    EmbeddingClassifier,
    MiniLMEmbedder,
)

RESULTS = Path(__file__).parent / "results" / "bench_captioners.json"
BATCH = 64

_WORDS = (
    "a close-up photograph of a red brick wall with soft window light warm tones shallow depth "
    "field wooden table white ceramic cup coffee latte art viewed from above grey wool blanket "
    "screenshot document paragraphs small black text heading numbered list scanned page "
    "landscape mountains lake sunrise pine trees clouds reflection watermark logo corner blur "
    "noise grain overexposed sky street cars pedestrians umbrellas rain night neon signs"
).split()


def synthetic_captions(n: int, words: int = 120, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) + "." for _ in range(n)]


def _batched(fn: Callable[[list], object], items: list, batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        fn(items[i : i + batch])
    return time.perf_counter() - start


def bench_embedding(n: int, reps: int) -> dict[str, float]:
    embedder = MiniLMEmbedder(device="cpu", batch_size=BATCH)
    clf = EmbeddingClassifier(embedder)
    captions = synthetic_captions(n)
    clf.classify(captions[:BATCH])  # load the model, build the prototypes, warm up
    t_embed, t_clf = [], []
    for _ in range(reps):
        t_embed.append(_batched(embedder.embed, captions, BATCH))
        t_clf.append(_batched(clf.classify, captions, BATCH))
    embed_s, clf_s = statistics.median(t_embed), statistics.median(t_clf)
    return {
        "n_captions": n,
        "batch": BATCH,
        "embedder_captions_per_s": n / embed_s,
        "classifier_captions_per_s": n / clf_s,
        "classifier_over_embedder_time_ratio": clf_s / embed_s,
    }


def bench_alt_text(n: int, reps: int) -> dict[str, float]:
    root = resources.files("prx_assets") / "demo" / "photos"
    photos = [p.read_bytes() for p in root.iterdir() if p.name.endswith((".png", ".jpg"))]
    alts = synthetic_captions(n, words=12, seed=1)
    inputs = [
        CaptionInput(
            key=f"k{i}", image=photos[i % len(photos)], alt_text=alts[i] if i % 7 else None
        )
        for i in range(n)
    ]
    cap = AltTextCaptioner()

    def baseline(items: list[CaptionInput]) -> list[str]:
        return [" ".join((item.alt_text or "").split()) for item in items]

    t_base, t_cap = [], []
    for _ in range(reps):
        t_base.append(_batched(baseline, inputs, BATCH))
        t_cap.append(_batched(cap.caption, inputs, BATCH))
    base_s, cap_s = statistics.median(t_base), statistics.median(t_cap)
    return {
        "n_images": n,
        "alt_text_images_per_s": n / cap_s,
        "baseline_images_per_s": n / base_s,
        "alt_text_over_baseline_time_ratio": cap_s / base_s,
    }


def bench_transformers(n: int) -> dict[str, object]:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from prx_assets.core.captions.models import TransformersCaptioner

    root = resources.files("prx_assets") / "demo" / "photos"
    photos = [p.read_bytes() for p in root.iterdir() if p.name.endswith((".png", ".jpg"))]
    inputs = [CaptionInput(key=f"k{i}", image=photos[i % len(photos)]) for i in range(n)]
    cap = TransformersCaptioner(max_new_tokens=256, batch_size=8)
    try:
        cap.caption(inputs[:2])  # load + warm-up
    except Exception as exc:  # noqa: BLE001 - report, do not crash the other numbers
        return {"skipped": f"model not loadable here: {type(exc).__name__}: {exc}"[:300]}
    start = time.perf_counter()
    results = cap.caption(inputs)
    elapsed = time.perf_counter() - start
    return {
        "n_images": n,
        "model_id": cap.model_id,
        "images_per_s": n / elapsed,
        "mean_words": statistics.mean(len(r.caption.split()) for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = parser.parse_args()
    n_emb, n_alt, reps = (128, 2_000, 3) if args.quick else (512, 20_000, 3)

    emb = bench_embedding(n_emb, reps)
    alt = bench_alt_text(n_alt, reps)
    vlm = bench_transformers(16 if args.quick else 64)

    print(f"{'backend':<34}{'items/s':>12}{'baseline/s':>14}{'time ratio':>12}")
    print(
        f"{'EmbeddingClassifier (batch 64)':<34}{emb['classifier_captions_per_s']:>12.1f}"
        f"{emb['embedder_captions_per_s']:>14.1f}"
        f"{emb['classifier_over_embedder_time_ratio']:>12.3f}"
    )
    print(
        f"{'AltTextCaptioner':<34}{alt['alt_text_images_per_s']:>12.0f}"
        f"{alt['baseline_images_per_s']:>14.0f}{alt['alt_text_over_baseline_time_ratio']:>12.2f}"
    )
    if "skipped" in vlm:
        print(f"{'TransformersCaptioner':<34} skipped: {vlm['skipped']}")
    else:
        print(f"{'TransformersCaptioner':<34}{vlm['images_per_s']:>12.2f}")
    print("baselines: MiniLMEmbedder.embed alone; a bare alt-text whitespace loop")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "quick": args.quick,
        "embedding_classifier": emb,
        "alt_text": alt,
        "transformers_captioner": vlm,
    }
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
