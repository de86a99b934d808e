"""Read views of the lab: each table opened once, optionally at pinned versions."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import lance
import pyarrow as pa
from lance.query import FullTextOperator, MatchQuery

from prx_assets.core.lab.blobs import (
    BlobStore,
    LocalBlobs,
    RemoteBlobs,
    is_blob_ref,
    logical_schema,
)
from prx_assets.core.lab.io import open_dataset
from prx_assets.core.lab.readers import ReaderHold, hold_version
from prx_assets.core.lab.spec import TableSpec


class Tables(Protocol):
    """What a view needs of its lab (``store.Lab`` is one). A protocol rather than the
    class, so that this module, which ``store`` imports, does not import ``store``."""

    root: str
    blobs: BlobStore

    def _open(self, table: str, version: int | None = None) -> lance.LanceDataset | None: ...

    def remote_blobs(self, spec: TableSpec, column: str) -> RemoteBlobs | None: ...


def _has_index(ds: lance.LanceDataset, column: str, kinds: Iterable[str]) -> bool:
    wanted = {k.upper() for k in kinds}
    return any(
        ix["fields"] == [column] and str(ix["type"]).upper() in wanted for ix in ds.list_indices()
    )


class LabView:
    """Reads of several tables through one open dataset each, optionally at fixed versions.

    Why: opening a Lance dataset reads its manifest; a caller that reads a table several
    times (the audit's trail, a browser query, a stage's inputs) should pay that once, and
    reads pinned to versions see one consistent state of the lab even while stages commit.
    A table is opened on first use (at ``versions[table]`` when given, else its latest
    version), then every read of it goes to that same version; ``versions`` records the
    version each opened table is read at, so a caller can report exactly what it read.
    Safe to share between threads (each table is still opened once).

    On a local lab the view holds each version it opened (``readers.hold_version``: a
    shared lock the kernel drops if the process dies) until ``close`` or until the view is
    garbage-collected, so version retention keeps those versions' files however long the
    view reads them. Use it as a context manager, or ``close`` it, to let them go early.
    """

    def __init__(self, lab: Tables, versions: Mapping[str, int] | None = None) -> None:
        self.lab = lab
        self.versions: dict[str, int] = dict(versions or {})
        self._open: dict[str, lance.LanceDataset | None] = {}
        self._holds: list[ReaderHold] = []
        self._lock = threading.Lock()

    def _ds(self, table: str) -> lance.LanceDataset | None:
        with self._lock:
            if table not in self._open:
                ds = self.lab._open(table, self.versions.get(table))
                if ds is not None:
                    hold = hold_version(self.lab.root, table, ds.version)
                    if hold is not None:
                        self._holds.append(hold)
                    self.versions[table] = ds.version
                self._open[table] = ds
            return self._open[table]

    def close(self) -> None:
        """Release the versions this view holds (it can still read; retention then
        protects those reads by age only)."""
        with self._lock:
            holds, self._holds = self._holds, []
        for hold in holds:
            hold.release()

    def __enter__(self) -> LabView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            for hold in self._holds:
                hold.release()

    def pin(self, tables: Iterable[str]) -> dict[str, int]:
        """Open ``tables`` now, so later reads see the lab as it is at this moment; the
        version of each one that exists (absent tables stay absent for this view)."""
        return {t: v for t in tables if (v := self.version(t)) is not None}

    def exists(self, table: str) -> bool:
        return self._ds(table) is not None

    def version(self, table: str) -> int | None:
        ds = self._ds(table)
        return None if ds is None else ds.version

    def table_at(self, table: str) -> TableAt | None:
        """``table`` at the version this view reads, for worker processes (None: absent)."""
        version = self.version(table)
        return None if version is None else TableAt(self.lab.root, table, version)

    def count_rows(self, table: str, filter: str | None = None) -> int:
        """Rows of ``table`` (matching ``filter``) at this view's version; 0 when absent.
        Without a filter, from the manifest alone."""
        ds = self._ds(table)
        return 0 if ds is None else int(ds.count_rows(filter))

    def schema(self, table: str) -> pa.Schema | None:
        ds = self._ds(table)
        return None if ds is None else logical_schema(ds.schema)

    def indexed_columns(self, table: str) -> dict[str, set[str]]:
        """Column -> index types present on ``table`` (empty when absent)."""
        ds = self._ds(table)
        out: dict[str, set[str]] = {}
        for ix in [] if ds is None else ds.list_indices():
            for column in ix["fields"]:
                out.setdefault(column, set()).add(str(ix["type"]).upper())
        return out

    def read(
        self,
        table: str,
        columns: Sequence[str] | None = None,
        filter: str | None = None,
        **scan: Any,
    ) -> pa.Table:
        """A pushed-down read; ``scan`` passes Lance scanner options (``limit``,
        ``full_text_query``, ``nearest``, ``prefilter``, ``with_row_id``...). An absent
        table reads as empty. Blob columns come back as their bytes."""
        ds = self._ds(table)
        if ds is None:
            return pa.table({})
        rows = ds.to_table(columns=list(columns) if columns else None, filter=filter, **scan)
        return self.lab.blobs.resolve(table, rows, ds.schema)

    def take_matching(self, table: str, columns: Sequence[str], filter: str) -> pa.Table:
        """The rows matching ``filter``, read in two steps: their row ids (the scalar
        indexes answer the filter; no data column is read), then only those rows.

        Why: a filtered scan that projects a large column costs Lance ~30 ms of CPU per
        call whatever the number of matches (measured on lance 14.0.2 with inline image
        bytes: 5 or 32 matching rows, 27-55 ms), while taking the rows by id costs ~1 ms per
        megabyte. Same rows as :meth:`read` (order not kept), same snapshot, so the ids are
        valid for the rows they name; blob columns come back as their bytes. An absent
        table reads as empty.
        """
        ds = self._ds(table)
        if ds is None:
            return pa.table({})
        rows = self._take_matching_stored(ds, columns, filter)
        return self.lab.blobs.resolve(table, rows, ds.schema)

    def take_matching_rows(
        self, table: str, columns: Sequence[str], filter: str, blob_refs: bool = False
    ) -> list[dict[str, Any]]:
        """:meth:`take_matching` as Python rows, for a caller that wants them anyway: blob
        values go from their files straight into the rows (checked against their address
        as always), never through an Arrow column and back (two copies of every image's
        bytes: 0.23 s against 0.15 s of CPU for 96 rows of 1.5 MB here,
        ``python -m benchmarks.bench_take_rows``). ``blob_refs``: leave blob columns as
        their references, for workers that read them through :meth:`local_blobs`."""
        ds = self._ds(table)
        if ds is None:
            return []
        rows = self._take_matching_stored(ds, columns, filter).to_pylist()
        return rows if blob_refs else self.lab.blobs.resolve_rows(table, rows, ds.schema)

    def take_rows(self, table: str, row_ids: Sequence[int], columns: Sequence[str]) -> pa.Table:
        """Rows by the ``_rowid`` a ``read(..., with_row_id=True)`` of this view gave (the
        same version, so the ids name the same rows), in the order of ``row_ids``; blob
        columns as their bytes. For a caller that found the rows it wants in a scan of a
        few columns: scattered rows otherwise cost an index search per look-up on top of the
        take (``benchmarks/bench_dedup_radius.py`` measures the dedup gather that uses it)."""
        ds = self._ds(table)
        if ds is None:
            return pa.table({})
        rows = ds._take_rows(list(row_ids), columns=list(columns))
        return self.lab.blobs.resolve(table, rows, ds.schema)

    def local_blobs(self, table: str, column: str) -> LocalBlobs | None:
        """``column``'s blobs for worker processes on this machine (reads are checked
        against their address there too); None on object storage, for an absent table or
        one that keeps the column inline."""
        ds = self._ds(table)
        if ds is None or column not in ds.schema.names or not is_blob_ref(ds.schema.field(column)):
            return None
        return self.lab.blobs.local(table)

    @staticmethod
    def _take_matching_stored(
        ds: lance.LanceDataset, columns: Sequence[str], filter: str
    ) -> pa.Table:
        ids = ds.to_table(columns=[], with_row_id=True, filter=filter).column("_rowid")
        # _take_rows is Lance's take by row id (marked unstable; pinned lance version).
        return ds._take_rows(ids, columns=list(columns))

    def explain(
        self,
        table: str,
        columns: Sequence[str] | None = None,
        filter: str | None = None,
        **scan: Any,
    ) -> str | None:
        """Lance's physical plan for the same read (which indexes it uses); None if absent.

        Why here: the browser shows, per step, whether an index answered it; the plan is the
        only place Lance says so.
        """
        ds = self._ds(table)
        if ds is None:
            return None
        cols = list(columns) if columns is not None else None
        return ds.scanner(columns=cols, filter=filter, **scan).explain_plan(True)

    def count(self, table: str, filter: str | None = None, **scan: Any) -> int:
        """Rows matching ``filter`` (0 when absent); ``scan`` as for :meth:`read`, e.g.
        ``use_scalar_index=False`` to count by a full scan."""
        ds = self._ds(table)
        if ds is None:
            return 0
        if not scan:
            return ds.count_rows(filter)
        return ds.scanner(columns=[], with_row_id=True, filter=filter, **scan).count_rows()


def full_text_query(text: str, column: str, *, all_terms: bool = True) -> Any:
    """A Lance full-text match of ``text`` on ``column`` for ``LabView.read(...,
    full_text_query=...)``: every term must match (``all_terms``) or any one of them.

    Why a function: the query object is Lance's type; readers outside this module build it
    here and never import Lance themselves.
    """
    operator = FullTextOperator.AND if all_terms else FullTextOperator.OR
    return MatchQuery(text, column, operator=operator)


@dataclass(frozen=True)
class TableAt:
    """One table of the lab at one version, for worker processes on any node that reaches
    the lab (picklable: the lab's URI, a table name and a version; credentials come from
    the worker's own environment, never from here). Made by ``LabView.table_at``.

    Why a version: a step hands its workers the version its own view read, so every chunk
    of one step sees the same rows whatever commits meanwhile; the step's view holds that
    version (``readers.hold_version``) while the step runs, so retention keeps its files.
    """

    lab_root: str
    table: str
    version: int

    def read(self, columns: Sequence[str], filter: str, blob_refs: bool = False) -> pa.Table:
        """A pushed-down read of ``columns`` of the rows matching ``filter``; blob columns
        come back as their bytes, or (``blob_refs``) as their references, for a worker
        that reads each blob when it needs it rather than a chunk's all at once."""
        ds = open_dataset(f"{self.lab_root}/{self.table}.lance", self.version)
        rows = ds.to_table(columns=list(columns), filter=filter)
        return rows if blob_refs else BlobStore(self.lab_root).resolve(self.table, rows, ds.schema)
