"""``dedup_dirty``: the queue of other batches' stored decisions that no longer hold.

Why a queue and not a rewrite: ``phash_clusters(B)`` writes only B's rows (one commit per
partition), though its corpus-wide computation can contradict other batches' stored rows
(a higher-resolution copy arriving in B flips an old keeper). It appends one row per such
contradiction here; the dedup sensor reads this tiny table and reruns exactly those
partitions (their ``phash_clusters`` and skip-lists, never their shards), and each rerun
clears the rows it read before deciding. Appends never conflict with each other; a delete
racing another is retried by :meth:`~prx_assets.core.lab.Lab.delete`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime

import pyarrow as pa

from prx_assets.core.dedup.decisions import DecisionChange
from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.tables import DEDUP_DIRTY


def _dirty_id(change: DecisionChange, detected_by: str, detected_at: datetime) -> str:
    raw = json.dumps(
        [change.batch, change.key, change.cluster_id, detected_by, detected_at.isoformat()]
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def dirty_rows(
    changes: Sequence[DecisionChange], detected_by: str, detected_at: datetime
) -> pa.Table:
    """The ``dedup_dirty`` rows for ``changes`` found by ``detected_by`` at ``detected_at``."""
    if detected_at.tzinfo is None:
        raise ValueError("detected_at must be timezone-aware (UTC)")
    return pa.Table.from_pylist(
        [
            {
                "dirty_id": _dirty_id(c, detected_by, detected_at),
                "batch": c.batch,
                "key": c.key,
                "cluster_id": c.cluster_id,
                "change": f"{c.before} -> {c.after}",
                "detected_by": detected_by,
                "detected_at": detected_at,
            }
            for c in changes
        ],
        schema=DEDUP_DIRTY.schema,
    )


def mark_dirty(
    lab: Lab,
    changes: Sequence[DecisionChange],
    detected_by: str,
    detected_at: datetime | None = None,
) -> int:
    """Append one ``dedup_dirty`` row per change in one commit; the rows appended."""
    if not changes:
        return 0
    rows = dirty_rows(changes, detected_by, detected_at or datetime.now(UTC))
    lab.append(DEDUP_DIRTY, rows)
    return rows.num_rows


def read_dirty(reader: Lab | LabView, batch: str | None = None) -> pa.Table:
    """The pending rows (of ``batch``, or all); an absent queue reads as empty."""
    where = f"batch = {sql_literal(batch)}" if batch is not None else None
    rows = reader.read(DEDUP_DIRTY.name, DEDUP_DIRTY.schema.names, where)
    return rows if rows.num_columns else DEDUP_DIRTY.schema.empty_table()


def pending_dirty(lab: Lab) -> int:
    """How many rows the queue holds (a count, no rows read)."""
    return lab.count(DEDUP_DIRTY.name)


def clear_dirty(lab: Lab, dirty_ids: Sequence[str]) -> int:
    """Delete exactly these rows (read before the rerun read the corpus); later ones stay.

    Returns how many ids were cleared (0 when there were none or the queue is absent).
    """
    if not dirty_ids:
        return 0
    version = lab.delete(DEDUP_DIRTY.name, in_list("dirty_id", dirty_ids))
    return len(set(dirty_ids)) if version else 0  # Lab.delete: 0 when the table is absent
