"""The lab's content-addressed blob store: large binary values (original image bytes) kept
outside Lance data files.

Why: Lance compaction rewrites the data files it merges, and Lance's own blob encoding
(pylance 14.0.2, ``lance.blob_field``, packed or dedicated ``.blob`` sidecars) is rewritten
by compaction too (measured: 100 % of the blob bytes per compaction of 0.5 MB values). At
10⁹ images (~500 TB) that makes every maintenance run a copying machine. Here a table
stores only the sha256 of each value (a string column marked with ``BLOB_METADATA``); the
bytes are written once to ``<lab>/_blobs/<table>/<aa>/<bb>/<sha256>`` before the commit
that references them, so compaction, index refresh and column additions move 64-byte
references, never the bytes.

Crash safety: a value is written under a temporary name and renamed into place (one PUT on
object storage), so a path either holds the whole value or does not exist; a writer killed
before its commit leaves blobs no row references, and its rerun writes the same addresses
(content-addressed: idempotent, byte-identical). Every read checks the sha256 of what it
read and raises on a mismatch or a missing blob: a reader never gets bytes other than the
ones the row names. Write-path maintenance never deletes blobs; ``blob_gc`` (run by the
``lance_maintenance`` job) deletes those no retained or pinned version names.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from prx_assets.core.lab.io import arrow_filesystem
from prx_assets.core.storage import S3Store

BLOB_METADATA = {b"prx.blob": b"sha256"}
BLOB_DIR = "_blobs"
STAGING_DIR = ".staging"  # under a table's blob directory: values being written in chunks
_REMOTE_READ_THREADS = 16


class BlobError(RuntimeError):
    """A referenced blob is missing or its bytes do not match its address."""


class BlobUnavailable(BlobError):
    """A blob could not be read for a reason other than its absence (an unreachable
    endpoint, refused credentials, an I/O error): storage trouble, possibly passing, so a
    caller must fail rather than record it as the image's own fault. Output must never
    depend on whether the store answered."""


#: The largest blob a read accepts: ingest refuses files over its own limit (512 MB by
#: default, ``max_file_bytes``), so a stored value is below this unless that was raised.
MAX_BLOB_BYTES = 4 << 30


def _read_error(table: str, ref: str, exc: OSError) -> BlobError:
    """``BlobError`` for a blob that is not there, ``BlobUnavailable`` for any other failure."""
    if isinstance(exc, FileNotFoundError):
        return BlobError(f"{table}: blob {ref} is missing ({type(exc).__name__})")
    return BlobUnavailable(f"{table}: blob {ref} could not be read: {type(exc).__name__}: {exc}")


def is_blob_ref(field: pa.Field) -> bool:
    """Whether a stored field holds blob references (sha256 strings) instead of bytes."""
    return bool(field.metadata) and field.metadata.get(b"prx.blob") == b"sha256"


def stored_schema(schema: pa.Schema, blobs: Sequence[str]) -> pa.Schema:
    """The schema Lance stores: each blob column becomes a nullable sha256 reference."""
    fields = []
    for field in schema:
        if field.name in blobs:
            fields.append(pa.field(field.name, pa.string(), nullable=True, metadata=BLOB_METADATA))
        else:
            fields.append(field)
    return pa.schema(fields, metadata=schema.metadata)


def logical_schema(stored: pa.Schema) -> pa.Schema:
    """The schema readers see: blob references read back as ``large_binary``."""
    return pa.schema(
        [
            pa.field(f.name, pa.large_binary(), nullable=True) if is_blob_ref(f) else f
            for f in stored
        ],
        metadata=stored.metadata,
    )


def _check_ref(table: str, ref: str) -> None:
    if len(ref) != 64 or any(c not in "0123456789abcdef" for c in ref):
        raise BlobError(f"{table}: not a blob reference: {ref[:80]!r}")


def _put_local(path: str, view: memoryview) -> int:
    """Write ``view`` at ``path`` unless it is there whole; the bytes newly written."""
    try:
        if os.stat(path).st_size == view.nbytes:
            # Touched: a blob about to be named again must look fresh to the collector
            # (blob_gc), which spares files younger than its min age.
            os.utime(path)
            return 0
        # A torn file (power loss before its bytes reached the disk): rewritten.
    except FileNotFoundError:
        pass
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(view)
    os.replace(tmp, path)  # atomic: the name holds the whole value or nothing
    return view.nbytes


@dataclass(frozen=True)
class LocalBlobs:
    """One table's blob directory on this machine, for worker processes to store and read
    values themselves (picklable: a path, nothing open).

    Why: ingest's workers hold each file's bytes and its sha256; storing the blob there
    spares the parent a second hash, an Arrow copy of every image and the writes, done
    serially while the workers waited (the rows then carry the references:
    ``Lab.replace_partition(..., stored_blobs=...)``, which checks each is in place before
    the commit). The shard renderer's workers read and check the source bytes themselves,
    so the parent neither reads nor ships them.
    """

    table: str
    directory: str

    def _path(self, ref: str) -> str:
        _check_ref(self.table, ref)
        return f"{self.directory}/{ref[:2]}/{ref[2:4]}/{ref}"

    def put(self, data: bytes | memoryview, sha256: str | None = None) -> tuple[str, int]:
        """Store ``data``; its reference (sha256 hex) and the bytes newly written.

        ``sha256``: the hex digest the caller has just computed of these same bytes (ingest's
        key), which spares hashing them a second time. A wrong one would store the bytes
        under another address; every ``get`` checks the bytes against their address, so such
        a blob is refused on read, never served as another image.
        """
        view = memoryview(data)
        ref = sha256 if sha256 is not None else hashlib.sha256(view).hexdigest()
        return ref, _put_local(self._path(ref), view)

    def staging_dir(self) -> str:
        """The ``.staging/`` directory (created), on the same filesystem as the blobs."""
        staging = Path(self.directory) / STAGING_DIR
        staging.mkdir(parents=True, exist_ok=True)
        return str(staging)

    def staging_path(self) -> str:
        """A new, unused path in this directory's ``.staging/`` (same filesystem as the
        blobs) for a value written in chunks and then put with ``put_staged``. Why: a big
        value is never held whole; its writer copies it there while hashing it. The
        collector never looks there; a writer killed mid-copy leaves its file behind."""
        staging = Path(self.directory) / STAGING_DIR
        staging.mkdir(parents=True, exist_ok=True)
        return str(staging / f"{uuid.uuid4().hex}.tmp")

    def put_staged(self, staged: str, sha256: str) -> int:
        """Make the staged file (``staging_path``) blob ``sha256`` (the hex digest its writer
        computed of exactly its bytes), renamed into place; the bytes newly stored (0, and
        the staged file deleted, when the blob is there whole already)."""
        path = self._path(sha256)
        size = os.stat(staged).st_size
        try:
            if os.stat(path).st_size == size:
                os.utime(path)  # fresh for the collector, as in ``put``
                os.unlink(staged)
                return 0
        except FileNotFoundError:
            pass
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, path)  # atomic: the name holds the whole value or nothing
        return size

    def get(self, ref: str) -> bytes:
        """The bytes of ``ref``, checked against it; a missing or altered blob raises."""
        try:
            with open(self._path(ref), "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise _read_error(self.table, ref, exc) from exc
        if hashlib.sha256(data).hexdigest() != ref:
            raise BlobError(
                f"{self.table}: blob {ref} does not match its address (altered or torn)"
            )
        return data


_STORES: dict[tuple[str, int], BlobStore] = {}


def _store_for(lab_root: str) -> BlobStore:
    """One ``BlobStore`` per lab root and process (its filesystem is slow to build; keyed by
    pid so a forked child never reuses its parent's connections)."""
    key = (lab_root, os.getpid())
    if key not in _STORES:
        _STORES[key] = BlobStore(lab_root)
    return _STORES[key]


@dataclass(frozen=True)
class RemoteBlobs:
    """One table's blobs in a lab on object storage, for a worker on any machine (a Ray
    task on another node) to store the values it holds itself (picklable: the lab's URI and
    the table's name, no credentials: the worker's environment supplies them, as
    ``core/storage.py`` reads them).

    Why: otherwise every accepted image travels worker -> step process -> object store, and
    the step process uploads every blob itself. ``put`` has ``LocalBlobs.put``'s shape so
    ingest treats both sinks alike; the rows then carry references, which
    ``replace_partition(..., stored_blobs=...)`` checks are stored before its commit.
    """

    table: str
    lab_root: str

    def put(self, data: bytes | memoryview, sha256: str | None = None) -> tuple[str, int]:
        """Store ``data`` (one PUT, atomic); its reference and the bytes newly written.
        The reference is always the sha256 of ``data`` computed here; a caller's ``sha256``
        that disagrees is an error (``OSError``: the bytes are not stored under it)."""
        ref, written = _store_for(self.lab_root).put(self.table, data)
        if sha256 is not None and ref != sha256:
            raise OSError(f"{self.table}: bytes hash to {ref}, not the expected {sha256}")
        return ref, written

    def get(self, ref: str) -> bytes:
        """The bytes of ``ref``, read from the object store and checked against it (a
        missing or altered blob raises ``BlobError``): what a shard worker on any node
        reads its sources with (``core/shards/pieces.py``), so the step never holds them."""
        return _store_for(self.lab_root).get(self.table, ref)


class BlobStore:
    """``<lab root>/_blobs/<table>/``: one immutable file per distinct value, named by its
    sha256 (local directory or object-store URI)."""

    def __init__(self, lab_root: str) -> None:
        self.root = f"{lab_root.rstrip('/')}/{BLOB_DIR}"
        self._local = "://" not in self.root
        if self._local:
            self._fs: pafs.FileSystem = pafs.LocalFileSystem()
            self._base = self.root
        else:
            self._fs, self._base = arrow_filesystem(self.root)
        self._s3: S3Store | None = None

    @property
    def is_local(self) -> bool:
        return self._local

    def table_dir(self, table: str) -> str:
        """The directory (filesystem path) holding ``table``'s blobs."""
        return f"{self._base}/{table}"

    def path(self, table: str, ref: str) -> str:
        """Where the value with sha256 ``ref`` of ``table`` lives (filesystem path)."""
        return f"{self._base}/{self._key(table, ref)}"

    @staticmethod
    def _key(table: str, ref: str) -> str:
        """The value's name under the blob root."""
        _check_ref(table, ref)
        return f"{table}/{ref[:2]}/{ref[2:4]}/{ref}"

    def _objects(self) -> S3Store:
        """The blob root as an object store (object-storage labs only), built once."""
        if self._s3 is None:
            self._s3 = S3Store(self.root)
        return self._s3

    def local(self, table: str) -> LocalBlobs | None:
        """``table``'s blobs for worker processes on this machine (picklable); None on
        object storage (the process that holds the lab reads and writes them there)."""
        return LocalBlobs(table, self.table_dir(table)) if self._local else None

    def check_present(self, table: str, refs: Iterable[str | None]) -> None:
        """Raise ``BlobError`` unless every reference names a stored blob (a ``stat``
        each): rows that name blobs stored elsewhere are never committed dangling."""
        wanted = [ref for ref in refs if ref is not None]
        if self._local:
            present = [os.path.isfile(self.path(table, ref)) for ref in wanted]
        else:
            # One HEAD each, in flight together: one after the other, a fragment of a few
            # hundred rows waited a round trip per row (``bench_ingest_latency``).
            objects = self._objects()
            keys = [self._key(table, ref) for ref in wanted]
            with ThreadPoolExecutor(_REMOTE_READ_THREADS) as pool:
                present = [size is not None for size in pool.map(objects.size, keys)]
        for ref, there in zip(wanted, present, strict=True):
            if not there:
                raise BlobError(f"{table}: rows name blob {ref}, which is not stored")

    def put(self, table: str, data: bytes | memoryview | pa.Buffer) -> tuple[str, int]:
        """Store ``data``; its reference (sha256 hex) and the bytes newly written (0 when
        the value was already stored)."""
        view = memoryview(data)
        ref = hashlib.sha256(view).hexdigest()
        path = self.path(table, ref)
        if self._local:
            return ref, _put_local(path, view)
        # Object storage: one HEAD, and one PutObject when the value is not there whole
        # (atomic per object). pyarrow's output stream made it a multipart upload (create,
        # part, complete) after two HEADs: five round trips per blob where two do
        # (``benchmarks/bench_ingest_latency.py`` logs the requests with
        # ``PRX_BENCH_S3_REQUEST_LOG``).
        key = self._key(table, ref)
        objects = self._objects()
        try:
            if objects.size(key) == view.nbytes:
                return ref, 0
            objects.put(key, view)
        except Exception as exc:  # noqa: BLE001 - storage trouble: the caller's OSError
            raise OSError(f"{table}: blob {ref} not stored: {type(exc).__name__}: {exc}") from exc
        return ref, view.nbytes

    def get(self, table: str, ref: str) -> bytes:
        """The bytes of ``ref``, checked against it; a missing or altered blob raises."""
        if self._local:
            return LocalBlobs(table, self.table_dir(table)).get(ref)
        # One GET (pyarrow's input file asked for the size first: two round trips).
        try:
            data = self._objects().get(self._key(table, ref), MAX_BLOB_BYTES)
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, too large: not "missing"
            raise BlobUnavailable(
                f"{table}: blob {ref} could not be read: {type(exc).__name__}: {exc}"
            ) from exc
        if data is None:
            raise BlobError(f"{table}: blob {ref} is missing (no such object)")
        if hashlib.sha256(data).hexdigest() != ref:
            raise BlobError(f"{table}: blob {ref} does not match its address (altered or torn)")
        return data

    def get_many(self, table: str, refs: Iterable[str | None]) -> list[bytes | None]:
        refs = list(refs)
        if self._local or len(refs) < 2:
            return [None if r is None else self.get(table, r) for r in refs]
        with ThreadPoolExecutor(_REMOTE_READ_THREADS) as pool:  # object-store latency
            return list(pool.map(lambda r: None if r is None else self.get(table, r), refs))

    def to_stored(
        self, table: str, rb: pa.RecordBatch, blobs: Sequence[str], schema: pa.Schema
    ) -> tuple[pa.RecordBatch, int]:
        """``rb`` with each blob column's bytes stored and replaced by references; the
        record batch in ``schema`` (the stored one) and the bytes newly written."""
        written = 0
        arrays = []
        for name in schema.names:
            column = rb.column(name)
            if name in blobs and not pa.types.is_string(column.type):
                refs: list[str | None] = []
                for value in column:
                    if not value.is_valid:
                        refs.append(None)
                        continue
                    ref, new = self.put(table, value.as_buffer())
                    refs.append(ref)
                    written += new
                column = pa.array(refs, pa.string())
            arrays.append(column)
        return pa.RecordBatch.from_arrays(arrays, schema=schema), written

    def resolve_rows(
        self, table: str, rows: list[dict[str, Any]], stored: pa.Schema
    ) -> list[dict[str, Any]]:
        """``rows`` (Python dicts, in place) with every blob reference replaced by its bytes."""
        for name in {k for row in rows[:1] for k in row}:
            if name not in stored.names or not is_blob_ref(stored.field(name)):
                continue
            values = self.get_many(table, [row[name] for row in rows])
            for row, value in zip(rows, values, strict=True):
                row[name] = value
        return rows

    def resolve(self, table: str, rows: pa.Table, stored: pa.Schema) -> pa.Table:
        """``rows`` with every blob-reference column replaced by the bytes it names."""
        for name in rows.column_names:
            if name not in stored.names or not is_blob_ref(stored.field(name)):
                continue
            values = self.get_many(table, rows.column(name).to_pylist())
            index = rows.column_names.index(name)
            rows = rows.set_column(
                index, pa.field(name, pa.large_binary()), pa.array(values, pa.large_binary())
            )
        return rows
