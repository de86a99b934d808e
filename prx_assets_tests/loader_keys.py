"""What the training loader yields from a shard tree: the check every skip test ends with."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

from prx_assets_tests.streaming_memory import streaming_memory_released


def loader_keys(shards_root: Path | str) -> list[str]:
    """Every key the default loader yields from ``shards_root`` (sidecars honoured), in order."""
    from prx_assets.loader import ShapeBatchedLoader, discover_streams

    with warnings.catch_warnings(), streaming_memory_released():
        warnings.simplefilter("ignore")  # tiny buckets: small-bucket warnings are expected
        buckets = discover_streams(shards_root)
        if not buckets:  # every sample of every bucket skipped: nothing to yield
            return []
        loader = ShapeBatchedLoader(buckets, batch_size=1, shuffle=False, num_canonical_nodes=1)
        keys = [k for batch in loader for k in batch["key"]]
        del loader  # inside the block: its shared memory is released on the way out
    gc.collect()
    return keys
