"""What the training loader yields from a shard tree: the check every skip test ends with."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path


def loader_keys(shards_root: Path) -> list[str]:
    """Every key the default loader yields from ``shards_root`` (sidecars honoured), in order."""
    from prx_assets.loader import ShapeBatchedLoader, discover_streams

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny buckets: small-bucket warnings are expected
        buckets = discover_streams(shards_root)
        if not buckets:  # every sample of every bucket skipped: nothing to yield
            return []
        loader = ShapeBatchedLoader(buckets, batch_size=1, shuffle=False, num_canonical_nodes=1)
        keys = [k for batch in loader for k in batch["key"]]
    del loader
    gc.collect()
    return keys
