"""A partition's new rows written as uncommitted Lance fragment files, by whichever
process holds them: the step, or the workers that produced the rows.

Why: per-image work runs on workers (``core/workers.py``, Ray actors on other nodes), and
when a worker writes its own rows into fragment files (next to the table, local or
``s3://``) the step carries only the fragments' metadata (a few hundred bytes per
fragment) and commits once: the rows, thumbnails and previews never pass through it.
``Lab.commit_partition`` makes them visible in the same single ``Update`` commit as
``Lab.replace_partition``, so readers see the batch's old rows or all of its new rows.
Files of fragments never committed (a killed run, a refused chunk) are what
``Lab.remove_orphaned_files`` removes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from lance.file import LanceFileReader
from lance.fragment import FragmentMetadata, write_fragments

from prx_assets.core.crashpoints import crashpoint
from prx_assets.core.lab.blobs import BlobError, BlobStore, is_blob_ref
from prx_assets.core.lab.io import open_dataset, storage_options
from prx_assets.core.lab.spec import TableSpec


class CountingBatches:
    """Pass record batches through, counting rows and refusing rows of another batch; blob
    columns are stored in the blob store and passed on as references."""

    def __init__(
        self,
        batches: Iterable[pa.RecordBatch],
        spec: TableSpec,
        batch: str,
        stored: pa.Schema,
        blobs: BlobStore,
        stored_blobs: Sequence[str] = (),
    ) -> None:
        self._batches = batches
        self._spec = spec
        self._batch = batch
        self._stored = stored
        self._blobs = blobs
        refs = [c for c in spec.blobs if is_blob_ref(stored.field(c))]
        if set(stored_blobs) - set(refs):
            raise ValueError(
                f"{spec.name}: stored_blobs {sorted(set(stored_blobs) - set(refs))} are not "
                "blob-reference columns of the stored table"
            )
        self._prestored = list(stored_blobs)
        self._blob_columns = [c for c in refs if c not in stored_blobs]
        # Columns given as references are cast to the stored (string) type, never to bytes.
        self._schema = pa.schema(
            [stored.field(f.name) if f.name in stored_blobs else f for f in spec.schema]
        )
        self.rows = 0
        self.blob_bytes_written = 0
        self.error: Exception | None = None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        """The checked batches; any exception on the way (ours, or the producer's: a dead
        Ray cluster, a lost worker, an object store refusing a blob) is kept in ``error``,
        because Lance reports an exception raised inside its reader only as an opaque
        ``OSError: LanceError(Arrow): C Data interface error`` and ``replace_partition``
        re-raises the original instead."""
        try:
            yield from self._checked()
        except Exception as exc:
            if self.error is None:
                self.error = exc
            raise

    def _checked(self) -> Iterator[pa.RecordBatch]:
        schema = self._schema
        for rb in self._batches:
            for name in self._prestored:
                if not pa.types.is_string(rb.schema.field(name).type):
                    self.error = ValueError(
                        f"{self._spec.name}.{name}: stored_blobs needs sha256 references, "
                        f"got {rb.schema.field(name).type}"
                    )
                    raise self.error
            rb = pa.Table.from_batches([rb]).select(schema.names).cast(schema)
            for part in rb.to_batches():
                batch_values = set(part.column("batch").unique().to_pylist())
                if batch_values - {self._batch}:
                    self.error = ValueError(
                        f"rows for batch {self._batch!r} include other batches: {batch_values}"
                    )
                    raise self.error
                for name in self._prestored:
                    try:
                        self._blobs.check_present(self._spec.name, part.column(name).to_pylist())
                    except BlobError as exc:
                        self.error = exc
                        raise
                self.rows += part.num_rows
                if self._blob_columns:
                    part, written = self._blobs.to_stored(
                        self._spec.name, part, self._blob_columns, self._stored
                    )
                    self.blob_bytes_written += written
                yield part
                crashpoint("lab.fragment_batch")


@dataclass(frozen=True)
class WrittenFragments:
    """Fragments a process wrote for one partition, not yet committed (picklable, small)."""

    fragments: tuple[dict[str, Any], ...]  # ``FragmentMetadata.to_json()`` of each
    rows: int
    blob_bytes_written: int = 0

    def metadata(self) -> list[FragmentMetadata]:
        return [FragmentMetadata.from_json(json.dumps(f)) for f in self.fragments]


@dataclass(frozen=True)
class PartitionFragments:
    """Where any process may write rows of partition ``batch`` of ``spec``'s table as new
    fragment files (picklable: a URI, the schema; credentials come from that process's
    environment, never from here). Made by ``Lab.partition_fragments``."""

    lab_root: str
    spec: TableSpec
    batch: str
    stored: pa.Schema  # the table's stored schema (blob columns as references)
    stored_blobs: tuple[str, ...] = ()  # blob columns the rows give as stored references

    @property
    def uri(self) -> str:
        return f"{self.lab_root}/{self.spec.name}.lance"

    def write(self, data: pa.Table | Iterable[pa.RecordBatch]) -> WrittenFragments:
        """Write ``data`` (rows of this batch only) as fragment files; nothing is visible
        until the step commits them. Blob columns not in ``stored_blobs`` are stored in
        the blob store first; references in ``stored_blobs`` must name stored blobs."""
        blobs = BlobStore(self.lab_root)
        batches = data.to_batches() if isinstance(data, pa.Table) else data
        counted = CountingBatches(
            batches, self.spec, self.batch, self.stored, blobs, self.stored_blobs
        )
        reader = pa.RecordBatchReader.from_batches(self.stored, iter(counted))
        try:
            # Through the opened table, whose object store this process keeps (a store
            # built per write loads the system's certificates each time: ``io._hold_store``).
            written = write_fragments(reader, open_dataset(self.uri), schema=self.stored)
        except Exception:
            if counted.error is not None:  # raised inside Lance's reader: the original
                raise counted.error from None
            raise
        return WrittenFragments(
            tuple(f.to_json() for f in written), counted.rows, counted.blob_bytes_written
        )

    def keep_rows(self, written: WrittenFragments, keep: Sequence[int]) -> WrittenFragments:
        """Rows ``keep`` (positions, in order) of ``written``, as new fragment files.

        For the step when it refuses some rows a worker wrote (a repeat of bytes another
        worker's chunk holds first): read back from the uncommitted files and written
        again, so only those chunks' rows pass through the step. ``written``'s files are
        then orphans (``remove_orphaned_files``)."""
        tables = []
        for fragment in written.metadata():
            files = fragment.data_files()
            if len(files) != 1:  # a fresh fragment holds every column in one file
                raise ValueError(f"{self.uri}: fragment with {len(files)} data files")
            for data_file in files:
                reader = LanceFileReader(
                    f"{self.uri}/data/{data_file.path}",
                    storage_options=storage_options(self.uri),
                )
                tables.append(reader.read_all().to_table())
        rows = pa.concat_tables(tables) if tables else self.stored.empty_table()
        kept = rows.take(pa.array(list(keep), pa.int64())) if keep else rows.slice(0, 0)
        if not kept.num_rows:
            return WrittenFragments((), 0)
        # Blob columns now hold the references stored by the first write.
        refs = tuple(c for c in self.spec.blobs if is_blob_ref(self.stored.field(c)))
        return dataclasses.replace(self, stored_blobs=refs).write(kept)
