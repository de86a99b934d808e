"""What to rerun so that every stored dedup decision holds: the dedup sensor's decision.

Two sources, both tiny tables, so asking costs what is stale (plus a row per batch), never
a scan of the decisions themselves: ``dedup_dirty`` (other batches a newer decision
contradicts, :mod:`.dirty`) and ``dedup_state`` (one row per decided batch: batches decided
under another configuration). :func:`dedup_reruns` is what the sensor requests;
:func:`settle_dedup` runs the same reruns in process for the CLI and the demo (no daemon).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import pyarrow as pa

from prx_assets.core.dedup.decisions import BatchPlan, DedupSettings
from prx_assets.core.dedup.dirty import read_dirty
from prx_assets.core.lab import Lab
from prx_assets.core.tables import DEDUP_STATE, IMAGE_HASHES, PHASH_CLUSTERS

DEFAULT_SETTLE_ROUNDS = 3


def state_row(
    batch: str, plan: BatchPlan, settings: DedupSettings, decided_at: datetime
) -> pa.Table:
    """The batch's ``dedup_state`` row: what it was decided under, and its counts."""
    kept = int(sum(plan.rows.column("is_keeper").to_pylist()))
    return pa.Table.from_pylist(
        [
            {
                "batch": batch,
                "config_fingerprint": settings.fingerprint(),
                "radius": settings.radius,
                "phash_version": settings.phash_version,
                "images": plan.stats.images,
                "kept": kept,
                "duplicates": plan.stats.images - kept,
                "low_information": plan.stats.low_information,
                "decided_at": decided_at,
            }
        ],
        schema=DEDUP_STATE.schema,
    )


@dataclass(frozen=True)
class StaleDecision:
    """A batch whose stored decisions were made under another dedup configuration."""

    batch: str
    config_fingerprint: str | None  # found in dedup_state
    phash_version: str | None
    needs_rehash: bool  # decided from hashes of another version: rerun image_hashes first


def stale_decisions(lab: Lab, settings: DedupSettings) -> dict[str, StaleDecision]:
    """Batches decided under another configuration, from ``dedup_state`` (a row per batch)."""
    fp = settings.fingerprint()
    out = {}
    # One read; an absent table reads as an empty table without rows.
    for r in lab.read(
        DEDUP_STATE.name, ["batch", "config_fingerprint", "phash_version"]
    ).to_pylist():
        if r["config_fingerprint"] != fp:
            out[r["batch"]] = StaleDecision(
                batch=r["batch"],
                config_fingerprint=r["config_fingerprint"],
                phash_version=r["phash_version"],
                needs_rehash=r["phash_version"] != settings.phash_version,
            )
    return out


def dedup_run_key(batch: str, assets: Sequence[str], markers: Iterable[str]) -> str:
    """The same stale state gives the same key, so Dagster requests it once."""
    raw = json.dumps([batch, sorted(assets), sorted(markers)])
    return f"dedup:{batch}:{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class DedupRerun:
    """What to rerun for one stale partition, under a run key digesting its stale state."""

    batch: str
    assets: tuple[str, ...]
    run_key: str
    reasons: tuple[str, ...]  # human-readable, for the run's tags and the log


def dedup_reruns(
    lab: Lab,
    settings: DedupSettings,
    downstream: Sequence[str] = (),
    registered: set[str] | None = None,
    *,
    hashes_asset: str = IMAGE_HASHES.name,
    clusters_asset: str = PHASH_CLUSTERS.name,
) -> dict[str, DedupRerun]:
    """Batch -> what to rerun there, for every partition whose dedup rows are stale.

    Stale: rows in ``dedup_dirty`` (a newer batch contradicts the stored decisions) or a
    ``dedup_state`` row decided under another configuration (a pHash mode change needs
    ``hashes_asset`` too). ``registered``: the partitions that exist (others are ignored: a
    deleted partition's leftover rows must not resurrect it). The dedup sensor requests
    exactly these; :func:`settle_dedup` runs them in process.
    """
    markers: dict[str, list[str]] = {}
    reasons: dict[str, list[str]] = {}
    by_batch: dict[str, list[dict]] = {}
    for row in read_dirty(lab).to_pylist():
        by_batch.setdefault(row["batch"], []).append(row)
    for batch, rows in by_batch.items():
        markers[batch] = [f"dirty:{r['dirty_id']}" for r in rows]
        by = ", ".join(sorted({r["detected_by"] for r in rows}))
        reasons[batch] = [f"{len(rows)} decision(s) changed by {by}"]
    stale = stale_decisions(lab, settings)
    for batch, found in stale.items():
        markers.setdefault(batch, []).append(f"decided:{found.config_fingerprint}")
        reasons.setdefault(batch, []).append(f"decided under {found.config_fingerprint}")
    out = {}
    for batch in sorted(markers):
        if registered is not None and batch not in registered:
            continue
        rehash = batch in stale and stale[batch].needs_rehash
        assets = ((hashes_asset,) if rehash else ()) + (clusters_asset, *downstream)
        assets = tuple(dict.fromkeys(assets))
        keyed = [*markers[batch], f"configured:{settings.fingerprint()}"]
        out[batch] = DedupRerun(
            batch=batch,
            assets=assets,
            run_key=dedup_run_key(batch, assets, keyed),
            reasons=tuple(reasons[batch]),
        )
    return out


@dataclass
class SettleReport:
    """What :func:`settle_dedup` reran, and whether the stale set ended empty."""

    reruns: list[DedupRerun] = field(default_factory=list)
    rounds: int = 0
    failed: list[DedupRerun] = field(default_factory=list)
    still_stale: list[str] = field(default_factory=list)  # batches, when not settled

    @property
    def settled(self) -> bool:
        return not self.failed and not self.still_stale


def settle_dedup(
    lab: Lab,
    settings: DedupSettings,
    registered: set[str],
    execute: Callable[[DedupRerun], bool],
    downstream: Sequence[str] = (),
    max_rounds: int = DEFAULT_SETTLE_ROUNDS,
    *,
    hashes_asset: str = IMAGE_HASHES.name,
    clusters_asset: str = PHASH_CLUSTERS.name,
    also_stale: Callable[[], dict[str, DedupRerun]] | None = None,
) -> SettleReport:
    """Run what the dedup sensor would request, in process, until nothing is stale.

    ``also_stale``: further reruns another sensor would request (the skip-list sensor's
    partitions whose training copy changed); a dedup rerun of the same batch wins, since
    it includes skip_lists.

    For the CLI and the demo, where no daemon ticks the sensor: each round reruns every
    stale partition (``execute(rerun)`` materialises ``rerun.assets`` for ``rerun.batch``
    and returns success). One round normally settles: each rerun decides its batch
    against the whole corpus, so reruns agree with each other; a second only confirms.
    Stops at the first failed rerun (its partition stays stale, so the sensor or the next
    call retries it) or after ``max_rounds``; ``still_stale`` then names what is left.
    """
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")

    def stale() -> dict[str, DedupRerun]:
        wanted = dedup_reruns(
            lab,
            settings,
            downstream,
            registered,
            hashes_asset=hashes_asset,
            clusters_asset=clusters_asset,
        )
        if also_stale is not None:
            for batch, rerun in also_stale().items():
                wanted.setdefault(batch, rerun)
        return wanted

    report = SettleReport()
    for _ in range(max_rounds):
        wanted = stale()
        if not wanted:
            return report
        report.rounds += 1
        for rerun in wanted.values():
            report.reruns.append(rerun)
            if not execute(rerun):
                report.failed.append(rerun)
                break
        if report.failed:
            break
    report.still_stale = sorted(stale())
    return report
