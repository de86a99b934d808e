"""The end of `make demo`: a training-style loop over the shards, as a trainer would run it.

It uses only ``prx_assets.loader`` (no Dagster): single-shape batches with skip-lists
applied, images decoded to tensors and captions turned into text latents on the fly by a
small text encoder (a randomly initialised BERT built offline: the demo has no weights
to download; swap in any transformers encoder without touching the data). It checks that
no sample the skip-lists exclude is ever yielded.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

from prx_assets.core.lab import Lab


def run_training_loop(shards_root: str, lab: Lab, batch_size: int = 4, epochs: int = 1) -> dict:
    """One pass of the loader over ``shards_root``, on one torch thread; what it yielded.

    The caller's torch thread count is restored afterwards: it is process state, and a model
    run later in the same process (e.g. the caption classifier) must not inherit ours.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(shards_root, lab, batch_size, epochs)
    finally:
        torch.set_num_threads(threads)


def _train(shards_root: str, lab: Lab, batch_size: int, epochs: int) -> dict:
    from transformers import AutoModel, AutoTokenizer

    from prx_assets.loader import (
        HFTextEncoder,
        ImageTextCollate,
        ShapeBatchedLoader,
        SmallBucketWarning,
        discover_streams,
    )
    from prx_assets.loader.offline_encoder import build_offline_bert

    excluded: set[str] = set()
    if lab.exists("skip_audit"):
        audit = lab.read("skip_audit", ["key", "excluded"], "excluded = true")
        excluded = set(audit.column("key").to_pylist())
    captions = lab.read("captions", ["caption"]).column("caption").to_pylist()
    words = {w for c in captions if c for w in c.split()}
    with tempfile.TemporaryDirectory() as tmp:
        enc_dir = build_offline_bert(Path(tmp) / "text-encoder", sorted(words))
        encoder = HFTextEncoder(
            AutoModel.from_pretrained(enc_dir), AutoTokenizer.from_pretrained(enc_dir)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            buckets = discover_streams(shards_root, cache_dir=Path(tmp) / "cache")
            loader = ShapeBatchedLoader(
                buckets,
                batch_size=batch_size,
                collate_fn=ImageTextCollate(encoder),
                num_canonical_nodes=1,
            )
        small = [w for w in caught if issubclass(w.category, SmallBucketWarning)]
        seen: list[str] = []
        shapes: set[tuple[int, ...]] = set()
        started = time.perf_counter()
        for _ in range(epochs):
            for batch in loader:
                shapes.add(tuple(batch["image"].shape[1:]))
                seen.extend(batch["key"])
        elapsed = time.perf_counter() - started
    leaked = sorted(set(seen) & excluded)
    return {
        "samples": len(seen),
        "unique_samples": len(set(seen)),
        "samples_per_s": len(seen) / elapsed if elapsed else 0.0,
        "batch_shapes": len(shapes),
        "excluded_keys": len(excluded),
        "small_bucket_warnings": len(small),
        "other_warnings": [str(w.message) for w in caught if w not in small],
        "skipped_sample_yielded": leaked,
    }
