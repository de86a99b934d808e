"""The per-image audit: a one-line verdict, then everything the lab knows, table by table.

Why a verdict first: the question a data lead brings is "is this image in training, and if
not, since when and why?". The tables answer it only to someone who knows how they chain;
the verdict states it, per copy of the image, from the same rows the trail shows:

- ``in training: <relative_dir>/<shard> #<index_in_shard>``: in ``shard_samples`` and kept by
  a ``skip_audit`` decision about that very slot;
- ``not in training since <time>: <reason> (<list or keeper>), ...``: excluded by
  ``skip_audit`` (reasons read generically, so new codes need no change here); for a
  duplicate it says whether its keeper, the training copy, is itself in training;
- ``undecided: ...``: sharded, but no skip decision about the current slot is recorded (the
  audit does not guess; the loader skips such samples as ``pending``);
- ``never sharded: <reason>``: accepted but not in any shard (ineligible, unassigned, no
  caption, not written yet);
- ``rejected at ingest: <reason> (<detail>)``: a ``rejects`` row.

Identifiers (every form the README lists): a content key; an original URL; ``source:id``
(or a bare source id); a landing path ``<source>/<chunk>/<path>`` (``<source>/<path>`` for
manifest rows, absolute under the landing zone too) or the path inside the batch. Rejected
files are found by path, and by key where their bytes were read. Look-ups are filtered
Lance reads (BTREE on key, url, source_id, path); each table is read at one pinned version,
recorded in the trail (one ``LabView`` pinned when the audit starts). Why generic tables:
each stage owns its tables, declared in the registry (``core/tables.py``), so every
registered table with a ``key`` column is read, binary and vector columns dropped.

No Dagster import: the CLI, the ``image_audit`` job and the curation browser share this.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from prx_assets.core.ingest.sources import ARCHIVE_SUFFIXES, MANIFEST_SUFFIXES, batch_key
from prx_assets.core.ingest.tables import ALIAS_REASON
from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.markdown import md_code
from prx_assets.core.skiplists.live import LiveGenerations, Unreadable
from prx_assets.core.snapshots.runner import snapshots_containing
from prx_assets.core.tables import LAB_TABLES

# The registry lists the tables in the order a data lead reads a trail in: where an image
# came from, to where it went.
TABLE_ORDER = tuple(spec.name for spec in LAB_TABLES)
_HIDDEN_COLUMNS = {"image", "vector"}
KEY_COLUMNS = ("key", "matched_key")  # opt_outs names the image it matched
MAX_KEYS = 20  # images one query may list; the rest are counted
MAX_COPIES_LISTED = 20
MAX_ROWS_SHOWN = 20  # rows per table in the Markdown form (the JSON form has them all)

IN_TRAINING = "in_training"
EXCLUDED = "excluded"
UNDECIDED = "undecided"
NEVER_SHARDED = "never_sharded"
REJECTED = "rejected"
NOT_FOUND = "not_found"
# The headline is the copy with the lowest rank: any copy in training answers "in training".
_RANK = {IN_TRAINING: 0, EXCLUDED: 1, UNDECIDED: 2, NEVER_SHARDED: 3, REJECTED: 4, NOT_FOUND: 5}
# skip_audit columns the verdict reads by name; any other column whose name starts with a
# reason's code (e.g. ``opt_out_via`` for ``opt_out``) is quoted with that reason.
_SKIP_CORE_COLUMNS = {
    "key",
    "batch",
    "tier",
    "shape",
    "relative_dir",
    "shard",
    "index_in_shard",
    "excluded",
    "reasons",
    "opt_out_list_ids",
    "class_label",
    "duplicate_of",
    "decided_at",
    "first_excluded_at",
    "policy_fingerprint",
    "reason_since",
}
SHARD_DIGEST = ["relative_dir", "dir_digest"]  # what shard_samples says the tree holds
# Tables a copy's verdict reads (also for a duplicate's keeper).
_VERDICT_TABLES = (
    "images",
    "resolution",
    "bucket_assignments",
    "captions",
    "caption_classes",
    "phash_clusters",
    "shard_samples",
    "skip_audit",
)


@dataclass(frozen=True)
class CopyVerdict:
    """The verdict on one copy: an ``images`` row (batch, key) or a ``rejects`` row."""

    batch: str
    key: str | None
    path: str | None
    status: str
    line: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "key": self.key,
            "path": self.path,
            "status": self.status,
            "verdict": self.line,
        }


@dataclass
class AuditTrail:
    """What the lab knows about the image(s) a query names: rows per table, the Lance version
    each table was read at, and one verdict per copy (best first)."""

    query: str
    keys: list[str]
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    matched_by: list[str] = field(default_factory=list)
    copies: list[CopyVerdict] = field(default_factory=list)
    keys_not_listed: int = 0  # matches (images or rejected files) beyond MAX_KEYS
    # Training snapshots whose training set held one of ``keys`` (oldest first): lineage.
    snapshots: list[dict[str, Any]] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.copies) or any(self.tables.values())

    @property
    def status(self) -> str:
        return self.copies[0].status if self.copies else NOT_FOUND

    @property
    def verdict(self) -> str:
        """One line: the best copy's verdict (copies are sorted best first)."""
        if not self.copies:
            named = self.tables.get("opt_outs")
            if named:
                return "not found: in no batch (only an opt-out list names it)"
            return "not found: in no lab table"
        head = self.copies[0].line
        if len(self.copies) > 1:
            head += f" (1 of {len(self.copies)} copies, each listed below)"
        return head

    def to_json(self) -> str:
        return json.dumps(
            {
                "query": self.query,
                "verdict": self.verdict,
                "status": self.status,
                "copies": [c.to_dict() for c in self.copies],
                "matched_by": self.matched_by,
                "keys": self.keys,
                "keys_not_listed": self.keys_not_listed,
                "versions": self.versions,
                "snapshots": self.snapshots,
                **self.tables,
            },
            indent=2,
            default=_jsonable,
            sort_keys=False,
        )

    def to_markdown(self) -> str:
        """The verdict, the copies, then every table's rows; every value from the lab is an
        escaped code span (``core/markdown.md_code``), so no data becomes markup."""
        lines = [
            f"# Audit trail for {md_code(self.query)}",
            "",
            f"**Verdict:** {md_code(self.verdict)}",
        ]
        lines.append("")
        if not self.found:
            return "\n".join(lines)
        if len(self.copies) > 1:
            lines.append("**Copies:**")
            lines.append("")
            for c in self.copies[:MAX_COPIES_LISTED]:
                where = f"{md_code(c.batch)} {md_code(c.key or c.path)}"
                lines.append(f"- {where}: {md_code(c.line)}")
            if len(self.copies) > MAX_COPIES_LISTED:
                lines.append(f"- … and {len(self.copies) - MAX_COPIES_LISTED} more")
            lines.append("")
        if self.matched_by:
            lines.append(f"Matched by: {', '.join(md_code(m) for m in self.matched_by)}")
            lines.append("")
        lines.append(f"Keys: {', '.join(md_code(k) for k in self.keys) or '*(none)*'}")
        if self.keys_not_listed:
            lines.append("")
            lines.append(f"{self.keys_not_listed} more match(es) not listed: narrow the query.")
        lines.append("")
        lines.append("## Training snapshots that contained it")
        lines.append("")
        for snap in self.snapshots[:MAX_ROWS_SHOWN]:
            lines.append(
                f"- {md_code(snap['snapshot_id'])} ({md_code(snap['status'])}, made "
                f"{md_code(_display(snap['created_at']))}): {md_code(snap['batch'])} "
                f"{md_code(snap['key'])}"
            )
        if not self.snapshots:
            lines.append("*none*")
        lines.append("")
        for table, rows in self.tables.items():
            lines.append(f"## {md_code(table)} (Lance version {self.versions.get(table)})")
            lines.append("")
            if not rows:
                lines.append("*no rows*")
                lines.append("")
            for i, row in enumerate(rows[:MAX_ROWS_SHOWN], 1):
                if len(rows) > 1:
                    lines.append(f"Row {i} of {len(rows)}:")
                    lines.append("")
                for column, value in row.items():
                    lines.append(f"- {md_code(column)}: {md_code(_display(value))}")
                lines.append("")
            if len(rows) > MAX_ROWS_SHOWN:
                lines.append(f"{len(rows) - MAX_ROWS_SHOWN} more row(s): see the JSON form.")
                lines.append("")
        return "\n".join(lines)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dt.datetime | dt.date):
        return v.isoformat()
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    return v


def _display(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list | dict):
        return json.dumps(v, default=_jsonable, ensure_ascii=False)
    return _jsonable(v)


# --------------------------------------------------------------------------- look-ups


class NoLab(LookupError):
    """The lab root holds no lab table: nothing can be said of any image there (which is not
    "never ingested": the path may be wrong)."""


class _Snapshot:
    """Every registered lab table opened once, at one version, for the whole audit, and the
    shard tree's live skip-list generations (what the loader obeys), each read once.

    A ``LabView`` pinned when the audit starts: every look-up sees the lab as it was then,
    and ``versions`` are exactly the versions the trail was read at.
    """

    def __init__(self, lab: Lab, shards_root: str) -> None:
        self.view = LabView(lab)
        self.versions = self.view.pin(TABLE_ORDER)
        self.tables = [t for t in TABLE_ORDER if t in self.versions]
        if not self.tables:
            raise NoLab(f"no lab at {lab.root} (no lab table there: check --data-root)")
        self.live = LiveGenerations(shards_root)
        self._apart: dict[str, str | None] = {}

    def tree_apart(self, batch: str) -> str | None:
        """Why the batch's live directories are not those ``shard_samples`` recorded (None:
        they are; ``LiveGenerations.apart``): every copy of such a batch is undecided."""
        if batch not in self._apart:
            rows = self.read("shard_samples", f"batch = {sql_literal(batch)}", SHARD_DIGEST)
            why = self.live.apart(batch, {r["relative_dir"]: r["dir_digest"] for r in rows})
            self._apart[batch] = why
        return self._apart[batch]

    def read(self, table: str, flt: str, columns: Sequence[str] | None = None) -> list[dict]:
        schema = self.view.schema(table) if table in self.versions else None
        if schema is None:
            return []
        names = [
            n
            for n in (columns or schema.names)
            if n in schema.names
            and n not in _HIDDEN_COLUMNS
            and not pa.types.is_binary(schema.field(n).type)
            and not pa.types.is_large_binary(schema.field(n).type)
        ]
        return self.view.read(table, names, flt).to_pylist() if names else []

    def has(self, table: str, column: str) -> bool:
        schema = self.view.schema(table) if table in self.versions else None
        return schema is not None and column in schema.names


def _is_key(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text.lower())


def _chunk_stem(name: str) -> str:
    for suffix in (*ARCHIVE_SUFFIXES, *MANIFEST_SUFFIXES):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def path_conditions(query: str, landing: Path | None = None) -> list[tuple[str, str]]:
    """(description, Lance predicate on ``batch``/``path``) for each way ``query`` can be a
    file's path: ``<source>/<chunk>/<path>`` under the landing zone (absolute or relative),
    ``<source>/<path>`` for a manifest row, or the path inside a batch."""
    text = query.strip()
    if landing is not None:
        # Literally, without normalising: a refused member's path may hold "..".
        for prefix in dict.fromkeys((str(landing), str(Path(landing).resolve()))):
            if text.startswith(prefix.rstrip("/") + "/"):
                text = text[len(prefix.rstrip("/")) + 1 :]
                break
    text = text.removeprefix("./")
    out = [("path in batch", f"path = {sql_literal(text)}")]
    parts = text.split("/")
    if len(parts) >= 2 and all(parts[:2]):
        source, rest = parts[0], "/".join(parts[1:])
        prefix = batch_key(source, "x")[:-1]  # "<safe source>."
        out.append(
            (
                "landing path (manifest)",
                f"starts_with(batch, {sql_literal(prefix)}) AND path = {sql_literal(rest)}",
            )
        )
    if len(parts) >= 3 and all(parts[:2]):
        batch = batch_key(parts[0], _chunk_stem(parts[1]))
        inner = "/".join(parts[2:])
        out.append(
            ("landing path", f"batch = {sql_literal(batch)} AND path = {sql_literal(inner)}")
        )
    return out


@dataclass
class _Matches:
    keys: set[str] = field(default_factory=set)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    matched_by: list[str] = field(default_factory=list)


def _resolve(snap: _Snapshot, query: str, landing: Path | None) -> _Matches:
    """The images and refused files ``query`` names. Refused files are found by path, URL
    and source id (``rejects`` keeps the names they carried), and by key where their bytes
    were read; a refused byte-identical repeat is an alias of the copy its batch kept, so
    its URL, ``source:id`` or path resolves to that copy too (the same bytes train under
    the kept copy's name)."""
    q = query.strip()
    m = _Matches()

    def image_keys(how: str, flt: str) -> None:
        keys = {r["key"] for r in snap.read("images", flt, ["key"])}
        if keys:
            m.keys |= keys
            m.matched_by.append(how)

    def rejected_files(how: str, flt: str, column: str) -> None:
        # A refused file found by its path, URL or source id; a refused byte-identical
        # repeat (ALIAS_REASON) names the copy its batch kept: that copy is audited too.
        if not snap.has("rejects", column):  # a rejects table from before aliases
            return
        rejected = [r for r in snap.read("rejects", flt) if r not in m.rejects]
        if not rejected:
            return
        m.rejects += rejected
        aliases = {r["key"] for r in rejected if r.get("reason") == ALIAS_REASON and r.get("key")}
        others = [r for r in rejected if r.get("reason") != ALIAS_REASON or not r.get("key")]
        if aliases:
            m.matched_by.append(f"{how} (alias of a rejected byte-identical copy)")
        if others:
            m.matched_by.append(f"{how} (rejects)")
        m.keys |= {r["key"] for r in rejected if r.get("key")}

    if not q:
        return m
    if _is_key(q):
        m.keys.add(q.lower())
        m.matched_by.append("content key")
        return m
    if q.lower().startswith(("http://", "https://")):
        image_keys("url", f"url = {sql_literal(q)}")
        rejected_files("url", f"url = {sql_literal(q)}", "url")
    if ":" in q:
        source, sid = (p.strip() for p in q.split(":", 1))
        if source and sid:
            flt = f"source = {sql_literal(source)} AND source_id = {sql_literal(sid)}"
            image_keys("source:id", flt)
            rejected_files("source:id", flt, "source_id")
    image_keys("source id", f"source_id = {sql_literal(q)}")
    rejected_files("source id", f"source_id = {sql_literal(q)}", "source_id")
    for how, flt in path_conditions(q, landing):
        image_keys(how, flt)
        rejected_files(how, flt, "path")
    return m


def _rows_by_key(snap: _Snapshot, table: str, keys: Iterable[str]) -> list[dict[str, Any]]:
    column = next((c for c in KEY_COLUMNS if snap.has(table, c)), None)
    keys = sorted(set(keys))
    if column is None or not keys:
        return []
    return snap.read(table, in_list(column, keys))


# --------------------------------------------------------------------------- verdicts


def _when(value: Any) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.UTC)
        return value.strftime("%Y-%m-%d %H:%M:%S UTC")
    return "an unrecorded time"


def _slot(row: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    return row.get("relative_dir"), row.get("shard"), row.get("index_in_shard")


def _one(rows: Sequence[Mapping[str, Any]], batch: str, key: str) -> dict[str, Any] | None:
    for r in rows:
        if r.get("batch") == batch and r.get("key") == key:
            return dict(r)
    return None


def _reason_text(
    reason: str,
    skip: Mapping[str, Any],
    rows: Mapping[str, Sequence[Mapping[str, Any]]],
    batch: str,
    key: str,
    keeper: str | None,
    since: str | None = None,
) -> str:
    details: list[str] = []
    if reason == "opt_out":
        lists = skip.get("opt_out_list_ids") or []
        if lists:
            details.append(("list " if len(lists) == 1 else "lists ") + ", ".join(lists))
    elif reason == "duplicate":
        if keeper:
            details.append(keeper)
    elif reason.startswith("class_"):
        if skip.get("class_label"):
            details.append(f"label {skip['class_label']}")
    elif reason == "pending":
        missing = [
            what
            for table, what in (("caption_classes", "class label"), ("phash_clusters", "dedup"))
            if _one(rows.get(table, ()), batch, key) is None
        ]
        if missing:
            details.append("waiting for " + " and ".join(missing))
    for column, value in skip.items():
        if column in _SKIP_CORE_COLUMNS or not column.startswith(reason) or value in (None, [], ""):
            continue
        shown = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
        details.append(f"{column} {shown}")
    if since is not None:
        details.append(f"since {since}")
    return f"{reason} ({'; '.join(details)})" if details else reason


def _copy_verdict(
    snap: _Snapshot,
    rows: Mapping[str, Sequence[Mapping[str, Any]]],
    batch: str,
    key: str,
    path: str | None,
    describe_keeper: bool = True,
) -> CopyVerdict:
    def verdict(status: str, line: str) -> CopyVerdict:
        return CopyVerdict(batch, key, path, status, line)

    placed = _one(rows.get("shard_samples", ()), batch, key)
    skip = _one(rows.get("skip_audit", ()), batch, key)
    apart = snap.tree_apart(batch)
    if apart is not None:
        return verdict(
            UNDECIDED,
            f"undecided: the shard tree of {batch} is not the one shard_samples records "
            f"({apart}); mds_shards for {batch} was interrupted or is running: rerun it, then "
            "skip_lists",
        )
    if placed is not None:
        return _sharded_verdict(snap, rows, placed, skip, batch, key, path, describe_keeper)
    stale = " (a skip decision from an earlier shard layout remains)" if skip else ""
    resolution = _one(rows.get("resolution", ()), batch, key)
    if resolution is None:
        why = f"not profiled yet (resolution_profile has not run for {batch})"
    elif not resolution.get("eligible"):
        why = f"ineligible ({resolution.get('ineligible_reason') or 'no reason recorded'})"
    elif _one(rows.get("bucket_assignments", ()), batch, key) is None:
        why = f"unassigned (bucket_assignments has not run for {batch})"
    else:
        caption = _one(rows.get("captions", ()), batch, key)
        if caption is None:
            why = "no_caption (no caption row)"
        elif not (caption.get("caption") or "").strip():
            why = "no_caption (the caption is empty)"
        else:
            why = f"not written (mds_shards has not run for {batch} since, or rendering failed)"
    return verdict(NEVER_SHARDED, f"never sharded: {why}{stale}")


_LAG = (
    "skip_audit does not record this decision yet: a skip_lists run of {batch} was "
    "interrupted or is still running (rerun skip_lists for {batch})"
)


def _sharded_verdict(
    snap: _Snapshot,
    rows: Mapping[str, Sequence[Mapping[str, Any]]],
    placed: Mapping[str, Any],
    skip: Mapping[str, Any] | None,
    batch: str,
    key: str,
    path: str | None,
    describe_keeper: bool,
) -> CopyVerdict:
    """A sharded copy's verdict: in or out as the live skip-list generation says (what the
    loader obeys), explained by the ``skip_audit`` row when that row records the same
    decision about the same slot, and said to lag when it does not (a killed or running
    ``skip_lists`` publishes its generations before it commits the audit)."""

    def verdict(status: str, line: str) -> CopyVerdict:
        return CopyVerdict(batch, key, path, status, line)

    loc = f"{placed['relative_dir']}/{placed['shard']} #{placed['index_in_shard']}"
    live = snap.live.slot(placed["relative_dir"], placed["shard"], placed["index_in_shard"])
    if isinstance(live, Unreadable):
        return verdict(
            UNDECIDED,
            f"undecided: sharded at {loc}, but the loader refuses that directory ("
            f"{live.reason}), so nothing of it trains until skip_lists (or mds_shards, if "
            f"the directory is gone) is rerun for {batch}",
        )
    recorded = skip if skip is not None and _slot(skip) == _slot(placed) else None
    agrees = (
        recorded is not None
        and bool(recorded.get("excluded")) == live.skipped
        and sorted(recorded.get("reasons") or []) == sorted(live.reasons)
    )
    lag = _LAG.format(batch=batch)
    if not live.skipped:
        return verdict(IN_TRAINING, f"in training: {loc}" + ("" if agrees else f" ({lag})"))
    if not agrees:
        return verdict(
            EXCLUDED,
            f"not in training: {', '.join(live.reasons) or 'unknown'} (per the live skip-list "
            f"generation {live.generation[:12]} of {placed['relative_dir']}; {lag})",
        )
    assert recorded is not None
    reasons = list(recorded.get("reasons") or [])
    keeper = None
    if "duplicate" in reasons and describe_keeper:
        keeper = _keeper_text(snap, rows, recorded, batch, key)
    head = _when(recorded.get("first_excluded_at") or recorded.get("decided_at"))
    stamps = recorded.get("reason_since") or []
    since = dict(zip(reasons, stamps, strict=True)) if len(stamps) == len(reasons) else {}
    texts = []
    for r in reasons:
        own = _when(since[r]) if since.get(r) is not None else None
        texts.append(
            _reason_text(r, recorded, rows, batch, key, keeper, own if own != head else None)
        )
    return verdict(EXCLUDED, f"not in training since {head}: {', '.join(texts)}")


def _keeper_text(
    snap: _Snapshot,
    rows: Mapping[str, Sequence[Mapping[str, Any]]],
    skip: Mapping[str, Any],
    batch: str,
    key: str,
) -> str:
    """The keeper (the copy training keeps instead) and whether it is in training."""
    cluster = _one(rows.get("phash_clusters", ()), batch, key) or {}
    keeper_key = skip.get("duplicate_of") or cluster.get("keeper_key")
    if not keeper_key:
        return "keeper not recorded"
    keeper_batch = skip.get("duplicate_of_batch") or (
        cluster.get("keeper_batch") if cluster.get("keeper_key") == keeper_key else None
    )
    keeper_rows = {t: _rows_by_key(snap, t, [keeper_key]) for t in _VERDICT_TABLES}
    batches = sorted({r["batch"] for r in keeper_rows["images"]})
    if keeper_batch is None and batches:
        keeper_batch = batches[0]
    if keeper_batch is None or keeper_batch not in batches:
        return f"keeper {keeper_key} is in no batch of the lab"
    kept = _copy_verdict(snap, keeper_rows, keeper_batch, keeper_key, None, describe_keeper=False)
    return f"keeper {keeper_key} of {keeper_batch} {kept.line}"


def _verdicts(snap: _Snapshot, trail: AuditTrail) -> list[CopyVerdict]:
    copies: list[CopyVerdict] = []
    for image in trail.tables.get("images", ()):
        copies.append(
            _copy_verdict(snap, trail.tables, image["batch"], image["key"], image.get("path"))
        )
    for reject in trail.tables.get("rejects", ()):
        detail = reject.get("detail")
        line = f"rejected at ingest: {reject['reason']}" + (f" ({detail})" if detail else "")
        copies.append(
            CopyVerdict(reject["batch"], reject.get("key"), reject["path"], REJECTED, line)
        )
    return sorted(copies, key=lambda c: (_RANK[c.status], c.batch, c.key or "", c.path or ""))


def audit_image(
    lab: Lab, query: str, landing: Path | str | None = None, *, shards_root: str
) -> AuditTrail:
    """The trail of the image(s) ``query`` names, with one verdict per copy.

    ``shards_root`` is the shard tree the loader reads: a sharded copy's verdict is what its
    directory's live skip-list generation says. ``NoLab`` when no lab table exists.
    """
    snap = _Snapshot(lab, str(shards_root))
    matches = _resolve(snap, query, Path(landing) if landing is not None else None)
    keys = sorted(matches.keys)
    trail = AuditTrail(query=query, keys=keys[:MAX_KEYS], matched_by=matches.matched_by)
    rejects = sorted(matches.rejects, key=lambda r: (r["batch"], r["path"]))
    matches.rejects = rejects[:MAX_KEYS]
    trail.keys_not_listed = max(0, len(keys) - MAX_KEYS) + max(0, len(rejects) - MAX_KEYS)
    if not keys and not matches.rejects:
        return trail
    for table in snap.tables:
        rows = _rows_by_key(snap, table, trail.keys)
        if table == "rejects":
            seen = {(r["batch"], r["path"]) for r in rows}
            rows += [r for r in matches.rejects if (r["batch"], r["path"]) not in seen]
        if rows or any(snap.has(table, c) for c in KEY_COLUMNS):
            trail.tables[table] = rows
            trail.versions[table] = snap.versions[table]
    trail.copies = _verdicts(snap, trail)
    trail.snapshots = _snapshot_lineage(lab, trail.keys)
    return trail


def _snapshot_lineage(lab: Lab, keys: list[str]) -> list[dict[str, Any]]:
    """The committed snapshots (id, status, date) whose training set held the audited keys,
    derived from their frozen directories (``snapshots.members.holders``: fails closed)."""
    out = [
        {
            "snapshot_id": s["snapshot_id"],
            "created_at": s["created_at"],
            "status": s["status"],
            "batch": s["batch"],
            "key": key,
        }
        for key, held in snapshots_containing(lab, keys).items()
        for s in held
    ]
    return sorted(out, key=lambda r: (r["created_at"], r["snapshot_id"], r["batch"], r["key"]))
