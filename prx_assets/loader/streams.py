"""A bucket partition of an MDS tree as the loader sees it (``BucketStream``), and the rules
discovery and snapshots share: the ``<H>x<W>`` naming, the tier/shape/batch filter, natural
order, and per-partition weights.

Why a module of its own: ``discover`` (the live tree) and ``snapshots`` (a frozen one) both
build streams by these rules; here, below both, neither imports the other's internals.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from prx_assets.core.skiplists.sidecars import Manifest, PartitionCounts
from prx_assets.loader.dataset import REQUIRE_SKIPLISTS, SkipListStream

_SHAPE_RE = re.compile(r"^(\d+)x(\d+)$")


@dataclass(frozen=True)
class BucketStream:
    """One ``<tier>/<H>x<W>/<batch>`` partition, ready to become a ``SkipListStream``.

    A spec, not a ``Stream``: streaming mutates the weights of the streams it is given, so
    each dataset gets fresh ones from ``to_stream``. ``counts`` is known for local roots.
    """

    relpath: str
    tier: str
    height: int
    width: int
    batch: str
    local: str
    remote: str | None = None
    repeat: float | None = None
    source: str | None = None
    counts: PartitionCounts | None = None
    # The manifest discovery read and verified (bytes, parsed): the stream re-reads the
    # file at construction and skips the parse only when the bytes are the same.
    manifest: tuple[bytes, Manifest] | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.height, self.width)

    @property
    def shape_name(self) -> str:
        return f"{self.height}x{self.width}"

    def to_stream(self, skiplists: str = REQUIRE_SKIPLISTS) -> SkipListStream:
        return SkipListStream(
            remote=self.remote,
            local=self.local,
            repeat=self.repeat,
            skiplists=skiplists,
            known_manifest=self.manifest if skiplists == REQUIRE_SKIPLISTS else None,
        )


def parse_shape(name: str) -> tuple[int, int]:
    """``"<H>x<W>"`` → (H, W); the directory naming convention of the MDS layout."""
    m = _SHAPE_RE.match(name)
    if not m:
        raise ValueError(f"bucket directory {name!r} is not named <H>x<W>")
    return int(m.group(1)), int(m.group(2))


def _shape_filter(shapes: Collection[str | tuple[int, int]] | None) -> set[tuple[int, int]] | None:
    if shapes is None:
        return None
    return {parse_shape(s) if isinstance(s, str) else (int(s[0]), int(s[1])) for s in shapes}


@dataclass(frozen=True)
class PartitionFilter:
    """Which ``<tier>/<H>x<W>/<batch>`` partitions the ``tiers``/``shapes``/``batches``
    arguments select (None: any); one rule for discovery, refusals and snapshots."""

    tiers: set[str] | None
    shapes: set[tuple[int, int]] | None
    batches: set[str] | None

    @classmethod
    def of(
        cls,
        tiers: Collection[int | str] | None,
        shapes: Collection[str | tuple[int, int]] | None,
        batches: Collection[str] | None,
    ) -> PartitionFilter:
        return cls(
            None if tiers is None else {str(t) for t in tiers},
            _shape_filter(shapes),
            None if batches is None else {str(b) for b in batches},
        )

    def selects(self, tier: str, shape_name: str, batch: str) -> bool:
        return (
            (self.tiers is None or tier in self.tiers)
            and (self.shapes is None or parse_shape(shape_name) in self.shapes)
            and (self.batches is None or batch in self.batches)
        )


def natural_order(name: str) -> tuple[int, int, str]:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def repeat_for(relpath: str, weights: Mapping[str, float] | None) -> float | None:
    for pattern, repeat in (weights or {}).items():
        if fnmatch.fnmatchcase(relpath, pattern):
            if repeat < 0:
                raise ValueError(f"weight for {pattern!r} must be >= 0, got {repeat}")
            return float(repeat)
    return None
