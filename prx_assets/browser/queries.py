"""The curation browser's queries over the Lance lab, answered through the lab's indexes.

Why a small planner: the lab is one table per stage, joined by ``key``, and Lance has no
joins. A query is one *primary* search (full text on ``captions``, nearest neighbours on
``caption_embeddings``, or a filtered listing) narrowed by filters that live in other
tables (``caption_classes.label``, ``images.source``, ``resolution`` sizes, ...). Each
filter is a predicate on its own table, answered by that table's scalar index:

- a *selective* filter (at most ``prefilter_max_keys`` matching rows) is turned into its
  key set and given to the primary search as a ``key IN (...)`` prefilter (BTREE on key),
  so FTS and ANN rank only rows that pass;
- a *broad* filter is checked afterwards on the primary's candidates, again by key through
  the index. The primary search first fetches ``limit`` / (share of rows passing), the
  share estimated from index-only counts, and widens x4 while too few pass.

Nothing here writes: the indexes are the tables' own (declared in their specs, built by
every write, kept by the maintenance job); :func:`index_report` only says which are there.
All Lance access goes through ``Lab``/``LabView`` (``core/lab.py``), table names come
from the registry (``core/tables.py``). No web code: the HTTP app (``app.py``) and the
benchmark call the same functions.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from prx_assets.core import tables as lab_tables
from prx_assets.core.audit import NoLab, audit_image
from prx_assets.core.captions.models.base import LABELS
from prx_assets.core.lab import (
    Lab,
    LabView,
    TableSpec,
    full_text_query,
    in_list,
    no_lab_at,
    sql_literal,
)
from prx_assets.core.skiplists.live import LiveGenerations, Unreadable
from prx_assets.core.skiplists.sidecars import REASON_CODES
from prx_assets.core.snapshots.members import holders
from prx_assets.core.snapshots.pins import SNAPSHOT_ID_RE

#: The tables the browser reads, as the registry declares them.
BROWSER_TABLES: tuple[TableSpec, ...] = (
    lab_tables.IMAGES,
    lab_tables.RESOLUTION,
    lab_tables.CAPTIONS,
    lab_tables.CAPTION_CLASSES,
    lab_tables.CAPTION_EMBEDDINGS,
    lab_tables.BUCKET_ASSIGNMENTS,
    lab_tables.SKIP_AUDIT,
)
IMAGES, RESOLUTION, CAPTIONS, CLASSES, EMBEDDINGS, BUCKETS, SKIP_AUDIT = (
    t.name for t in BROWSER_TABLES
)
#: Full-text search needs this INVERTED index, which the caption stage keeps (it is not a
#: scalar index of the spec); every other index the browser uses is in the tables' specs.
TEXT_INDEX = (CAPTIONS, "caption")

#: Tables later stages write; until they exist their filters are unavailable, not errors.
OPTIONAL_TABLES: dict[str, str] = {
    BUCKETS: "the shards stage has not written bucket_assignments yet",
    SKIP_AUDIT: "the skip-lists stage has not written skip_audit yet",
    "training_snapshots": "no training snapshot has been made yet (prx-assets snapshot create)",
}
SNAPSHOTS = "training_snapshots"
# The snapshot filter is never a table predicate: which samples a snapshot holds is derived
# from its frozen directories (core/snapshots/members.py), so it always runs as a post-filter
# on candidate keys. Its ``_Plan.post`` entry carries the snapshot ids, one per line.
SNAPSHOT_FILTER = "snapshot membership"
SKIP_STATES: tuple[str, ...] = ("kept", "excluded")
SKIP_CHOICES: tuple[str, ...] = (*SKIP_STATES, *REASON_CODES)

KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_SHAPE_RE = re.compile(r"^[0-9]{1,5}x[0-9]{1,5}$")


def _shape_order(shape: str) -> tuple[int, int, str]:
    """``<H>x<W>`` by height, then width, as numbers (``704x1408`` before ``1024x1024``)."""
    h, _, w = shape.partition("x")
    return (int(h), int(w), shape) if h.isdigit() and w.isdigit() else (1 << 30, 0, shape)


_BATCH_RE = re.compile(r"^[A-Za-z0-9_-]{1,120}\.[A-Za-z0-9_-]{1,120}$")  # sources.batch_key
_MAX_VALUE_CHARS = 200

MAX_QUERY_CHARS = 400
# Numbers a URL may give: ASCII digits only (int() also takes "1_000" and other scripts'
# digits), bounded by what the columns hold, so no value reaches Lance's SQL out of range.
MAX_SIDE = 2**31 - 1  # resolution.width/height are int32
MAX_TIER = 2**31 - 1  # bucket_assignments.tier is int32
MAX_MEGAPIXELS = 1e6
_INT_RE = re.compile(r"[0-9]{1,10}")
_FLOAT_RE = re.compile(r"(?:[0-9]{1,15}(?:\.[0-9]{0,15})?|\.[0-9]{1,15})(?:[eE][+-]?[0-9]{1,3})?")
MAX_LIMIT = 200
PREFILTER_MAX_KEYS = 5_000
MAX_CANDIDATES = 20_000
WIDEN_FACTOR = 4
OVERFETCH = 1.5  # margin on the estimated candidates a post-filtered page needs
REFINE_BUDGET = 2_000  # most vectors re-ranked exactly per nearest-neighbour read


class QueryError(ValueError):
    """A request the browser cannot answer as asked; the message says what to change."""


def parse_number(name: str, raw: str, kind: type[int] | type[float], maximum: float) -> Any:
    """A URL parameter as a non-negative ``kind`` up to ``maximum``, or a QueryError that
    names the parameter, the accepted range and (bounded) the value given."""
    text = raw.strip()
    pattern = _INT_RE if kind is int else _FLOAT_RE
    what = "a whole number" if kind is int else "a number"
    if pattern.fullmatch(text):
        value = kind(text)
        if np.isfinite(value) and 0 <= value <= maximum:
            return value
    shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
    top = str(int(maximum)) if kind is int else f"{maximum:g}"
    raise QueryError(f"{name} must be {what} from 0 to {top}, got {shown!r}")


class NotFound(LookupError):
    """The key is not in the table the request needs."""


# --------------------------------------------------------------------------- filters


@dataclass(frozen=True)
class Filters:
    """What a result must satisfy; every field empty/None means "no condition"."""

    batches: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    tiers: tuple[int, ...] = ()
    shapes: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()  # "kept", "excluded" or reason codes (any of them)
    min_short_side: int | None = None
    max_short_side: int | None = None
    min_megapixels: float | None = None
    max_megapixels: float | None = None
    snapshots: tuple[str, ...] = ()  # in the training set of any of these snapshots

    def __post_init__(self) -> None:
        bad = [v for v in self.batches if not _BATCH_RE.match(v)]
        if bad:
            raise QueryError(f"invalid batch {bad[0][:80]!r}; batches look like <source>.<chunk>")
        # Source names come from manifests: any text, quoted by sql_literal, but bounded.
        bad = [v for v in self.sources if len(v) > _MAX_VALUE_CHARS or not v.isprintable()]
        if bad:
            raise QueryError(f"invalid source {bad[0][:80]!r}: too long or not printable")
        bad = [v for v in self.labels if v not in LABELS]
        if bad:
            raise QueryError(f"unknown class label {bad[0]!r}; labels are {', '.join(LABELS)}")
        bad = [v for v in self.shapes if not _SHAPE_RE.match(v)]
        if bad:
            raise QueryError(f"invalid shape {bad[0]!r}; shapes are written <H>x<W>, e.g. 1024x768")
        bad = [v for v in self.snapshots if not SNAPSHOT_ID_RE.match(v)]
        if bad:
            raise QueryError(f"invalid snapshot name {bad[0][:80]!r}")
        bad = [v for v in self.skip if v not in SKIP_CHOICES]
        if bad:
            raise QueryError(
                f"unknown skip filter {bad[0]!r}; choose from {', '.join(SKIP_CHOICES)}"
            )
        limits = {
            "min_short_side": MAX_SIDE,
            "max_short_side": MAX_SIDE,
            "min_megapixels": MAX_MEGAPIXELS,
            "max_megapixels": MAX_MEGAPIXELS,
        }
        for name, maximum in limits.items():
            v = getattr(self, name)
            if v is not None and (not np.isfinite(v) or not 0 <= v <= maximum):
                raise QueryError(f"{name} must be a number from 0 to {maximum:g}, got {v!r}")
        bad_tiers = [t for t in self.tiers if not 0 <= t <= MAX_TIER]
        if bad_tiers:
            raise QueryError(f"tier must be from 0 to {MAX_TIER}, got {bad_tiers[0]!r}")
        lo, hi = self.min_short_side, self.max_short_side
        if lo is not None and hi is not None and lo > hi:
            raise QueryError(f"min_short_side {lo} is above max_short_side {hi}")
        lo_mp, hi_mp = self.min_megapixels, self.max_megapixels
        if lo_mp is not None and hi_mp is not None and lo_mp > hi_mp:
            raise QueryError(f"min_megapixels {lo_mp} is above max_megapixels {hi_mp}")

    @classmethod
    def from_params(cls, params: Mapping[str, Sequence[str]]) -> Filters:
        """From URL query parameters: repeated, or comma-separated (not for ``source``,
        whose names may hold commas)."""

        def many(name: str) -> tuple[str, ...]:
            out: list[str] = []
            for raw in params.get(name, ()):
                if name == "source":
                    out.append(raw)
                else:
                    out.extend(p.strip() for p in raw.split(",") if p.strip())
            return tuple(dict.fromkeys(out))

        def number(name: str, kind: type[int] | type[float], maximum: float) -> Any:
            raw = [v for v in params.get(name, ()) if v.strip()]
            return parse_number(name, raw[-1], kind, maximum) if raw else None

        return cls(
            batches=many("batch"),
            sources=many("source"),
            labels=many("label"),
            tiers=tuple(parse_number("tier", t, int, MAX_TIER) for t in many("tier")),
            shapes=many("shape"),
            skip=many("skip"),
            min_short_side=number("min_side", int, MAX_SIDE),
            max_short_side=number("max_side", int, MAX_SIDE),
            min_megapixels=number("min_mp", float, MAX_MEGAPIXELS),
            max_megapixels=number("max_mp", float, MAX_MEGAPIXELS),
            snapshots=many("snapshot"),
        )

    def batch_clause(self) -> str | None:
        return in_list("batch", self.batches) if self.batches else None

    def table_conditions(self) -> dict[str, str]:
        """Per table, the condition (without batch) a key must meet there."""
        out: dict[str, list[str]] = {}
        if self.sources:
            out.setdefault(IMAGES, []).append(in_list("source", self.sources))
        if self.min_short_side is not None:
            m = int(self.min_short_side)
            out.setdefault(RESOLUTION, []).append(f"width >= {m} AND height >= {m}")
        if self.max_short_side is not None:
            m = int(self.max_short_side)
            out.setdefault(RESOLUTION, []).append(f"(width <= {m} OR height <= {m})")
        if self.min_megapixels is not None:
            out.setdefault(RESOLUTION, []).append(f"megapixels >= {float(self.min_megapixels)!r}")
        if self.max_megapixels is not None:
            out.setdefault(RESOLUTION, []).append(f"megapixels <= {float(self.max_megapixels)!r}")
        if self.labels:
            out.setdefault(CLASSES, []).append(in_list("label", self.labels))
        if self.tiers:
            tiers = ", ".join(str(int(t)) for t in sorted(set(self.tiers)))
            out.setdefault(BUCKETS, []).append(f"tier IN ({tiers})")
        if self.shapes:
            out.setdefault(BUCKETS, []).append(in_list("shape", self.shapes))
        if self.skip:
            parts = []
            if "kept" in self.skip:
                parts.append("excluded = false")
            if "excluded" in self.skip:
                parts.append("excluded = true")
            reasons = sorted(set(self.skip) - set(SKIP_STATES))
            if reasons:
                parts.append(f"array_has_any(reasons, [{', '.join(map(sql_literal, reasons))}])")
            out.setdefault(SKIP_AUDIT, []).append("(" + " OR ".join(parts) + ")")
        return {t: " AND ".join(conds) for t, conds in out.items()}

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _and(*parts: str | None) -> str | None:
    kept = [p for p in parts if p]
    if not kept:
        return None
    return " AND ".join(f"({p})" for p in kept) if len(kept) > 1 else kept[0]


# --------------------------------------------------------------------------- results


@dataclass
class Step:
    """One Lance read a query made: which table, why, how many rows, how long."""

    table: str
    purpose: str
    rows: int
    ms: float
    uses: list[str] = field(default_factory=list)  # index operators in the plan
    plan: str | None = None


@dataclass
class Result:
    """A query's answer with its cost: the hits, and every Lance read (``steps``) behind them."""

    mode: str  # "search", "similar" or "browse"
    hits: list[dict[str, Any]]
    candidates: int  # primary rows examined
    exhausted: bool  # no more rows could have matched
    steps: list[Step] = field(default_factory=list)
    ms: float = 0.0
    reference: str | None = None  # the key of a "more like this" query
    explain: bool = False  # keep each step's Lance plan

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_PLAN_OPERATORS = (
    "ScalarIndexQuery",
    "MaterializeIndex",
    "MatchQuery",
    "FlatMatchQuery",
    "ANNSubIndex",
    "ANNIvfPartition",
    "KNNVectorDistance",
)


def plan_operators(plan: str) -> list[str]:
    """The index-related operators a Lance plan uses (flat KNN is brute force)."""
    return [op for op in _PLAN_OPERATORS if re.search(rf"\b{op}\b", plan)]


@dataclass
class _Plan:
    """How a query's cross-table filters run: a key-set prefilter and/or post-filters."""

    keys: set[str] | None = None  # selective filters' keys (intersection); None: none
    post: list[tuple[str, str, float]] = field(default_factory=list)  # table, predicate, share

    def where(self, f: Filters) -> str | None:
        """The primary search's prefilter: batch plus the selective key set."""
        return _and(f.batch_clause(), in_list("key", self.keys) if self.keys is not None else None)


# --------------------------------------------------------------------------- indexes


def index_report(view: LabView) -> dict[str, str]:
    """``"table.column" -> present | missing | empty table | absent table`` for each index
    the browser's reads use: the indexes the specs of :data:`BROWSER_TABLES` declare, and
    the caption full-text index.

    Read-only. A missing index changes how fast a query runs, never its answer (Lance scans
    the column instead). The write path builds a spec's indexes on every commit, so one is
    missing only on a lab written before the spec listed it; the ``lance_maintenance`` job
    builds it there.
    """
    wanted = [(t.name, column) for t in BROWSER_TABLES for column, _ in t.indexes]
    report: dict[str, str] = {}
    for table, column in [*wanted, TEXT_INDEX]:
        name = f"{table}.{column}"
        if not view.exists(table):
            report[name] = "absent table"
        elif column in view.indexed_columns(table):
            report[name] = "present"
        elif view.count(table) == 0:
            report[name] = "empty table"  # Lance indexes nothing until the first rows
        else:
            report[name] = "missing"
    return report


# --------------------------------------------------------------------------- queries


def _jsonable(v: Any) -> Any:
    if isinstance(v, dt.datetime | dt.date):
        return v.isoformat()
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    if isinstance(v, float) and not np.isfinite(v):
        return None
    return v


class LabQueries:
    """Read-only queries over one lab; safe to share between threads.

    Datasets are reopened after ``refresh_s`` so new partitions show up without a restart.
    ``use_scalar_index=False`` / ``use_vector_index=False`` turn indexes off (the
    benchmark's full-scan baselines); ``explain=True`` keeps each step's Lance plan.
    ``nprobes`` / ``refine_factor`` tune the vector index: re-ranking 10x the candidates
    with the stored vectors took IVF_PQ recall@10 from 0.19 to 1.0 on 100k clustered
    embeddings for ~2 ms (0.83 at 1M rows; benchmarks/bench_browser.py).
    """

    def __init__(
        self,
        lab: Lab,
        refresh_s: float = 5.0,
        prefilter_max_keys: int = PREFILTER_MAX_KEYS,
        max_candidates: int = MAX_CANDIDATES,
        use_scalar_index: bool = True,
        explain: bool = False,
        nprobes: int = 20,
        refine_factor: int | None = 10,
        use_vector_index: bool = True,
        shards_root: str | None = None,
    ) -> None:
        if prefilter_max_keys < 1 or max_candidates < 1:
            raise ValueError("prefilter_max_keys and max_candidates must be positive")
        self.lab = lab
        self.refresh_s = refresh_s
        self.prefilter_max_keys = prefilter_max_keys
        self.max_candidates = max_candidates
        self.use_scalar_index = use_scalar_index
        self.explain = explain
        self.nprobes = nprobes
        self.refine_factor = refine_factor
        self.use_vector_index = use_vector_index
        # The tree the loader reads: audit verdicts come from its live skip-lists (None: the
        # audit panel refuses rather than answer from the lab alone).
        self.shards_root = shards_root
        self._lock = threading.Lock()
        self._view: tuple[float, LabView] | None = None
        self._facet_cache: dict[tuple[str, str, int | None], list[Any]] = {}

    # ------------------------------------------------------------------ the lab

    def view(self) -> LabView:
        """The lab as queries read it now: one view (each table opened once), replaced after
        ``refresh_s`` so that new partitions show up without a restart."""
        now = time.monotonic()
        with self._lock:
            if self._view is None or now - self._view[0] >= self.refresh_s:
                self._view = (now, self.lab.view())
            return self._view[1]

    def _need(self, table: str) -> LabView:
        view = self.view()
        if not view.exists(table):
            note = OPTIONAL_TABLES.get(table, f"materialise the {table} asset first")
            raise QueryError(f"no {table} table in the lab: {note}")
        return view

    def tables(self) -> dict[str, dict[str, Any]]:
        """Presence, rows, version and indexed columns of every table the browser reads."""
        view = self.view()
        out: dict[str, dict[str, Any]] = {}
        for table in (t.name for t in BROWSER_TABLES):
            if not view.exists(table):
                out[table] = {"present": False, "note": OPTIONAL_TABLES.get(table, "")}
                continue
            indexed = view.indexed_columns(table)
            out[table] = {
                "present": True,
                "rows": view.count(table),
                "version": view.version(table),
                "indexes": {c: sorted(k) for c, k in sorted(indexed.items())},
            }
        return out

    def _distinct(self, table: str, column: str) -> list[Any]:
        view = self.view()
        schema = view.schema(table)
        if schema is None or column not in schema.names:
            return []
        cache_key = (table, column, view.version(table))
        with self._lock:
            if cache_key in self._facet_cache:
                return self._facet_cache[cache_key]
        values = view.read(table, [column]).column(column).unique().to_pylist()
        values = sorted(v for v in values if v is not None)
        with self._lock:
            for old in [k for k in self._facet_cache if k[:2] == (table, column)]:
                del self._facet_cache[old]  # an older version's values
            self._facet_cache[cache_key] = values
        return values

    def _snapshot_ids(self) -> list[str]:
        """Names of the recorded training snapshots, oldest first."""
        view = self.view()
        if not view.exists("training_snapshots"):
            return []
        rows = view.read("training_snapshots", ["snapshot_id", "created_at"]).to_pylist()
        return [
            r["snapshot_id"]
            for r in sorted(rows, key=lambda r: (r["created_at"], r["snapshot_id"]))
        ]

    def facets(self) -> dict[str, Any]:
        """Values the filters offer, and which filters are unavailable and why."""
        tables = self.tables()
        disabled: dict[str, str] = {}
        for table, filters in ((BUCKETS, ("tier", "shape")), (SKIP_AUDIT, ("skip",))):
            if not tables[table]["present"]:
                for name in filters:
                    disabled[name] = OPTIONAL_TABLES[table]
        for table, filters in (
            (IMAGES, ("source",)),
            (RESOLUTION, ("min_side", "max_side", "min_mp", "max_mp")),
            (CLASSES, ("label",)),
        ):
            if not tables[table]["present"]:
                for name in filters:
                    disabled[name] = f"no {table} table in the lab yet"
        if not self.view().exists(SNAPSHOTS):
            disabled["snapshot"] = OPTIONAL_TABLES[SNAPSHOTS]
        if not tables[CAPTIONS]["present"]:
            disabled["q"] = "no captions table in the lab yet"
        if not tables[EMBEDDINGS]["present"]:
            disabled["similar"] = "no caption_embeddings table in the lab yet"
        return {
            "tables": tables,
            "batches": self._distinct(IMAGES, "batch"),
            "sources": self._distinct(IMAGES, "source"),
            "labels": list(LABELS),
            "tiers": self._distinct(BUCKETS, "tier"),
            "shapes": sorted(self._distinct(BUCKETS, "shape"), key=_shape_order),
            "skip": list(SKIP_CHOICES),
            "snapshots": self._snapshot_ids(),
            "disabled": disabled,
        }

    # ------------------------------------------------------------------ one Lance read

    def _read(
        self,
        result: Result,
        table: str,
        purpose: str,
        columns: list[str],
        filter: str | None = None,
        limit: int | None = None,
        **search: Any,
    ) -> pa.Table:
        view = self._need(table)
        scan: dict[str, Any] = {"limit": limit, "use_scalar_index": self.use_scalar_index}
        scan.update(search)
        if search and filter:
            scan["prefilter"] = True
        t0 = time.perf_counter()
        table_out = view.read(table, columns, filter, **scan)
        ms = (time.perf_counter() - t0) * 1000
        explain = self.explain or result.explain
        plan = view.explain(table, columns, filter, **scan) if explain else None
        result.steps.append(
            Step(table, purpose, table_out.num_rows, round(ms, 2), plan_operators(plan or ""), plan)
        )
        return table_out

    # ------------------------------------------------------------------ filter planning

    def _count(self, result: Result, table: str, purpose: str, predicate: str | None) -> int:
        view = self._need(table)
        scan = {"use_scalar_index": self.use_scalar_index}
        t0 = time.perf_counter()
        n = view.count(table, predicate, **scan)
        ms = (time.perf_counter() - t0) * 1000
        explain = self.explain or result.explain
        plan = view.explain(table, [], predicate, with_row_id=True, **scan) if explain else None
        result.steps.append(Step(table, purpose, n, round(ms, 2), plan_operators(plan or ""), plan))
        return n

    def _plan(self, f: Filters, result: Result) -> _Plan:
        """Count each filter's matches (index-only); selective -> key set, broad -> post."""
        plan = _Plan()
        keysets: list[set[str]] = []
        scope = f.batch_clause()
        for table, condition in f.table_conditions().items():
            predicate = _and(scope, condition) or condition
            n = self._count(result, table, f"count: {condition}", predicate)
            if n <= self.prefilter_max_keys:
                rows = self._read(result, table, f"filter: {condition}", ["key"], predicate)
                keysets.append(set(rows.column("key").to_pylist()))
                continue
            # Its share of the rows the primary search sees (batch is already prefiltered).
            total = self._count(result, table, "count: scope", scope) if scope else None
            if total is None:
                total = self._need(table).count(table)
            plan.post.append((table, predicate, n / max(1, total)))
        if f.snapshots:
            self._need(SNAPSHOTS)
            plan.post.append((SNAPSHOT_FILTER, "\n".join(f.snapshots), self._kept_share(f)))
        if keysets:
            plan.keys = set.intersection(*keysets)
        plan.post.sort(key=lambda p: p[2])  # the most selective first: fewer keys next
        return plan

    def _kept_share(self, f: Filters) -> float:
        """The largest share of sharded samples the chosen snapshots keep (how many
        candidates a snapshot-filtered page needs)."""
        rows = (
            self.view()
            .read(SNAPSHOTS, ["samples", "kept_samples"], in_list("snapshot_id", f.snapshots))
            .to_pylist()
        )
        if not rows:
            raise QueryError(f"no training snapshot named {f.snapshots[0][:80]!r}")
        return max((r["kept_samples"] or 0) / max(1, r["samples"] or 0) for r in rows)

    def _post_filter(
        self, result: Result, keys: list[str], post: Sequence[tuple[str, str, float]]
    ) -> set[str]:
        passing = set(keys)
        for table, predicate, _ in post:
            if not passing:
                break
            if table == SNAPSHOT_FILTER:
                passing &= self._held(result, passing, set(predicate.split("\n")))
                continue
            rows = self._read(
                result,
                table,
                f"post-filter {len(passing)} candidates",
                ["key"],
                _and(in_list("key", passing), predicate),
            )
            passing &= set(rows.column("key").to_pylist())
        return passing

    def _held(self, result: Result, keys: set[str], snapshots: set[str]) -> set[str]:
        """The ``keys`` one of ``snapshots`` held (derived: ``members.holders``)."""
        t0 = time.perf_counter()
        held = {k for (_, k), ids in holders(self.lab, keys, snapshots).items() if ids}
        ms = round((time.perf_counter() - t0) * 1000, 2)
        result.steps.append(Step(SNAPSHOTS, f"held by {len(snapshots)} snapshot(s)", len(held), ms))
        return held

    def _ranked(
        self,
        result: Result,
        limit: int,
        post: Sequence[tuple[str, str, float]],
        fetch_page: Any,
    ) -> list[dict[str, Any]]:
        """Fetch enough primary candidates for ``limit`` to pass the post-filters.

        The first fetch assumes the filters are independent (``limit`` / product of their
        shares, plus a margin); it is widened x4 while too few pass.
        """
        share = float(np.prod([p[2] for p in post])) if post else 1.0
        want = limit / max(share, 1e-9) * (OVERFETCH if post else 1.0)
        fetch = int(min(max(limit, np.ceil(want)), self.max_candidates))
        while True:
            rows = fetch_page(fetch)
            seen: dict[str, dict[str, Any]] = {}
            for row in rows:
                seen.setdefault(row["key"], row)  # first = best ranked copy of a key
            candidates = list(seen.values())
            passing = self._post_filter(result, list(seen), post) if post else set(seen)
            hits = [c for c in candidates if c["key"] in passing]
            exhausted = len(rows) < fetch
            if len(hits) >= limit or exhausted or fetch >= self.max_candidates:
                result.candidates = len(rows)
                result.exhausted = exhausted
                return hits[:limit]
            fetch = min(fetch * WIDEN_FACTOR, self.max_candidates)

    # ------------------------------------------------------------------ the three modes

    def search(
        self,
        text: str,
        filters: Filters | None = None,
        limit: int = 60,
        match: str = "all",
        explain: bool = False,
    ) -> Result:
        """Full-text search over captions (the INVERTED index), best BM25 score first."""
        f = filters or Filters()
        text = " ".join((text or "").split())
        if not text:
            raise QueryError("the search text is empty")
        if len(text) > MAX_QUERY_CHARS:
            raise QueryError(f"the search text is longer than {MAX_QUERY_CHARS} characters")
        if match not in ("all", "any"):
            raise QueryError(f"match must be 'all' or 'any', got {match!r}")
        limit = _check_limit(limit)
        t0 = time.perf_counter()
        result = Result("search", [], 0, False, explain=explain)
        self._need(CAPTIONS)
        plan = self._plan(f, result)
        if plan.keys is not None and not plan.keys:
            return _finish(result, t0, exhausted=True)
        where = plan.where(f)
        query = full_text_query(text, TEXT_INDEX[1], all_terms=match == "all")

        def page(k: int) -> list[dict[str, Any]]:
            rows = self._read(
                result,
                CAPTIONS,
                f"full-text search top {k}",
                ["key", "batch", "_score"],
                where,
                limit=k,
                full_text_query=query,
            ).to_pylist()
            rows.sort(key=lambda r: -r["_score"])
            return [{"key": r["key"], "batch": r["batch"], "score": r["_score"]} for r in rows]

        hits = self._ranked(result, limit, plan.post, page)
        result.hits = self._details(result, hits, f)
        return _finish(result, t0)

    def reference_vector(self, key: str, result: Result | None = None) -> np.ndarray:
        if not KEY_RE.match(key or ""):
            raise QueryError(f"not an image key (64 lowercase hex digits): {key[:80]!r}")
        res = result or Result("similar", [], 0, False)
        rows = self._read(
            res, EMBEDDINGS, "reference vector", ["vector"], f"key = {sql_literal(key)}", limit=1
        )
        if rows.num_rows == 0:
            raise NotFound(
                f"no caption embedding for {key}: it has no caption, or caption_embeddings "
                "has not been materialised for its batch"
            )
        return np.asarray(rows.column("vector")[0].as_py(), dtype=np.float32)

    def similar(
        self, key: str, filters: Filters | None = None, limit: int = 60, explain: bool = False
    ) -> Result:
        """Nearest captions by cosine distance of their embeddings ("more like this").

        The image itself (distance 0) and exact caption duplicates come first. Uses the
        vector index when the table has one, brute force otherwise; filters prefilter.
        """
        f = filters or Filters()
        limit = _check_limit(limit)
        t0 = time.perf_counter()
        result = Result("similar", [], 0, False, reference=key, explain=explain)
        vector = self.reference_vector(key, result)
        plan = self._plan(f, result)
        if plan.keys is not None and not plan.keys:
            return _finish(result, t0, exhausted=True)
        where = plan.where(f)

        def page(k: int) -> list[dict[str, Any]]:
            nearest: dict[str, Any] = {
                "column": "vector",
                "q": vector,
                "k": k,
                "metric": "cosine",
                "nprobes": self.nprobes,
            }
            if self.refine_factor:
                # Re-rank with stored vectors, within a budget: a widened k is a candidate
                # pool for post-filters, where the exact order matters less.
                nearest["refine_factor"] = max(1, min(self.refine_factor, REFINE_BUDGET // k))
            if not self.use_vector_index:
                nearest["use_index"] = False  # exact: the benchmark's brute-force baseline
            rows = self._read(
                result,
                EMBEDDINGS,
                f"nearest {k}",
                ["key", "batch", "_distance"],
                where,
                nearest=nearest,
            ).to_pylist()
            rows.sort(key=lambda r: r["_distance"])
            return [
                {"key": r["key"], "batch": r["batch"], "distance": max(0.0, r["_distance"])}
                for r in rows
            ]

        hits = self._ranked(result, limit, plan.post, page)
        result.hits = self._details(result, hits, f)
        return _finish(result, t0)

    def browse(
        self, filters: Filters | None = None, limit: int = 60, explain: bool = False
    ) -> Result:
        """Images matching the filters, without a text or vector query.

        Listed in key order when a selective filter bounds the answer, else in storage order.
        """
        f = filters or Filters()
        limit = _check_limit(limit)
        t0 = time.perf_counter()
        result = Result("browse", [], 0, False, explain=explain)
        plan = self._plan(f, result)
        if plan.keys is not None:
            # A selective filter bounds the answer: check the rest on that key set.
            ordered = sorted(plan.keys)
            passing = self._post_filter(result, ordered, plan.post) if plan.post else plan.keys
            hits = [{"key": k, "batch": None} for k in ordered if k in passing]
            result.candidates = len(ordered)
            result.exhausted = len(hits) <= limit
            result.hits = self._details(result, hits[:limit], f)
            return _finish(result, t0)
        # No selective filter: list the most selective broad one, post-filter the rest.
        listable = [p for p in plan.post if p[0] != SNAPSHOT_FILTER]
        primary, predicate = listable[0][:2] if listable else (IMAGES, f.batch_clause())
        rest = [p for p in plan.post if not listable or p is not listable[0]]

        def page(k: int) -> list[dict[str, Any]]:
            return self._read(
                result, primary, f"listing {k}", ["key", "batch"], predicate, limit=k
            ).to_pylist()

        hits = self._ranked(result, limit, rest, page)
        result.hits = self._details(result, hits, f)
        return _finish(result, t0)

    # ------------------------------------------------------------------ hit details

    def _details(
        self, result: Result, hits: list[dict[str, Any]], f: Filters
    ) -> list[dict[str, Any]]:
        """What a result card shows, read by key from each table (never the image bytes)."""
        if not hits:
            return []
        keys = [h["key"] for h in hits]
        where = _and(in_list("key", keys), f.batch_clause())
        wanted = {
            IMAGES: ["key", "batch", "source", "width", "height", "format", "file_size"],
            CAPTIONS: ["key", "caption", "word_count", "is_fallback", "backend"],
            CLASSES: ["key", "label", "p_visual", "p_text", "p_nsfw"],
            RESOLUTION: ["key", "megapixels", "eligible", "max_tier"],
            BUCKETS: ["key", "tier", "shape"],
            SKIP_AUDIT: ["key", "excluded", "reasons", "relative_dir", "shard", "index_in_shard"],
        }
        view = self.view()
        jobs = []
        for table, columns in wanted.items():
            schema = view.schema(table)
            if schema is not None:
                jobs.append((table, [c for c in columns if c in schema.names]))
        tables = []
        if jobs:  # one key lookup per table, side by side (Lance releases the GIL)
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                tables = list(
                    pool.map(lambda j: self._read(result, j[0], "details", j[1], where), jobs)
                )
        merged: dict[str, dict[str, Any]] = {k: {} for k in keys}
        for table_rows in tables:
            for row in table_rows.to_pylist():
                slot = merged[row.pop("key")]
                for k, v in row.items():
                    slot.setdefault(k, _jsonable(v))
        live = LiveGenerations(self.shards_root) if self.shards_root is not None else None
        apart: dict[str, str | None] = {}
        out = []
        for hit in hits:
            info = merged[hit["key"]]
            if "relative_dir" in info:
                batch = info.get("batch") or hit.get("batch")
                if live is not None and batch not in apart:
                    apart[batch] = live.apart(batch, self._recorded_dirs(result, batch))
                _skip_as_trained(info, live, apart.get(batch))
            out.append({**info, **{k: v for k, v in hit.items() if v is not None}})
        return out

    # ------------------------------------------------------------------ single image

    def image_bytes(self, key: str) -> bytes:
        """The original bytes of one image (BTREE lookup on ``images.key``)."""
        if not KEY_RE.match(key or ""):
            raise QueryError(f"not an image key (64 lowercase hex digits): {key[:80]!r}")
        rows = self._need(IMAGES).read(
            IMAGES,
            ["image"],
            f"key = {sql_literal(key)}",
            limit=1,
            use_scalar_index=self.use_scalar_index,
        )
        if rows.num_rows == 0 or rows.column("image")[0].as_py() is None:
            raise NotFound(f"no image bytes for {key} in the images table")
        return rows.column("image")[0].as_py()

    def _recorded_dirs(self, result: Result, batch: str) -> dict[str, str | None]:
        """relative_dir -> dir_digest of a batch's ``shard_samples`` (what the lab places)."""
        if self.view().schema(lab_tables.SHARD_SAMPLES.name) is None:
            return {}
        rows = self._read(
            result,
            lab_tables.SHARD_SAMPLES.name,
            "details",
            ["relative_dir", "dir_digest"],
            f"batch = {sql_literal(batch)}",
        )
        return dict(
            zip(
                rows.column("relative_dir").to_pylist(),
                rows.column("dir_digest").to_pylist(),
                strict=True,
            )
        )

    def audit(self, key: str) -> dict[str, Any]:
        """The image's verdict and audit trail (every lab table, with Lance versions)."""
        if not KEY_RE.match(key or ""):
            raise QueryError(f"not an image key (64 lowercase hex digits): {key[:80]!r}")
        if self.shards_root is None:
            raise QueryError("no shard tree configured: an audit verdict needs the skip-lists")
        try:
            trail = audit_image(self.lab, key, shards_root=self.shards_root)
        except NoLab as exc:
            raise NotFound(str(exc)) from None
        if not trail.found:
            # A lab with no table at all (its directory emptied or replaced since start) is
            # no lab: "in no lab table" would read as "never ingested" in an audit.
            raise NotFound(no_lab_at(self.lab.root) or f"{key} is in no lab table")
        return {
            "query": trail.query,
            "verdict": trail.verdict,
            "status": trail.status,
            "copies": [c.to_dict() for c in trail.copies],
            "keys": trail.keys,
            "versions": trail.versions,
            "tables": {
                t: [{k: _jsonable(v) for k, v in row.items()} for row in rows]
                for t, rows in trail.tables.items()
            },
            "markdown": trail.to_markdown(),
        }


def _skip_as_trained(
    info: dict[str, Any], live: LiveGenerations | None, apart: str | None = None
) -> None:
    """A card's skip state as the loader sees it: the live skip-list generation of the slot
    ``skip_audit`` recorded, not the recorded row alone (a killed or running ``skip_lists``
    flips generations before it commits the audit). ``skip_lags`` marks a card whose recorded
    row says otherwise; a slot whose generation cannot be read is skipped (the loader refuses
    its directory), and so is every card when no shard tree is configured (unverified)."""
    where = (info.pop("relative_dir"), info.pop("shard", None), info.pop("index_in_shard", None))
    if live is None:
        info.update(excluded=True, reasons=["unverified: no shard tree configured"])
        return
    if apart is not None:  # the lab places other samples than the loader reads (mid-rewrite)
        info.update(excluded=True, reasons=[f"undecided: {apart[:200]}"])
        return
    if where[1] is None or where[2] is None:
        return
    slot = live.slot(where[0], where[1], int(where[2]))
    if isinstance(slot, Unreadable):
        decided = (True, [f"directory refused: {slot.reason[:200]}"])
    else:
        decided = (slot.skipped, list(slot.reasons))
    if (bool(info.get("excluded")), sorted(info.get("reasons") or [])) != (
        decided[0],
        sorted(decided[1]),
    ):
        info["skip_lags"] = True
    info["excluded"], info["reasons"] = decided


def _check_limit(limit: int) -> int:
    if not 1 <= int(limit) <= MAX_LIMIT:
        raise QueryError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    return int(limit)


def _finish(result: Result, t0: float, exhausted: bool | None = None) -> Result:
    if exhausted is not None:
        result.exhausted = exhausted
    result.ms = round((time.perf_counter() - t0) * 1000, 2)
    return result
