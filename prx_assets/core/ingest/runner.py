"""Ingest one batch: every input file becomes an accepted image row or a rejection row.

Why the accounting: a data lead must be able to say what happened to every file of
every batch, so ``seen == accepted + rejected`` is an invariant checked here, and a
bad file never takes down its batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from prx_assets.core.crashpoints import crashpoint
from prx_assets.core.dedup.gallery import preview_of_decoded
from prx_assets.core.dedup.phash import (
    FAST_DRAFT_TARGET,
    fast_thumbnail_of_decoded,
    phash_version,
    thumbnail_to_bytes,
)
from prx_assets.core.ingest.decode import (
    DEFAULT_MAX_PIXELS,
    DecodeRejected,
    ImageInfo,
    inspect_and_decode,
)
from prx_assets.core.ingest.remote_landing import RemoteRead
from prx_assets.core.ingest.sources import (
    BAD_SIDECAR,
    DEFAULT_MAX_FILE_BYTES,
    STREAM_ABOVE_BYTES,
    BatchRef,
    Candidate,
    FileRead,
    FileRefused,
    iter_candidates,
    sidecar_metadata,
)
from prx_assets.core.ingest.tables import ALIAS_REASON, ensure_usage_signals_column
from prx_assets.core.lab import Lab
from prx_assets.core.lab.blobs import LocalBlobs, RemoteBlobs
from prx_assets.core.lab.fragments import PartitionFragments, WrittenFragments
from prx_assets.core.lab.maintenance import TaskMap
from prx_assets.core.progress import Progress, Report
from prx_assets.core.tables import IMAGES, REJECTS
from prx_assets.core.text import bound_text, quote_bounded
from prx_assets.core.workers import (
    SHARED_FS_ENV,
    ItemFailed,
    ProcessPool,
    WorkerPool,
    make_pool,
    shared_filesystem,
    task_map,
)

ROWS_PER_RECORD_BATCH = 256
BYTES_PER_RECORD_BATCH = 8 * 1024 * 1024  # a record batch also ends at this many image bytes


@dataclass
class IngestStats:
    """The batch's accounting: every file seen is accepted or rejected (``check``)."""

    seen: int = 0
    accepted: int = 0
    rejected: int = 0
    bytes_accepted: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    formats: Counter[str] = field(default_factory=Counter)
    conversions: Counter[str] = field(default_factory=Counter)
    animated: int = 0

    def check(self) -> None:
        if self.seen != self.accepted + self.rejected:
            raise AssertionError(
                f"ingest accounting broken: seen {self.seen} != accepted {self.accepted} "
                f"+ rejected {self.rejected}"
            )


def _record_batches(rows: Iterator[dict], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Record batches of at most ROWS_PER_RECORD_BATCH rows or about BYTES_PER_RECORD_BATCH
    image bytes, so memory holds a bounded slice of the batch whatever its files weigh."""
    buf: list[dict] = []
    held = 0
    for row in rows:
        buf.append(row)
        image = row.get("image")
        held += len(image) if isinstance(image, bytes) else 0  # references hold nothing
        if len(buf) >= ROWS_PER_RECORD_BATCH or held >= BYTES_PER_RECORD_BATCH:
            yield pa.RecordBatch.from_pylist(buf, schema=schema)
            buf = []
            held = 0
    if buf:
        yield pa.RecordBatch.from_pylist(buf, schema=schema)


THUMBNAIL_VERSION = phash_version("fast")  # what images.phash_thumbnail is made for
# key, and (info, stored pHash thumbnail or None, review preview or None) or the refusal's
# (reason, detail)
Checked = tuple[str, tuple[ImageInfo, bytes | None, bytes | None] | tuple[str, str]]


def check_candidate(item: tuple[bytes, int]) -> Checked:
    """sha256, the policy's validation, the pHash thumbnail and the review preview of one
    file (picklable).

    Validation decodes at the pHash ``fast`` scale (every scan is still entropy-decoded, so
    the refusals are the same as a 1/8 draft's) and the thumbnail is made from that decode,
    so ``image_hashes`` never decodes the image again; so is the small preview the
    duplicate gallery draws (``core/dedup/gallery``). A refusal comes back as (reason,
    detail), the same in a worker as inline.
    """
    data, max_pixels = item
    key = hashlib.sha256(data).hexdigest()
    try:
        info, rgb = inspect_and_decode(data, max_pixels, (FAST_DRAFT_TARGET, FAST_DRAFT_TARGET))
    except DecodeRejected as exc:
        return key, (exc.reason, exc.detail)
    thumb = preview = None
    if rgb is not None:
        try:
            thumb = thumbnail_to_bytes(fast_thumbnail_of_decoded(data, rgb))
        except Exception:  # noqa: BLE001 - no thumbnail: image_hashes decodes the bytes itself
            thumb = None
        try:
            preview = preview_of_decoded(rgb)
        except Exception:  # noqa: BLE001 - no preview: the gallery decodes the bytes itself
            preview = None
    return key, (info, thumb, preview)


# What a worker returns for one file: its sha256 (None when it could not be read), the check
# (``Checked``'s result, or a read refusal's (reason, detail)), whether its bytes were stored
# in the blob store, and how many bytes it held.
FileChecked = tuple[str | None, object, bool, int]


def _refused(exc: FileRefused) -> FileChecked:
    """What a worker returns for a file its read refused: as if the step had read it."""
    return None, (exc.reason, bound_text(exc.detail)), False, 0


def check_and_store(
    item: tuple[bytes | FileRead | RemoteRead, int, LocalBlobs | RemoteBlobs | None],
) -> FileChecked:
    """Read the file when its read was deferred to this process (``FileRead``), then
    ``check_candidate``, then store the accepted bytes in the lab's blob store (with a sink)
    by the process that already holds them (picklable).

    ``stored`` is False when the file was refused (nothing is stored), there is no sink, or
    the store failed (the parent then stores it, reading it again when it was not sent, and
    reports the error if that fails too). A file that cannot be read comes back as
    (None, (reason, detail), False, 0): the same refusal the parent's read would have made.
    A ``RemoteRead`` (a landing object) is downloaded here, bounded by its limit, and with a
    ``RemoteBlobs`` sink the bytes go to the lab's object store from here too.
    """
    source, max_pixels, sink = item
    if isinstance(source, (FileRead, RemoteRead)):
        try:
            big = isinstance(source, FileRead) and isinstance(sink, LocalBlobs)
            if big and source.size() > STREAM_ABOVE_BYTES:
                assert isinstance(source, FileRead) and isinstance(sink, LocalBlobs)
                return _check_and_store_big(source, max_pixels, sink)
            data = source.read()
        except FileRefused as exc:
            return _refused(exc)
    else:
        data = source
    key, result = check_candidate((data, max_pixels))
    if sink is None or not isinstance(result[0], ImageInfo):
        return key, result, False, len(data)
    try:
        sink.put(data, sha256=key)  # ``key`` is these bytes' sha256, just computed
    except OSError:
        return key, result, False, len(data)
    return key, result, True, len(data)


def _check_and_store_big(read: FileRead, max_pixels: int, sink: LocalBlobs) -> FileChecked:
    """``check_and_store`` for a file over ``STREAM_ABOVE_BYTES``, never held whole: copied
    in bounded chunks into the blob store's staging area while hashed, validated by decoding
    that copy (what is checked is exactly what is stored, even if the source changes
    meanwhile), then renamed into place as its blob, or deleted when refused. No pHash
    thumbnail is kept for it (``image_hashes`` decodes the blob itself); the review preview
    is. ``FileRefused`` when the file cannot be read."""
    staged = sink.staging_path()
    try:
        with open(staged, "w+b") as fh:
            key, size = read.copy_to(fh)
            fh.flush()
            try:
                info, rgb = inspect_and_decode(
                    fh, max_pixels, (FAST_DRAFT_TARGET, FAST_DRAFT_TARGET)
                )
            except DecodeRejected as exc:
                return key, (exc.reason, exc.detail), False, size
        preview = None
        if rgb is not None:
            try:
                preview = preview_of_decoded(rgb)
            except Exception:  # noqa: BLE001 - no preview: the gallery decodes the original
                preview = None
        try:
            sink.put_staged(staged, key)
        except OSError:
            # Not stored here: the parent stores it (reading it again) or reports why not.
            return key, (info, None, preview), False, size
        return key, (info, None, preview), True, size
    finally:
        try:
            os.unlink(staged)  # refused, or not stored (a stored one was renamed away)
        except FileNotFoundError:
            pass


def migrate_images_table(lab: Lab) -> list[str]:
    """Give an ``images`` table written under an older spec the columns this one adds.

    ``usage_signals`` first, filled with the "not captured" marker (never null, which would
    read as "no opt-out signal"); the pHash thumbnail columns null (``image_hashes`` then
    decodes those rows' bytes). Returns the names added.
    """
    if not lab.exists(IMAGES.name):
        return []
    signals = ["usage_signals"] if ensure_usage_signals_column(lab) else []
    have = set(lab.dataset(IMAGES.name).schema.names)
    missing = [f for f in IMAGES.schema if f.name not in have]
    if missing:
        lab.add_columns(IMAGES.name, missing)
    return signals + [f.name for f in missing]


def _check_or_skip(
    item: tuple[bytes | FileRead | RemoteRead, int, LocalBlobs | RemoteBlobs | None] | None,
) -> FileChecked | None:
    return None if item is None else check_and_store(item)


NOT_SHARED = "shared filesystem not seen by this worker:"

#: Candidates per worker task when the workers write the rows themselves (one Lance
#: fragment each): the task then carries references and row metadata, the result a
#: fragment's metadata and each file's check, never its thumbnail or preview.
INGEST_CHUNK = 256


def _image_row(
    batch: str,
    c: Candidate | RowMeta,
    key: str,
    info: ImageInfo,
    thumb: bytes | None,
    preview: bytes | None,
    nbytes: int,
    image: bytes | str,
) -> dict:
    """An accepted file's ``images`` row (the same whoever writes it: worker or step)."""
    return {
        "key": key,
        "batch": batch,
        "source": c.source,
        "license": c.license,
        "alt_text": c.alt_text,
        "url": c.url,
        "source_id": c.source_id,
        "path": c.path,
        "format": info.format,
        "width": info.width,
        "height": info.height,
        "mode": info.mode,
        "conversion": info.conversion,
        "orientation": info.orientation,
        "n_frames": info.n_frames,
        "file_size": nbytes,
        "image": image,
        "usage_signals": c.usage_signals,
        "phash_thumbnail": thumb,
        "phash_thumbnail_version": THUMBNAIL_VERSION if thumb is not None else None,
        "preview": preview,
    }


@dataclass(frozen=True)
class RowMeta:
    """What a candidate's row holds besides its check (a worker writes the row)."""

    path: str
    source: str | None
    license: str | None
    alt_text: str | None
    url: str | None
    source_id: str | None
    usage_signals: str | None
    # The sample's sidecars, unread (``Candidate.sidecars``): the fields above are then the
    # batch's defaults, and the worker reads them (``resolve_sidecars``).
    sidecars: tuple[tuple[str, str, FileRead | RemoteRead, int | None], ...] = ()

    @classmethod
    def of(cls, c: Candidate) -> RowMeta:
        return cls(
            c.path,
            c.source,
            c.license,
            c.alt_text,
            c.url,
            c.source_id,
            c.usage_signals,
            c.sidecars,  # type: ignore[arg-type]
        )


#: A sidecar that could not be read or is malformed: (its path, reason, detail, size).
SidecarProblem = tuple[str, str, str, int | None]


def resolve_sidecars(meta: RowMeta) -> tuple[RowMeta, tuple[SidecarProblem, ...]]:
    """Read ``meta``'s deferred sidecars (where its image is checked): the row's metadata
    as the step would have made it from them (a sidecar's source or licence over the
    batch's defaults), and the problems that refuse the image (``bad_sidecar``)."""
    if not meta.sidecars:
        return meta, ()
    fields, problems = sidecar_metadata(meta.sidecars)  # type: ignore[arg-type]
    resolved = RowMeta(
        meta.path,
        fields.get("source") or meta.source,
        fields.get("license") or meta.license,
        fields.get("alt_text"),
        fields.get("url"),
        fields.get("source_id"),
        fields.get("usage_signals"),
    )
    return resolved, tuple(problems)


IO_THREADS_ENV = "PRX_INGEST_IO_THREADS"
DEFAULT_IO_THREADS = 8


def io_threads_from_env() -> int:
    """``PRX_INGEST_IO_THREADS``: how many round trips to object storage an ingest worker
    keeps in flight (default 8; 1: one item after the other). Anything but an integer
    from 1 to 64 is refused with the setting's name."""
    raw = os.environ.get(IO_THREADS_ENV, "").strip()
    if not raw:
        return DEFAULT_IO_THREADS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 64:
        raise ValueError(f"{IO_THREADS_ENV}={raw[:40]!r}: expected an integer from 1 to 64")
    return value


@dataclass(frozen=True)
class ChunkTask:
    """Up to ``INGEST_CHUNK`` consecutive candidates (None: nothing to check) for one
    worker, which checks and stores each and writes the rows of those it stored."""

    items: tuple[tuple[bytes | FileRead | RemoteRead, RowMeta] | None, ...]
    max_pixels: int
    sink: LocalBlobs | RemoteBlobs
    fragments: PartitionFragments
    # A file the step made just before (a local lab on a shared mount): a worker that does
    # not see it is on a node without the mount, and refuses the chunk (the step fails).
    probe: str | None = None
    # Landing reads and blob writes kept in flight by the worker when either is on object
    # storage (``_check_items_overlapped``); 1: one item after the other.
    io_threads: int = DEFAULT_IO_THREADS


@dataclass(frozen=True)
class ChunkResult:
    """Each candidate's check (thumbnail and preview left out where the row is written),
    the fragments holding the written rows, and which positions they are, in order."""

    checked: tuple[FileChecked | None, ...]
    written: WrittenFragments | None
    positions: tuple[int, ...]
    # Per item whose sidecars the worker read: the metadata they gave, or why they refuse
    # the image (no check then). Empty: no item had deferred sidecars.
    metas: tuple[RowMeta | None, ...] = ()
    sidecar_problems: tuple[tuple[SidecarProblem, ...], ...] = ()


def check_store_and_write(task: ChunkTask) -> ChunkResult:
    """``check_and_store`` each candidate of the chunk, then write the rows of the ones
    stored as one fragment (picklable; run by a worker, which reaches the lab itself).

    A repeat of a key or path earlier in the chunk is not written (the step refuses it as
    an alias or a duplicate path); the step decides every file as before and, where it
    refuses a row written here (a repeat of a file in an earlier chunk), keeps the others
    (``PartitionFragments.keep_rows``).
    """
    if task.probe is not None and not os.path.exists(task.probe):
        raise FileNotFoundError(f"{NOT_SHARED} {task.probe}")
    checked: list[FileChecked | None] = []
    rows: list[dict] = []
    positions: list[int] = []
    keys: set[str] = set()
    paths: set[str] = set()
    metas: list[RowMeta | None] = [None] * len(task.items)
    problems: list[tuple[SidecarProblem, ...]] = [()] * len(task.items)
    if task.io_threads > 1 and _on_object_storage(task):
        items = _check_items_overlapped(task)
    else:
        items = (_check_item(item, task.max_pixels, task.sink) for item in task.items)
    for i, (item, done) in enumerate(zip(task.items, items, strict=True)):
        if item is None or done is None:
            checked.append(None)
            continue
        meta, problems[i], out = done
        if item[1].sidecars:
            metas[i] = meta
        if out is None:  # refused for its sidecar: neither checked nor stored
            checked.append(None)
            continue
        key, result, stored, nbytes = out
        first = key not in keys and meta.path not in paths
        if key is not None and stored and first and isinstance(result[0], ImageInfo):
            info, thumb, preview = result  # type: ignore[misc]
            rows.append(
                _image_row(task.fragments.batch, meta, key, info, thumb, preview, nbytes, key)
            )
            positions.append(i)
            keys.add(key)
            paths.add(meta.path)
            out = (key, (info, None, None), stored, nbytes)
        checked.append(out)
    written = None
    if rows:
        written = task.fragments.write(pa.Table.from_pylist(rows, schema=_stored_image_schema()))
        crashpoint("ingest.chunk_written")
    if not any(m is not None for m in metas):
        return ChunkResult(tuple(checked), written, tuple(positions))
    return ChunkResult(tuple(checked), written, tuple(positions), tuple(metas), tuple(problems))


# One item of a chunk, checked: its metadata (from its sidecars where the worker read them),
# the sidecar problems that refuse it (then no check: None) and its ``FileChecked``.
_ItemDone = tuple["RowMeta", tuple[SidecarProblem, ...], FileChecked | None]

#: Bytes of landing objects a worker holds at once while their reads, checks and blob
#: writes overlap (a single larger object is still taken, alone).
OVERLAP_WINDOW_BYTES = 64 << 20


def _on_object_storage(task: ChunkTask) -> bool:
    return isinstance(task.sink, RemoteBlobs) or any(
        item is not None and isinstance(item[0], RemoteRead) for item in task.items
    )


def _check_item(
    item: tuple[bytes | FileRead | RemoteRead, RowMeta] | None,
    max_pixels: int,
    sink: LocalBlobs | RemoteBlobs | None,
) -> _ItemDone | None:
    """One item of a chunk read, checked and stored, one step after the other."""
    if item is None:
        return None
    meta, problems = resolve_sidecars(item[1])  # (meta, ()) when it has none
    if problems:
        return meta, problems, None
    return meta, problems, check_and_store((item[0], max_pixels, sink))


def _fetch_item(
    item: tuple[bytes | FileRead | RemoteRead, RowMeta],
) -> tuple[RowMeta, tuple[SidecarProblem, ...], bytes | FileChecked | None]:
    """The I/O half of ``_check_item``: sidecars and the object's bytes (or the refusal a
    read made: a ``FileChecked`` with no key)."""
    source = item[0]
    meta, problems = resolve_sidecars(item[1])
    if problems:
        return meta, problems, None
    if not isinstance(source, (FileRead, RemoteRead)):
        return meta, problems, source
    try:
        return meta, problems, source.read()
    except FileRefused as exc:
        return meta, problems, _refused(exc)


def _streamed_here(
    item: tuple[bytes | FileRead | RemoteRead, RowMeta], sink: LocalBlobs | RemoteBlobs | None
) -> bool:
    """A local file ``check_and_store`` copies into a local blob store in bounded chunks
    (over ``STREAM_ABOVE_BYTES``): it is never read whole, so never read ahead."""
    source = item[0]
    return (
        isinstance(source, FileRead)
        and isinstance(sink, LocalBlobs)
        and source.size() > STREAM_ABOVE_BYTES
    )


def _item_bytes(item: tuple[bytes | FileRead | RemoteRead, RowMeta] | None) -> int:
    if item is None:
        return 0
    source = item[0]
    return source.size() if isinstance(source, (FileRead, RemoteRead)) else len(source)


def _check_items_overlapped(task: ChunkTask) -> list[_ItemDone | None]:
    """``_check_item`` for every item, with the round trips to object storage overlapped.

    Why: on object storage an item is three sequential requests (sidecar, object, blob
    PUT), each tens of milliseconds, around ~5 ms of CPU: a worker doing them one after the
    other waits most of the time, and a cluster's ingest rate is set by storage latency,
    not by its cores (``benchmarks/bench_ingest_latency.py``: with 20 ms round trips, 212 ms
    per photo one at a time against 94 ms overlapped). Here ``task.io_threads`` threads
    read ahead (sidecars and objects, at most ``OVERLAP_WINDOW_BYTES`` held) and write the
    accepted blobs while this thread checks the next image. Same results, in the same order, as one after the other:
    a blob counts as stored only once its write returned, a write that failed is "not
    stored" (the step stores it), a read's refusal is that item's, any other error fails
    the chunk as before (the step then isolates it).
    """
    from concurrent.futures import Future, ThreadPoolExecutor

    n = len(task.items)
    done: list[_ItemDone | None] = [None] * n
    sink = task.sink
    reads: deque[tuple[int, Future, int]] = deque()
    writes: deque[tuple[int, Future, int]] = deque()
    held = 0  # bytes of objects read ahead or being written
    with ThreadPoolExecutor(task.io_threads, thread_name_prefix="prx-ingest-io") as io:

        def finish_write() -> None:
            nonlocal held
            i, future, size = writes.popleft()
            meta, problems, (key, result, _, nbytes) = done[i]  # type: ignore[misc]
            try:
                future.result()
                stored = True
            except OSError:  # not stored here: the step stores it, or says why not
                stored = False
            done[i] = (meta, problems, (key, result, stored, nbytes))
            held -= size

        next_read = 0
        for i in range(n):
            # Read ahead while the window allows (always at least the item to check next).
            while next_read < n and (
                next_read == i
                or (
                    len(reads) < task.io_threads
                    and held + _item_bytes(task.items[next_read]) <= OVERLAP_WINDOW_BYTES
                )
            ):
                item = task.items[next_read]
                if item is not None and not _streamed_here(item, sink):
                    size = _item_bytes(item)
                    reads.append((next_read, io.submit(_fetch_item, item), size))
                    held += size
                next_read += 1
            if task.items[i] is None:
                continue
            if _streamed_here(task.items[i], sink):  # never held whole: as one at a time
                done[i] = _check_item(task.items[i], task.max_pixels, sink)
                continue
            j, future, size = reads.popleft()
            assert j == i
            meta, problems, got = future.result()  # a storage error fails the chunk
            if got is None or isinstance(got, tuple):  # refused by its sidecar or its read
                done[i] = (meta, problems, got)
                held -= size
                continue
            key, result = check_candidate((got, task.max_pixels))
            if sink is None or not isinstance(result[0], ImageInfo):
                done[i] = (meta, problems, (key, result, False, len(got)))
                held -= size
                continue
            done[i] = (meta, problems, (key, result, False, len(got)))
            writes.append((i, io.submit(sink.put, got, sha256=key), size))
            while writes and (writes[0][1].done() or held > OVERLAP_WINDOW_BYTES):
                finish_write()
        while writes:
            finish_write()
    return done


def _isolate_chunk(task: ChunkTask) -> ChunkResult:
    """A chunk whose worker failed (a decoder that kills its process, a write refused):
    each file is checked alone in a pool of its own, one that kills its worker is that
    file's failure (``validation_failed``, as when files were tasks), and the step writes
    the rows of the others itself."""
    resolved = [None if it is None else resolve_sidecars(it[1]) for it in task.items]
    singles = [
        None if it is None or r is None or r[1] else (it[0], task.max_pixels, task.sink)
        for it, r in zip(task.items, resolved, strict=True)
    ]
    with ProcessPool(1) as alone:
        checked = list(alone.map_ordered(_check_or_skip, singles))
    if not any(it is not None and it[1].sidecars for it in task.items):
        return ChunkResult(tuple(checked), None, ())  # type: ignore[arg-type]
    metas = tuple(
        r[0] if it is not None and r is not None and it[1].sidecars else None
        for it, r in zip(task.items, resolved, strict=True)
    )
    problems = tuple(r[1] if r is not None else () for r in resolved)
    return ChunkResult(tuple(checked), None, (), metas, problems)  # type: ignore[arg-type]


def _stored_image_schema() -> pa.Schema:
    """``images``' schema with the image given as its blob reference."""
    schema = IMAGES.schema
    at = schema.get_field_index("image")
    return schema.set(at, pa.field("image", pa.string(), nullable=True))


class BatchIngest:
    """Validate and describe every file of a batch (reads files, writes nothing).

    ``image_batches()`` streams accepted rows as Arrow record batches so that a
    large batch never sits in memory whole; ``rejects`` and ``stats`` are complete
    once that stream has been consumed. Hashing and validation run on ``workers`` processes
    (None: every CPU available; ``executor`` as in ``core/workers.py``), a bounded window of
    files in flight; everything order-dependent (duplicates, accounting) stays here, so the
    rows are the same for any worker count. With ``blob_sink`` (``Lab.local_blobs``), each
    accepted file's bytes are stored by the process that validated it (a worker on this
    machine, or here for Ray workers), and the rows carry the references: write them with
    ``replace_partition(IMAGES, ..., stored_blobs=run.stored_blobs)``. Workers on this
    machine then also read the files of folders and manifests themselves (the same checks
    and refusals: ``sources.FileRead``), so this process never holds or ships the images.

    Where the data is on object storage, any worker can reach it (Ray actors on other nodes
    included): with ``remote_reads`` (filled by ``remote_landing.landing_batch``) the tasks
    carry each landing object's reference (``RemoteRead``: URI, listed size, limit), the
    worker downloads and validates it, and with a ``RemoteBlobs`` sink
    (``Lab.remote_blobs``) stores the blob itself, returning only the check's result. A
    local landing zone or lab on Ray keeps the bytes travelling through this process:
    workers on another node cannot read or write this machine's disk.
    """

    def __init__(
        self,
        ref: BatchRef,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        workers: int | None = None,
        executor: str | None = None,
        blob_sink: LocalBlobs | RemoteBlobs | None = None,
        remote_reads: dict[bytes, RemoteRead] | None = None,
        report: Report | None = None,
    ) -> None:
        self.report = report  # progress lines (count, rate) while the workers run
        if remote_reads and blob_sink is None:
            # The rows would need bytes this process never read: refused, not guessed at.
            raise ValueError("remote_reads need a blob_sink (Lab.remote_blobs/local_blobs)")
        self.ref = ref
        self.blob_sink = blob_sink
        self.remote_reads = remote_reads or {}
        self.workers = workers
        self.executor = executor
        self.max_pixels = max_pixels
        self.max_file_bytes = max_file_bytes
        self.stats = IngestStats()
        self._reject_rows: list[dict] = []
        self._seen_paths: set[str] = set()
        self._done = False
        self._workers_write_rows = False
        self._sidecars_refused: set[str] = set()  # recorded from a worker's sidecar reads
        self.io_threads = io_threads_from_env()  # each chunk worker's, on object storage

    @property
    def rejects(self) -> pa.Table:
        if not self._done:
            raise RuntimeError("consume image_batches() before reading rejects")
        return pa.Table.from_pylist(self._reject_rows, schema=REJECTS.schema)

    def _reject(self, c: Candidate, reason: str, detail: str, key: str | None = None) -> None:
        self.stats.rejected += 1
        self.stats.reasons[reason] += 1
        path = c.path or f"<row {self.stats.seen}>"
        if path in self._seen_paths:  # e.g. an archive holding the same name twice
            path = f"{path}#{self.stats.seen}"
        self._seen_paths.add(path)
        self._reject_rows.append(
            {
                "batch": self.ref.key,
                "path": path,
                "reason": reason,
                "detail": bound_text(detail),  # decoder messages included: bounded
                "source": c.source,
                "key": key,
                "file_size": len(c.data) if c.data is not None else c.size,
                # Every name the file carried: for a byte-identical repeat (ALIAS_REASON),
                # aliases of the copy kept, which opt-out lists and the audit match.
                "url": c.url,
                "source_id": c.source_id,
                "usage_signals": c.usage_signals,  # an alias's signals reserve the copy kept
            }
        )

    def rewrite_on_workers(self) -> TaskMap | None:
        """Where the commit's compaction should rewrite the rows ``write_images`` wrote:
        the same pool, when its workers wrote them (they reach the lab); else None (the
        committing process). Set it as the lab's ``rewrite`` before the commit."""
        if not self._workers_write_rows:
            return None
        return task_map(self.executor, self.workers)

    def _worker_sink(
        self, pool: WorkerPool, shared: bool = False
    ) -> LocalBlobs | RemoteBlobs | None:
        """The blob sink workers store into: only where they share this machine's
        filesystem, or where the lab is on object storage (None: this process stores)."""
        remote_sink = isinstance(self.blob_sink, RemoteBlobs)
        return self.blob_sink if pool.same_machine or shared or remote_sink else None

    def _candidates(
        self,
        pool: WorkerPool,
        defer: bool,
        spool_dir: str | None,
        shared: bool = False,
        sidecars_there: bool = False,
    ) -> Iterator[tuple[Candidate, bytes | FileRead | RemoteRead | None]]:
        """Every candidate in order with what a worker checks (None: nothing to check).

        ``sidecars_there``: the worker reads a folder sample's sidecars with its image
        (``resolve_sidecars``; the chunk path), so this process opens none of them: on
        object storage that was a ``GET`` per image in the step."""
        for c in iter_candidates(
            self.ref,
            self.max_file_bytes,
            defer_reads=defer,
            spool_dir=spool_dir,
            # Only where the workers read the images too: they then reach the sidecars.
            defer_sidecars=sidecars_there
            and (pool.same_machine or shared or bool(self.remote_reads)),
            remote_sidecars=self.remote_reads,
        ):
            if isinstance(c.deferred, FileRead) and c.deferred.path in self.remote_reads:
                c.deferred = self.remote_reads[c.deferred.path]  # a placeholder's object
            elif c.deferred is not None and not (pool.same_machine or shared):
                # Only object storage is reachable from another node: read here.
                try:
                    c.data = c.deferred.read()
                except FileRefused as exc:
                    c.error = (exc.reason, bound_text(exc.detail))
                if c.sidecars:  # nor this machine's sidecars (not deferred then): here too
                    self._apply_sidecars(c, *resolve_sidecars(RowMeta.of(c)))
                    c.sidecars = ()
            source = c.data if c.data is not None else c.deferred
            yield c, (None if c.error is not None else source)

    def _apply_sidecars(
        self, c: Candidate, meta: RowMeta | None, problems: tuple[SidecarProblem, ...]
    ) -> None:
        """What a worker read from ``c``'s sidecars, applied as the step would have: each
        sidecar it could not use recorded once as its own rejection, and ``c`` refused
        (``bad_sidecar``); else the metadata they gave."""
        if problems:
            for path, reason, detail, size in problems:
                if path in self._sidecars_refused:
                    continue  # another image of the sample recorded it
                self._sidecars_refused.add(path)
                refused = Candidate(
                    path,
                    None,
                    source=c.source,
                    license=c.license,
                    error=(reason, detail),
                    size=size,
                )
                self._decide(refused, None)
            listed = ", ".join(f"{quote_bounded(p)} ({r})" for p, r, _, _ in problems[:3])
            c.error = (
                BAD_SIDECAR,
                f"its sidecar {listed} was refused, so its metadata (URL, id, licence) is unknown",
            )
            return
        if meta is not None:
            c.source, c.license, c.alt_text = meta.source, meta.license, meta.alt_text
            c.url, c.source_id, c.usage_signals = meta.url, meta.source_id, meta.usage_signals

    @staticmethod
    def _done_with(c: Candidate) -> None:
        if c.deferred is not None and c.deferred.temporary:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(c.deferred.path)

    def _checked(self) -> Iterator[tuple[Candidate, FileChecked | ItemFailed | None]]:
        """Every candidate in order with its hash and validation (None: no bytes to check)."""
        pending: deque[Candidate] = deque()

        pool = make_pool(self.executor, self.workers)
        # Workers store blobs only where they share this machine's filesystem, or where the
        # lab is on object storage; there they read the files themselves too (landing
        # objects: ``remote_reads``), so the parent neither reads nor ships the images.
        sink = self._worker_sink(pool)
        defer = sink is not None if pool.same_machine else bool(self.remote_reads)
        # Big archive members are copied here rather than into memory (sources.spool_member),
        # each deleted once checked; the directory goes when the run ends, however it ends.
        spool_dir = tempfile.mkdtemp(prefix="prx-ingest-") if defer else None

        def tasks() -> Iterator[tuple | None]:
            for c, source in self._candidates(pool, defer, spool_dir):
                pending.append(c)
                yield None if source is None else (source, self.max_pixels, sink)

        try:
            for out in pool.map_ordered(_check_or_skip, tasks()):
                c = pending.popleft()
                yield c, out
                self._done_with(c)
        finally:
            pool.close()
            if spool_dir is not None:
                shutil.rmtree(spool_dir, ignore_errors=True)

    def write_images(self, fragments: PartitionFragments) -> list[WrittenFragments]:
        """Every accepted row written as new fragments of ``fragments``' partition, to
        commit with ``Lab.commit_partition`` (``rejects`` and ``stats`` complete after).

        Where workers store the blobs (on this machine, or anywhere when the lab is on
        object storage) they write the rows too, ``INGEST_CHUNK`` files per fragment: the
        images, thumbnails and previews never pass through this process, which decides
        every file in batch order as before and commits the fragments' metadata. Otherwise
        (Ray workers with a local lab) this process writes the rows it builds.
        """
        self._first_path_of_key = {}
        pool = make_pool(self.executor, self.workers)
        # A local lab on a mount every Ray node shares (``PRX_SHARED_FILESYSTEM=1``): Ray
        # workers read the landing files and write blobs and fragments like local ones.
        shared = shared_filesystem() and isinstance(self.blob_sink, LocalBlobs)
        sink = self._worker_sink(pool, shared)
        self._workers_write_rows = sink is not None and pool.workers > 1
        if sink is None:
            pool.close()
            return [fragments.write(self.image_batches())]
        written: list[WrittenFragments] = []
        schema = _stored_image_schema()
        defer = pool.same_machine or shared or bool(self.remote_reads)  # as in ``_checked``
        # Archive members are spooled where the workers read them: with a shared mount,
        # next to the lab's blobs (the local temp dir is this node's only).
        spool_dir = tempfile.mkdtemp(
            prefix="prx-ingest-", dir=sink.staging_dir() if shared else None
        )
        probe = None
        if shared:
            probe = os.path.join(spool_dir, "probe")
            open(probe, "wb").close()
        progress = Progress(f"{self.ref.key}: checked", None, self.report)
        try:
            chunks = self._checked_chunks(pool, sink, defer, spool_dir, fragments, shared, probe)
            for cands, result in chunks:
                progress.advance(len(cands))
                accepted: list[tuple[int, dict]] = []
                for pos, (c, checked) in enumerate(zip(cands, result.checked, strict=True)):
                    if result.metas:  # the worker read this image's sidecars
                        self._apply_sidecars(c, result.metas[pos], result.sidecar_problems[pos])
                    row = self._decide(c, checked)
                    if row is not None:
                        accepted.append((pos, row))
                    self._done_with(c)
                index = {p: j for j, p in enumerate(result.positions)}
                keep = [index[p] for p, _ in accepted if p in index]
                extra = [row for p, row in accepted if p not in index]
                if result.written is not None and keep:
                    if keep == list(range(len(result.positions))):
                        written.append(result.written)
                    else:  # a repeat of a file in an earlier chunk: refused, the rest kept
                        written.append(fragments.keep_rows(result.written, keep))
                if extra:  # stored here (the worker's store failed, or it died)
                    written.append(fragments.write(pa.Table.from_pylist(extra, schema=schema)))
        finally:
            pool.close()
            shutil.rmtree(spool_dir, ignore_errors=True)
        progress.finish()
        self.stats.check()
        self._done = True
        return written

    def _checked_chunks(
        self,
        pool: WorkerPool,
        sink: LocalBlobs | RemoteBlobs,
        defer: bool,
        spool_dir: str,
        fragments: PartitionFragments,
        shared: bool = False,
        probe: str | None = None,
    ) -> Iterator[tuple[list[Candidate], ChunkResult]]:
        """The candidates in chunks, each checked, stored and written by one worker."""
        pending: deque[list[Candidate]] = deque()
        sent: deque[ChunkTask] = deque()

        def chunk(cands: list[Candidate], items: list) -> ChunkTask:
            task = ChunkTask(tuple(items), self.max_pixels, sink, fragments, probe, self.io_threads)
            pending.append(cands)
            sent.append(task)
            return task

        def tasks() -> Iterator[ChunkTask]:
            cands: list[Candidate] = []
            items: list = []
            held = 0  # bytes of the chunk's files held here (archive members)
            for c, source in self._candidates(pool, defer, spool_dir, shared, defer):
                cands.append(c)
                items.append(None if source is None else (source, RowMeta.of(c)))
                held += len(c.data) if c.data is not None else 0
                if len(items) >= INGEST_CHUNK or held >= BYTES_PER_RECORD_BATCH:
                    yield chunk(cands, items)
                    cands, items, held = [], [], 0
            if items:
                yield chunk(cands, items)

        # One chunk per worker and one more in flight: chunks may hold archive members.
        window = pool.workers + 1
        for out in pool.map_ordered(check_store_and_write, tasks(), window=window):
            cands = pending.popleft()
            task = sent.popleft()
            if isinstance(out, ItemFailed):
                if NOT_SHARED in out.error:  # a wrong setting fails the step, loses nothing
                    raise RuntimeError(
                        f"{SHARED_FS_ENV}=1, but a worker does not see this machine's lab: "
                        f"{out.error}"
                    )
                out = _isolate_chunk(task)
            yield cands, out

    def _key_of(self, c: Candidate) -> str | None:
        """The sha256 of a candidate's bytes, read here if need be (None: unreadable now)."""
        try:
            if c.data is None and c.deferred is not None:
                return c.deferred.sha256()  # read in bounded chunks, never held whole
            return hashlib.sha256(c.read()).hexdigest()
        except FileRefused:
            return None

    def _store_here(self, c: Candidate, key: str) -> str | None:
        """Store a checked candidate's bytes from this process (a Ray worker's, or one whose
        worker could not store them): None once stored, or why not when the file can no
        longer be read as the bytes that were checked."""
        assert self.blob_sink is not None
        try:
            data = c.read()
        except FileRefused as exc:
            return f"{exc.reason}: {exc.detail}"
        ref, _ = self.blob_sink.put(data)
        if ref != key:
            if c.data is not None:
                raise AssertionError(f"blob reference {ref} != key {key} of {c.path!r}")
            return "the file changed between its check and its store"
        return None

    def _accepted_rows(self) -> Iterator[dict]:
        self._first_path_of_key: dict[str, str] = {}
        for c, checked in self._checked():
            row = self._decide(c, checked)
            if row is not None:
                yield row
        self.stats.check()
        self._done = True

    def _decide(self, c: Candidate, checked: FileChecked | ItemFailed | None) -> dict | None:
        """One candidate accepted (its row) or rejected (recorded; None), in batch order:
        everything order-dependent (repeats, accounting) is decided here."""
        stats = self.stats
        first_path_of_key = self._first_path_of_key
        stats.seen += 1
        if c.error is not None or (c.data is None and c.deferred is None):
            reason, detail = c.error or ("unreadable", "no bytes")
            self._reject(c, reason, detail)
            return None
        if isinstance(checked, ItemFailed) or checked is None:
            # The check itself failed (it only raises on a bug or a dead worker): the file
            # is refused with why, never accepted unvalidated.
            why = checked.error if checked is not None else "no result"
            self._reject(c, "validation_failed", why, self._key_of(c))
            return None
        key, result, stored, nbytes = checked
        if key is None:  # the deferred read was refused: as if read here
            reason, detail = result  # type: ignore[misc]
            self._reject(c, str(reason), str(detail))
            return None
        if key in first_path_of_key:
            self._reject(
                c,
                ALIAS_REASON,  # its url / source id / path become the kept copy's aliases
                f"same bytes as {quote_bounded(first_path_of_key[key])} in this batch",
                key,
            )
            return None
        if c.path in self._seen_paths:
            self._reject(
                c, "duplicate_path", f"{quote_bounded(c.path)} appears twice in the batch", key
            )
            return None
        if not isinstance(result[0], ImageInfo):
            self._reject(c, str(result[0]), str(result[1]), key)
            return None
        info, thumb, preview = result
        image: bytes | str
        if self.blob_sink is not None:
            if not stored:  # a Ray worker, or the worker's store failed: stored here
                why = self._store_here(c, key)
                if why is not None:
                    self._reject(c, "unreadable", why, key)
                    return None
            image = key  # the blob's reference: the same sha256
        else:
            assert c.data is not None  # reads are deferred only with a blob sink
            image = c.data
        self._seen_paths.add(c.path)
        first_path_of_key[key] = c.path
        stats.accepted += 1
        stats.bytes_accepted += nbytes
        stats.formats[info.format] += 1
        stats.conversions[info.conversion] += 1
        stats.animated += int(info.animated)
        return _image_row(self.ref.key, c, key, info, thumb, preview, nbytes, image)

    @property
    def stored_blobs(self) -> tuple[str, ...]:
        """The columns ``image_batches`` gives as blob references (see ``blob_sink``)."""
        return ("image",) if self.blob_sink is not None else ()

    def image_batches(self) -> Iterator[pa.RecordBatch]:
        schema = _stored_image_schema() if self.blob_sink is not None else IMAGES.schema
        return _record_batches(self._accepted_rows(), schema)
