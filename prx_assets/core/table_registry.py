"""Every lab table, for maintenance and docs (stage modules own their specs)."""

from __future__ import annotations

from prx_assets.core.caption_tables import CAPTION_EMBEDDINGS
from prx_assets.core.dedup_tables import DEDUP_DIRTY, DEDUP_STATE, IMAGE_HASHES, PHASH_CLUSTERS
from prx_assets.core.lab import TableSpec
from prx_assets.core.optouts import OPT_OUT_LISTS, OPT_OUTS
from prx_assets.core.shard_tables import BUCKET_ASSIGNMENTS, SHARD_SAMPLES
from prx_assets.core.skip_policy import SKIP_AUDIT, SKIP_DIRTY
from prx_assets.core.tables import ALL_TABLES

LAB_TABLES: tuple[TableSpec, ...] = (
    *ALL_TABLES,
    CAPTION_EMBEDDINGS,
    IMAGE_HASHES,
    PHASH_CLUSTERS,
    DEDUP_DIRTY,
    DEDUP_STATE,
    BUCKET_ASSIGNMENTS,
    SHARD_SAMPLES,
    OPT_OUTS,
    OPT_OUT_LISTS,
    SKIP_AUDIT,
    SKIP_DIRTY,
)
