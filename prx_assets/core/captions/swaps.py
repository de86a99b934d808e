"""Model-swap detection: which partitions were made by another backend than the configured one.

Why from rows: every caption, class and embedding row records the fingerprint of the backend
that made it (and, downstream, the captioner fingerprint it was made from). Dagster 1.13
offers no public way to ask "which partitions are stale because a code version changed", so
the project compares stored fingerprints with the configured ones itself
(:func:`stale_batches`), closes the result over what depends on it (:func:`plan_reruns`) and
names each rerun so it is requested exactly once (:func:`swap_run_key`). The swap sensor
(``defs/captions/reconcile.py``) reads the rows and requests the runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class ConfiguredFingerprints:
    """The fingerprints of the backends configured now (what fresh rows would carry)."""

    captioner: str
    classifier: str
    embedder: str


@dataclass(frozen=True)
class StaleBatch:
    """One partition whose stored rows were made by something other than the configuration.

    ``found`` lists the distinct stored values that differ (``"<null>"`` for a missing one);
    ``newest`` is the newest ``created_at`` of those rows: together they identify the stale
    materialisation, so a rerun request for it can be made exactly once.
    """

    batch: str
    rows: int
    found: tuple[str, ...]
    newest: str

    @property
    def marker(self) -> str:
        return f"{'|'.join(self.found)}@{self.newest}"


def stale_batches(rows: pa.Table, expected: Mapping[str, str]) -> dict[str, StaleBatch]:
    """Batches holding a row whose ``expected`` columns differ from the expected values.

    ``rows`` needs ``batch``, ``created_at`` and every column of ``expected``; any subset of
    a table's rows may be passed (a reader can pre-filter), the answer only depends on the
    rows that differ. A null fingerprint counts as different.
    """
    if not expected:
        raise ValueError("expected must name at least one column")
    if rows.num_rows == 0:
        return {}
    missing = [c for c in ("batch", "created_at", *expected) if c not in rows.column_names]
    if missing:
        raise ValueError(f"rows lack columns {missing}")
    mask = None
    for column, value in expected.items():
        col = rows.column(column)
        differs = pc.or_kleene(pc.not_equal(col, value), pc.is_null(col))
        mask = differs if mask is None else pc.or_(mask, differs)
    stale = rows.filter(mask)
    out: dict[str, StaleBatch] = {}
    if stale.num_rows == 0:
        return out
    by_batch: dict[str, list[int]] = {}
    for i, b in enumerate(stale.column("batch").to_pylist()):
        by_batch.setdefault(b, []).append(i)
    created = stale.column("created_at").to_pylist()
    values = {c: stale.column(c).to_pylist() for c in expected}
    for batch, idx in sorted(by_batch.items()):
        found = set()
        for i in idx:
            parts = []
            for column, want in expected.items():
                got = values[column][i]
                if got != want:
                    parts.append(f"{column}={'<null>' if got is None else got}")
            found.add(",".join(parts))
        stamps = [created[i] for i in idx if created[i] is not None]
        newest = max(stamps).isoformat() if stamps else "<null>"
        out[batch] = StaleBatch(batch, len(idx), tuple(sorted(found)), newest)
    return out


def plan_reruns(
    stale: Mapping[str, Iterable[str]], downstream: Mapping[str, Sequence[str]]
) -> dict[str, list[str]]:
    """Asset -> sorted batches to rerun: each stale asset plus everything downstream of it.

    ``downstream[a]`` lists the assets that must be rebuilt when ``a`` is (transitively
    closed here, so listing direct children is enough). Assets with nothing to rerun are
    left out.
    """
    plan: dict[str, set[str]] = {}
    for asset, batches in stale.items():
        batches = set(batches)
        if not batches:
            continue
        todo, seen = [asset], set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            plan.setdefault(current, set()).update(batches)
            todo.extend(downstream.get(current, ()))
    return {asset: sorted(b) for asset, b in sorted(plan.items()) if b}


def reruns_by_batch(
    plan: Mapping[str, Iterable[str]], order: Sequence[str]
) -> dict[str, list[str]]:
    """Batch -> the assets to rerun in it, in ``order`` (then by name for unknown ones)."""
    rank = {name: i for i, name in enumerate(order)}
    out: dict[str, set[str]] = {}
    for asset, batches in plan.items():
        for b in batches:
            out.setdefault(b, set()).add(asset)
    return {
        b: sorted(assets, key=lambda a: (rank.get(a, len(rank)), a))
        for b, assets in sorted(out.items())
    }


def swap_run_key(batch: str, assets: Sequence[str], markers: Sequence[str]) -> str:
    """A run key naming the partition, the assets and the stale materialisations it fixes."""
    digest = hashlib.sha256("\0".join([batch, *assets, *sorted(markers)]).encode()).hexdigest()
    return f"model-swap:{batch}:{digest[:16]}"
