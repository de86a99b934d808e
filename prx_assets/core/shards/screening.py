"""The first skip-list generation of each directory ``mds_shards`` writes.

Why at write time: a bucket x batch directory must never become visible without a complete,
current skip-list generation (a directory without one would be trained on whole). So
``core/shards/mds.py`` calls a ``skips_for(placements)`` callback once a directory's shards
are in its temporary directory; ``ShardScreener`` is that callback. It decides with the same
entry point as ``skip_lists`` (``core/skiplists/decisions.py`` ``decide_partition``, the
lab's decisions at that moment, ``SampleRef``s at their *final* ``relative_dir``), so
``skip_lists`` later refreshes the same decisions, not different ones.

``no_caption``: a sample written without a usable caption (``core/shards/plan.py``) goes to
the policy with ``SampleRef.caption_usable=False``, which excludes it whatever the
``captions`` table says by then; ``skip_lists`` passes the same from ``shard_samples``
(``caption_fingerprint`` is null for such a sample: ``tables.written_without_caption``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from prx_assets.core.lab import Lab
from prx_assets.core.shards.mds import Placement, relative_partition_dir
from prx_assets.core.skiplists.decisions import decide_partition
from prx_assets.core.skiplists.policy import (
    PartitionDecisions,
    SampleDecision,
    SampleRef,
    SkipPolicy,
    SkipPolicyError,
)


def sample_refs(
    placements: Sequence[Placement], uncaptioned: Collection[str] = ()
) -> list[SampleRef]:
    """Where each placed sample sits, as the skip policy names it (final directory)."""
    return [
        SampleRef(
            key=p.key,
            relative_dir=p.relative_dir,
            shard=p.shard,
            index_in_shard=p.index_in_shard,
            tier=p.tier,
            shape=p.shape,
            caption_usable=p.key not in uncaptioned,
        )
        for p in placements
    ]


PLANNED_SHARD = "(planned)"  # a sample's shard before it is written (positions do not decide)


class ShardScreener:
    """``skips_for`` for ``mds.write_partition_streams``: the first generation's decisions.

    The whole partition is decided once, before rendering, exactly as ``skip_lists`` decides
    it (one ``decide_partition`` call over every planned sample, at its final directory), so
    decisions that look across samples of the batch see all of them and the first
    generation is the one ``skip_lists`` would write from the same lab state. Each call then
    places those decisions at the positions the writer reports; a written sample that was
    never decided is an error (fail closed), never kept.
    """

    def __init__(
        self,
        lab: Lab,
        batch: str,
        policy: SkipPolicy,
        planned: Mapping[tuple[int, str], Sequence[str]],
        uncaptioned: Collection[str],
    ) -> None:
        self.uncaptioned = frozenset(uncaptioned)
        refs = [
            SampleRef(
                key=key,
                relative_dir=relative_partition_dir(tier, shape, batch),
                shard=PLANNED_SHARD,
                index_in_shard=i,
                tier=tier,
                shape=shape,
                caption_usable=key not in self.uncaptioned,
            )
            for (tier, shape), keys in sorted(planned.items())
            for i, key in enumerate(keys)
        ]
        self.policy = policy
        self.planned = decide_partition(lab, batch, refs, policy)
        self._reasons = {d.sample.key: d for d in self.planned.decisions}
        self._placed: list[SampleDecision] = []

    def __call__(self, placements: Sequence[Placement]) -> dict[str, dict[int, list[str]]]:
        undecided = sorted(p.key for p in placements if p.key not in self._reasons)
        if undecided:
            raise SkipPolicyError(
                f"{len(undecided)} sample(s) written without a skip decision (e.g. "
                f"{undecided[0]}): refusing to publish their directory"
            )
        out: dict[str, dict[int, list[str]]] = {}
        for ref in sample_refs(placements, self.uncaptioned):
            decided = dataclasses.replace(self._reasons[ref.key], sample=ref)
            self._placed.append(decided)
            if decided.excluded:
                out.setdefault(ref.shard, {})[ref.index_in_shard] = list(decided.reasons)
        return out

    def decisions(self) -> PartitionDecisions:
        """The decisions of every sample written so far, at its written position."""
        return dataclasses.replace(self.planned, decisions=list(self._placed))
