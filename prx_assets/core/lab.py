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
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
from lance.commit import CommitConflictError
from lance.fragment import write_fragments

from prx_assets.core.crashpoints import crashpoint

TARGET_ROWS_PER_FRAGMENT = 1_048_576


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

    def exists(self, table: str) -> bool:
        try:
            lance.dataset(self.uri(table))
        except (ValueError, OSError, FileNotFoundError):
            return False
        return True

    def dataset(self, table: str, version: int | None = None) -> lance.LanceDataset:
        return lance.dataset(self.uri(table), version=version)

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
            self._ensure_indexes(spec)
            return {
                "rows_written": rows,
                "rows_replaced": addresses.num_rows,
                "version": committed.version,
            }
        assert last is not None
        raise last

    def _ensure_indexes(self, spec: TableSpec, attempts: int = 8) -> None:
        """Create the spec's missing scalar indexes, tolerating concurrent writers.

        Two partitions committing at once may both try to create the same index: Lance
        then rejects one CreateIndex as preempted (retryable) or says it already exists.
        Either way the other writer's index serves; re-read and carry on.
        """
        if not spec.indexes:
            return
        for attempt in range(attempts):
            ds = self.dataset(spec.name)
            if ds.count_rows() == 0:
                return
            have = {tuple(ix["fields"]) for ix in ds.list_indices()}
            missing = [(c, k) for c, k in spec.indexes if (c,) not in have]
            if not missing:
                return
            column, kind = missing[0]
            try:
                ds.create_scalar_index(column, kind)
            except CommitConflictError:
                time.sleep(0.05 * (2**attempt))
            except (OSError, ValueError) as exc:
                if "already exists" not in str(exc):
                    raise
        ds = self.dataset(spec.name)
        have = {tuple(ix["fields"]) for ix in ds.list_indices()}
        still = [c for c, _ in spec.indexes if (c,) not in have]
        if still:
            raise RuntimeError(f"{spec.name}: could not create indexes on {still} (conflicts)")

    def read(
        self,
        table: str,
        columns: Sequence[str] | None = None,
        filter: str | None = None,
        version: int | None = None,
    ) -> pa.Table:
        """Projection + predicate pushdown read; an absent table reads as empty."""
        if not self.exists(table):
            return pa.table({})
        return self.dataset(table, version).to_table(
            columns=list(columns) if columns else None, filter=filter
        )

    def read_batch(self, table: str, batch: str, columns: Sequence[str] | None = None) -> pa.Table:
        return self.read(table, columns, f"batch = {sql_literal(batch)}")

    def maintain(
        self,
        spec: TableSpec,
        target_rows_per_fragment: int = TARGET_ROWS_PER_FRAGMENT,
        retention: timedelta = timedelta(days=7),
    ) -> dict[str, Any]:
        """Compact toward the target fragment size, refresh indexes, drop old versions."""
        if not self.exists(spec.name):
            return {"table": spec.name, "skipped": "absent"}
        self._ensure_indexes(spec)
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
        ds = self.dataset(spec.name)
        return {
            "table": spec.name,
            "rows": ds.count_rows(),
            "fragments_before": before,
            "fragments_after": len(ds.get_fragments()),
            "fragments_removed": metrics.fragments_removed,
            "versions_removed": getattr(cleanup, "old_versions", None),
            "version": ds.version,
        }
