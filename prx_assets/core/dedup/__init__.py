"""The dedup stage's logic: cross-batch near-duplicate decisions, one batch at a time.

- ``phash``: the 64-bit perceptual hash (fast and reference modes) and AC energy;
- ``clustering``: exact and radius clusters over many hashes (multi-index hashing);
- ``decisions``: settings, the keeper rule, and :func:`~.decisions.plan_batch` (pure);
- ``corpus``: reading what can touch one batch's decisions from the lab (index look-ups);
- ``dirty``: the ``dedup_dirty`` queue of other batches' contradicted decisions;
- ``reruns``: what is stale (queue, configuration sweep) and :func:`~.reruns.settle_dedup`;
- ``checks``: hash completeness and one keeper per cluster, over the stored rows;
- ``gallery`` / ``planted``: the reviewer's contact sheet; the demo's planted-pair summary;
- ``runner``: :class:`~.runner.BatchHashes` and :class:`~.runner.BatchClusters`, what the
  ``image_hashes`` and ``phash_clusters`` assets call;
- ``tables``: the stage's table specs (collected in :mod:`prx_assets.core.tables`).
"""
