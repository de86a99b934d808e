"""Opt-out intake: record one list in the lab (``opt_outs``, ``opt_out_lists``).

Why a run of its own (the ``opt_out_lists`` asset, one partition per list): an opt-out list
is a legal request, so what happened to it (accepted with what it matched, or rejected with
the reason) must be a recorded, rerunnable step, not a side effect of a sensor tick. The
opt-out sensor only notices a new file and requests this run; once it is recorded, the
sensor requests ``skip_lists`` for exactly the partitions holding any copy of an image the
list names (:mod:`prx_assets.core.skiplists.reruns`).

The run is read -> decide -> write -> verify: find the list's file by its id (a file name
and a content hash: the id never becomes a path), parse it as a stream within the caps
(:mod:`prx_assets.core.skiplists.optouts`), resolve what it names through the ``images``
indexes (:mod:`prx_assets.core.skiplists.matching`), replace the list's rows in one commit
per table (a replay writes the same rows, keeping the first arrival time), and check that
the rows are there. A malformed list is recorded as ``rejected`` with its reason and
nothing of it is applied. Lists are additive: no run withdraws an opt-out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from prx_assets.core.lab import Lab, TableSpec, sql_literal
from prx_assets.core.skiplists.identifiers import OptOutIdentifier
from prx_assets.core.skiplists.matching import resolve_identifiers
from prx_assets.core.skiplists.optouts import (
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_LIST_BYTES,
    OptOutListError,
    discover_lists,
    file_sha256,
    make_list_id,
    parse_list_file,
)
from prx_assets.core.tables import IMAGES, OPT_OUT_LISTS, OPT_OUTS, REJECTS
from prx_assets.core.text import printable_name

STATUS_ACCEPTED = "accepted"
STATUS_REJECTED = "rejected"
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
) -> pa.Table:
    """``opt_outs`` rows: one per (identifier, matched image), or one with no match."""
    cols: dict[str, list[Any]] = {f.name: [] for f in OPT_OUTS.schema}
    for ident in sorted(matches):
        for batch, key in matches[ident] or [(None, None)]:
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
) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
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


@dataclass(frozen=True)
class IntakeOutcome:
    """What one intake recorded for one list."""

    list_id: str
    path: str  # printable
    sha256: str
    status: str  # accepted | rejected
    reason: str | None  # "<code>: <details>" when rejected (bounded)
    format: str | None
    identifiers: int  # distinct identifiers in the list
    matched: frozenset[tuple[str, str]]  # (batch, key) images named when it arrived
    received_at: datetime
    opt_outs_version: int | None  # None: rejected, opt_outs untouched
    opt_out_lists_version: int
    indexes_created: tuple[str, ...] = field(default=())

    @property
    def accepted(self) -> bool:
        return self.status == STATUS_ACCEPTED

    @property
    def batches(self) -> list[str]:
        return sorted({b for b, _ in self.matched})


class ListIntake:
    """Take one opt-out list into the lab (see the module docstring); ``run()`` once."""

    def __init__(
        self,
        lab: Lab,
        directory: str | Path,
        list_id: str,
        *,
        max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        now: datetime | None = None,
    ) -> None:
        self.lab = lab
        self.directory = Path(directory)
        self.list_id = list_id
        self.max_list_bytes = max_list_bytes
        self.max_line_bytes = max_line_bytes
        self.now = now or datetime.now(UTC)

    def run(self) -> IntakeOutcome:
        item = find_list_file(self.directory, self.list_id)
        # The images spec declares the key/url/source_id BTREEs resolution probes; a lab
        # written before they were declared gets them here.
        indexes = tuple(self.lab.ensure_indexes(IMAGES)) + tuple(
            f"rejects.{c}"
            for c in self.lab.ensure_indexes(REJECTS)  # alias look-ups
        )
        prior = recorded_list(self.lab, item.list_id)
        received_at = prior["received_at"] if prior else self.now
        shown = printable_name(os.fsencode(item.path))
        try:
            parsed = parse_list_file(
                item.path,
                max_list_bytes=self.max_list_bytes,
                max_line_bytes=self.max_line_bytes,
                expected_sha256=item.sha256,
            )
        except OptOutListError as exc:
            row = list_row(item.list_id, shown, item.sha256, received_at, fmt=None, error=exc)
            return IntakeOutcome(
                list_id=item.list_id,
                path=shown,
                sha256=item.sha256,
                status=STATUS_REJECTED,
                reason=exc.reason,
                format=None,
                identifiers=0,
                matched=frozenset(),
                received_at=received_at,
                opt_outs_version=None,
                opt_out_lists_version=self._record(OPT_OUT_LISTS, row),
                indexes_created=indexes,
            )
        matches = resolve_identifiers(self.lab, parsed.identifiers)
        pairs = frozenset(p for ms in matches.values() for p in ms)
        opt_outs = self._record(OPT_OUTS, opt_out_rows(item.list_id, matches, received_at))
        row = list_row(
            item.list_id,
            shown,
            item.sha256,
            received_at,
            fmt=parsed.format,
            rows=len(parsed.identifiers),
            matched_images=len(pairs),
            batches=sorted({b for b, _ in pairs}),
        )
        return IntakeOutcome(
            list_id=item.list_id,
            path=shown,
            sha256=item.sha256,
            status=STATUS_ACCEPTED,
            reason=None,
            format=parsed.format,
            identifiers=len(parsed.identifiers),
            matched=pairs,
            received_at=received_at,
            opt_outs_version=opt_outs,
            opt_out_lists_version=self._record(OPT_OUT_LISTS, row),
            indexes_created=indexes,
        )

    def _record(self, spec: TableSpec, rows: pa.Table) -> int:
        """Replace this list's rows of ``spec`` in one commit, then check they are there."""
        version = self.lab.replace_rows(spec, "list_id", self.list_id, rows)
        stored = self.lab.count(spec.name, f"list_id = {sql_literal(self.list_id)}")
        if stored != rows.num_rows:
            raise IntakeError(
                f"{spec.name} holds {stored} row(s) of list {self.list_id} after writing "
                f"{rows.num_rows}: rerun the intake"
            )
        return version
