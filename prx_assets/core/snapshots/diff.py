"""What changed between the training sets of two snapshots, and why.

Membership comes from ``snapshot_samples`` (the samples each snapshot trains on); the reason
a sample left or joined is read from the lab *at the versions each snapshot pinned*
(``skip_audit`` of the later snapshot for a removal, of the earlier one for an addition),
so the answer does not drift as the lab moves on. Reasons, first match wins:

- ``new batch`` / ``batch removed``: the batch was not sharded in the other snapshot;
- ``opt-out``: the later skip decision names an opt-out;
- ``captioner or classifier swap``: the sample's caption or class fingerprint differs between
  the two, and its exclusion (or former exclusion) is a class or caption verdict;
- ``dedup change``: it is (or was) a duplicate of another copy;
- ``class policy``: excluded (or formerly excluded) for its class under the same models;
- ``quality``: low information, quality, or no usable caption;
- ``pending``: a decision it depends on was (or is) not known;
- ``other``: none of the above (e.g. re-bucketed).

``changed`` lists samples in both whose caption or class fingerprint moved (their shard
bytes differ: a captioner swap re-renders them). Counts are exact; sample keys are bounded
(``max_keys`` per group).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prx_assets.core.lab import Lab, sql_literal
from prx_assets.core.markdown import md_table
from prx_assets.core.snapshots.manifest import SnapshotError
from prx_assets.core.snapshots.runner import existing
from prx_assets.core.snapshots.tables import SNAPSHOT_SAMPLES

REASONS = (
    "new batch",
    "batch removed",
    "opt-out",
    "captioner or classifier swap",
    "dedup change",
    "class policy",
    "quality",
    "pending",
    "other",
)
DIRECTIONS = ("added", "removed", "changed")
MAX_KEYS = 10
_MEMBER_COLS = (
    "batch",
    "key",
    "tier",
    "shape",
    "source",
    "caption_fingerprint",
    "class_fingerprint",
)


@dataclass
class DiffGroup:
    """Samples of one direction, reason, tier, shape and source."""

    direction: str
    reason: str
    tier: int | None
    shape: str | None
    source: str | None
    count: int = 0
    keys: list[str] = field(default_factory=list)


@dataclass
class SnapshotDiff:
    """Samples added, removed and changed from snapshot ``a`` to ``b``, by reason."""

    a: str
    b: str
    a_samples: int
    b_samples: int
    groups: list[DiffGroup]

    def totals(self) -> dict[tuple[str, str], int]:
        """(direction, reason) -> samples."""
        out: Counter[tuple[str, str]] = Counter()
        for g in self.groups:
            out[(g.direction, g.reason)] += g.count
        return dict(out)

    def count(self, direction: str, reason: str | None = None) -> int:
        return sum(
            g.count
            for g in self.groups
            if g.direction == direction and (reason is None or g.reason == reason)
        )

    def keys(self, direction: str, reason: str) -> list[str]:
        return [
            k for g in self.groups if (g.direction, g.reason) == (direction, reason) for k in g.keys
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "a_samples": self.a_samples,
            "b_samples": self.b_samples,
            "totals": [
                {"direction": d, "reason": r, "samples": n} for (d, r), n in self.totals().items()
            ],
            "groups": [g.__dict__ for g in self.groups],
        }

    def to_markdown(self) -> str:
        """A heading line and one table per level (every value from data in code spans)."""
        lines = [
            f"Snapshot diff {md_table_value(self.a)} → {md_table_value(self.b)}: "
            f"{self.a_samples} → {self.b_samples} samples.",
            "",
            md_table(
                ["direction", "reason", "samples"],
                [(d, r, n) for (d, r), n in self.totals().items()],
            ),
            "",
            md_table(
                ["direction", "reason", "tier", "shape", "source", "samples", "keys (first 10)"],
                [
                    (
                        g.direction,
                        g.reason,
                        g.tier if g.tier is not None else "",
                        g.shape,
                        g.source,
                        g.count,
                        " ".join(k[:16] for k in g.keys),
                    )
                    for g in self.groups
                ],
            ),
        ]
        return "\n".join(lines)

    def chart(self) -> tuple[list[str], list[float]]:
        """Labels and values for a bar chart of the totals."""
        items = list(self.totals().items())
        return [f"{d}: {r}" for (d, r), _ in items], [float(n) for _, n in items]


def md_table_value(value: str) -> str:
    from prx_assets.core.markdown import md_code

    return md_code(value)


def _members(lab: Lab, snapshot_id: str) -> dict[tuple[str, str], dict[str, Any]]:
    rows = lab.read(
        SNAPSHOT_SAMPLES.name, list(_MEMBER_COLS), f"snapshot_id = {sql_literal(snapshot_id)}"
    ).to_pylist()
    return {(r["batch"], r["key"]): r for r in rows}


def _versions(lab: Lab, snapshot_id: str) -> dict[str, int]:
    row = existing(lab, snapshot_id)
    if row is None:
        raise SnapshotError(f"no training snapshot {snapshot_id!r} in the lab")
    return json.loads(row["lab_versions"] or "{}")


def _at(lab: Lab, versions: dict[str, int], table: str, columns: list[str]) -> list[dict]:
    if table not in versions:
        return []
    return lab.read(table, columns, version=versions[table]).to_pylist()


def _context(lab: Lab, versions: dict[str, int]) -> tuple[dict, dict, dict, set[str]]:
    """(batch, key) -> reasons; -> caption fp; -> class fp; and the batches sharded."""
    reasons = {
        (r["batch"], r["key"]): set(r["reasons"] or [])
        for r in _at(lab, versions, "skip_audit", ["batch", "key", "reasons"])
    }
    shard_rows = _at(lab, versions, "shard_samples", ["batch", "key", "caption_fingerprint"])
    captions = {(r["batch"], r["key"]): r["caption_fingerprint"] for r in shard_rows}
    classes = {
        (r["batch"], r["key"]): r["backend_fingerprint"]
        for r in _at(lab, versions, "caption_classes", ["batch", "key", "backend_fingerprint"])
    }
    return reasons, captions, classes, {b for b, _ in captions}


_MODEL_VERDICTS = {"class_text", "class_nsfw", "no_caption"}


def _reason(reasons: set[str] | None, swapped: bool) -> str:
    if reasons is None:
        return "other"
    if "opt_out" in reasons:
        return "opt-out"
    if swapped and reasons & _MODEL_VERDICTS:
        return "captioner or classifier swap"
    if "duplicate" in reasons:
        return "dedup change"
    if reasons & {"class_text", "class_nsfw"}:
        return "class policy"
    if reasons & {"low_information", "quality", "no_caption"}:
        return "quality"
    if "pending" in reasons:
        return "pending"
    return "other"


def diff_snapshots(lab: Lab, a: str, b: str, max_keys: int = MAX_KEYS) -> SnapshotDiff:
    """The diff from snapshot ``a`` to snapshot ``b`` (see the module docstring)."""
    va, vb = _versions(lab, a), _versions(lab, b)
    ma, mb = _members(lab, a), _members(lab, b)
    reasons_a, cap_a, cls_a, batches_a = _context(lab, va)
    reasons_b, cap_b, cls_b, batches_b = _context(lab, vb)
    groups: dict[tuple, DiffGroup] = {}

    def add(direction: str, reason: str, row: dict[str, Any]) -> None:
        k = (direction, reason, row.get("tier"), row.get("shape"), row.get("source"))
        g = groups.setdefault(k, DiffGroup(*k))
        g.count += 1
        if len(g.keys) < max_keys:
            g.keys.append(row["key"])

    def swapped(ident: tuple[str, str]) -> bool:
        return cap_a.get(ident) != cap_b.get(ident) or cls_a.get(ident) != cls_b.get(ident)

    for ident in sorted(mb.keys() - ma.keys()):
        row = mb[ident]
        if ident[0] not in batches_a:
            add("added", "new batch", row)
        else:
            add("added", _reason(reasons_a.get(ident), swapped(ident)), row)
    for ident in sorted(ma.keys() - mb.keys()):
        row = ma[ident]
        if ident[0] not in batches_b:
            add("removed", "batch removed", row)
        else:
            add("removed", _reason(reasons_b.get(ident), swapped(ident)), row)
    for ident in sorted(ma.keys() & mb.keys()):
        ra, rb = ma[ident], mb[ident]
        if (ra["caption_fingerprint"], ra["class_fingerprint"]) != (
            rb["caption_fingerprint"],
            rb["class_fingerprint"],
        ):
            add("changed", "captioner or classifier swap", rb)
    order = {d: i for i, d in enumerate(DIRECTIONS)}
    rank = {r: i for i, r in enumerate(REASONS)}
    ordered = sorted(
        groups.values(),
        key=lambda g: (
            order[g.direction],
            rank[g.reason],
            g.tier or 0,
            g.shape or "",
            g.source or "",
        ),
    )
    return SnapshotDiff(a, b, len(ma), len(mb), ordered)
