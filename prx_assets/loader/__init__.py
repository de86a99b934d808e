"""Training-side loader for the MDS shards: skip-lists applied, single-shape batches.

Usable from a training script without Dagster (nothing here imports it). Entry points:
``discover_streams`` → ``ShapeBatchedLoader`` (one ``SkipListDataset`` per shape), with
``ImageTextCollate`` + ``HFTextEncoder`` for on-the-fly text latents::

    buckets = discover_streams("/data/prx", tiers=[512, 1024])      # or a URL + cache_dir
    loader = ShapeBatchedLoader(
        buckets, batch_size=32, num_workers=8, num_canonical_nodes=8,
        collate_fn=ImageTextCollate(HFTextEncoder.from_pretrained("/models/text-enc")),
    )
    if checkpoint:
        loader.load_state_dict(checkpoint["data"])                  # SkipListChanged if edited
    for batch in loader:                                            # one (H, W) per batch
        step(batch["image"], batch["text_latents"], batch["attention_mask"])
        if time_to_save:
            save({"data": loader.state_dict(), ...})

Skip-lists are required: a bucket directory without a valid skip-list generation (written by
``mds_shards``, refreshed by ``skip_lists``) stops the loader with ``SkipListError``. Reading
unscreened data is ``skiplists="ignore-UNSAFE"`` (on ``discover_streams``, the loader and the
dataset), which warns every time.

A published directory is readable by this loader only (plain streaming refuses its
``index.json``, naming this package: ``core/shards/published.py``); a plain directory
(version 2 index) is refused here with ``UnpublishedIndex``. ``export_training_samples``
(``prx-assets export``) writes the kept samples as plain MDS for tools without the loader.

Run one process per device (torchrun sets WORLD_SIZE/RANK/LOCAL_WORLD_SIZE/LOCAL_RANK) and
keep ``num_canonical_nodes`` fixed for the whole run: a checkpoint then resumes at another
world size with no sample lost or repeated in the epoch.
"""

from prx_assets.core.shards.published import UnpublishedIndex
from prx_assets.loader.collate import HFTextEncoder, ImageTextCollate, TextEncoder
from prx_assets.loader.dataset import (
    IGNORE_SKIPLISTS_UNSAFE,
    REQUIRE_SKIPLISTS,
    FilteredShard,
    PinnedShard,
    ShardsReplaced,
    SkipListChanged,
    SkipListDataset,
    SkipListMismatchAcrossRanks,
    SkipListStream,
    SmallBucketWarning,
    UnscreenedDataWarning,
    small_bucket_problems,
)
from prx_assets.loader.discover import discover_streams, group_by_shape
from prx_assets.loader.export import export_training_samples
from prx_assets.loader.shape_loader import ShapeBatchedLoader, collate_samples
from prx_assets.loader.streams import BucketStream

__all__ = [
    "IGNORE_SKIPLISTS_UNSAFE",
    "REQUIRE_SKIPLISTS",
    "BucketStream",
    "FilteredShard",
    "HFTextEncoder",
    "ImageTextCollate",
    "PinnedShard",
    "ShapeBatchedLoader",
    "ShardsReplaced",
    "SkipListChanged",
    "SkipListDataset",
    "SkipListMismatchAcrossRanks",
    "SkipListStream",
    "SmallBucketWarning",
    "TextEncoder",
    "UnpublishedIndex",
    "UnscreenedDataWarning",
    "collate_samples",
    "discover_streams",
    "export_training_samples",
    "group_by_shape",
    "small_bucket_problems",
]
