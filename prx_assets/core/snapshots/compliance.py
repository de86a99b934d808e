"""Opt-out compliance: from one opt-out list to every training snapshot that held its images.

For a list (``opt_out_lists``): when it arrived, the images it matched directly (``opt_outs``
rows with a match) and through duplicate clusters (every other copy in the same
``phash_clusters`` cluster, and every ``skip_audit`` row excluded because of the list), which
snapshots contained each of them (``snapshot_samples``), and the first snapshot made after
the list arrived that excludes it. A snapshot made after the list arrived that still holds
one of those images is a *violation*: the asset check and ``prx-assets compliance`` fail on
it, until that snapshot is retired (a retired snapshot can no longer be trained on).
Snapshots made before the list arrived holding its images are history, reported, not
violations (they are why the report exists: "which runs used this image?").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from prx_assets.core.lab import Lab, in_list, sql_literal
from prx_assets.core.markdown import md_code, md_table
from prx_assets.core.snapshots.runner import list_snapshots
from prx_assets.core.snapshots.tables import SNAPSHOT_SAMPLES

MAX_LISTED = 50


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


@dataclass
class ComplianceReport:
    """Everything one list reaches; ``passed`` is False when a later snapshot holds any."""

    list_id: str
    status: str
    received_at: datetime
    images: list[ImageCompliance]
    snapshots_after: list[str]

    @property
    def passed(self) -> bool:
        return not any(i.violations for i in self.images)

    @property
    def violations(self) -> list[ImageCompliance]:
        return [i for i in self.images if i.violations]

    def as_dict(self) -> dict[str, Any]:
        return {
            "list_id": self.list_id,
            "status": self.status,
            "received_at": self.received_at.isoformat(),
            "passed": self.passed,
            "snapshots_after_arrival": self.snapshots_after,
            "images": [i.__dict__ for i in self.images],
        }

    def to_markdown(self, limit: int = MAX_LISTED) -> str:
        head = (
            f"Opt-out list {md_code(self.list_id)} ({md_code(self.status)}) arrived "
            f"{md_code(self.received_at.isoformat())}: {len(self.images)} image(s) reached "
            f"({sum(i.via == 'direct' for i in self.images)} directly), "
            f"{len(self.violations)} still in a snapshot made after it arrived — "
            f"**{'PASS' if self.passed else 'FAIL'}**."
        )
        table = md_table(
            ["batch", "key", "via", "contained in", "first excluding", "violations"],
            [
                (
                    i.batch,
                    i.key,
                    i.via,
                    " ".join(i.contained_in) or "none",
                    i.first_excluding or "none yet",
                    " ".join(i.violations) or "none",
                )
                for i in sorted(self.images, key=lambda i: (not i.violations, i.batch, i.key))[
                    :limit
                ]
            ],
        )
        more = len(self.images) - limit
        return head + "\n\n" + table + (f"\n\n(+{more} more images)" if more > 0 else "")


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


def _reached(lab: Lab, list_id: str) -> dict[tuple[str, str], str]:
    """(batch, key) -> "direct" or "duplicate of <key>" for every image the list reaches."""
    out: dict[tuple[str, str], str] = {}
    rows = lab.read(
        "opt_outs", ["matched_batch", "matched_key"], f"list_id = {sql_literal(list_id)}"
    ).to_pylist()
    for r in rows:
        if r["matched_key"]:
            out[(r["matched_batch"], r["matched_key"])] = "direct"
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
    return out


def compliance_report(lab: Lab, name: str) -> ComplianceReport:
    """The report for the list ``name`` (id, file name or path)."""
    row = find_list(lab, name)
    list_id, received = row["list_id"], row["received_at"]
    reached = _reached(lab, list_id) if row["status"] == "accepted" else {}
    snapshots = list_snapshots(lab)
    created = {s["snapshot_id"]: s["created_at"] for s in snapshots}
    after = [s["snapshot_id"] for s in snapshots if s["created_at"] > received]
    live_after = {
        s["snapshot_id"] for s in snapshots if s["created_at"] > received and s["status"] == "live"
    }
    held: dict[tuple[str, str], set[str]] = {}
    keys = sorted({k for _, k in reached})
    if keys and lab.exists(SNAPSHOT_SAMPLES.name):
        rows = lab.read(
            SNAPSHOT_SAMPLES.name, ["snapshot_id", "batch", "key"], in_list("key", keys)
        )
        for sid, batch, key in zip(
            *(rows.column(c).to_pylist() for c in ("snapshot_id", "batch", "key")), strict=True
        ):
            if sid in created:
                held.setdefault((batch, key), set()).add(sid)
    images = []
    for (batch, key), via in sorted(reached.items()):
        inside = held.get((batch, key), set())
        images.append(
            ImageCompliance(
                batch=batch,
                key=key,
                via=via,
                contained_in=sorted(inside, key=lambda s: (created[s], s)),
                first_excluding=next((s for s in after if s not in inside), None),
                violations=[s for s in after if s in inside and s in live_after],
            )
        )
    return ComplianceReport(list_id, row["status"], received, images, after)


def all_reports(lab: Lab) -> list[ComplianceReport]:
    """One report per accepted list (what the asset check evaluates)."""
    if not lab.exists("opt_out_lists"):
        return []
    rows = lab.read("opt_out_lists", ["list_id"], "status = 'accepted'")
    return [compliance_report(lab, lid) for lid in sorted(rows.column("list_id").to_pylist())]
