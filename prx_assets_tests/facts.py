"""Every fact the skip policy needs for real images of a batch, so that nothing is pending.

The policy (``core/skiplists/policy.py``) decides from class labels made from the *current*
caption, hash rows (keeper order) and dedup decisions; a test that wants definite decisions
for the demo batch's images plants all three here, deciding the clusters with the real
dedup code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import pyarrow as pa

from prx_assets.core.dedup.corpus import gather_corpus
from prx_assets.core.dedup.decisions import DedupSettings, plan_batch
from prx_assets.core.dedup.tables import with_phash_halves
from prx_assets.core.lab import Lab
from prx_assets.core.tables import (
    CAPTION_CLASSES,
    CAPTIONS,
    IMAGE_HASHES,
    IMAGES,
    PHASH_CLUSTERS,
    RESOLUTION,
)

T0 = datetime(2024, 1, 1, tzinfo=UTC)


def plant_decision_facts(
    store: Lab,
    batch: str,
    keys: Sequence[str],
    *,
    labels: Mapping[str, str] | None = None,
    copies: Mapping[str, str] | None = None,
) -> None:
    """Labels (``visual`` unless given) for every key with a caption row, and real dedup
    decisions: each key of ``copies`` shares its keeper's pHash and the keeper has more
    pixels, every other key is alone."""
    labels, copies = labels or {}, copies or {}
    captions = {
        r["key"]: r["backend_fingerprint"]
        for r in store.read_batch(CAPTIONS.name, batch, ["key", "backend_fingerprint"]).to_pylist()
    }
    classes = [
        {
            "key": k,
            "batch": batch,
            "label": labels.get(k, "visual"),
            "caption_fingerprint": captions[k],  # made from the current caption
            "created_at": T0,
        }
        for k in keys
        if k in captions
    ]
    store.replace_partition(
        CAPTION_CLASSES, batch, pa.Table.from_pylist(classes, schema=CAPTION_CLASSES.schema)
    )
    sizes = {
        r["key"]: r["width"] * r["height"]
        for r in store.read_batch(RESOLUTION.name, batch, ["key", "width", "height"]).to_pylist()
    }
    files = {
        r["key"]: r["file_size"]
        for r in store.read_batch(IMAGES.name, batch, ["key", "file_size"]).to_pylist()
    }
    settings = DedupSettings()
    keepers = set(copies.values())
    order = sorted(keys)
    hashes = [
        {
            "key": k,
            "batch": batch,
            "phash": 1000 + order.index(copies.get(k, k)),
            "phash_mode": settings.phash_mode,
            "phash_version": settings.phash_version,
            "ac_energy": 30.0 + i,
            "pixels": sizes[k] * (4 if k in keepers else 1),
            "file_size": files[k],
        }
        for i, k in enumerate(order)
    ]
    store.replace_partition(
        IMAGE_HASHES,
        batch,
        with_phash_halves(pa.Table.from_pylist(hashes, schema=IMAGE_HASHES.schema)),
    )
    gathered = gather_corpus(store, batch, settings)
    plan = plan_batch(batch, gathered.corpus, gathered.stored, settings)
    store.replace_partition(PHASH_CLUSTERS, batch, plan.rows)
    decided = {r["key"]: r for r in plan.rows.to_pylist()}
    for copy, keeper in copies.items():
        assert decided[copy]["keeper_key"] == keeper and decided[keeper]["is_keeper"]
