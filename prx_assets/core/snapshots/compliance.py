"""Opt-out compliance: is one opt-out list applied and holding, and which snapshots held its images.

For a list (``opt_out_lists``): when it arrived, the images it matched directly (``opt_outs``
rows with a match) and through duplicate clusters (every other copy in the same
``phash_clusters`` cluster, and every ``skip_audit`` row excluded because of the list), which
snapshots contained each of them (derived from their frozen directories:
core/snapshots/members.py), and the first snapshot made after
the list arrived that excludes it.

Each report ends in one verdict; only ``PASS`` means "applied and holding":

- ``NOT APPLIED``: the list was rejected at intake (its recorded reason), so nothing of it
  was applied (a list never taken in has no row at all: ``find_list`` raises).
- ``FAIL``: a live snapshot made after the list arrived still holds one of its images (a
  *violation*), until that snapshot is retired (a retired one can no longer be trained on).
- ``PENDING``: accepted, but some image it reaches that is sharded (a ``shard_samples``
  row) is not yet provably out of training: its batch's ``skip_lists`` has not decided it
  since the list arrived, the decision does not exclude it for this list, or the live
  skip-list generation of its directory (what the loader reads, ``load_generation``) does
  not skip its index or cannot be read. The report names the batches whose ``skip_lists``
  must run.
- ``PASS``: accepted, every reached sharded image is excluded for this list by a decision
  made after the list arrived and skipped by its directory's live generation, and no live
  snapshot made after arrival holds any. A reached image that is not sharded has nothing to
  hold. Snapshots made before the list arrived holding its images are history, reported,
  not violations (they are why the report exists: "which runs used this image?").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from prx_assets.core.lab import Lab, in_list, sql_literal
from prx_assets.core.markdown import md_code, md_table
from prx_assets.core.shards.mds import relative_partition_dir
from prx_assets.core.skiplists.live import LiveGenerations, Unreadable
from prx_assets.core.skiplists.matching import opt_out_columns, standing_rows
from prx_assets.core.skiplists.optouts import ACTION_ADD, ACTION_WITHDRAW
from prx_assets.core.snapshots.members import holders
from prx_assets.core.snapshots.runner import list_snapshots

MAX_LISTED = 50
PASS, FAIL, PENDING, NOT_APPLIED = "PASS", "FAIL", "PENDING", "NOT APPLIED"
ACCEPTED = "accepted"


class ComplianceError(LookupError):
    """The list asked about is not known (or not unambiguous)."""


@dataclass
class ImageCompliance:
    """One image a list reaches, and the snapshots that held it."""

    batch: str
    key: str
    via: str  # "direct" | "duplicate of <key>"
    contained_in: list[str] = field(default_factory=list)  # snapshot ids, oldest first
    first_excluding: str | None = None  # first snapshot after arrival without it
    violations: list[str] = field(default_factory=list)  # made after arrival, still holding it
    # Where it is sharded ("<relative_dir>/<shard>#<index>"); None: not sharded, nothing to hold.
    placement: str | None = None
    # Why the list is not (yet) applied and holding for it; None: held, or not sharded.
    not_held: str | None = None


@dataclass
class ComplianceReport:
    """Everything one list reaches, and its verdict (``PASS`` only when applied and holding)."""

    list_id: str
    status: str  # the list's intake status: accepted | rejected
    received_at: datetime
    images: list[ImageCompliance]
    snapshots_after: list[str]
    list_reason: str | None = None  # intake's reason when rejected
    # (batch, key) images it named whose opt-out its source withdrew since (a later list of
    # the same source): no longer required out of training, and not part of the verdict
    withdrawn: list[tuple[str, str]] = field(default_factory=list)
    withdraws: int = 0  # identifiers this list itself withdraws (a registry's delta)

    @property
    def verdict(self) -> str:
        """``NOT APPLIED``, ``FAIL``, ``PENDING`` or ``PASS`` (module docstring)."""
        if self.status != ACCEPTED:
            return NOT_APPLIED
        if self.violations:
            return FAIL
        if self.pending:
            return PENDING
        return PASS

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    @property
    def violations(self) -> list[ImageCompliance]:
        return [i for i in self.images if i.violations]

    @property
    def pending(self) -> list[ImageCompliance]:
        """Reached sharded images not (yet) excluded by their live skip-lists."""
        return [i for i in self.images if i.not_held]

    @property
    def pending_batches(self) -> list[str]:
        """The batches whose ``skip_lists`` must (re)run for the list to hold."""
        return sorted({i.batch for i in self.pending})

    @property
    def reason(self) -> str:
        """One line saying why the verdict is what it is (raw text: escape for the medium)."""
        sharded = sum(i.placement is not None for i in self.images)
        batches = self.pending_batches
        rerun = (
            f"; skip_lists has not applied it to {len(self.pending)} sharded image(s): "
            f"rerun skip_lists for batch(es) {', '.join(batches[:MAX_LISTED])}"
            + (f" (+{len(batches) - MAX_LISTED} more)" if len(batches) > MAX_LISTED else "")
            if batches
            else ""
        )
        verdict = self.verdict
        if verdict == NOT_APPLIED:
            return (
                f"the list was {self.status} at intake ({self.list_reason or 'no reason recorded'})"
                "; nothing of it was applied"
            )
        if verdict == FAIL:
            held = sorted({s for i in self.violations for s in i.violations})
            return (
                f"{len(self.violations)} image(s) still in live snapshot(s) made after the list "
                f"arrived: {', '.join(held[:MAX_LISTED])} (retire them){rerun}"
            )
        if verdict == PENDING:
            first = self.pending[0]
            return (
                rerun.lstrip("; ") + f" (first: {first.batch} {first.key[:16]}: {first.not_held})"
            )
        pulled = (
            f"; {len(self.withdrawn)} image(s) it named were withdrawn by its source since "
            "(no longer required out)"
            if self.withdrawn
            else ""
        ) + (
            f"; it withdraws {self.withdraws} earlier opt-out(s) of its source"
            if self.withdraws
            else ""
        )
        return (
            f"every sharded image it reaches ({sharded} of {len(self.images)}) is excluded for it "
            "by its live skip-lists, and no live snapshot made after it arrived holds one" + pulled
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "list_id": self.list_id,
            "status": self.status,
            "list_reason": self.list_reason,
            "verdict": self.verdict,
            "reason": self.reason,
            "received_at": self.received_at.isoformat(),
            "passed": self.passed,
            "pending_batches": self.pending_batches,
            "snapshots_after_arrival": self.snapshots_after,
            "images": [i.__dict__ for i in self.images],
            "withdrawn": [{"batch": b, "key": k} for b, k in self.withdrawn],
            "withdraws": self.withdraws,
        }

    def headline(self) -> str:
        """The verdict and its reason, as one Markdown line (data in code spans)."""
        return f"**{self.verdict}**: {md_code(self.reason, limit=2000)}"

    def to_markdown(self, limit: int = MAX_LISTED) -> str:
        head = (
            f"Opt-out list {md_code(self.list_id)} ({md_code(self.status)}) arrived "
            f"{md_code(self.received_at.isoformat())}: {len(self.images)} image(s) reached "
            f"({sum(i.via == 'direct' for i in self.images)} directly, "
            f"{sum(i.placement is not None for i in self.images)} sharded), "
            f"{len(self.pending)} not yet excluded by their live skip-lists, "
            f"{len(self.violations)} still in a snapshot made after it arrived"
            + (
                f"; {len(self.withdrawn)} withdrawn by its source since (not required out)."
                if self.withdrawn
                else "."
            )
        )
        table = md_table(
            [
                "batch",
                "key",
                "via",
                "sharded at",
                "held",
                "contained in",
                "first excluding",
                "violations",
            ],
            [
                (
                    i.batch,
                    i.key,
                    i.via,
                    i.placement or "not sharded",
                    ("NO: " + i.not_held) if i.not_held else "yes",
                    " ".join(i.contained_in) or "none",
                    i.first_excluding or "none yet",
                    " ".join(i.violations) or "none",
                )
                for i in sorted(
                    self.images,
                    key=lambda i: (not i.violations, not i.not_held, i.batch, i.key),
                )[:limit]
            ],
        )
        more = len(self.images) - limit
        return (
            self.headline()
            + "\n\n"
            + head
            + "\n\n"
            + table
            + (f"\n\n(+{more} more images)" if more > 0 else "")
        )


def find_list(lab: Lab, name: str) -> dict[str, Any]:
    """The ``opt_out_lists`` row named by its id, its file name or its path."""
    rows = lab.read("opt_out_lists").to_pylist()
    for test in (
        lambda r: r["list_id"] == name,
        lambda r: r["path"] == name or r["path"].rsplit("/", 1)[-1] == name.rsplit("/", 1)[-1],
    ):
        found = [r for r in rows if test(r)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            newest = max(found, key=lambda r: r["received_at"])
            return newest  # the same file name sent twice: its latest content
    raise ComplianceError(f"no opt-out list {name[:200]!r} (known: {len(rows)} lists)")


def _reached(lab: Lab, list_id: str) -> tuple[dict[tuple[str, str], str], set[tuple[str, str]]]:
    """(batch, key) -> "direct" or "duplicate of <key>" for every image the list reaches,
    and the (batch, key) images it named whose opt-outs its source withdrew since (no longer
    required out of training for this list)."""
    out: dict[tuple[str, str], str] = {}
    view = lab.view()
    rows = view.read(  # matched rows only: a registry's millions of unmatched rows stay unread
        "opt_outs",
        [*opt_out_columns(view), "matched_batch", "matched_key"],
        f"list_id = {sql_literal(list_id)} AND matched_key IS NOT NULL",
    ).to_pylist()
    for r in standing_rows(view, rows):
        out[(r["matched_batch"], r["matched_key"])] = "direct"
    withdrawn = {
        (r["matched_batch"], r["matched_key"])
        for r in rows
        if (r.get("action") or ACTION_ADD) == ACTION_ADD
    } - set(out)
    direct_keys = sorted({k for _, k in out})
    if direct_keys and lab.exists("phash_clusters"):
        mine = lab.read("phash_clusters", ["key", "cluster_id"], in_list("key", direct_keys))
        cluster_of = {
            c: k
            for k, c in zip(
                mine.column("key").to_pylist(), mine.column("cluster_id").to_pylist(), strict=True
            )
            if c
        }
        if cluster_of:
            copies = lab.read(
                "phash_clusters", ["batch", "key", "cluster_id"], in_list("cluster_id", cluster_of)
            ).to_pylist()
            for r in copies:
                out.setdefault(
                    (r["batch"], r["key"]), f"duplicate of {cluster_of[r['cluster_id']]}"
                )
    if lab.exists("skip_audit"):
        audit = lab.read(
            "skip_audit", ["batch", "key", "opt_out_list_ids", "opt_out_via"], "excluded = true"
        )
        for r in audit.to_pylist():
            if list_id in (r["opt_out_list_ids"] or []):
                via = [v for v in (r["opt_out_via"] or []) if v != r["key"]]
                out.setdefault(
                    (r["batch"], r["key"]), f"duplicate of {via[0]}" if via else "direct"
                )
    return out, withdrawn - set(out)


def _holding(
    lab: Lab,
    shards_root: str,
    list_id: str,
    received: datetime,
    reached: dict[tuple[str, str], str],
) -> dict[tuple[str, str], tuple[str, str | None]]:
    """(batch, key) -> (placement, why not held or None) for each reached *sharded* image.

    Held means: the batch's ``skip_audit`` row was decided after the list arrived, excludes
    the image for this list, for the placement it has now, and the directory's live
    generation skips that index. Anything missing or unreadable is "not held" (fail closed).
    """
    keys = sorted({k for _, k in reached})
    if not keys or not lab.exists("shard_samples"):
        return {}
    cols = ["batch", "key", "tier", "shape", "relative_dir", "shard", "index_in_shard"]
    placed = {
        (r["batch"], r["key"]): r
        for r in lab.read("shard_samples", cols, in_list("key", keys)).to_pylist()
        if (r["batch"], r["key"]) in reached
    }
    if not placed:
        return {}
    audit: dict[tuple[str, str], dict[str, Any]] = {}
    if lab.exists("skip_audit"):
        rows = lab.read(
            "skip_audit",
            [
                "batch",
                "key",
                "relative_dir",
                "shard",
                "index_in_shard",
                "excluded",
                "opt_out_list_ids",
                "decided_at",
            ],
            in_list("key", sorted({k for _, k in placed})),
        )
        audit = {(r["batch"], r["key"]): r for r in rows.to_pylist()}
    generations = LiveGenerations(str(shards_root))  # each directory read once, local or s3
    out: dict[tuple[str, str], tuple[str, str | None]] = {}
    for ref, p in sorted(placed.items()):
        where = f"{p['relative_dir']}/{p['shard']}#{p['index_in_shard']}"
        out[ref] = (
            where,
            _not_held(shards_root, list_id, received, p, audit.get(ref), generations),
        )
    return out


def _not_held(
    shards_root: str,
    list_id: str,
    received: datetime,
    placed: dict[str, Any],
    decided: dict[str, Any] | None,
    generations: LiveGenerations,
) -> str | None:
    """Why one sharded image is not (yet) excluded for the list in training; None: it is."""
    batch, shard, index = placed["batch"], placed["shard"], placed["index_in_shard"]
    if decided is None:
        return "no skip_lists decision for it yet"
    at = decided["decided_at"]
    if at is None or at <= received:
        return f"skip_lists last decided it {at.isoformat() if at else 'at an unknown time'}, before the list arrived"
    if not decided["excluded"] or list_id not in (decided["opt_out_list_ids"] or []):
        return "its skip_lists decision since the list arrived does not exclude it for this list"
    if (decided["relative_dir"], decided["shard"], decided["index_in_shard"]) != (
        placed["relative_dir"],
        shard,
        index,
    ):
        return "its skip_lists decision was for another placement (shards rewritten since)"
    try:
        if placed["relative_dir"] != relative_partition_dir(placed["tier"], placed["shape"], batch):
            return "its shard_samples row names a directory the layout does not give it"
    except (TypeError, ValueError) as exc:
        return f"its shard_samples row is not a valid placement: {str(exc)[:200]}"
    # The directory comes from the row's parts by the one layout rule (checked above), never
    # from a stored path string alone, so a hostile ``relative_dir`` cannot point elsewhere.
    live = generations.slot(placed["relative_dir"], shard, index)
    if isinstance(live, Unreadable):
        return f"live skip-lists unreadable: {live.reason[:300]}"
    if not live.skipped:
        return (
            f"the live skip-list generation of its directory ({live.generation[:12]}) does not "
            f"skip {shard} #{index}"
        )
    return None


def compliance_report(lab: Lab, shards_root: str | os.PathLike[str], name: str) -> ComplianceReport:
    """The report for the list ``name`` (id, file name or path); ``shards_root``: the shard
    tree whose live skip-lists must hold the list (the data root's ``shards``)."""
    row = find_list(lab, name)
    list_id, received = row["list_id"], row["received_at"]
    reached, withdrawn = _reached(lab, list_id) if row["status"] == ACCEPTED else ({}, set())
    holding = _holding(lab, os.fspath(shards_root), list_id, received, reached)
    snapshots = list_snapshots(lab)
    created = {s["snapshot_id"]: s["created_at"] for s in snapshots}
    after = [s["snapshot_id"] for s in snapshots if s["created_at"] > received]
    live_after = {
        s["snapshot_id"] for s in snapshots if s["created_at"] > received and s["status"] == "live"
    }
    # Derived from each snapshot's frozen directories (fails closed when it cannot be).
    held = {
        ident: {sid for sid in ids if sid in created}
        for ident, ids in holders(lab, {k for _, k in reached}).items()
    }
    images = []
    for (batch, key), via in sorted(reached.items()):
        inside = held.get((batch, key), set())
        placement, not_held = holding.get((batch, key), (None, None))
        images.append(
            ImageCompliance(
                batch=batch,
                key=key,
                via=via,
                contained_in=sorted(inside, key=lambda s: (created[s], s)),
                first_excluding=next((s for s in after if s not in inside), None),
                violations=[s for s in after if s in inside and s in live_after],
                placement=placement,
                not_held=not_held,
            )
        )
    return ComplianceReport(
        list_id,
        row["status"],
        received,
        images,
        after,
        list_reason=row.get("reason"),
        withdrawn=sorted(withdrawn),
        withdraws=_withdraws(lab, list_id) if row["status"] == ACCEPTED else 0,
    )


def _withdraws(lab: Lab, list_id: str) -> int:
    """Withdrawal rows of the list (``action`` BITMAP and ``list_id`` BTREE indexes)."""
    view = lab.view()
    if "action" not in opt_out_columns(view):
        return 0
    return len(
        {
            r["identifier"]
            for r in view.read(
                "opt_outs",
                ["identifier"],
                f"list_id = {sql_literal(list_id)} AND action = {sql_literal(ACTION_WITHDRAW)}",
            ).to_pylist()
        }
    )


def all_reports(lab: Lab, shards_root: str | os.PathLike[str]) -> list[ComplianceReport]:
    """One report per recorded list, rejected ones included (what the asset check evaluates:
    a rejected list is a legal request not applied, never a pass)."""
    if not lab.exists("opt_out_lists"):
        return []
    rows = lab.read("opt_out_lists", ["list_id"])
    return [
        compliance_report(lab, shards_root, lid)
        for lid in sorted(rows.column("list_id").to_pylist())
    ]
