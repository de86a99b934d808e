"""What changed between the training sets of two snapshots, and why.

Membership is derived (core/snapshots/members.py: ``shard_samples`` at each snapshot's pinned
version, less what its frozen skip-list generations skip) only for the batches whose
directories differ: each snapshot records per directory a digest of the samples it keeps
there (``snapshot_directories``), and a batch with the same directories and digests in both
is skipped unread. The changed batches are read a few at a time, so a
diff's memory grows with its largest changed batch, not with the snapshots. The reason
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

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.markdown import md_table
from prx_assets.core.snapshots.members import (
    MEMBER_COLUMNS,
    Frozen,
    frozen,
    frozen_batches,
    members_of_batches,
)
from prx_assets.core.snapshots.tables import SNAPSHOT_DIRECTORIES, SNAPSHOT_SAMPLES

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
# Samples per read of the changed batches (both sides together; a batch is never split).
DIFF_CHUNK_SAMPLES = 100_000


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
    batches_compared: int = 0  # batches whose samples were read and compared
    batches_unchanged: int | None = None  # skipped by digest (None: compared whole)

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
            "batches_compared": self.batches_compared,
            "batches_unchanged": self.batches_unchanged,
            "totals": [
                {"direction": d, "reason": r, "samples": n} for (d, r), n in self.totals().items()
            ],
            "groups": [g.__dict__ for g in self.groups],
        }

    def to_markdown(self) -> str:
        """A heading line and one table per level (every value from data in code spans)."""
        lines = [
            f"Snapshot diff {md_table_value(self.a)} → {md_table_value(self.b)}: "
            f"{self.a_samples} → {self.b_samples} samples; {self.compared_line()}.",
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

    def compared_line(self) -> str:
        if self.batches_unchanged is None:
            return f"{self.batches_compared} batches compared sample by sample"
        return (
            f"{self.batches_compared} batches compared sample by sample, "
            f"{self.batches_unchanged} unchanged (same directories and members digests)"
        )

    def chart(self) -> tuple[list[str], list[float]]:
        """Labels and values for a bar chart of the totals."""
        items = list(self.totals().items())
        return [f"{d}: {r}" for (d, r), _ in items], [float(n) for _, n in items]


def md_table_value(value: str) -> str:
    from prx_assets.core.markdown import md_code

    return md_code(value)


def _members(
    lab: Lab, snap: Frozen, view: LabView, batches: list[str] | None
) -> dict[tuple[str, str], dict[str, Any]]:
    """(batch, key) -> member row of ``snap`` in ``batches`` (None: every batch, for a
    snapshot made before directory digests, compared whole)."""
    if batches is not None:
        rows = members_of_batches(lab, snap, batches, view)
    elif snap.legacy:
        where = f"snapshot_id = {sql_literal(snap.snapshot_id)}"
        rows = lab.read(SNAPSHOT_SAMPLES.name, list(MEMBER_COLUMNS), where).to_pylist()
    else:  # ``frozen`` checked its directory rows are all there
        rows = members_of_batches(lab, snap, frozen_batches(lab, snap.snapshot_id), view)
    return {(r["batch"], r["key"]): r for r in rows}


def _directories(lab: Lab, snapshot_id: str) -> dict[str, dict[str, tuple[str, int]]] | None:
    """batch -> relative_dir -> (members digest, kept samples) of a snapshot (O(directories));
    None for a snapshot made before ``snapshot_directories`` existed (every snapshot froze
    at least one directory), which is then compared whole."""
    if not lab.exists(SNAPSHOT_DIRECTORIES.name):
        return None
    rows = lab.read(
        SNAPSHOT_DIRECTORIES.name,
        ["batch", "relative_dir", "members_sha256", "kept_samples"],
        f"snapshot_id = {sql_literal(snapshot_id)}",
    )
    if not rows.num_rows:
        return None
    out: dict[str, dict[str, tuple[str, int]]] = {}
    for batch, rel, digest, kept in zip(
        *(rows.column(c).to_pylist() for c in rows.column_names), strict=True
    ):
        out.setdefault(batch, {})[rel] = (digest, int(kept))
    return out


def _chunks(
    dirs_a: dict[str, dict[str, tuple[str, int]]],
    dirs_b: dict[str, dict[str, tuple[str, int]]],
    chunk_samples: int,
) -> tuple[list[list[str]], dict[str, int]]:
    """The batches whose directories differ (by members digest), in order, grouped into
    reads of about ``chunk_samples`` samples; and the kept samples of the batches skipped,
    per side (``{"a": n, "b": n}``)."""
    chunks: list[list[str]] = []
    current: list[str] = []
    size = 0
    skipped = {"a": 0, "b": 0}
    for batch in sorted(dirs_a.keys() | dirs_b.keys()):
        da, db = dirs_a.get(batch, {}), dirs_b.get(batch, {})
        if da == db:  # same directories, same members: nothing to compare
            skipped["a"] += sum(kept for _, kept in da.values())
            skipped["b"] += sum(kept for _, kept in db.values())
            continue
        weight = sum(kept for _, kept in da.values()) + sum(kept for _, kept in db.values())
        if current and size + weight > chunk_samples:
            chunks.append(current)
            current, size = [], 0
        current.append(batch)
        size += weight
    if current:
        chunks.append(current)
    return chunks, skipped


def _at(
    view: LabView, versions: dict[str, int], table: str, columns: list[str], batches: str | None
) -> list[dict]:
    if table not in versions:
        return []
    return view.read(table, columns, batches).to_pylist()


def _context(
    view: LabView, versions: dict[str, int], batches: str | None
) -> tuple[dict, dict, dict, set[str]]:
    """(batch, key) -> reasons; -> caption fp; -> class fp; and the batches sharded (of the
    batches ``batches`` selects, at the snapshot's pinned versions)."""
    reasons = {
        (r["batch"], r["key"]): set(r["reasons"] or [])
        for r in _at(view, versions, "skip_audit", ["batch", "key", "reasons"], batches)
    }
    shard_rows = _at(
        view, versions, "shard_samples", ["batch", "key", "caption_fingerprint"], batches
    )
    captions = {(r["batch"], r["key"]): r["caption_fingerprint"] for r in shard_rows}
    classes = {
        (r["batch"], r["key"]): r["backend_fingerprint"]
        for r in _at(
            view, versions, "caption_classes", ["batch", "key", "backend_fingerprint"], batches
        )
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


def _compare(
    ma: dict[tuple[str, str], dict[str, Any]],
    mb: dict[tuple[str, str], dict[str, Any]],
    context_a: tuple[dict, dict, dict, set[str]],
    context_b: tuple[dict, dict, dict, set[str]],
    add: Callable[[str, str, dict[str, Any]], None],
) -> None:
    """Samples of the same batches in ``a`` and ``b`` into ``add``: added, removed,
    changed, each in (batch, key) order, with the reason read at each side's versions."""
    reasons_a, cap_a, cls_a, batches_a = context_a
    reasons_b, cap_b, cls_b, batches_b = context_b

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


def diff_snapshots(
    lab: Lab, a: str, b: str, max_keys: int = MAX_KEYS, chunk_samples: int = DIFF_CHUNK_SAMPLES
) -> SnapshotDiff:
    """The diff from snapshot ``a`` to snapshot ``b`` (see the module docstring).

    Reads the two snapshots' directory rows, skips every batch whose directories carry the
    same members digests on both sides, and compares the others a few batches at a time
    (about ``chunk_samples`` samples per read): memory grows with the largest changed batch,
    not with the snapshots, and time with what changed. Snapshots made before directory
    digests were recorded are compared whole."""
    snap_a, snap_b = frozen(lab, a), frozen(lab, b)
    va, vb = snap_a.versions, snap_b.versions
    dirs_a, dirs_b = _directories(lab, a), _directories(lab, b)
    if dirs_a is None or dirs_b is None:
        chunks: list[list[str] | None] = [None]
        skipped = {"a": 0, "b": 0}
        batches_total = None
    else:
        compared, skipped = _chunks(dirs_a, dirs_b, chunk_samples)
        chunks = list(compared)
        batches_total = len(dirs_a.keys() | dirs_b.keys())
    groups: dict[tuple, DiffGroup] = {}
    a_samples, b_samples = skipped["a"], skipped["b"]
    batches_compared = 0

    def add(direction: str, reason: str, row: dict[str, Any]) -> None:
        k = (direction, reason, row.get("tier"), row.get("shape"), row.get("source"))
        g = groups.setdefault(k, DiffGroup(*k))
        g.count += 1
        if len(g.keys) < max_keys:
            g.keys.append(row["key"])

    with lab.view(va) as view_a, lab.view(vb) as view_b:
        for chunk in chunks:
            where = None if chunk is None else in_list("batch", chunk)
            ma, mb = _members(lab, snap_a, view_a, chunk), _members(lab, snap_b, view_b, chunk)
            a_samples += len(ma)
            b_samples += len(mb)
            batches_compared += len(
                {i[0] for i in ma.keys() | mb.keys()} if chunk is None else chunk
            )
            _compare(ma, mb, _context(view_a, va, where), _context(view_b, vb, where), add)
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
    return SnapshotDiff(
        a,
        b,
        a_samples,
        b_samples,
        ordered,
        batches_compared=batches_compared,
        batches_unchanged=None if batches_total is None else batches_total - batches_compared,
    )
