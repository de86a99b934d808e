"""Rows for the dedup tests: hash rows as plan_batch and the lab tables hold them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from prx_assets.core.dedup.corpus import gather_corpus
from prx_assets.core.dedup.decisions import BatchPlan, DedupSettings, plan_batch
from prx_assets.core.dedup.tables import with_phash_halves
from prx_assets.core.lab import Lab
from prx_assets.core.tables import IMAGE_HASHES, PHASH_CLUSTERS

S0 = DedupSettings()


def rows(*items: tuple) -> pa.Table:
    """(batch, key, hash, pixels, file_size[, ac_energy]) -> HASH_COLUMNS rows."""
    out = []
    for it in items:
        batch, key, h, px, fs, *rest = it
        out.append(
            {
                "key": key,
                "batch": batch,
                "phash": int(np.uint64(h).view(np.int64)),
                "ac_energy": rest[0] if rest else 30.0,
                "pixels": px,
                "file_size": fs,
            }
        )
    return pa.Table.from_pylist(out)


def by_key(table: pa.Table) -> dict[tuple[str, str], dict]:
    return {(r["batch"], r["key"]): r for r in table.to_pylist()}


def stored_from(decisions: pa.Table, settings: DedupSettings = S0) -> pa.Table:
    """What a batch would have stored: decisions plus the configuration fingerprint."""
    n = decisions.num_rows
    return decisions.append_column("config_fingerprint", pa.array([settings.fingerprint()] * n))


def hash_table(
    batch: str, items: list[tuple], version: str = "fast-v1", halves: bool = True
) -> pa.Table:
    """``image_hashes`` rows for (key, hash, pixels, ac_energy) items; ``halves=False``: as
    written before ``phash_hi``/``phash_lo`` existed (null)."""
    table = pa.Table.from_pylist(
        [
            {
                "key": k,
                "batch": batch,
                "phash": int(np.uint64(h).view(np.int64)),
                "phash_mode": version.split("-")[0],
                "phash_version": version,
                "ac_energy": e,
                "low_information": e < 1.0,
                "pixels": px,
                "file_size": 10,
            }
            for k, h, px, e in items
        ],
        schema=IMAGE_HASHES.schema,
    )
    return with_phash_halves(table) if halves else table


def run_batch(lab: Lab, batch: str, settings: DedupSettings = S0) -> BatchPlan:
    """What phash_clusters does, without Dagster."""
    g = gather_corpus(lab, batch, settings, chunk=2)  # tiny chunks: several IN-lists
    plan = plan_batch(batch, g.corpus, g.stored, settings)
    lab.replace_partition(PHASH_CLUSTERS, batch, plan.rows)
    return plan


def brute_closure(rows: list[dict], seeds: list[int], radius: int) -> set[str]:
    """Keys of the radius closure of ``seeds`` over stored ``image_hashes`` rows (version
    fast-v1, not low-information), by comparing every row with the frontier: the answer the
    corpus readers must give."""
    live = [r for r in rows if r["phash_version"] == "fast-v1" and r["ac_energy"] >= 1.0]
    seen = {s & (2**64 - 1) for s in seeds}
    frontier = set(seen)
    while frontier:
        nxt = {
            r["phash"] & (2**64 - 1)
            for r in live
            if r["phash"] & (2**64 - 1) not in seen
            and any(((r["phash"] & (2**64 - 1)) ^ f).bit_count() <= radius for f in frontier)
        }
        seen |= nxt
        frontier = nxt
    return {r["key"] for r in live if r["phash"] & (2**64 - 1) in seen}
