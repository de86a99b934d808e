"""The first skip-list generation of each directory ``mds_shards`` writes, and ``no_caption``.

Why at write time: a bucket x batch directory must never become visible without a complete,
current skip-list generation (a directory without one would be trained on whole). So
``core/mds.py`` calls a ``skips_for(placements)`` callback once a directory's shards are in
its temporary directory; ``ShardScreener`` is that callback. It turns the placements into
``SampleRef``s at their *final* ``relative_dir`` and decides with the same entry point as
``skip_lists`` (``skip_decisions.decide_partition``, the lab's decisions at that moment), so
``skip_lists`` later refreshes the same decisions, not different ones.

``no_caption``: a sample written without a usable caption (``shard_tables.plan_shards``) is
always excluded. ``add_no_caption`` adds the reason at both call sites from what was written
(``shard_samples.caption_fingerprint`` is null for such a sample), so the exclusion holds
whatever the policy's ``decide`` knows about captions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from prx_assets.core.lab import Lab
from prx_assets.core.mds import Placement
from prx_assets.core.shard_tables import NO_CAPTION
from prx_assets.core.skip_decisions import decide_partition
from prx_assets.core.skip_policy import (
    PartitionDecisions,
    SampleDecision,
    SampleRef,
    SkipPolicy,
)


def add_no_caption(
    decisions: PartitionDecisions, uncaptioned: Collection[str]
) -> PartitionDecisions:
    """``decisions`` with reason ``no_caption`` added for every key in ``uncaptioned``."""
    if not uncaptioned:
        return decisions
    out = []
    for d in decisions.decisions:
        if d.sample.key in uncaptioned and NO_CAPTION not in d.reasons:
            d = dataclasses.replace(d, reasons=tuple(sorted({*d.reasons, NO_CAPTION})))
        out.append(d)
    return dataclasses.replace(decisions, decisions=out)


def sample_refs(placements: Sequence[Placement]) -> list[SampleRef]:
    """Where each placed sample sits, as the skip policy names it (final directory)."""
    return [
        SampleRef(
            key=p.key,
            relative_dir=p.relative_dir,
            shard=p.shard,
            index_in_shard=p.index_in_shard,
            tier=p.tier,
            shape=p.shape,
        )
        for p in placements
    ]


class ShardScreener:
    """``skips_for`` for ``mds.write_partition_streams``: decides each directory as written.

    Keeps every directory's decisions so the asset can report what the first generation
    excluded (``decisions()``).
    """

    def __init__(
        self, lab: Lab, batch: str, policy: SkipPolicy, uncaptioned: Collection[str]
    ) -> None:
        self.lab = lab
        self.batch = batch
        self.policy = policy
        self.uncaptioned = frozenset(uncaptioned)
        self._decided: list[PartitionDecisions] = []

    def __call__(self, placements: Sequence[Placement]) -> dict[str, dict[int, list[str]]]:
        if not placements:
            return {}
        decided = add_no_caption(
            decide_partition(self.lab, self.batch, sample_refs(placements), self.policy),
            self.uncaptioned,
        )
        self._decided.append(decided)
        by_dir = decided.skips_by_dir()
        (relative_dir,) = {p.relative_dir for p in placements}
        return by_dir.get(relative_dir, {})

    def decisions(self) -> PartitionDecisions:
        """Every directory's decisions so far, as one partition's."""
        merged: list[SampleDecision] = [d for part in self._decided for d in part.decisions]
        return PartitionDecisions(
            decisions=merged,
            unclassified=sum(p.unclassified for p in self._decided),
            undecided=sum(p.undecided for p in self._decided),
            policy=self.policy,
        )
