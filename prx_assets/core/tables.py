"""Every lab table, in one registry: stages, the audit, maintenance and the browser read it.

Each stage owns its tables' schemas (``core/<stage>/tables.py``); this module only collects
them, so nothing else needs to know where a table is declared. Import a spec from here or
from its stage; the objects are the same.
"""

from __future__ import annotations

from prx_assets.core.captions.tables import CAPTION_CLASSES, CAPTION_EMBEDDINGS, CAPTIONS
from prx_assets.core.dedup.tables import DEDUP_DIRTY, DEDUP_STATE, IMAGE_HASHES, PHASH_CLUSTERS
from prx_assets.core.ingest.tables import IMAGES, REJECTS
from prx_assets.core.lab import VERSION_PINS, TableSpec
from prx_assets.core.resolution.tables import RESOLUTION
from prx_assets.core.shards.tables import BUCKET_ASSIGNMENTS, SHARD_SAMPLES
from prx_assets.core.skiplists.tables import (
    OPT_OUT_LISTS,
    OPT_OUT_PROBLEMS,
    OPT_OUTS,
    SKIP_AUDIT,
    SKIP_DIRTY,
)
from prx_assets.core.snapshots.tables import (
    SKIP_GENERATIONS,
    SNAPSHOT_DIRECTORIES,
    SNAPSHOT_SAMPLES,
    TRAINING_SNAPSHOTS,
)

LAB_TABLES: tuple[TableSpec, ...] = (
    IMAGES,
    REJECTS,
    RESOLUTION,
    CAPTIONS,
    CAPTION_CLASSES,
    CAPTION_EMBEDDINGS,
    IMAGE_HASHES,
    PHASH_CLUSTERS,
    DEDUP_DIRTY,
    DEDUP_STATE,
    BUCKET_ASSIGNMENTS,
    SHARD_SAMPLES,
    OPT_OUTS,
    OPT_OUT_LISTS,
    OPT_OUT_PROBLEMS,
    SKIP_AUDIT,
    SKIP_DIRTY,
    TRAINING_SNAPSHOTS,
    SNAPSHOT_SAMPLES,
    SNAPSHOT_DIRECTORIES,
    SKIP_GENERATIONS,
    VERSION_PINS,
)
"""Every lab table, in the order a data lead reads an image's trail."""

BY_NAME: dict[str, TableSpec] = {spec.name: spec for spec in LAB_TABLES}


def spec(name: str) -> TableSpec:
    """The spec of table ``name``; a name no stage declares is an error."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no lab table named {name!r}; known: {sorted(BY_NAME)}") from None
