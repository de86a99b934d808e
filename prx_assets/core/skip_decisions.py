"""Gather what a partition's skip decisions depend on from the lab, and decide.

Why one entry point: ``mds_shards`` writes a first sidecar generation inside its temporary
directory and ``skip_lists`` refreshes it; both must decide the same way from the same
inputs, so both call :func:`decide_partition`.
"""

from __future__ import annotations

from collections.abc import Sequence

from prx_assets.core.dedup_tables import PHASH_CLUSTERS
from prx_assets.core.lab import Lab
from prx_assets.core.optouts import opted_out_keys
from prx_assets.core.skip_policy import (
    DedupDecision,
    PartitionDecisions,
    SampleRef,
    SkipPolicy,
    SkipPolicyError,
    decide,
)
from prx_assets.core.tables import CAPTION_CLASSES, IMAGES


class MissingImages(SkipPolicyError):
    """Samples that are not (any more) in ``images``: the shards are stale."""


def decide_partition(
    lab: Lab, batch: str, samples: Sequence[SampleRef], policy: SkipPolicy
) -> PartitionDecisions:
    """One decision per sample of ``batch``, from the lab's current class labels, dedup
    decisions and opt-out lists (read at call time)."""
    keys = {s.key for s in samples}
    classes = lab.read_batch(CAPTION_CLASSES.name, batch, ["key", "label"]).to_pylist()
    labels = {r["key"]: r["label"] for r in classes if r["key"] in keys}
    clusters = lab.read_batch(
        PHASH_CLUSTERS.name, batch, ["key", "is_keeper", "keeper_key", "low_information"]
    ).to_pylist()
    dedup = {
        r["key"]: DedupDecision(
            is_keeper=bool(r["is_keeper"]),
            keeper_key=r["keeper_key"],
            low_information=bool(r["low_information"]),
        )
        for r in clusters
        if r["key"] in keys and r["is_keeper"] is not None
    }
    images = lab.read_batch(IMAGES.name, batch, ["key", "url", "source", "source_id"])
    missing = keys - set(images.column("key").to_pylist()) if images.num_rows else keys
    if missing:
        raise MissingImages(
            f"{len(missing)} sharded image(s) of {batch} are not in `images` "
            f"(e.g. {sorted(missing)[0]}): rerun raw_images and the stages after it"
        )
    return decide(samples, labels, dedup, opted_out_keys(lab, images), policy)
