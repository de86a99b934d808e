"""The Lance "lab": one directory of Lance tables that every stage reads and extends.

Why these helpers: every partitioned stage writes "its rows for batch B" and must be
idempotent and safe when partitions run concurrently. Lance gives both if each
rewrite of a partition is a single commit: ``merge_insert`` on the table's identity
columns with ``when_not_matched_by_source_delete("batch = 'B'")`` replaces exactly
that batch's rows in one transaction; concurrent commits from other partitions are
rebased by Lance's optimistic concurrency (checked in the tests with processes).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pyarrow.fs as pafs
from lance.commit import CommitConflictError
from lance.fragment import write_fragments
from lance.query import FullTextOperator, MatchQuery

from prx_assets.core.crashpoints import crashpoint

TARGET_ROWS_PER_FRAGMENT = 1_048_576
# Files no version references are deleted once this old: longer than any write takes from
# its first fragment to its commit, so an in-flight write's files are never touched.
ORPHAN_MIN_AGE = timedelta(hours=24)
ORPHAN_SCAN_LIMIT = 100_000  # candidates listed per table and run; the next run continues


def _object_key(uri: str) -> str:
    """How Lance names a file of ``uri`` in cleanup plans: the path without scheme or root."""
    if "://" in uri:
        return uri.split("://", 1)[1].strip("/")
    return str(Path(uri).resolve()).strip("/")


def _remove_empty_parent(fs: pafs.FileSystem, path: str, base_key: str) -> None:
    """A killed index build leaves ``_indices/<uuid>/``: drop the folder once empty (local)."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return
    parent = Path(path).parent
    if parent.parent.name == "_indices" and str(parent).strip("/").startswith(base_key):
        with contextlib.suppress(OSError):
            parent.rmdir()  # only succeeds when empty


def sql_literal(value: str) -> str:
    """Quote a string for a Lance SQL filter; batch keys are restricted, but be strict anyway."""
    return "'" + value.replace("'", "''") + "'"


def in_list(column: str, values: Iterable[str]) -> str:
    vals = sorted(set(values))
    if not vals:
        return "false"
    return f"{column} IN ({', '.join(sql_literal(v) for v in vals)})"


@dataclass(frozen=True)
class TableSpec:
    """A lab table: its schema, the columns that identify a row, and its scalar indexes."""

    name: str
    schema: pa.Schema
    identity: tuple[str, ...]
    indexes: tuple[tuple[str, str], ...] = ()  # (column, index type)


class _CountingBatches:
    """Pass record batches through, counting rows and refusing rows of another batch."""

    def __init__(self, batches: Iterable[pa.RecordBatch], schema: pa.Schema, batch: str) -> None:
        self._batches = batches
        self._schema = schema
        self._batch = batch
        self.rows = 0
        self.error: ValueError | None = None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        for rb in self._batches:
            rb = pa.Table.from_batches([rb]).select(self._schema.names).cast(self._schema)
            for part in rb.to_batches():
                batch_values = set(part.column("batch").unique().to_pylist())
                if batch_values - {self._batch}:
                    self.error = ValueError(
                        f"rows for batch {self._batch!r} include other batches: {batch_values}"
                    )
                    raise self.error
                self.rows += part.num_rows
                yield part
                crashpoint("lab.fragment_batch")


class Lab:
    """A directory of Lance tables (local path or object-store URI)."""

    def __init__(self, root: str | Path) -> None:
        self.root = str(root).rstrip("/")
        if "://" not in self.root:
            Path(self.root).mkdir(parents=True, exist_ok=True)

    def uri(self, table: str) -> str:
        return f"{self.root}/{table}.lance"

    def _open(self, table: str, version: int | None = None) -> lance.LanceDataset | None:
        """The dataset, or None when the table does not exist (one open either way)."""
        try:
            return lance.dataset(self.uri(table), version=version)
        except (ValueError, OSError, FileNotFoundError):
            return None

    def exists(self, table: str) -> bool:
        return self._open(table) is not None

    def dataset(self, table: str, version: int | None = None) -> lance.LanceDataset:
        """The Lance dataset itself: for code inside this module and its tests only.

        Everything else goes through the methods of ``Lab`` and ``LabView``, so that one
        place decides how the lab is read, written and indexed.
        """
        return lance.dataset(self.uri(table), version=version)

    def view(self, versions: Mapping[str, int] | None = None) -> LabView:
        """A read view that opens each table once (at ``versions[table]`` when given)."""
        return LabView(self, versions)

    def ensure(self, spec: TableSpec) -> lance.LanceDataset:
        """Create the table empty if missing (tolerating a concurrent creator)."""
        try:
            return self.dataset(spec.name)
        except (ValueError, OSError, FileNotFoundError):
            pass
        try:
            lance.write_dataset(
                pa.Table.from_pylist([], schema=spec.schema), self.uri(spec.name), mode="create"
            )
        except (OSError, ValueError):
            # Another process created it first; that is fine.
            pass
        return self.dataset(spec.name)

    def replace_partition(
        self,
        spec: TableSpec,
        batch: str,
        data: pa.Table | Iterable[pa.RecordBatch],
        attempts: int = 8,
    ) -> dict[str, Any]:
        """Replace every row of ``batch`` with ``data`` in one Lance commit.

        New rows are streamed into new fragment files first (bounded memory: a batch's
        image bytes are never all held at once), then one ``Update`` transaction both
        marks the batch's old rows deleted and adds the new fragments. Readers see the
        old rows or the new rows, never a mix or nothing; rows of other batches are
        untouched; a rerun with the same data leaves the table's content unchanged. A
        concurrent commit touching the same fragments makes the commit retry with the
        deletions recomputed (the written fragments are reused).
        """
        self.ensure(spec)
        batches = data.to_batches() if isinstance(data, pa.Table) else data
        counted = _CountingBatches(batches, spec.schema, batch)
        reader = pa.RecordBatchReader.from_batches(spec.schema, iter(counted))
        try:
            new_fragments = write_fragments(reader, self.uri(spec.name), schema=spec.schema)
        except OSError:
            if counted.error is not None:  # our own refusal, wrapped by Lance: surface it
                raise counted.error from None
            raise
        crashpoint("lab.fragments_written")
        predicate = f"batch = {sql_literal(batch)}"
        with self._partition_lock(spec.name, batch):
            return self._commit_replacement(spec, predicate, new_fragments, counted.rows, attempts)

    @contextlib.contextmanager
    def _partition_lock(self, table: str, batch: str) -> Iterator[None]:
        """Serialise replacements of the *same* partition on a local lab.

        Lance rebases concurrent commits that touch different fragments, so two
        replacements of one batch that both start before either commits would both
        add rows. Different batches never wait on each other. On object storage the
        run coordinator's per-partition limit (dagster.yaml) provides the exclusion.
        """
        if "://" in self.root:
            yield
            return
        lock_dir = Path(self.root) / ".locks"
        lock_dir.mkdir(exist_ok=True)
        digest = hashlib.sha256(f"{table}\0{batch}".encode()).hexdigest()[:24]
        with open(lock_dir / f"{table}.{digest}.lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _commit_replacement(
        self, spec: TableSpec, predicate: str, new_fragments: list, rows: int, attempts: int
    ) -> dict[str, Any]:
        last: Exception | None = None
        for attempt in range(attempts):
            ds = self.dataset(spec.name)
            addresses = ds.to_table(columns=[], filter=predicate, with_row_address=True)
            touched = sorted({int(a) >> 32 for a in addresses.column("_rowaddr").to_pylist()})
            removed: list[int] = []
            updated = []
            for fragment_id in touched:
                fragment = ds.get_fragment(fragment_id)
                after = fragment.delete(predicate)
                if after is None:
                    removed.append(fragment_id)
                else:
                    updated.append(after)
            op = lance.LanceOperation.Update(
                removed_fragment_ids=removed,
                updated_fragments=updated,
                new_fragments=new_fragments,
            )
            try:
                committed = lance.LanceDataset.commit(
                    self.uri(spec.name), op, read_version=ds.version
                )
            except OSError as exc:  # a conflicting concurrent commit: recompute and retry
                last = exc
                time.sleep(0.05 * (2**attempt))
                continue
            crashpoint("lab.committed")
            self.ensure_indexes(spec)
            return {
                "rows_written": rows,
                "rows_replaced": addresses.num_rows,
                "version": committed.version,
            }
        assert last is not None
        raise last

    def ensure_indexes(self, spec: TableSpec, attempts: int = 8) -> list[str]:
        """Create the spec's missing scalar indexes, tolerating concurrent writers; the
        columns indexed now.

        Two partitions committing at once may both try to create the same index: Lance
        then rejects one CreateIndex as preempted (retryable) or says it already exists.
        Either way the other writer's index serves; re-read and carry on.
        """
        created: list[str] = []
        if not spec.indexes:
            return created
        for attempt in range(attempts + len(spec.indexes)):  # one round per index, + retries
            ds = self._open(spec.name)
            if ds is None or ds.count_rows() == 0:
                return created
            have = {tuple(ix["fields"]) for ix in ds.list_indices()}
            missing = [(c, k) for c, k in spec.indexes if (c,) not in have]
            if not missing:
                return created
            column, kind = missing[0]
            try:
                ds.create_scalar_index(column, kind)
                created.append(column)
            except CommitConflictError:
                time.sleep(0.05 * (2 ** min(attempt, 5)))
            except (OSError, ValueError) as exc:
                if "already exists" not in str(exc):
                    raise
        ds = self.dataset(spec.name)
        have = {tuple(ix["fields"]) for ix in ds.list_indices()}
        still = [c for c, _ in spec.indexes if (c,) not in have]
        if still:
            raise RuntimeError(f"{spec.name}: could not create indexes on {still} (conflicts)")
        return created

    def read(
        self,
        table: str,
        columns: Sequence[str] | None = None,
        filter: str | None = None,
        version: int | None = None,
    ) -> pa.Table:
        """Projection + predicate pushdown read; an absent table reads as empty."""
        ds = self._open(table, version)
        if ds is None:
            return pa.table({})
        return ds.to_table(columns=list(columns) if columns else None, filter=filter)

    def read_batch(self, table: str, batch: str, columns: Sequence[str] | None = None) -> pa.Table:
        return self.read(table, columns, f"batch = {sql_literal(batch)}")

    def count(self, table: str, filter: str | None = None) -> int:
        """Rows of ``table`` matching ``filter``; an absent table has none."""
        ds = self._open(table)
        return 0 if ds is None else ds.count_rows(filter)

    def version(self, table: str) -> int | None:
        """The table's current version; None when it does not exist."""
        ds = self._open(table)
        return None if ds is None else ds.version

    def append(self, spec: TableSpec, rows: pa.Table) -> int:
        """Add ``rows`` in one commit (for small queue/log tables); returns the version."""
        self.ensure(spec)
        rows = rows.select(spec.schema.names).cast(spec.schema)
        if rows.num_rows:
            lance.write_dataset(rows, self.uri(spec.name), mode="append")
            self.ensure_indexes(spec)
        return self.dataset(spec.name).version

    def delete(self, table: str, predicate: str, attempts: int = 8) -> int:
        """Delete the rows matching ``predicate`` in one commit, retrying lost races.

        Returns the version after the delete (the current one when the table is absent or
        nothing matched is still a valid answer: the rows are gone either way).
        """
        last: Exception | None = None
        for attempt in range(attempts):
            ds = self._open(table)
            if ds is None:
                return 0
            try:
                ds.delete(predicate)
                return self.dataset(table).version
            except (OSError, RuntimeError) as exc:
                if "conflict" not in str(exc).lower() and not isinstance(exc, CommitConflictError):
                    raise
                last = exc
                time.sleep(0.05 * (2**attempt))
        assert last is not None
        raise last

    def replace_rows(self, spec: TableSpec, column: str, value: str, rows: pa.Table) -> int:
        """Make ``rows`` exactly the rows of ``spec`` whose ``column`` is ``value``, in one
        commit (a full-replacement ``merge_insert`` on the identity columns): a replay leaves
        the same rows, never duplicates. For tables keyed by something other than ``batch``
        (an opt-out list's rows); returns the table version."""
        rows = rows.select(spec.schema.names).cast(spec.schema)
        others = set(rows.column(column).to_pylist()) - {value}
        if others:
            raise ValueError(f"rows for {column}={value!r} include other values {sorted(others)}")
        ds = self.ensure(spec)
        (
            ds.merge_insert(list(spec.identity))
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .when_not_matched_by_source_delete(f"{column} = {sql_literal(value)}")
            .execute(rows)
        )
        self.ensure_indexes(spec)
        return self.dataset(spec.name).version

    def add_columns(self, table: str, fields: Sequence[pa.Field]) -> int:
        """Append null columns to ``table`` (a metadata-only commit): how a table written
        under an older spec gains the fields a newer one added. Returns the version."""
        ds = self.dataset(table)
        if fields:
            ds.add_columns(pa.schema(list(fields)))
        return self.dataset(table).version

    def ensure_scalar_indexes(self, table: str, indexes: Iterable[tuple[str, str]]) -> list[str]:
        """Create the missing scalar indexes of a non-empty table; the columns indexed now.

        For indexes a reader wants on another stage's table (the spec's own indexes are
        kept by ``ensure_indexes`` on every write).
        """
        return self.ensure_indexes(TableSpec(table, pa.schema([]), (), tuple(indexes)))

    def ensure_text_index(self, table: str, column: str, name: str) -> str:
        """Create the INVERTED (full-text) index on ``column``, or fold new fragments into it.

        Returns ``"created"``, ``"optimized"``, ``"empty"``, ``"absent"`` or ``"deferred
        (...)"`` when concurrent commits kept winning: unindexed fragments are still searched
        (flat), and the next write or the maintenance job indexes them.
        """

        def act(ds: lance.LanceDataset) -> str:
            if ds.count_rows() == 0:
                return "empty"
            if _has_index(ds, column, ("INVERTED", "FTS")):
                names = sorted({ix["name"] for ix in ds.list_indices() if ix["fields"] == [column]})
                ds.optimize.optimize_indices(index_names=names)
                return "optimized"
            ds.create_scalar_index(column, "INVERTED", name=name, replace=False)
            return "created"

        return self._index_action(table, act)

    def ensure_vector_index(
        self,
        table: str,
        column: str,
        name: str,
        *,
        min_rows: int,
        index_type: str,
        index_types: Sequence[str],
        metric: str = "cosine",
        **params: Any,
    ) -> str:
        """Build a vector index once ``table`` has ``min_rows`` rows; then keep it fed.

        Returns ``"below_threshold (n < min)"``, ``"created"``, ``"optimized"``, ``"absent"``
        or ``"deferred (...)"``. New data is assigned to the trained partitions (no
        retraining). ``index_types``: the kinds that count as "already indexed".
        """

        def act(ds: lance.LanceDataset) -> str:
            rows = ds.count_rows()
            if _has_index(ds, column, index_types):
                names = sorted({ix["name"] for ix in ds.list_indices() if ix["fields"] == [column]})
                ds.optimize.optimize_indices(index_names=names)
                return "optimized"
            if rows < min_rows:
                return f"below_threshold ({rows} < {min_rows})"
            ds.create_index(column, index_type, name=name, metric=metric, **params)
            return "created"

        return self._index_action(table, act)

    def _index_action(
        self, table: str, action: Callable[[lance.LanceDataset], str], attempts: int = 3
    ) -> str:
        """Run an index action; a conflicting concurrent commit is retried, then reported.

        Any other error is raised: only a lost race is an acceptable reason to skip.
        """
        last: Exception | None = None
        for attempt in range(attempts):
            ds = self._open(table)
            if ds is None:
                return "absent"
            try:
                return action(ds)
            except (OSError, RuntimeError, ValueError) as exc:
                message = str(exc)
                if "already exists" in message:  # a concurrent writer built it
                    return "exists"
                if "conflict" not in message.lower():
                    raise
                last = exc
                time.sleep(0.05 * (2**attempt))
        return f"deferred ({type(last).__name__}: {str(last)[:160]})"

    def maintain(
        self,
        spec: TableSpec,
        target_rows_per_fragment: int = TARGET_ROWS_PER_FRAGMENT,
        retention: timedelta = timedelta(days=7),
        orphan_min_age: timedelta = ORPHAN_MIN_AGE,
    ) -> dict[str, Any]:
        """Compact toward the target fragment size, refresh indexes, drop old versions, and
        remove files no version references once they are ``orphan_min_age`` old."""
        if not self.exists(spec.name):
            return {"table": spec.name, "skipped": "absent"}
        self.ensure_indexes(spec)
        ds = self.dataset(spec.name)
        before = len(ds.get_fragments())
        # Index every fragment first: Lance only merges fragments of equal index coverage.
        if ds.list_indices():
            ds.optimize.optimize_indices()
        ds = self.dataset(spec.name)
        metrics = ds.optimize.compact_files(target_rows_per_fragment=target_rows_per_fragment)
        ds = self.dataset(spec.name)
        if ds.list_indices():
            ds.optimize.optimize_indices()
        cleanup = self.dataset(spec.name).cleanup_old_versions(older_than=retention)
        orphans = self.remove_orphaned_files(spec.name, retention, orphan_min_age)
        ds = self.dataset(spec.name)
        return {
            "table": spec.name,
            "rows": ds.count_rows(),
            "fragments_before": before,
            "fragments_after": len(ds.get_fragments()),
            "fragments_removed": metrics.fragments_removed,
            "versions_removed": getattr(cleanup, "old_versions", None),
            "version": ds.version,
            **orphans,
        }

    def remove_orphaned_files(
        self, table: str, retention: timedelta, min_age: timedelta = ORPHAN_MIN_AGE
    ) -> dict[str, Any]:
        """Delete files of ``table`` that no kept version references, if older than ``min_age``.

        A writer killed between ``write_fragments`` and its commit (or an index build or a
        compaction killed before theirs) leaves data, deletion or index files that no
        manifest names. Lance's ``cleanup_old_versions`` leaves such "unverified" files
        for 7 days, and ``delete_unverified=True`` removes them regardless of age, which
        would also delete the files of a write still in flight: its fragments are on disk
        before its commit names them, and a commit naming deleted files corrupts the table.
        So Lance lists the candidates (``explain_cleanup_old_versions``, the same rules as
        the cleanup) and only those at least ``min_age`` old (file modification time) are
        deleted here. ``min_age`` must exceed the longest write, from its first fragment to
        its commit (a partition replacement streams one batch; default 24 h). A file Lance
        lists that cannot be mapped to this table's directory is left alone.
        """
        if min_age < timedelta(0):
            raise ValueError(f"min_age must be >= 0, got {min_age}")
        ds = self.dataset(table)
        plan = ds.explain_cleanup_old_versions(
            older_than=retention,
            delete_unverified=True,
            include_files=True,
            max_files=ORPHAN_SCAN_LIMIT,
        )
        base_uri = self.uri(table)
        base_key = _object_key(base_uri)
        now = time.time()
        removed = kept = unmapped = 0
        removed_bytes = 0
        for candidate in plan.candidate_files:
            if not candidate.unverified:
                continue  # referenced by a version past retention: cleanup_old_versions' job
            path = candidate.path.lstrip("/")
            if not path.startswith(base_key + "/"):
                unmapped += 1
                continue
            fs, fs_path = pafs.FileSystem.from_uri(f"{base_uri}/{path[len(base_key) + 1 :]}")
            info = fs.get_file_info(fs_path)
            if info.type != pafs.FileType.File or info.mtime is None:
                continue
            if now - info.mtime.timestamp() < min_age.total_seconds():
                kept += 1
                continue
            fs.delete_file(fs_path)
            removed += 1
            removed_bytes += candidate.size_bytes
            _remove_empty_parent(fs, fs_path, base_key)
        return {
            "orphan_files_removed": removed,
            "orphan_bytes_removed": removed_bytes,
            "orphan_files_kept_recent": kept,
            "orphan_files_unmapped": unmapped,
            "orphan_scan_truncated": plan.candidate_files_truncated,
        }


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
    """

    def __init__(self, lab: Lab, versions: Mapping[str, int] | None = None) -> None:
        self.lab = lab
        self.versions: dict[str, int] = dict(versions or {})
        self._open: dict[str, lance.LanceDataset | None] = {}
        self._lock = threading.Lock()

    def _ds(self, table: str) -> lance.LanceDataset | None:
        with self._lock:
            if table not in self._open:
                ds = self.lab._open(table, self.versions.get(table))
                self._open[table] = ds
                if ds is not None:
                    self.versions[table] = ds.version
            return self._open[table]

    def pin(self, tables: Iterable[str]) -> dict[str, int]:
        """Open ``tables`` now, so later reads see the lab as it is at this moment; the
        version of each one that exists (absent tables stay absent for this view)."""
        return {t: v for t in tables if (v := self.version(t)) is not None}

    def exists(self, table: str) -> bool:
        return self._ds(table) is not None

    def version(self, table: str) -> int | None:
        ds = self._ds(table)
        return None if ds is None else ds.version

    def schema(self, table: str) -> pa.Schema | None:
        ds = self._ds(table)
        return None if ds is None else ds.schema

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
        table reads as empty."""
        ds = self._ds(table)
        if ds is None:
            return pa.table({})
        return ds.to_table(columns=list(columns) if columns else None, filter=filter, **scan)

    def take_matching(self, table: str, columns: Sequence[str], filter: str) -> pa.Table:
        """The rows matching ``filter``, read in two steps: their row ids (the scalar
        indexes answer the filter; no data column is read), then only those rows.

        Why: a filtered scan that projects a large column (``images.image``, megabytes a
        row) costs Lance ~30 ms of CPU per call whatever the number of matches (measured on
        lance 14.0.2: 5 or 32 matching rows, 27-55 ms), while taking the rows by id costs
        ~1 ms per megabyte. Same rows as :meth:`read` (order not kept); same snapshot, so
        the ids are valid for the rows they name. An absent table reads as empty.
        """
        ds = self._ds(table)
        if ds is None:
            return pa.table({})
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
