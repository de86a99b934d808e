"""How ``mds_shards`` writes a partition: ``ShardSettings`` and the piece size.

A module below both ``pieces`` (which renders with them) and ``runner`` (which builds them
from the asset's config), so that neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS
from prx_assets.core.shards.mds import DEFAULT_SIZE_LIMIT
from prx_assets.core.shards.resize import RESAMPLE

#: Samples per piece: the unit of work of one task and the largest a shard gets (fewer when
#: ``size_limit`` cuts it first). Part of the output layout: changing it changes the
#: shard boundaries (and so the bytes), never what a sample holds.
PIECE_SAMPLES = 256  # ~40-75 MB at 1024 px: the shard size streaming is built for, ~4 M
# shards per 10^9 samples (64 gave ~16 M); a 100k-image batch still makes ~400 pieces


@dataclass(frozen=True)
class ShardSettings:
    """How shards are written (size, resample, reads, workers) and judged (hazard rule).

    ``workers``: processes rendering the partition's images (None: every CPU this process
    may use); ``executor``: the pool kind (None: ``$PRX_EXECUTOR``, see ``core/workers.py``).
    Neither changes a byte of the output. ``piece_samples`` does: it is how many consecutive
    samples of a bucket one worker task renders into its own shard file(s).
    """

    size_limit: int = DEFAULT_SIZE_LIMIT
    resample: str = RESAMPLE
    max_render_failures: int = 20
    read_chunk: int = 32
    workers: int | None = None
    executor: str | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    canonical_nodes: int = 64  # the small-bucket rule: loader canonical nodes ...
    device_batch_size: int = 1  # ... and per-device batch size it is judged against
    # Samples per worker task, and at most per shard (core/shards/pieces.py): this one is
    # part of the output layout (shard boundaries), unlike workers and executor.
    piece_samples: int = PIECE_SAMPLES
