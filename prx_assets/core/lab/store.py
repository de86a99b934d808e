"""The Lance "lab": one directory of Lance tables that every stage reads and extends.

Why these helpers: every partitioned stage writes "its rows for batch B" and must be
idempotent and safe when partitions run concurrently. Each rewrite of a partition is a
single Lance commit (new fragments plus the deletion of the batch's old rows); concurrent
commits from other partitions are rebased by Lance's optimistic concurrency (checked in the
tests with processes). After each commit the writer keeps the table cheap for the next
operation (``maintenance.py``): indexes cover the new fragment, a full size tier is
compacted, old versions are dropped by count and age, and pinned versions are kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pyarrow.fs as pafs
from lance.commit import CommitConflictError
from lance.fragment import write_fragments

from prx_assets.core.crashpoints import crashpoint
from prx_assets.core.lab import maintenance as mx
from prx_assets.core.lab.blob_gc import BlobSweep, sweep_blobs
from prx_assets.core.lab.blobs import (
    BlobStore,
    LocalBlobs,
    RemoteBlobs,
    is_blob_ref,
    stored_schema,
)
from prx_assets.core.lab.fragments import CountingBatches, PartitionFragments, WrittenFragments
from prx_assets.core.lab.io import arrow_filesystem, open_dataset, seen, session, storage_options
from prx_assets.core.lab.maintenance import (
    DEFAULT_POLICY,
    ORPHAN_MIN_AGE,
    TARGET_ROWS_PER_FRAGMENT,
    MaintenancePolicy,
)
from prx_assets.core.lab.pins import VersionPins
from prx_assets.core.lab.readers import held_versions
from prx_assets.core.lab.spec import TableSpec, sql_literal
from prx_assets.core.lab.view import LabView, _has_index
from prx_assets.core.storage import check_bucket


class Lab(VersionPins):
    """A directory of Lance tables (local path or object-store URI).

    ``policy`` says how the write path maintains what it writes (on by default;
    ``maintenance.MANUAL`` leaves it all to ``maintain``).
    """

    def __init__(self, root: str | Path, policy: MaintenancePolicy = DEFAULT_POLICY) -> None:
        self.root = str(root).rstrip("/")
        self.policy = policy
        # Where the write path's compactions rewrite rows: None here; a step whose workers
        # reach the lab sets its pool (``workers.task_map``), so a big batch's rows are
        # rewritten by the workers that wrote them, not read and written by the step.
        self.rewrite: mx.TaskMap | None = None
        # Endpoint, region, credentials of an s3:// lab, from the environment (holds
        # secrets: passed to Lance only, never logged; core/storage.py).
        self.storage_options = storage_options(self.root)
        if "://" not in self.root:
            Path(self.root).mkdir(parents=True, exist_ok=True)
        else:  # a missing bucket: say so and how to create it, not Lance's raw S3 error
            check_bucket(self.root)
        self.blobs = BlobStore(self.root)

    def uri(self, table: str) -> str:
        return f"{self.root}/{table}.lance"

    def _open(self, table: str, version: int | None = None) -> lance.LanceDataset | None:
        """The dataset, or None when the table does not exist (one open either way)."""
        try:
            return open_dataset(self.uri(table), version)
        except (ValueError, OSError, FileNotFoundError):
            return None

    def exists(self, table: str) -> bool:
        return self._open(table) is not None

    def dataset(self, table: str, version: int | None = None) -> lance.LanceDataset:
        """The Lance dataset itself: for code inside this package and its tests only.

        Everything else goes through the methods of ``Lab`` and ``LabView``, so that one
        place decides how the lab is read, written and indexed (blob columns hold
        references here, not bytes).
        """
        return open_dataset(self.uri(table), version)

    def view(self, versions: Mapping[str, int] | None = None) -> LabView:
        """A read view that opens each table once (at ``versions[table]`` when given)."""
        return LabView(self, versions)

    def stored_schema(self, spec: TableSpec) -> pa.Schema:
        """The schema the table is (or will be) stored with: blob columns as references,
        except on a table created before blob storage, whose inline bytes stay inline."""
        ds = self._open(spec.name)
        if ds is not None:
            return pa.schema([ds.schema.field(n) for n in spec.schema.names])
        return stored_schema(spec.schema, spec.blobs)

    def local_blobs(self, spec: TableSpec, column: str) -> LocalBlobs | None:
        """``column``'s blobs for worker processes on this machine (picklable; references
        they store go to ``replace_partition(..., stored_blobs=[column])``); None when the
        lab is on object storage or the table keeps that column inline."""
        if column not in spec.blobs or not is_blob_ref(self.stored_schema(spec).field(column)):
            return None
        return self.blobs.local(spec.name)

    def remote_blobs(self, spec: TableSpec, column: str) -> RemoteBlobs | None:
        """``column``'s blobs for workers on any machine to store into (picklable, no
        credentials) when the lab is on object storage; None for a local lab (workers on
        other machines cannot write its disk: ``local_blobs`` is for this machine's) or when
        the table keeps that column inline."""
        if self.blobs.is_local:
            return None
        if column not in spec.blobs or not is_blob_ref(self.stored_schema(spec).field(column)):
            return None
        return RemoteBlobs(spec.name, self.root)

    def ensure(self, spec: TableSpec) -> lance.LanceDataset:
        """Create the table empty if missing (tolerating a concurrent creator).

        Why not ``write_dataset(mode="create")``: when another process creates the table
        between its existence check and its commit, Lance retries the create as an
        ``Overwrite`` at the next version, which erases every row committed meanwhile (seen:
        four processes creating ``opt_outs`` at once, one list's rows gone). Committing the
        empty ``Overwrite`` with no retry lands as version 1 or fails; a failed create finds
        the table another process made.
        """
        try:
            return self.dataset(spec.name)
        except (ValueError, OSError, FileNotFoundError):
            pass
        schema = stored_schema(spec.schema, spec.blobs)
        try:
            lance.LanceDataset.commit(
                self.uri(spec.name),
                lance.LanceOperation.Overwrite(schema, []),
                max_retries=0,
                storage_options=self.storage_options,
                enable_v2_manifest_paths=True,
            )
        except (OSError, ValueError):
            pass  # another process created it first; the open below finds its table
        return self.dataset(spec.name)

    def _to_stored(self, spec: TableSpec, rows: pa.Table) -> pa.Table:
        rows = rows.select(spec.schema.names).cast(spec.schema)
        stored = self.stored_schema(spec)
        blob_columns = [c for c in spec.blobs if is_blob_ref(stored.field(c))]
        if not blob_columns:
            return rows
        parts = [
            self.blobs.to_stored(spec.name, rb, blob_columns, stored)[0] for rb in rows.to_batches()
        ]
        return pa.Table.from_batches(parts, schema=stored)

    def replace_partition(
        self,
        spec: TableSpec,
        batch: str,
        data: pa.Table | Iterable[pa.RecordBatch],
        attempts: int = 8,
        stored_blobs: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Replace every row of ``batch`` with ``data`` in one Lance commit.

        ``stored_blobs``: blob columns whose values ``data`` gives as the references a
        ``local_blobs`` put stored (already stored, e.g. by worker processes); each is checked
        to be in the blob store before the commit, and a dangling one fails the write.

        New rows are streamed into new fragment files first (bounded memory: a batch's
        image bytes are never all held at once; blob columns go to the blob store first),
        then one ``Update`` transaction both marks the batch's old rows deleted and adds the
        new fragments. Readers see the old rows or the new rows, never a mix or nothing;
        rows of other batches are untouched; a rerun with the same data leaves the table's
        content unchanged. A concurrent commit touching the same fragments makes the commit
        retry with the deletions recomputed (the written fragments are reused). Then the
        table is maintained per ``policy`` (``result["maintenance"]``).
        """
        ds = self.ensure(spec)
        stored = pa.schema([ds.schema.field(n) for n in spec.schema.names])
        batches = data.to_batches() if isinstance(data, pa.Table) else data
        counted = CountingBatches(batches, spec, batch, stored, self.blobs, stored_blobs)
        reader = pa.RecordBatchReader.from_batches(stored, iter(counted))
        try:
            # On the opened dataset, not its URI: Lance would list every kept manifest to
            # find the latest version first (measured: 1.5 ms at 100 partitions, 4.8 ms at
            # 4,000).
            new_fragments = write_fragments(reader, ds, schema=stored)
        except Exception:
            if counted.error is not None:  # raised inside Lance's reader: surface the original
                raise counted.error from None
            raise
        return self._commit_new_rows(
            spec, batch, new_fragments, counted.rows, counted.blob_bytes_written, attempts
        )

    def partition_fragments(
        self, spec: TableSpec, batch: str, stored_blobs: Sequence[str] = ()
    ) -> PartitionFragments:
        """Where worker processes (on any node that reaches the lab) write rows of
        ``batch`` as uncommitted fragment files; ``commit_partition`` makes them the batch's
        rows. Creates the table if missing, so the workers find it."""
        ds = self.ensure(spec)
        stored = pa.schema([ds.schema.field(n) for n in spec.schema.names])
        return PartitionFragments(self.root, spec, batch, stored, tuple(stored_blobs))

    def commit_partition(
        self, spec: TableSpec, batch: str, written: Sequence[WrittenFragments], attempts: int = 8
    ) -> dict[str, Any]:
        """Replace every row of ``batch`` with the rows of ``written`` (fragments workers
        wrote through ``partition_fragments``) in one Lance commit: the same commit, locks,
        retries and maintenance as ``replace_partition``.

        Every data file the fragments name must be there (one stat each): a worker that
        wrote them somewhere this lab cannot see (a node without the mount) fails the
        commit, never commits rows whose files are missing."""
        fragments = [f for w in written for f in w.metadata()]
        fs, base = arrow_filesystem(self.uri(spec.name))
        paths = [f"{base}/data/{d.path}" for f in fragments for d in f.data_files()]
        missing = [i.path for i in fs.get_file_info(paths) if i.type == pafs.FileType.NotFound]
        if missing:
            raise FileNotFoundError(
                f"{spec.name}: {len(missing)} fragment file(s) of batch {batch[:120]!r} are "
                f"not in the lab (written where this lab cannot see?), e.g. {missing[0]}"
            )
        rows = sum(w.rows for w in written)
        blob_bytes = sum(w.blob_bytes_written for w in written)
        return self._commit_new_rows(spec, batch, fragments, rows, blob_bytes, attempts)

    def _commit_new_rows(
        self,
        spec: TableSpec,
        batch: str,
        new_fragments: list,
        rows: int,
        blob_bytes_written: int,
        attempts: int,
    ) -> dict[str, Any]:
        crashpoint("lab.fragments_written")
        predicate = f"batch = {sql_literal(batch)}"
        with self._partition_lock(spec.name, batch):
            result, committed = self._commit_replacement(
                spec, predicate, new_fragments, rows, attempts
            )
        result["blob_bytes_written"] = blob_bytes_written
        result["maintenance"] = self.after_commit(spec, committed)
        return result

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
    ) -> tuple[dict[str, Any], lance.LanceDataset]:
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
                # Committing on the opened dataset, not its URI: Lance then does not list
                # every kept manifest to find the latest (a conflict is still detected).
                committed = lance.LanceDataset.commit(ds, op, read_version=ds.version)
            except OSError as exc:  # a conflicting concurrent commit: recompute and retry
                last = exc
                time.sleep(0.05 * (2**attempt))
                continue
            crashpoint("lab.committed")
            seen(self.uri(spec.name), committed.version)
            result = {
                "rows_written": rows,
                "rows_replaced": addresses.num_rows,
                "version": committed.version,  # before index commits move ``committed`` on
                "attempts": attempt + 1,  # more than 1: a concurrent commit was in the way
            }
            self.ensure_indexes(spec, committed)
            return result, committed
        assert last is not None
        raise last

    def after_commit(self, spec: TableSpec, ds: lance.LanceDataset | None = None) -> dict[str, Any]:
        """Keep ``spec``'s table cheap after a commit (the write path's maintenance).

        Once more than ``policy.index_lag_fragments`` fragments are unindexed, compacts them
        into one and adds a delta segment to each scalar index; then merges any full index
        tier and compacts the fragments it covers (``maintenance.fold_new_fragments``,
        ``merge_due_tier``: the cost is that tier's rows, not the table's); rewrites
        fragments with many deleted rows; and every ``policy.cleanup_every`` versions
        applies version retention when it would remove something. ``ds``: the table as the
        commit left it (saves an open). One maintainer per table at a time (others skip:
        the next commit catches up); a maintenance commit that loses a race to a partition
        commit is deferred, never retried over it, so no partition commit is ever lost.
        Returns what was done.
        """
        policy = self.policy
        if not policy.enabled:
            return {"skipped": "manual"}
        done: dict[str, Any] = {}
        with mx.maintenance_lock(self.root, spec.name) as mine:
            if not mine:
                return {"skipped": "another maintainer"}
            try:
                ds = ds if ds is not None else self.dataset(spec.name)
                first = ds.version  # the commit just made (or a later one)
                if mx.fold_due(ds, spec, policy):
                    ds = self.dataset(spec.name)  # act on the latest, not the commit's view
                    done.update(mx.fold_new_fragments(ds, spec, policy, self.rewrite))
                if done:  # a new run: the only event that can fill an index tier
                    for _ in range(16):  # a cascade climbs one tier per step
                        merged = mx.merge_due_tier(ds, spec, policy, self.rewrite)
                        if not merged:
                            break
                        for key, value in merged.items():
                            done[key] = done.get(key, 0) + value
                heavy = mx.heavy_fragments(ds, policy)
                if heavy:  # check again on the latest version before rewriting
                    ds = self.dataset(spec.name)
                    heavy = mx.heavy_fragments(ds, policy)
                if heavy:
                    metrics = mx.compact(ds, heavy, policy, self.rewrite)
                    done["fragments_compacted"] = (
                        done.get("fragments_compacted", 0) + metrics.fragments_removed
                    )
                every = policy.cleanup_every  # crossed a multiple since the commit?
                if ds.version // every > (first - 1) // every:
                    held, min_age = self._held_versions(spec.name), self._reader_min_age()
                    if mx.cleanup_due(
                        self.uri(spec.name), ds.version, policy, min_age, held or set()
                    ):
                        started = time.perf_counter()
                        done.update(
                            mx.cleanup_versions(
                                self.uri(spec.name),
                                policy.keep_versions,
                                min_age,
                                policy.retention,
                                held,
                            )
                        )
                        done["cleanup_s"] = round(time.perf_counter() - started, 4)
            except (OSError, RuntimeError, ValueError, CommitConflictError) as exc:
                if not mx.is_conflict(exc):
                    raise
                done["deferred"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return done

    def _held_versions(self, table: str) -> set[int] | None:
        """The versions of ``table`` live views hold (local labs); None on object storage,
        where no holds are known and the age rule alone protects readers."""
        return None if "://" in self.root else held_versions(self.root, table)

    def _reader_min_age(self) -> timedelta:
        """The age under which no version is dropped: ``policy.reader_min_age`` where
        views hold their versions (local labs; one-shot reads), else
        ``policy.version_min_age``."""
        return self.policy.version_min_age if "://" in self.root else self.policy.reader_min_age

    def ensure_indexes(
        self, spec: TableSpec, ds: lance.LanceDataset | None = None, attempts: int = 8
    ) -> list[str]:
        """Create the spec's missing scalar indexes, tolerating concurrent writers; the
        columns indexed now. ``ds``: the table as just committed (saves an open when every
        index exists already).

        Two partitions committing at once may both try to create the same index: Lance
        then rejects one CreateIndex as preempted (retryable) or says it already exists.
        Either way the other writer's index serves; re-read and carry on.
        """
        created: list[str] = []
        if not spec.indexes:
            return created
        for attempt in range(attempts + len(spec.indexes)):  # one round per index, + retries
            ds = ds if attempt == 0 and ds is not None else self._open(spec.name)
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
        """Projection + predicate pushdown read; an absent table reads as empty. Blob
        columns come back as their bytes (checked against their address)."""
        ds = self._open(table, version)
        if ds is None:
            return pa.table({})
        rows = ds.to_table(columns=list(columns) if columns else None, filter=filter)
        return self.blobs.resolve(table, rows, ds.schema)

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
        rows = self._to_stored(spec, rows)
        if rows.num_rows:
            lance.write_dataset(
                rows,
                self.uri(spec.name),
                mode="append",
                storage_options=self.storage_options,
                session=session(),
            )
            self.ensure_indexes(spec)
            self.after_commit(spec)
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
            .execute(self._to_stored(spec, rows))
        )
        self.ensure_indexes(spec)
        self.after_commit(spec)
        return self.dataset(spec.name).version

    def insert_missing(self, spec: TableSpec, rows: pa.Table) -> int:
        """Add the ``rows`` whose identity the table does not hold yet, in one commit
        (``merge_insert`` inserting only unmatched rows): for content-addressed rows that
        are written once and never change, so a replay or a racing writer adds nothing
        twice. Returns the table version."""
        rows = rows.select(spec.schema.names).cast(spec.schema)
        ds = self.ensure(spec)
        if not rows.num_rows:
            return ds.version
        ds.merge_insert(list(spec.identity)).when_not_matched_insert_all().execute(
            self._to_stored(spec, rows)
        )
        self.ensure_indexes(spec)
        self.after_commit(spec)
        return self.dataset(spec.name).version

    def write_rows(self, spec: TableSpec, batches: Iterable[pa.RecordBatch]) -> list:
        """Stream ``batches`` into new, uncommitted fragment files of ``spec``'s table
        (bounded memory: ``ROWS_PER_WRITE`` rows are held at a time) and return the fragments, for
        ``commit_rows``. Nothing is visible until then; files of fragments never committed
        (a refused or killed run) are what ``remove_orphaned_files`` removes. Tables with
        blob columns go through ``replace_partition`` instead."""
        if spec.blobs:
            raise ValueError(f"{spec.name} has blob columns: use replace_partition")
        ds = self.ensure(spec)
        stored = pa.schema([ds.schema.field(n) for n in spec.schema.names])
        source = iter(batches)
        fragments: list = []
        while True:
            # The rows of one write are gathered here first, in this thread, then handed to
            # Lance whole: a generator pulled from inside Lance's writer (which here resolves
            # identifiers through other Lance reads) grew the process by ~25 MB per 100k
            # rows for as long as the stream lasted (the intake of a 2M-line list, in a one-off
            # script; bench_optout_registry checks the peak before the commit); gathered, memory stays flat at one write's rows (ROWS_PER_WRITE).
            part = list(_take_rows(source, ROWS_PER_WRITE))
            if not part:
                break
            part = [b.select(stored.names).cast(stored) for b in part]
            reader = pa.RecordBatchReader.from_batches(stored, iter(part))
            fragments.extend(write_fragments(reader, ds, schema=stored))
            del part, reader
        crashpoint("lab.fragments_written")
        return fragments

    def commit_rows(
        self, spec: TableSpec, column: str, value: str, fragments: Sequence, rows: int
    ) -> int:
        """Make the rows of ``fragments`` (``write_rows``) exactly the rows of ``spec``
        whose ``column`` is ``value``, in one commit (the old ones marked deleted and the
        new ones added by one ``Update``, as ``replace_partition`` does for a batch): a rerun
        leaves the same rows, never both. The caller wrote only rows of that value. Returns
        the table version after the commit's index upkeep."""
        predicate = f"{column} = {sql_literal(value)}"
        with self._partition_lock(spec.name, f"{column}\0{value}"):
            _, committed = self._commit_replacement(spec, predicate, list(fragments), rows, 8)
        self.after_commit(spec, committed)
        return self.dataset(spec.name).version

    def add_columns(self, table: str, fields: Sequence[pa.Field]) -> int:
        """Append null columns to ``table`` (a metadata-only commit): how a table written
        under an older spec gains the fields a newer one added. Returns the version."""
        ds = self.dataset(table)
        if fields:
            ds.add_columns(pa.schema(list(fields)))
        return self.dataset(table).version

    def add_derived_columns(
        self,
        table: str,
        read_columns: Sequence[str],
        derive: Callable[[pa.RecordBatch], pa.RecordBatch],
    ) -> int:
        """Add the columns ``derive`` computes from ``read_columns`` to every row of
        ``table``, in one commit (Lance writes the new columns' files beside each fragment;
        the existing data is not rewritten): how a table written under an older spec gains
        a field derived from the ones it has. Returns the version."""
        ds = self.dataset(table)
        ds.add_columns(derive, read_columns=list(read_columns))
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
        keep_versions: int | None = None,
        version_min_age: timedelta | None = None,
    ) -> dict[str, Any]:
        """Compact toward the target fragment size, refresh every index, drop versions past
        retention (age, and count beyond ``keep_versions`` once older than
        ``version_min_age``; pinned ones never), and remove files no version references
        once they are ``orphan_min_age`` old. Blob bytes are never read or copied."""
        if not self.exists(spec.name):
            return {"table": spec.name, "skipped": "absent"}
        keep = self.policy.keep_versions if keep_versions is None else keep_versions
        min_age = self._reader_min_age() if version_min_age is None else version_min_age
        self.ensure_indexes(spec)
        ds = self.dataset(spec.name)
        before = len(ds.get_fragments())
        with mx.maintenance_lock(self.root, spec.name, wait=True):  # a writer's is short
            # Index every fragment first: Lance only merges fragments of equal index coverage.
            # A partition commit racing a step wins; the step is redone on the new version.
            deferred: list[str] = []
            uri = self.uri(spec.name)
            mx.retry_conflicts(lambda: mx.optimize_all_indices(uri), deferred)
            metrics = mx.retry_conflicts(
                lambda: open_dataset(uri).optimize.compact_files(
                    target_rows_per_fragment=target_rows_per_fragment,
                    batch_size=self.policy.compaction_batch_size,
                    num_threads=1,
                ),
                deferred,
            )
            mx.retry_conflicts(lambda: mx.optimize_all_indices(uri), deferred)
            held = self._held_versions(spec.name)
            cleanup = mx.cleanup_versions(self.uri(spec.name), keep, min_age, retention, held)
            orphans = mx.remove_orphaned_files(
                self.dataset(spec.name), self.uri(spec.name), retention, orphan_min_age
            )
        ds = self.dataset(spec.name)
        return {
            "table": spec.name,
            "rows": ds.count_rows(),
            "fragments_before": before,
            "fragments_after": len(ds.get_fragments()),
            "fragments_removed": metrics.fragments_removed if metrics else 0,
            "version": ds.version,
            "deferred": deferred,
            **cleanup,
            **orphans,
        }

    def remove_orphaned_files(
        self, table: str, retention: timedelta, min_age: timedelta = ORPHAN_MIN_AGE
    ) -> dict[str, Any]:
        """Delete files of ``table`` no kept version references, once older than ``min_age``
        (see ``maintenance.remove_orphaned_files``)."""
        return mx.remove_orphaned_files(self.dataset(table), self.uri(table), retention, min_age)

    def sweep_blobs(
        self, spec: TableSpec, min_age: timedelta = ORPHAN_MIN_AGE, **kwargs: Any
    ) -> dict[str, Any]:
        """Delete ``spec``'s blobs that no retained (or pinned) version names, once older
        than ``min_age`` (see ``blob_gc``); under the table's maintenance lock, so no
        version cleanup runs meanwhile."""
        if not spec.blobs or not self.exists(spec.name):
            return BlobSweep(spec.name, skipped="no blobs").as_dict()
        with mx.maintenance_lock(self.root, spec.name, wait=True):
            return sweep_blobs(
                self.uri(spec.name), self.blobs, spec.name, spec.blobs, min_age, **kwargs
            ).as_dict()


def no_lab_at(root: str | Path) -> str | None:
    """Why ``root`` is not a lab, as "no lab at <root> (...)"; None when it is one.

    A local lab is a directory holding at least one Lance table (``<name>.lance``). Read-only
    commands check this before ``Lab(root)``, which creates the directory: a mistyped data
    root must say so, not read as a lab where nothing was ever ingested or decided (in a
    legal audit, "not found" would read as "never ingested"). An object-store URI cannot be
    listed cheaply here: it is taken as given (None), and reads of it fail on their own.
    """
    text = str(root)
    if "://" in text:
        return None
    path = Path(text)
    if not path.is_dir():
        return f"no lab at {text} (no such directory; wrong --data-root?)"
    if not any(p.name.endswith(".lance") for p in path.iterdir()):
        return f"no lab at {text} (the directory holds no lab table; wrong --data-root?)"
    return None


#: Rows gathered per Lance write of ``Lab.write_rows`` (see there; one or more fragments
#: each); ``bench_optout_registry`` measures the peak memory of a registry's intake with it.
ROWS_PER_WRITE = 500_000


def _take_rows(rest: Iterator[pa.RecordBatch], limit: int) -> Iterator[pa.RecordBatch]:
    """Batches of ``rest`` until ``limit`` rows are given (the batch crossing it included);
    ``rest`` is left at the next batch."""
    rows = 0
    while rows < limit:
        batch = next(rest, None)
        if batch is None:
            return
        yield batch
        rows += batch.num_rows
