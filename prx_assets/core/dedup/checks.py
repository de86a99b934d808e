"""The dedup stage's checks: what the stored rows must satisfy after a run wrote them.

- :func:`hash_coverage`: every profiled image of a batch has exactly one hash row of the
  configured pHash version, and no other image has one (``image_hashes_complete``);
- :func:`check_keepers`: each cluster touching a batch has exactly one keeper across all
  batches, the one with the most pixels; low-information images are their own keeper
  (``phash_clusters_one_keeper``, ``phash_clusters_keeper_most_pixels``).

Pure functions over rows, plus :func:`read_cluster_members`, which reads those rows back
through the lab after the write (a check verifies what was stored, not what was meant).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from prx_assets.core.dedup.corpus import (
    DEFAULT_LOOKUP_CHUNK,
    Reader,
    as_view,
    cluster_members,
    lookup_by_keys,
    pairs_of,
)
from prx_assets.core.dedup.decisions import DedupSettings
from prx_assets.core.lab import sql_literal
from prx_assets.core.tables import IMAGE_HASHES


@dataclass(frozen=True)
class HashCoverage:
    """Stored hash rows of a batch against the images it must hash (every profiled one)."""

    expected: int
    hashed: int
    missing: list[str]  # expected, no hash row
    unexpected: list[str]  # hashed, but not a profiled image of the batch
    other_phash_version: list[str]
    undecodable: list[str]  # "key: reason" (ingest accepted them; the hasher could not)

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.other_phash_version)


def hash_coverage(
    expected: list[str], stored: pa.Table, version: str, rejected: dict[str, str]
) -> HashCoverage:
    """``stored``: the batch's ``key, phash_version`` rows as read back after the write."""
    versions = dict(
        zip(
            stored.column("key").to_pylist(),
            stored.column("phash_version").to_pylist(),
            strict=True,
        )
    )
    return HashCoverage(
        expected=len(expected),
        hashed=len(versions),
        missing=[k for k in expected if k not in versions],
        unexpected=sorted(set(versions) - set(expected)),
        other_phash_version=sorted(k for k, v in versions.items() if v != version),
        undecodable=[f"{k}: {why}" for k, why in sorted(rejected.items())],
    )


@dataclass
class KeeperCheck:
    """Stored members of the clusters touching a batch against the keeper rule."""

    clusters: int
    no_keeper: list[str]
    several_keepers: list[str]
    keeper_not_largest: list[str]
    low_information_not_own_keeper: list[str]

    @property
    def one_keeper(self) -> bool:
        return not (self.no_keeper or self.several_keepers or self.low_information_not_own_keeper)

    @property
    def keeper_largest(self) -> bool:
        return not self.keeper_not_largest


def check_keepers(members: pa.Table, pixels: dict[tuple[str, str], int]) -> KeeperCheck:
    """Stored rows of some clusters (all their members, every batch) vs the keeper rule.

    ``members``: ``cluster_id, batch, key, is_keeper, low_information``. Low-information rows
    are singletons and must be their own keeper; the rest are grouped by ``cluster_id``.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    low_bad = []
    for r in members.to_pylist():
        if r["low_information"]:
            if not r["is_keeper"] or r["cluster_id"] != r["key"]:
                low_bad.append(f"{r['batch']}:{r['key']}")
            continue
        groups.setdefault(r["cluster_id"], []).append(r)
    no_keeper, several, not_largest = [], [], []
    for cid, rows in sorted(groups.items()):
        keepers = [r for r in rows if r["is_keeper"]]
        if not keepers:
            no_keeper.append(cid)
        elif len(keepers) > 1:
            several.append(cid)
        else:
            best = max(pixels.get((r["batch"], r["key"]), -1) for r in rows)
            k = keepers[0]
            if pixels.get((k["batch"], k["key"]), -1) < best:
                not_largest.append(cid)
    return KeeperCheck(len(groups), no_keeper, several, not_largest, low_bad)


def read_cluster_members(
    reader: Reader,
    cluster_ids: Iterable[str],
    settings: DedupSettings,
    chunk: int = DEFAULT_LOOKUP_CHUNK,
) -> tuple[pa.Table, dict[tuple[str, str], int]]:
    """Every stored member (all batches, this configuration) of the clusters, and pixels."""
    cols = ["cluster_id", "batch", "key", "is_keeper", "low_information"]
    ids = sorted(set(cluster_ids))
    fp = sql_literal(settings.fingerprint())
    view = as_view(reader)
    members = cluster_members(view, ids, cols, chunk, where=f"config_fingerprint = {fp}")
    px = lookup_by_keys(
        view,
        IMAGE_HASHES.name,
        IMAGE_HASHES.schema,
        pairs_of(members),
        ["batch", "key", "pixels"],
        extra=f"phash_version = {sql_literal(settings.phash_version)}",
        chunk=chunk,
    )
    pixels = {
        (b, k): int(p)
        for b, k, p in zip(
            px.column("batch").to_pylist(),
            px.column("key").to_pylist(),
            px.column("pixels").to_pylist(),
            strict=True,
        )
    }
    return members, pixels
