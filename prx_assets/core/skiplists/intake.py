"""Opt-out intake: record one list in the lab (``opt_outs``, ``opt_out_lists``).

Why a run of its own (the ``opt_out_lists`` asset, one partition per list): an opt-out list
is a legal request, so what happened to it (accepted with what it matched, or rejected with
the reason) must be a recorded, rerunnable step, not a side effect of a sensor tick. The
opt-out sensor only notices a new file and requests this run; once it is recorded, the
sensor requests ``skip_lists`` for exactly the partitions holding any copy of an image the
list names (:mod:`prx_assets.core.skiplists.reruns`).

The run is read -> decide -> write -> verify: find the list's file by its id (a file name
and a content hash: the id never becomes a path), read it as a stream of entries
(:mod:`prx_assets.core.skiplists.optouts`), and for each chunk of ``chunk_entries``
identifiers resolve what they name through the ``images`` indexes
(:mod:`prx_assets.core.skiplists.matching`: one probe per 8,192 values, so the cost follows
the list, not the lab) and write their ``opt_outs`` rows into uncommitted fragment files;
then commit them as the list's rows in one commit (a replay writes the same rows, keeping
the first arrival time) and check that they are there. Memory follows the chunk: a
registry of 10^8 identifiers is never held. A malformed list is recorded as ``rejected``
with its reason and nothing of it is applied (unless its source records malformed entries
and applies the rest: ``on_malformed``). Lists are additive, except that a source allowed
to withdraw may take back its own earlier opt-outs with ``withdraw`` rows (recorded like
opt-outs; which opt-outs stand is decided where they are read:
``matching.standing_opt_outs``).

Identifiers repeated across chunks of one list are stored once per chunk (rows with the
same identity): every reader takes opt-out rows as a set, so a repeat changes no decision.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from prx_assets.core.lab import Lab, TableSpec, sql_literal
from prx_assets.core.skiplists.decisions import cluster_copies
from prx_assets.core.skiplists.identifiers import OptOutIdentifier
from prx_assets.core.skiplists.matching import resolve_identifiers, sharded_batches
from prx_assets.core.skiplists.optouts import (
    ACTION_ADD,
    ACTION_WITHDRAW,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_SOURCE,
    Entry,
    ListReader,
    OptOutListError,
    _Problems,
    check_digest,
    discover_lists,
    file_sha256,
    make_list_id,
)
from prx_assets.core.tables import IMAGES, OPT_OUT_LISTS, OPT_OUT_PROBLEMS, OPT_OUTS, REJECTS
from prx_assets.core.text import printable_name

STATUS_ACCEPTED = "accepted"
STATUS_REJECTED = "rejected"
MALFORMED_REJECT = "reject"  # fail closed: a list with a malformed entry applies nothing
MALFORMED_RECORD = "record"  # the source says so: record each malformed entry, apply the rest
MALFORMED_POLICIES = (MALFORMED_REJECT, MALFORMED_RECORD)
#: Identifiers resolved and written per step of the stream: memory follows this, not the list
#: (``bench_optout_registry`` measures the peak).
DEFAULT_CHUNK_ENTRIES = 100_000
#: Malformed entries stored per list in ``opt_out_problems`` (each with its line); the list's
#: row counts them all.
MAX_RECORDED_PROBLEMS = 10_000
_HEX16 = re.compile(r"^[0-9a-f]{16}")
_MASK = (1 << 64) - 1
_IDENT_ORDER = attrgetter("kind", "value")  # C-level tuple order, not dataclass __lt__
# Dagster refuses partition keys holding "..."; a list id never holds "%" unescaped
# (``text.printable_name`` escapes it), so this spelling of the dots is unambiguous.
_DOTS, _DOTS_IN_KEY = "...", "%2E%2E%2E"


class IntakeError(RuntimeError):
    """A list that cannot be taken in at all (its file is gone or holds other bytes):
    nothing is recorded for it."""


class ListFileMissing(IntakeError):
    """No list file of that name in the opt-out directory any more."""


class ListFileChanged(IntakeError):
    """The file of that name now holds other bytes: those are another list."""


def list_partition_key(list_id: str) -> str:
    """The ``opt_out_lists`` partition key of a list (its id, Dagster-safe)."""
    return list_id.replace(_DOTS, _DOTS_IN_KEY)


def list_id_of_partition(partition_key: str) -> str:
    """The inverse of :func:`list_partition_key`."""
    return partition_key.replace(_DOTS_IN_KEY, _DOTS)


@dataclass(frozen=True)
class ListFile:
    """A list file and the id its current bytes give it (``<name>@<sha256[:16]>``)."""

    path: Path
    sha256: str
    list_id: str

    @classmethod
    def of(cls, path: Path) -> ListFile:
        sha = file_sha256(path)
        return cls(path, sha, make_list_id(path.name, sha))


def find_list_file(directory: str | Path, list_id: str) -> ListFile:
    """The file in ``directory`` whose name and bytes make ``list_id``.

    Only existing candidate files are considered (matched by their printable name), so an
    id from anywhere (a partition key typed into the UI) cannot name another path.
    """
    name = list_id.rsplit("@", 1)[0]
    for path in discover_lists(directory):
        if printable_name(path.name) != name:
            continue
        try:
            found = ListFile.of(path)
        except (FileNotFoundError, OptOutListError) as exc:
            raise ListFileMissing(f"list file {name} vanished while it was read: {exc}") from None
        if found.list_id != list_id:
            raise ListFileChanged(
                f"{name} no longer holds list {list_id} (its bytes now make {found.list_id}); "
                "nothing is recorded for the old bytes, the new ones are a new list"
            )
        return found
    raise ListFileMissing(f"no list file {name} in {directory} (renamed or deleted)")


def opt_out_rows(
    list_id: str,
    matches: Mapping[OptOutIdentifier, Sequence[tuple[str, str]]],
    received_at: datetime,
    withdrawn: Iterable[OptOutIdentifier] = (),
) -> pa.Table:
    """``opt_outs`` rows: one per (identifier, matched image), or one with no match;
    identifiers in ``withdrawn`` are withdrawals (``action`` "withdraw"), the rest opt-outs."""
    cols: dict[str, list[Any]] = {f.name: [] for f in OPT_OUTS.schema}
    withdrawn = set(withdrawn)
    for ident in sorted(matches, key=_IDENT_ORDER):  # (kind, value) is unique per identifier
        action = ACTION_WITHDRAW if ident in withdrawn else ACTION_ADD
        for batch, key in matches[ident] or [(None, None)]:
            cols["action"].append(action)
            cols["list_id"].append(list_id)
            cols["identifier"].append(ident.value)
            cols["identifier_kind"].append(ident.kind)
            cols["received_at"].append(received_at)
            cols["matched_key"].append(key)
            cols["matched_batch"].append(batch)
    return pa.table(cols, schema=OPT_OUTS.schema)


def recorded_list(lab: Lab, list_id: str) -> dict[str, Any] | None:
    """The ``opt_out_lists`` row of a list already seen (a replay keeps its first arrival)."""
    rows = lab.read(OPT_OUT_LISTS.name, filter=f"list_id = {sql_literal(list_id)}").to_pylist()
    return rows[0] if rows else None


def list_row(
    list_id: str,
    path: str,
    sha256: str,
    received_at: datetime,
    *,
    fmt: str | None,
    error: OptOutListError | None = None,
    rows: int = 0,
    matched_images: int = 0,
    batches: Sequence[str] = (),
    malformed: int = 0,
    source: str = DEFAULT_SOURCE,
    reach: tuple[Sequence[str], Sequence[str]] | None = None,
) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "malformed": malformed,
                "source": source,
                "reach_batches": None if reach is None else sorted(reach[0]),
                "reach_sharded": None if reach is None else sorted(reach[1]),
                "list_id": list_id,
                "path": path,
                "format": fmt,
                "sha256": sha256,
                "status": STATUS_REJECTED if error else STATUS_ACCEPTED,
                "reason": error.reason if error else None,
                "rows": rows,
                "matched_images": matched_images,
                "batches": sorted(batches),
                "received_at": received_at,
            }
        ],
        schema=OPT_OUT_LISTS.schema,
    )


def ensure_list_columns(lab: Lab) -> None:
    """``opt_out_lists`` / ``opt_outs`` tables written before a column was declared get it
    (null for the rows recorded then: no malformed count, source "default", action add)."""
    view = lab.view()
    for spec in (OPT_OUT_LISTS, OPT_OUTS):
        stored = view.schema(spec.name)
        if stored is None:
            continue
        missing = [f for f in spec.schema if f.name not in stored.names]
        if missing:
            lab.add_columns(spec.name, missing)


def list_reach(lab: Lab, list_id: str) -> tuple[list[str], list[str]]:
    """The batches holding a copy (through the pHash clusters) of an image the list's rows
    matched, and those of them where such a copy is in a shard: what the opt-out sensor
    reruns for the list. Read from the committed rows, so a replay computes the same."""
    rows = lab.read(
        OPT_OUTS.name,
        ["matched_batch", "matched_key"],
        f"list_id = {sql_literal(list_id)} AND matched_key IS NOT NULL",
    )
    pairs = set(
        zip(
            rows.column("matched_batch").to_pylist(),
            rows.column("matched_key").to_pylist(),
            strict=True,
        )
    )
    copies = cluster_copies(lab, pairs)
    return sorted({b for b, _ in copies}), sorted(sharded_batches(lab, copies))


def problem_rows(list_id: str, problems: Sequence[tuple[str, str]]) -> pa.Table:
    """``opt_out_problems`` rows: one per recorded malformed entry (where, why)."""
    return pa.table(
        {
            "list_id": [list_id] * len(problems),
            "position": [w for w, _ in problems],
            "problem": [p for _, p in problems],
        },
        schema=OPT_OUT_PROBLEMS.schema,
    )


@dataclass(frozen=True)
class IntakeOutcome:
    """What one intake recorded for one list."""

    list_id: str
    path: str  # printable
    sha256: str
    status: str  # accepted | rejected
    reason: str | None  # "<code>: <details>" when rejected (bounded)
    format: str | None
    identifiers: int  # identifier rows taken (distinct within each chunk of the stream)
    matched_images: int  # distinct (batch, key) images named when it arrived
    batches: tuple[str, ...]  # sorted: the batches holding one of them
    received_at: datetime
    opt_outs_version: int | None  # None: rejected, opt_outs untouched
    opt_out_lists_version: int
    malformed: int = 0  # malformed entries (recorded, skipped) under on_malformed="record"
    withdrawals: int = 0  # identifier rows that withdraw an earlier opt-out of the source
    source: str = DEFAULT_SOURCE
    reach_sharded: tuple[str, ...] = ()  # batches with a sharded copy: what the sensor reruns
    indexes_created: tuple[str, ...] = field(default=())

    @property
    def accepted(self) -> bool:
        return self.status == STATUS_ACCEPTED


class _Taken:
    """What the stream of one list gave so far: counts, matches, malformed entries."""

    def __init__(self, on_malformed: str) -> None:
        self.on_malformed = on_malformed
        self.rows = 0
        self.identifiers = 0
        self.withdrawals = 0
        self.problems = _Problems()
        self.recorded: list[tuple[str, str]] = []  # (where, problem), the first few
        self.batches: set[str] = set()
        self._keys: list[np.ndarray] = []  # 64-bit prefixes of matched keys, per chunk
        self.error: OptOutListError | None = None

    def note_problem(self, where: str, problem: str) -> None:
        self.problems.add(problem)
        if len(self.recorded) < MAX_RECORDED_PROBLEMS:
            self.recorded.append((where, problem))

    def note_matches(self, pairs: Iterable[tuple[str, str]]) -> None:
        prefixes = []
        for batch, key in pairs:
            self.batches.add(batch)
            prefixes.append(int(key[:16], 16) if _HEX16.match(key) else hash(key) & _MASK)
        if prefixes:
            self._keys.append(np.unique(np.asarray(prefixes, dtype=np.uint64)))

    @property
    def matched_images(self) -> int:
        """Distinct images matched (by the first 64 bits of their sha256 key: 8 bytes per
        match held, and a count, not a decision: the rows hold every match exactly)."""
        if not self._keys:
            return 0
        return int(np.unique(np.concatenate(self._keys)).size)

    @property
    def rejected(self) -> bool:
        return self.error is not None or (
            self.problems.count > 0 and self.on_malformed == MALFORMED_REJECT
        )


class ListIntake:
    """Take one opt-out list into the lab (see the module docstring); ``run()`` once.

    The list is streamed: read ``chunk_entries`` identifiers at a time, resolve that chunk
    through the ``images`` indexes, write its ``opt_outs`` rows into uncommitted fragment
    files, and commit them all at once at the end (``Lab.commit_rows``): memory follows the
    chunk, not the list, and readers see the list's old rows or all its new ones.
    ``max_list_bytes`` (None: no limit) refuses a larger file unread; ``on_malformed``:
    ``"reject"`` (the default: fail closed, nothing of a list with a malformed entry is
    applied) or ``"record"`` (a registry that says so: each malformed entry is recorded in
    ``opt_out_problems`` with its line, the count in the list's row, the rest applies).
    ``source``: the list's source (recorded); ``allow_withdrawals``: whether that source may
    withdraw its earlier opt-outs (a list with a withdrawal from any other is rejected).
    """

    def __init__(
        self,
        lab: Lab,
        directory: str | Path,
        list_id: str,
        *,
        max_list_bytes: int | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        on_malformed: str = MALFORMED_REJECT,
        chunk_entries: int = DEFAULT_CHUNK_ENTRIES,
        source: str = DEFAULT_SOURCE,
        allow_withdrawals: bool = False,
        now: datetime | None = None,
    ) -> None:
        if on_malformed not in MALFORMED_POLICIES:
            raise ValueError(f"on_malformed must be one of {MALFORMED_POLICIES}")
        if chunk_entries < 1:
            raise ValueError("chunk_entries must be at least 1")
        self.lab = lab
        self.directory = Path(directory)
        self.list_id = list_id
        self.max_list_bytes = max_list_bytes
        self.max_line_bytes = max_line_bytes
        self.on_malformed = on_malformed
        self.chunk_entries = chunk_entries
        self.source = source
        self.allow_withdrawals = allow_withdrawals
        self.now = now or datetime.now(UTC)

    def run(self) -> IntakeOutcome:
        item = find_list_file(self.directory, self.list_id)
        # The images spec declares the key/url/source_id BTREEs resolution probes; a lab
        # written before they were declared gets them here.
        indexes = tuple(self.lab.ensure_indexes(IMAGES)) + tuple(
            f"rejects.{c}"
            for c in self.lab.ensure_indexes(REJECTS)  # alias look-ups
        )
        ensure_list_columns(self.lab)
        prior = recorded_list(self.lab, item.list_id)
        received_at = prior["received_at"] if prior else self.now
        shown = printable_name(os.fsencode(item.path))
        taken = _Taken(self.on_malformed)
        fmt: str | None = None
        fragments: list = []
        try:
            with ListReader(
                item.path, max_list_bytes=self.max_list_bytes, max_line_bytes=self.max_line_bytes
            ) as reader:
                fmt = reader.format
                fragments = self.lab.write_rows(
                    OPT_OUTS, self._rows(reader.entries(), taken, received_at)
                )
                if taken.error is None:
                    check_digest(reader.shown, reader.digest(), item.sha256)
            if taken.error is not None:
                raise taken.error
            if taken.rejected:
                raise taken.problems.error(reader.shown)
            if taken.identifiers == 0:
                raise OptOutListError("empty", f"{reader.shown} holds no identifiers")
        except OptOutListError as exc:
            # Fragments written before the problem was found are never committed (what
            # ``Lab.remove_orphaned_files`` removes): nothing of the list is applied.
            row = list_row(
                item.list_id,
                shown,
                item.sha256,
                received_at,
                fmt=None,
                error=exc,
                source=self.source,
            )
            return IntakeOutcome(
                list_id=item.list_id,
                path=shown,
                sha256=item.sha256,
                status=STATUS_REJECTED,
                reason=exc.reason,
                format=None,
                identifiers=0,
                matched_images=0,
                batches=(),
                received_at=received_at,
                opt_outs_version=None,
                opt_out_lists_version=self._record(OPT_OUT_LISTS, row),
                source=self.source,
                indexes_created=indexes,
            )
        opt_outs = self.lab.commit_rows(OPT_OUTS, "list_id", item.list_id, fragments, taken.rows)
        self._verify(OPT_OUTS, taken.rows)
        if taken.recorded or self.lab.exists(OPT_OUT_PROBLEMS.name):
            self._record(OPT_OUT_PROBLEMS, problem_rows(item.list_id, taken.recorded))
        reach = list_reach(self.lab, item.list_id)
        row = list_row(
            item.list_id,
            shown,
            item.sha256,
            received_at,
            fmt=fmt,
            rows=taken.identifiers,
            matched_images=taken.matched_images,
            batches=sorted(taken.batches),
            malformed=taken.problems.count,
            source=self.source,
            reach=reach,
        )
        return IntakeOutcome(
            list_id=item.list_id,
            path=shown,
            sha256=item.sha256,
            status=STATUS_ACCEPTED,
            reason=None,
            format=fmt,
            identifiers=taken.identifiers,
            matched_images=taken.matched_images,
            batches=tuple(sorted(taken.batches)),
            received_at=received_at,
            opt_outs_version=opt_outs,
            opt_out_lists_version=self._record(OPT_OUT_LISTS, row),
            malformed=taken.problems.count,
            withdrawals=taken.withdrawals,
            source=self.source,
            reach_sharded=tuple(reach[1]),
            indexes_created=indexes,
        )

    def _rows(
        self, entries: Iterator[Entry], taken: _Taken, received_at: datetime
    ) -> Iterator[pa.RecordBatch]:
        """The list's ``opt_outs`` rows, a chunk at a time. A structural error ends the
        stream (kept in ``taken.error``, raised by ``run``: an exception raised inside
        Lance's writer would lose its reason); under ``reject``, the first malformed entry
        stops the writing (the rest is read only to count and quote what is malformed)."""
        chunk: dict[OptOutIdentifier, bool] = {}  # identifier -> withdrawn (an add wins)
        try:
            for entry in entries:
                if entry.identifier is None:
                    taken.note_problem(entry.where, entry.problem or entry.where)
                    continue
                if entry.action == ACTION_WITHDRAW and not self.allow_withdrawals:
                    raise OptOutListError(
                        "withdrawal_not_allowed",
                        f"{entry.where} withdraws an opt-out, and source {self.source!r} is not "
                        "configured to withdraw (allow_withdrawals): nothing of the list applies",
                    )
                if taken.rejected:
                    continue
                withdraw = entry.action == ACTION_WITHDRAW
                chunk[entry.identifier] = chunk.get(entry.identifier, True) and withdraw
                if len(chunk) >= self.chunk_entries:
                    yield self._resolved(chunk, taken, received_at)
                    chunk = {}
        except OptOutListError as exc:
            taken.error = exc
            return
        if chunk and not taken.rejected:
            yield self._resolved(chunk, taken, received_at)

    def _resolved(
        self, chunk: Mapping[OptOutIdentifier, bool], taken: _Taken, received_at: datetime
    ) -> pa.RecordBatch:
        matches = resolve_identifiers(self.lab, list(chunk))
        taken.note_matches(p for ms in matches.values() for p in ms)
        withdrawn = [i for i, w in chunk.items() if w]
        rows = opt_out_rows(self.list_id, matches, received_at, withdrawn)
        taken.rows += rows.num_rows
        taken.identifiers += len(chunk)
        taken.withdrawals += len(withdrawn)
        return rows.combine_chunks().to_batches()[0]

    def _verify(self, spec: TableSpec, expected: int) -> None:
        stored = self.lab.count(spec.name, f"list_id = {sql_literal(self.list_id)}")
        if stored != expected:
            raise IntakeError(
                f"{spec.name} holds {stored} row(s) of list {self.list_id} after writing "
                f"{expected}: rerun the intake"
            )

    def _record(self, spec: TableSpec, rows: pa.Table) -> int:
        """Replace this list's rows of ``spec`` in one commit, then check they are there."""
        version = self.lab.replace_rows(spec, "list_id", self.list_id, rows)
        self._verify(spec, rows.num_rows)
        return version
