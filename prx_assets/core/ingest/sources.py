"""Reading ingest batches: folders, tar/WebDataset archives and parquet/CSV manifests.

A *batch* is one entry of the landing zone, ``<landing>/<source>/<chunk>``:

- ``<chunk>/``            a folder of images; complete once it holds a ``_SUCCESS`` file
- ``<chunk>.tar``         a tar or WebDataset archive (``.tar``, ``.tar.gz``, ``.tgz``)
- ``<chunk>.parquet``     a manifest of paths (also ``.csv``)

Entries whose name starts with ``.`` or ``_`` or ends in ``.tmp``/``.partial`` are
ignored, so producers write under a temporary name and rename when done. Inside a folder
batch, hidden files and directories (``.name``) and the ``_SUCCESS`` marker are not inputs.

Per-sample metadata comes from WebDataset-style sidecars (``name.txt`` = alt text,
``name.json`` with ``url``/``license``/``source``/``id``/``alt_text``) in folders and
archives, or from manifest columns. ``<landing>/<source>/_source.json`` may give
source-wide defaults (``license``, ``visibility``). The partition key of a batch is
``<source>.<chunk>``.

Opt-out headers captured at download time travel the same way: manifest columns or sidecar
keys ``X-Robots-Tag``, ``tdm-reservation``, ``tdm-policy``, ``Content-Usage`` (any case,
``_`` or ``-``), or a ``headers`` JSON object holding them. They are recorded raw, bounded
and sanitised (:func:`prx_assets.core.ingest.signals.capture_signals`) in
``Candidate.usage_signals``; interpreting them is the skip policy's job, not ingest's.

Every file is an input, accounted for as a candidate (bytes, or the reason there are
none); nothing a file holds can fail its batch. Refusals, each checked before a byte of
the file is read:

- ``bad_filename``: a name no filesystem path can be (empty, or over ``MAX_NAME_BYTES``).
  Every other name is kept, written by the lossless printable rule of
  :func:`prx_assets.core.text.printable_name` (invalid UTF-8 and control characters as
  ``%XX``), so any name a filesystem or tar holds becomes a valid path/key.
- ``too_large``: a file over the per-file limit (``max_file_bytes``, default 512 MB), by
  ``stat`` for folder files and manifest rows, by header for archive members; a WebDataset
  sample (the adjacent members sharing a stem, held in memory together) over the limit in
  total is refused whole. Sidecars have their own, small limit (``MAX_SIDECAR_BYTES``).
- ``not_a_file``: a directory, FIFO, socket or device named by a manifest row or found
  in a folder, or an archive member that is no regular file, link or device.
- ``symlink``: symbolic links in folder batches (to files or directories, sidecars
  included) are never followed, wherever they point. A link inside the batch would only
  duplicate a file the batch already holds, and following links makes a batch's content
  depend on paths outside it that can change between the check and the read; producers
  copy instead. Reads open with ``O_NOFOLLOW``, so a link swapped in after the check is
  refused too. (Manifest rows may name links: their target must resolve inside the
  source folder, as before.)
- ``unsafe_path``: archive members with absolute paths, ``..``, or that are links or
  devices; manifest rows resolving outside the source folder.
- ``bad_sidecar``: a sidecar that is refused or malformed (not a JSON object, two sidecars
  of one kind), and every image of its sample: its URL, id and licence are what opt-out
  lists and the audit match on, so an image whose metadata cannot be trusted is not
  ingested without it.

Archive members are never extracted under their own names: a sample's members are read into
memory (at most one sample, at most the limit) after a first pass over the headers that
sizes each sample, except that when the validating workers read files themselves
(``defer_reads``), an image member over ``STREAM_ABOVE_BYTES`` (8 MiB) is copied in 1 MiB
chunks to an anonymous temporary file and handed over like a folder file, so no process
holds a big member whole (``spool_member``).

Sample grouping: in archives, the WebDataset rule (a member's key is its name up to the
first dot of its basename: ``a.seg.png`` belongs to sample ``a``); in folders, a file's
extension is its last suffix, so ``IMG.2019.07.14.jpg`` is a JPEG whose sidecars are
``IMG.2019.07.14.txt`` / ``.json``.
"""

from __future__ import annotations

import bz2
import csv
import errno
import gzip
import hashlib
import json
import lzma
import os
import posixpath
import re
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from prx_assets.core.ingest.signals import HEADER_MAP_FIELDS, capture_signals, header_name
from prx_assets.core.text import (
    bound_text,
    clean_text,
    printable_name,
    quote_bounded,
    read_lines,
)

IMAGE_EXTENSIONS = {
    ".jpg",
    ".jpeg",
    ".jpe",
    ".png",
    ".webp",
    ".tif",
    ".tiff",
    ".bmp",
    ".gif",
    ".mpo",
}
SIDECAR_EXTENSIONS = {".txt", ".json", ".caption", ".cls"}
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
MANIFEST_SUFFIXES = (".parquet", ".csv")
READY_MARKER = "_SUCCESS"
SOURCE_DEFAULTS_FILE = "_source.json"
DEFAULT_MAX_FILE_BYTES = 512 * 1024 * 1024  # one input file, or one WebDataset sample
DEFAULT_MAX_MEMBER_BYTES = DEFAULT_MAX_FILE_BYTES  # its earlier name (archive members)
MAX_SIDECAR_BYTES = 1024 * 1024  # alt text and JSON metadata of one sample
MAX_NAME_BYTES = 4096  # PATH_MAX: longer names cannot be a path on any filesystem
MAX_MANIFEST_LINE_BYTES = 1024 * 1024  # one CSV manifest line
SOURCE_DEFAULTS_MAX_BYTES = 1024 * 1024
MANIFEST_BATCH_ROWS = 1024
#: Files over this many bytes are never held whole: an archive member is spooled to a
#: temporary file (``spool_member``) and, like a folder file, copied into the blob store in
#: ``COPY_CHUNK_BYTES`` chunks and decoded from that copy (``runner.check_and_store``).
STREAM_ABOVE_BYTES = 8 * 1024 * 1024
COPY_CHUNK_BYTES = 1024 * 1024
_NAME_QUOTE_BYTES = 200
_KEY_SAFE = re.compile(r"[^A-Za-z0-9_\-]+")
MANIFEST_COLUMNS = {
    "path": ("path", "file", "filepath", "image_path"),
    "alt_text": ("alt_text", "alt", "caption", "text"),
    "source": ("source",),
    "license": ("license", "licence"),
    "url": ("url", "original_url"),
    "source_id": ("id", "source_id", "sample_id"),
}

# Reason codes of refused input files (README "Decoding and bad input").
TOO_LARGE = "too_large"
NOT_A_FILE = "not_a_file"
SYMLINK = "symlink"
BAD_FILENAME = "bad_filename"
BAD_SIDECAR = "bad_sidecar"
UNSAFE_PATH = "unsafe_path"
MISSING_FILE = "missing_file"
UNREADABLE = "unreadable"
UNSUPPORTED_EXTENSION = "unsupported_extension"


class BatchError(Exception):
    """A batch that cannot be read at all (as opposed to a bad file inside it)."""


class FileRefused(Exception):
    """A file that must not be (or could not be) read; ``reason`` is a stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class FileRead:
    """A regular file for the process that validates it to read (a worker on this machine):
    the same checks and limit as ``read_regular_file``, done there. Picklable.

    Why: ingest's workers then hold each file's bytes without the parent reading and
    pickling every image to them (the parent's serial share of a partition). ``quoted``:
    the printable path a refusal's detail starts with (a manifest row names its file).
    """

    path: bytes
    max_bytes: int
    quoted: str | None = None
    # A temporary copy of an archive member (``spool_member``), deleted once it is checked.
    temporary: bool = False

    def _named(self, exc: FileRefused) -> FileRefused:
        return (
            exc if self.quoted is None else FileRefused(exc.reason, f"{self.quoted} {exc.detail}")
        )

    def read(self) -> bytes:
        """The file's bytes, or ``FileRefused`` (missing, a link, not regular, too large...)."""
        try:
            return read_regular_file(self.path, self.max_bytes)
        except FileRefused as exc:
            raise self._named(exc) from None

    def size(self) -> int:
        """The file's size now (``FileRefused`` as ``read``): whether to read or stream it."""
        fd, size = self._open()
        os.close(fd)
        return size

    def _open(self) -> tuple[int, int]:
        try:
            return open_regular_file(self.path, self.max_bytes)
        except FileRefused as exc:
            raise self._named(exc) from None

    def copy_to(self, out: BinaryIO) -> tuple[str, int]:
        """Copy the file into ``out`` in bounded chunks (``copy_regular_file``): the sha256
        and size of the bytes copied, or ``FileRefused`` as ``read``."""
        try:
            return copy_regular_file(self.path, self.max_bytes, out)
        except FileRefused as exc:
            raise self._named(exc) from None

    def sha256(self) -> str:
        """The sha256 (hex) of the file's bytes, read in bounded chunks."""

        class _Discard:
            def write(self, data: bytes) -> int:
                return len(data)

        return self.copy_to(_Discard())[0]  # type: ignore[arg-type]


@dataclass
class Candidate:
    """One input file of a batch: bytes to decode (or, read deferred, the file to read them
    from), or the reason there are none."""

    path: str  # printable (text.printable_name), unique within its batch
    data: bytes | None
    alt_text: str | None = None
    source: str | None = None
    license: str | None = None
    url: str | None = None
    source_id: str | None = None
    error: tuple[str, str] | None = None  # (reason, detail) when unreadable
    size: int | None = None  # bytes on disk / in the header, when known
    usage_signals: str | None = None  # captured HTTP opt-out headers (signals.capture_signals)
    deferred: FileRead | None = None  # with ``data`` None: read by whoever validates it
    # Its sample's sidecars, unread, for whoever validates it to read (``defer_sidecars``):
    # (extension, printable path, read, listed size). The metadata fields above are then
    # unset here and come from ``sidecar_metadata`` there.
    sidecars: tuple[tuple[str, str, FileRead, int | None], ...] = ()

    def read(self) -> bytes:
        """The candidate's bytes: held, or read now (``FileRefused`` when that fails)."""
        if self.data is not None:
            return self.data
        if self.deferred is None:
            raise FileRefused(UNREADABLE, "no bytes")
        return self.deferred.read()


@dataclass(frozen=True)
class BatchRef:
    """One complete batch of the landing zone: its partition key and where its files are."""

    key: str
    source: str  # printable
    chunk: str  # printable
    path: Path
    kind: str  # folder | archive | manifest
    defaults: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


# --------------------------------------------------------------------------- landing zone


def _ignored(name: str) -> bool:
    return name.startswith((".", "_")) or name.endswith((".tmp", ".partial"))


def file_chunk(name: str) -> tuple[str, str] | None:
    """(chunk, kind) of a batch file by its suffix, local or on object storage; None if
    the name is no batch file."""
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], "archive"
    for suffix in MANIFEST_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], "manifest"
    return None


def _chunk_name(entry: Path) -> tuple[str, str] | None:
    if entry.is_dir():
        return (entry.name, "folder") if (entry / READY_MARKER).exists() else None
    return file_chunk(entry.name)


def batch_key(source: str, chunk: str) -> str:
    """Partition key for a batch; stable, and safe in paths and Lance filters."""
    return f"{_KEY_SAFE.sub('-', source)}.{_KEY_SAFE.sub('-', chunk)}"


def _source_defaults(source_dir: Path) -> dict[str, str]:
    f = source_dir / SOURCE_DEFAULTS_FILE
    if not f.exists():
        return {}
    where = printable_name(os.fsencode(f))
    try:
        with open(f, "rb") as fh:  # operator configuration: a link to it is fine
            raw = fh.read(SOURCE_DEFAULTS_MAX_BYTES + 1)
        if len(raw) > SOURCE_DEFAULTS_MAX_BYTES:
            raise ValueError(f"over {SOURCE_DEFAULTS_MAX_BYTES:,} bytes")
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise BatchError(f"{where}: unreadable source defaults: {bound_text(str(exc))}") from exc
    if not isinstance(data, dict):
        raise BatchError(f"{where}: source defaults are not a JSON object")
    return {
        clean_text(str(k)): clean_text(str(v))
        for k, v in data.items()
        if isinstance(v, str | int | float)
    }


def _ref(
    source_dir: Path, entry: Path, chunk: str, kind: str, defaults: dict[str, str]
) -> BatchRef:
    source, chunk = printable_name(source_dir.name), printable_name(chunk)
    return BatchRef(batch_key(source, chunk), source, chunk, entry, kind, defaults)


def discover_batches(landing: Path) -> list[BatchRef]:
    """Every complete batch in the landing zone, sorted by key."""
    found: dict[str, BatchRef] = {}
    if not landing.is_dir():
        return []
    for source_dir in sorted(p for p in landing.iterdir() if p.is_dir()):
        if _ignored(source_dir.name):
            continue
        defaults = _source_defaults(source_dir)
        for entry in sorted(source_dir.iterdir()):
            if _ignored(entry.name):
                continue
            named = _chunk_name(entry)
            if named is None:
                continue
            ref = _ref(source_dir, entry, *named, defaults)
            if ref.key in found:
                first = printable_name(os.fsencode(found[ref.key].path))
                raise BatchError(
                    f"two landing entries map to partition {ref.key!r}: "
                    f"{first} and {printable_name(os.fsencode(entry))}; rename one"
                )
            found[ref.key] = ref
    return [found[k] for k in sorted(found)]


def key_part(name: str) -> str:
    """A source's or chunk's name as it appears in partition keys (``batch_key``)."""
    return _KEY_SAFE.sub("-", printable_name(name))


def key_parts(key: str) -> tuple[str, str] | None:
    """(source, chunk) as ``batch_key`` made them safe (neither holds a dot), or None for a
    key no landing entry can have."""
    source, dot, chunk = key.partition(".")
    if not dot or _KEY_SAFE.search(source) or _KEY_SAFE.search(chunk):
        return None
    return source, chunk


def entry_chunk(name: str, is_dir: bool) -> tuple[str, str] | None:
    """(chunk, kind) a landing entry would have by its name alone (a folder still needs
    its marker to be a batch); None for a name that is ignored or no batch."""
    if _ignored(name):
        return None
    return (name, "folder") if is_dir else file_chunk(name)


def resolve_batch(landing: Path, key: str) -> BatchRef:
    """The complete batch of partition ``key``, as ``discover_batches`` finds it.

    Why not ``discover_batches``: a step resolves its own batch, and that stat every entry
    of the landing zone (10^5 batches: seconds per step). Only entries whose names map to
    ``key`` are inspected here (one listing per source whose name maps to it); two that map
    to it are refused as there."""
    parts = key_parts(key)
    found: list[BatchRef] = []
    if parts is not None and landing.is_dir():
        for source_dir in sorted(p for p in landing.iterdir() if p.is_dir()):
            if _ignored(source_dir.name) or key_part(source_dir.name) != parts[0]:
                continue
            defaults: dict[str, str] | None = None
            with os.scandir(source_dir) as listing:
                names = sorted((e.name, e.is_dir(follow_symlinks=True)) for e in listing)
            for name, is_dir in names:
                by_name = entry_chunk(name, is_dir)
                if by_name is None or key_part(by_name[0]) != parts[1]:
                    continue
                entry = source_dir / name
                complete = _chunk_name(entry)  # a folder: only once its marker is there
                if complete is None:
                    continue
                if defaults is None:
                    defaults = _source_defaults(source_dir)
                found.append(_ref(source_dir, entry, *complete, defaults))
    found = [r for r in found if r.key == key]
    if len(found) > 1:
        first, second = (printable_name(os.fsencode(r.path)) for r in found[:2])
        raise BatchError(
            f"two landing entries map to partition {key!r}: {first} and {second}; rename one"
        )
    if not found:
        raise BatchError(f"no complete batch for partition {key!r} under {landing}")
    return found[0]


def describe_batch(path: Path, landing: Path) -> BatchRef:
    """A BatchRef for an explicit landing path (used when registering by hand)."""
    path = path.resolve()
    landing = landing.resolve()
    if path.parent.parent != landing:
        raise BatchError(f"{path} is not a <landing>/<source>/<chunk> entry of {landing}")
    named = _chunk_name(path)
    if named is None:
        raise BatchError(
            f"{path} is not a batch: expected a folder with {READY_MARKER}, "
            f"an archive ({', '.join(ARCHIVE_SUFFIXES)}) or a manifest "
            f"({', '.join(MANIFEST_SUFFIXES)})"
        )
    return _ref(path.parent, path, *named, _source_defaults(path.parent))


# --------------------------------------------------------------------------- reading files


def _where(path: Path) -> str:
    return printable_name(os.fsencode(path))


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


def _too_large(size: int, limit: int, what: str = "file") -> FileRefused:
    return FileRefused(TOO_LARGE, f"{what} is {size:,} bytes, over the {limit:,}-byte limit")


def open_regular_file(path: str | bytes | os.PathLike[str], max_bytes: int) -> tuple[int, int]:
    """An open descriptor on a regular file of at most ``max_bytes``, and its size, or
    ``FileRefused`` (nothing left open).

    Checked on the open descriptor before reading: the final component is no symlink
    (``O_NOFOLLOW``), the file is regular (a FIFO is opened non-blocking and refused, never
    waited on) and not over the limit. The caller closes the descriptor.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileRefused(MISSING_FILE, "does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileRefused(SYMLINK, "is a symbolic link; links are not followed") from None
        raise FileRefused(UNREADABLE, f"cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(NOT_A_FILE, f"is {_file_kind(st.st_mode)}")
        if st.st_size > max_bytes:
            raise _too_large(st.st_size, max_bytes)
    except OSError as exc:
        os.close(fd)
        raise FileRefused(UNREADABLE, f"cannot be inspected: {exc.strerror}") from None
    except FileRefused:
        os.close(fd)
        raise
    return fd, st.st_size


def _fd_chunks(fd: int, size: int, chunk: int | None = None) -> Iterator[bytes]:
    """The ``size`` bytes of an open file, in chunks of at most ``chunk`` (None: as the
    kernel gives them); a file that grew while read is refused (``FileRefused``)."""
    got = 0
    try:
        while got < size:
            part = os.read(fd, size - got if chunk is None else min(chunk, size - got))
            if not part:
                break
            got += len(part)
            yield part
        if os.read(fd, 1):
            raise FileRefused(UNREADABLE, "the file grew while it was read")
    except OSError as exc:
        raise FileRefused(UNREADABLE, f"read failed: {exc.strerror}") from None


def read_regular_file(path: str | bytes | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, or ``FileRefused``
    (``open_regular_file``'s checks; a file that grows while read is refused too)."""
    fd, size = open_regular_file(path, max_bytes)
    try:
        parts = list(_fd_chunks(fd, size))
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def copy_regular_file(
    path: str | bytes | os.PathLike[str], max_bytes: int, out: BinaryIO
) -> tuple[str, int]:
    """Copy a regular file into ``out`` in ``COPY_CHUNK_BYTES`` chunks (the same checks and
    refusals as ``read_regular_file``, never more than a chunk held): the sha256 (hex) and
    size of exactly the bytes copied."""
    fd, size = open_regular_file(path, max_bytes)
    digest = hashlib.sha256()
    copied = 0
    try:
        for part in _fd_chunks(fd, size, COPY_CHUNK_BYTES):
            digest.update(part)
            out.write(part)
            copied += len(part)
    finally:
        os.close(fd)
    return digest.hexdigest(), copied


def _display_path(raw: bytes) -> str:
    """The printable path of a name; a name too long to be a path is cut, counted, hashed."""
    if len(raw) <= MAX_NAME_BYTES:
        return printable_name(raw)
    digest = hashlib.sha256(raw).hexdigest()[:16]
    more = len(raw) - _NAME_QUOTE_BYTES
    return f"{printable_name(raw[:_NAME_QUOTE_BYTES])}…(+{more:,} more bytes)#{digest}"


def _name_refusal(raw: bytes) -> FileRefused | None:
    if not raw:
        return FileRefused(BAD_FILENAME, "empty file name")
    if len(raw) > MAX_NAME_BYTES:
        return FileRefused(
            BAD_FILENAME,
            f"name of {len(raw):,} bytes is over the {MAX_NAME_BYTES:,}-byte path limit",
        )
    return None


# --------------------------------------------------------------------------- samples


@dataclass
class _Entry:
    """One file of a sample group, before it is read: refused already, or readable."""

    path: str  # printable
    ext: str
    refusal: FileRefused | None = None
    size: int | None = None
    read: Callable[[], bytes] | None = None  # bytes, or raises FileRefused
    deferred: FileRead | None = None  # the same read, for another process to do
    # A big archive member: copied to a temporary file there (``spool_member``), to be
    # read by whoever validates it like a folder file (with ``defer``).
    spool: Callable[[], FileRead] | None = None


def _sidecar_fields(
    sidecars: dict[str, tuple[str, bytes]],
) -> tuple[dict[str, str | None], list[tuple[str, str]]]:
    """Metadata from a sample's sidecars, and the (path, detail) of any malformed one."""
    out: dict[str, str | None] = {}
    bad: list[tuple[str, str]] = []
    for ext in (".txt", ".caption"):
        if ext in sidecars:
            text = sidecars[ext][1].decode("utf-8", "replace").strip()
            out["alt_text"] = clean_text(text) or None
    if ".json" in sidecars:
        path, data = sidecars[".json"]
        try:
            meta = json.loads(data.decode("utf-8", "replace"))
        except (ValueError, RecursionError) as exc:
            bad.append((path, f"not valid JSON: {bound_text(str(exc), 200)}"))
            meta = {}
        if not isinstance(meta, dict):
            bad.append((path, f"a JSON {type(meta).__name__}, not an object"))
            meta = {}
        for col, names in MANIFEST_COLUMNS.items():
            for name in names:
                if name in meta and meta[name] is not None and col != "path":
                    out.setdefault(col, clean_text(str(meta[name])))
                    break
        signals = capture_signals(meta)  # X-Robots-Tag, tdm-*, Content-Usage, headers
        if signals is not None:
            out["usage_signals"] = signals
    return out, bad


def sidecar_metadata(
    sidecars: tuple[tuple[str, str, FileRead, int | None], ...],
) -> tuple[dict[str, str | None], list[tuple[str, str, str, int | None]]]:
    """Read a sample's deferred sidecars (``Candidate.sidecars``) where its image is checked:
    the metadata fields, and (path, reason, detail, size) of each sidecar that could not be
    read or is malformed (then the image is refused as ``bad_sidecar``), exactly as the
    step decides them when it reads them itself."""
    read: dict[str, tuple[str, bytes]] = {}
    problems: list[tuple[str, str, str, int | None]] = []
    for ext, path, reader, size in sidecars:
        try:
            read[ext] = (path, reader.read())
        except FileRefused as exc:
            problems.append((path, exc.reason, bound_text(exc.detail), size))
    fields, malformed = _sidecar_fields(read)
    problems += [(path, BAD_SIDECAR, detail, None) for path, detail in malformed]
    return fields, problems


def _split_ext(name: str) -> tuple[str, str]:
    """WebDataset grouping (archives): the key is everything before the first dot of the
    basename, so ``a.seg.png`` is member ``.seg.png`` of sample ``a``."""
    directory, base = posixpath.split(name)
    if "." not in base:
        return name, ""
    stem, ext = base.split(".", 1)
    return posixpath.join(directory, stem), "." + ext.lower()


def _split_last_ext(name: str) -> tuple[str, str]:
    """Folder grouping: a plain file's extension is its last suffix, so a camera's
    ``IMG.2019.07.14.jpg`` is a JPEG (stem ``IMG.2019.07.14``, whose sidecars are
    ``IMG.2019.07.14.txt`` / ``.json``), not the unknown extension ``.2019.07.14.jpg``."""
    directory, base = posixpath.split(name)
    stem, dot, ext = base.rpartition(".")
    if not dot or not stem:
        return name, ""
    return posixpath.join(directory, stem), "." + ext.lower()


def _with_defaults(c: Candidate, ref: BatchRef) -> Candidate:
    c.source = c.source or ref.defaults.get("source") or ref.source
    c.license = c.license or ref.defaults.get("license")
    return c


def _refused(ref: BatchRef, e: _Entry, exc: FileRefused) -> Candidate:
    # A spooled member refused after its copy (its sample turned out too large, or a
    # sidecar was bad) still names its temporary file, for the caller to delete.
    spooled = e.deferred if e.deferred is not None and e.deferred.temporary else None
    return _with_defaults(
        Candidate(
            e.path, None, error=(exc.reason, bound_text(exc.detail)), size=e.size, deferred=spooled
        ),
        ref,
    )


def _sample_candidates(
    ref: BatchRef, entries: list[_Entry], defer: bool = False, defer_sidecars: bool = False
) -> Iterator[Candidate]:
    """The candidates of one sample: refused sidecars, then its other files.

    Sidecars are not candidates themselves unless refused; a refused or malformed sidecar
    refuses the sample's images (``bad_sidecar``) rather than ingest them without it.
    With ``defer``, an image that can be read elsewhere is yielded unread
    (``Candidate.deferred``). Sidecars are read here, except with ``defer_sidecars`` where
    every image of the sample is yielded unread: what can be decided without reading them
    (a refused sidecar, a second one of a kind) still is, here; the readable ones travel
    unread with each image (``Candidate.sidecars``) for its validator to read
    (``sidecar_metadata``), so this process never opens them.
    """
    entries = sorted(entries, key=lambda e: (e.ext, e.path))
    images = [e for e in entries if e.ext not in SIDECAR_EXTENSIONS]
    later = (
        defer
        and defer_sidecars
        and bool(images)
        and all(e.refusal is None and e.deferred is not None for e in images)
    )
    sidecars: dict[str, tuple[str, bytes]] = {}
    unread: list[tuple[str, str, FileRead, int | None]] = []
    first_of: dict[str, str] = {}  # extension -> the path of the sample's sidecar, read or not
    problems: list[str] = []
    for e in entries:
        if e.ext not in SIDECAR_EXTENSIONS:
            continue
        try:
            if e.refusal is not None:
                raise e.refusal
            if e.ext in first_of:
                raise FileRefused(
                    BAD_SIDECAR,
                    f"a second {e.ext} sidecar for one sample (after "
                    f"{quote_bounded(first_of[e.ext])})",
                )
            if later and e.deferred is not None:
                unread.append((e.ext, e.path, e.deferred, e.size))
            else:
                assert e.read is not None
                sidecars[e.ext] = (e.path, e.read())
            first_of[e.ext] = e.path  # once it is in hand (read or left for the worker)
        except FileRefused as exc:
            problems.append(f"{quote_bounded(e.path)} ({exc.reason})")
            yield _refused(ref, e, exc)
    fields, malformed = _sidecar_fields(sidecars)
    for path, detail in malformed:
        problems.append(f"{quote_bounded(path)} ({BAD_SIDECAR})")
        yield _with_defaults(Candidate(path, None, error=(BAD_SIDECAR, detail)), ref)
    for e in entries:
        if e.ext in SIDECAR_EXTENSIONS:
            continue
        try:
            if e.refusal is not None:
                raise e.refusal
            if problems:
                raise FileRefused(
                    BAD_SIDECAR,
                    f"its sidecar {', '.join(problems[:3])} was refused, so its metadata "
                    "(URL, id, licence) is unknown",
                )
            if defer and e.deferred is None and e.spool is not None:
                e.deferred = e.spool()  # a big member: never held whole here
            if defer and e.deferred is not None:
                yield _with_defaults(
                    Candidate(
                        e.path,
                        None,
                        size=e.size,
                        deferred=e.deferred,
                        sidecars=tuple(unread),
                        **fields,
                    ),
                    ref,
                )
                continue
            assert e.read is not None
            data = e.read()
        except FileRefused as exc:
            yield _refused(ref, e, exc)
            continue
        yield _with_defaults(Candidate(e.path, data, size=len(data), **fields), ref)


# --------------------------------------------------------------------------- folders


def _folder_entry(
    full: str, rel: str, ext: str, max_file_bytes: int, remote: Mapping[bytes, Any] | None = None
) -> _Entry:
    raw = os.fsencode(rel)
    e = _Entry(_display_path(raw), ext)
    e.refusal = _name_refusal(raw)
    if e.refusal is not None:
        return e
    try:
        st = os.lstat(full)
    except OSError as exc:
        e.refusal = FileRefused(UNREADABLE, f"cannot be inspected: {exc.strerror}")
        return e
    e.size = st.st_size
    limit = MAX_SIDECAR_BYTES if ext in SIDECAR_EXTENSIONS else max_file_bytes
    if stat.S_ISLNK(st.st_mode):
        try:
            target = quote_bounded(printable_name(os.fsencode(os.readlink(full))))
        except OSError:
            target = "(unreadable)"
        e.size = None
        e.refusal = FileRefused(SYMLINK, f"symbolic link to {target}; links are not followed")
    elif not stat.S_ISREG(st.st_mode):
        e.refusal = FileRefused(NOT_A_FILE, f"is {_file_kind(st.st_mode)}")
    elif ext not in IMAGE_EXTENSIONS and ext not in SIDECAR_EXTENSIONS:
        e.refusal = FileRefused(
            UNSUPPORTED_EXTENSION,
            f"{quote_bounded(printable_name(ext)) if ext else '(none)'} is not an image extension",
        )
    elif st.st_size > limit:
        what = "sidecar" if ext in SIDECAR_EXTENSIONS else "file"
        e.refusal = _too_large(st.st_size, limit, what)
    else:
        e.deferred = FileRead(os.fsencode(full), limit)
        if remote is not None and ext in SIDECAR_EXTENSIONS and e.deferred.path in remote:
            # A remote landing's sidecar staged as a placeholder: read the object itself.
            e.deferred = remote[e.deferred.path]
        e.read = e.deferred.read
    return e


def _iter_folder(
    ref: BatchRef,
    max_file_bytes: int,
    defer: bool = False,
    defer_sidecars: bool = False,
    remote: Mapping[bytes, Any] | None = None,
) -> Iterator[Candidate]:
    groups: dict[str, list[tuple[str, str, str]]] = {}  # stem -> (full, rel, ext)
    unlisted: list[Candidate] = []

    def _unlistable(exc: OSError) -> None:
        rel = os.path.relpath(exc.filename, ref.path) if exc.filename else "."
        unlisted.append(
            _with_defaults(
                Candidate(
                    _display_path(os.fsencode(rel)),
                    None,
                    error=(UNREADABLE, f"directory cannot be listed: {exc.strerror}"),
                ),
                ref,
            )
        )

    top = os.fspath(ref.path)
    cut = len(top.rstrip("/")) + 1  # a listed path's part under the batch (os.walk joins)
    for root, dirs, files in os.walk(top, onerror=_unlistable, followlinks=False):
        listed = list(files)
        kept = []
        for d in sorted(dirs):
            if d.startswith("."):
                continue
            if os.path.islink(os.path.join(root, d)):
                listed.append(d)  # a symlinked directory: an entry to refuse, not to walk
            else:
                kept.append(d)
        dirs[:] = kept
        for name in listed:
            if name.startswith(".") or (name == READY_MARKER and root == top):
                continue
            full = os.path.join(root, name)
            rel = full[cut:]  # as ``relpath``, without its two ``abspath`` per file
            stem, ext = _split_last_ext(rel)
            groups.setdefault(stem, []).append((full, rel, ext))
    yield from unlisted
    for stem in sorted(groups):
        entries = [
            _folder_entry(f, r, x, max_file_bytes, remote) for f, r, x in sorted(groups[stem])
        ]
        yield from _sample_candidates(ref, entries, defer, defer_sidecars)


# --------------------------------------------------------------------------- archives


def unsafe_member_reason(member: tarfile.TarInfo) -> str | None:
    """Why an archive member must not be read as a path, or None when it is safe."""
    name = member.name
    shown = quote_bounded(printable_name(name))
    pure = PurePosixPath(name)
    if name.startswith("/") or pure.is_absolute() or re.match(r"^[A-Za-z]:", name):
        return f"absolute path {shown}"
    if ".." in pure.parts:
        return f"path traversal {shown}"
    if member.issym() or member.islnk():
        return f"link member {shown} -> {quote_bounded(printable_name(member.linkname))}"
    if member.isdev() or member.isfifo():
        return f"device or fifo member {shown}"
    return None


def _member_refusal(member: tarfile.TarInfo, ext: str, max_file_bytes: int) -> FileRefused | None:
    """Why a member is not read (checked on its header alone), or None."""
    raw = member.name.encode("utf-8", "surrogateescape")
    refusal = _name_refusal(raw)
    if refusal is not None:
        return refusal
    unsafe = unsafe_member_reason(member)
    if unsafe is not None:
        return FileRefused(UNSAFE_PATH, unsafe)
    if not member.isfile():
        return FileRefused(NOT_A_FILE, f"archive member of tar type {member.type!r}")
    if ext not in IMAGE_EXTENSIONS and ext not in SIDECAR_EXTENSIONS:
        shown = quote_bounded(printable_name(ext)) if ext else "(none)"
        return FileRefused(UNSUPPORTED_EXTENSION, f"{shown} is not an image extension")
    if ext in SIDECAR_EXTENSIONS and member.size > MAX_SIDECAR_BYTES:
        return _too_large(member.size, MAX_SIDECAR_BYTES, "sidecar")
    if member.size > max_file_bytes:
        return _too_large(member.size, max_file_bytes, "member")
    return None


#: The largest extended header (pax records, GNU long name or link) read. tarfile reads
#: one whole into memory before the member it describes; real ones are a few hundred bytes.
MAX_EXTENDED_HEADER_BYTES = 1 << 20
_EXTENDED_HEADERS = frozenset(
    {
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
    }
)


class _BoundedTarInfo(tarfile.TarInfo):
    """A header whose extended header is refused before it is read when it is too big."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED_HEADERS and self.size > MAX_EXTENDED_HEADER_BYTES:
            # SubsequentHeaderError: tarfile turns it into a ReadError wherever it occurs.
            raise tarfile.SubsequentHeaderError(
                f"an extended header of {self.size:,} bytes, over the "
                f"{MAX_EXTENDED_HEADER_BYTES:,}-byte limit (the rest of the archive is unread)"
            )
        return super()._proc_member(tarfile_)


def _open_tar(ref: BatchRef) -> tarfile.TarFile:
    try:
        # Names are bytes in the header; surrogateescape keeps every byte (printable_name).
        return tarfile.open(
            ref.path,
            mode="r:*",
            encoding="utf-8",
            errors="surrogateescape",
            tarinfo=_BoundedTarInfo,
        )
    except (tarfile.TarError, OSError) as exc:
        where = printable_name(os.fsencode(ref.path))
        raise BatchError(f"{where}: not a readable tar archive: {bound_text(str(exc))}") from exc


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Members one by one without tarfile's list of every member seen (a 1M-file archive)."""
    while True:
        member = tar.next()
        tar.members.clear()
        if member is None:
            return
        if not member.isdir():
            yield member


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    try:
        f = tar.extractfile(member)
        return f.read() if f is not None else b""
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise FileRefused(UNREADABLE, f"archive member unreadable: {bound_text(str(exc))}") from exc


def spool_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, directory: str, max_bytes: int
) -> FileRead:
    """Copy one archive member to a new temporary file in ``directory``, in
    ``COPY_CHUNK_BYTES`` chunks, so a big member is never held whole in memory: the file
    for the validating process to read like a folder file (``FileRead.temporary``: deleted
    once checked). A member shorter than its header says is refused as unreadable."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="member-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            f = tar.extractfile(member)
            copied = 0
            while f is not None:
                part = f.read(COPY_CHUNK_BYTES)
                if not part:
                    break
                out.write(part)
                copied += len(part)
        if copied != member.size:
            raise FileRefused(
                UNREADABLE,
                f"archive member holds {copied:,} bytes, its header says {member.size:,}",
            )
    except (tarfile.TarError, OSError, EOFError) as exc:
        os.unlink(path)
        raise FileRefused(UNREADABLE, f"archive member unreadable: {bound_text(str(exc))}") from exc
    except BaseException:
        os.unlink(path)
        raise
    return FileRead(os.fsencode(path), max_bytes, temporary=True)


def _oversized(stem: str, total: int, max_file_bytes: int) -> FileRefused:
    return FileRefused(
        TOO_LARGE,
        f"sample {quote_bounded(printable_name(stem))} holds {total:,} bytes in its members, "
        f"over the {max_file_bytes:,}-byte limit for one sample",
    )


def _iter_archive(
    ref: BatchRef, max_file_bytes: int, spool_dir: str | None = None
) -> Iterator[Candidate]:
    """One pass, one sample (a run of adjacent members sharing a stem) at a time; a sample
    whose members' sizes (from their headers) add up to more than the limit is refused
    whole, and never more than the limit is held.

    An uncompressed archive's members are read when their sample ends, by seeking back, so
    an oversized sample is never read. A compressed one cannot seek back cheaply: members
    are read as they come while their sample fits, and dropped if it turns out not to; the
    stream is decompressed once. With ``spool_dir``, an image member over
    ``STREAM_ABOVE_BYTES`` is not read into memory: it is copied to a temporary file there
    (``spool_member``) and yielded unread (``Candidate.deferred``), like a folder file.
    """
    tar = _open_tar(ref)
    spooling = spool_dir is not None  # big members come unread (``Candidate.deferred``)
    seekable = not isinstance(tar.fileobj, (gzip.GzipFile, bz2.BZ2File, lzma.LZMAFile))
    group: list[_Entry] = []
    current: str | None = None
    total = 0

    def sample() -> list[_Entry]:
        if total > max_file_bytes:
            refusal = _oversized(current or "", total, max_file_bytes)
            for e in group:
                if e.refusal is None:
                    e.refusal, e.read = refusal, None
        return group

    with tar:
        try:
            for member in _members(tar):
                stem, ext = _split_ext(member.name)
                if stem != current or not group:
                    yield from _sample_candidates(ref, sample(), spooling)
                    group, current, total = [], stem, 0
                raw = member.name.encode("utf-8", "surrogateescape")
                e = _Entry(_display_path(raw), ext, size=member.size)
                e.refusal = _member_refusal(member, ext, max_file_bytes)
                if e.refusal is None:
                    total += member.size
                    big = (
                        spool_dir is not None
                        and ext in IMAGE_EXTENSIONS
                        and member.size > STREAM_ABOVE_BYTES
                    )
                    if seekable:
                        if big:
                            assert spool_dir is not None
                            e.spool = lambda m=member, d=spool_dir: spool_member(
                                tar, m, d, max_file_bytes
                            )
                        else:
                            e.read = lambda m=member: _read_member(tar, m)
                    elif total <= max_file_bytes:
                        try:
                            if big:
                                assert spool_dir is not None
                                e.deferred = spool_member(tar, member, spool_dir, max_file_bytes)
                            else:
                                data = _read_member(tar, member)
                                e.read = lambda data=data: data
                        except FileRefused as exc:
                            e.refusal = exc
                group.append(e)
            yield from _sample_candidates(ref, sample(), spooling)
        except (tarfile.TarError, OSError, EOFError) as exc:
            # A damaged archive: keep the samples before the damage, record it once.
            yield from _sample_candidates(ref, sample(), spooling)
            yield _with_defaults(
                Candidate(
                    printable_name(ref.path.name),
                    None,
                    error=("corrupt_archive", f"archive: {bound_text(str(exc))}"),
                ),
                ref,
            )


# --------------------------------------------------------------------------- manifests


def _csv_rows(path: Path) -> Iterator[dict[str, Any]]:
    """CSV rows, streamed; cells decoded with surrogateescape so paths keep their bytes."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, after the generator ends
    except OSError as exc:
        raise BatchError(f"{path}: unreadable CSV manifest: {exc.strerror}") from exc

    def lines() -> Iterator[str]:
        for line in read_lines(fh, MAX_MANIFEST_LINE_BYTES):
            if line.truncated:
                raise BatchError(
                    f"{printable_name(os.fsencode(path))}: line {line.number} is "
                    f"{line.total_chars:,} characters, over the "
                    f"{MAX_MANIFEST_LINE_BYTES:,}-byte line limit"
                )
            data = (
                line.data[3:]
                if line.number == 1 and line.data[:3] == b"\xef\xbb\xbf"
                else line.data
            )
            yield data.decode("utf-8", "surrogateescape") + "\n"

    with fh:
        try:
            yield from csv.DictReader(lines())
        except csv.Error as exc:
            where = printable_name(os.fsencode(path))
            raise BatchError(f"{where}: unreadable CSV manifest: {bound_text(str(exc))}") from exc


def _parquet_rows(path: Path, wanted: Callable[[list[str]], list[str]]) -> Iterator[dict]:
    """Parquet rows in record batches; string cells as bytes, so no decode can fail."""
    where = printable_name(os.fsencode(path))
    try:
        pf = pq.ParquetFile(path)
        columns = wanted(pf.schema_arrow.names)
        for batch in pf.iter_batches(batch_size=MANIFEST_BATCH_ROWS, columns=columns):
            arrays = []
            for col in batch.columns:
                if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                    col = col.cast(
                        pa.binary() if pa.types.is_string(col.type) else pa.large_binary()
                    )
                arrays.append(col)
            yield from pa.RecordBatch.from_arrays(arrays, names=batch.schema.names).to_pylist()
    except BatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise BatchError(f"{where}: unreadable parquet manifest: {bound_text(str(exc))}") from exc


def _column_mapping(path: Path, names: list[str]) -> dict[str, str]:
    columns = {str(c).lower(): c for c in names}
    mapping: dict[str, str] = {}
    for field_name, options in MANIFEST_COLUMNS.items():
        for name in options:
            if name in columns:
                mapping[field_name] = columns[name]
                break
    if "path" not in mapping:
        found = ", ".join(
            quote_bounded(clean_text(str(c)), 60) for c in list(columns.values())[:20]
        )
        raise BatchError(
            f"{printable_name(os.fsencode(path))}: manifest has no path column (expected one "
            f"of {', '.join(MANIFEST_COLUMNS['path'])}; found {found})"
        )
    return mapping


def is_signal_column(name: str) -> bool:
    """A manifest column holding an opt-out header (``x_robots_tag``, ``tdm-reservation``,
    ``tdm_policy``, ``content_usage``, any case) or a JSON header map (``headers``)."""
    return header_name(name) is not None or name.strip().lower() in HEADER_MAP_FIELDS


def _cell_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        text = bytes(value).decode("utf-8", "replace")
    else:
        text = clean_text(str(value))
    return text or None


def _cell_path(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        raw = bytes(value)
    else:
        raw = str(value).encode("utf-8", "surrogateescape")
    return raw or None


def _manifest_rows(path: Path) -> Iterator[tuple[bytes | None, dict[str, str]]]:
    """(raw path, metadata fields) per manifest row, streamed."""
    mapping: dict[str, str] = {}

    signal_columns: list[str] = []

    def wanted(names: list[str]) -> list[str]:
        mapping.update(_column_mapping(path, names))
        signal_columns[:] = [c for c in names if is_signal_column(str(c))]
        return list(dict.fromkeys([*mapping.values(), *signal_columns]))

    if path.suffix == ".parquet":
        rows = _parquet_rows(path, wanted)
    else:
        rows = _csv_rows(path)
    for row in rows:
        if not mapping:
            wanted(list(row.keys()))
        fields = {
            k: text
            for k, col in mapping.items()
            if k != "path" and (text := _cell_text(row.get(col))) is not None
        }
        signals = capture_signals({c: row.get(c) for c in signal_columns})
        if signals is not None:
            fields["usage_signals"] = signals
        yield _cell_path(row.get(mapping["path"])), fields


def _manifest_candidate(
    ref: BatchRef,
    base: bytes,
    raw: bytes,
    fields: dict[str, str],
    max_file_bytes: int,
    defer: bool = False,
) -> Candidate:
    """One manifest row: the file it names, checked by ``stat`` before it is read (with
    ``defer``, left for the validating process to read: ``Candidate.deferred``)."""
    shown = _display_path(raw)
    quoted = quote_bounded(shown)
    size: int | None = None
    try:
        refusal = _name_refusal(raw)
        if refusal is not None:
            raise refusal
        if b"\x00" in raw:
            raise FileRefused(BAD_FILENAME, "a NUL byte cannot be in a file name")
        target = os.path.realpath(os.path.join(base, raw))
        if os.path.commonpath([base, target]) != base or target == base:
            where = printable_name(base)
            raise FileRefused(UNSAFE_PATH, f"{quoted} resolves outside the source folder {where}")
        try:
            st = os.stat(target)
        except FileNotFoundError:
            raise FileRefused(MISSING_FILE, f"{quoted} does not exist") from None
        except OSError as exc:
            raise FileRefused(UNREADABLE, f"{quoted} cannot be inspected: {exc.strerror}") from None
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(NOT_A_FILE, f"{quoted} is {_file_kind(st.st_mode)}")
        if st.st_size > max_file_bytes:
            raise _too_large(st.st_size, max_file_bytes)
        read = FileRead(target, max_file_bytes, quoted)
        if defer:
            c = Candidate(shown, None, size=size, deferred=read, **fields)
            return _with_defaults(c, ref)
        data = read.read()
    except FileRefused as exc:
        c = Candidate(shown, None, error=(exc.reason, bound_text(exc.detail)), size=size, **fields)
        return _with_defaults(c, ref)
    return _with_defaults(Candidate(shown, data, size=len(data), **fields), ref)


def _iter_manifest(ref: BatchRef, max_file_bytes: int, defer: bool = False) -> Iterator[Candidate]:
    base = os.fsencode(ref.path.parent.resolve())
    for raw, fields in _manifest_rows(ref.path):
        if raw is None:
            yield _with_defaults(
                Candidate("", None, error=("missing_path", "empty path cell"), **fields), ref
            )
        else:
            yield _manifest_candidate(ref, base, raw, fields, max_file_bytes, defer)


def iter_candidates(
    ref: BatchRef,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    defer_reads: bool = False,
    spool_dir: str | None = None,
    defer_sidecars: bool = False,
    remote_sidecars: Mapping[bytes, Any] | None = None,
) -> Iterator[Candidate]:
    """Every input file of a batch, in a deterministic order, readable or not.

    ``max_file_bytes``: the per-file limit (and per WebDataset sample), checked before
    reading; over it a file is refused as ``too_large``. ``defer_reads``: images of folders
    and manifests come unread, for the process that validates them to read
    (``Candidate.deferred``, the same checks and refusals); archive members are read here
    (one sequential stream), and so are sidecars (their metadata is the candidate's).
    ``spool_dir`` (with ``defer_reads``): an archive's image members over
    ``STREAM_ABOVE_BYTES`` are copied to temporary files there instead of into memory, and
    come unread too (``FileRead.temporary``: the caller deletes each once checked, and the
    directory when done). ``defer_sidecars`` (with ``defer_reads``): a folder sample's
    sidecars come unread with its images (``Candidate.sidecars``), for the validator to read.
    ``remote_sidecars``: readers (``remote_landing.RemoteRead``) by the local path of the
    placeholder a remote landing staged for a sidecar: read through them, never the
    placeholder.
    """
    if ref.kind in ("archive", "manifest"):
        try:
            st = os.stat(ref.path)
        except OSError as exc:
            raise BatchError(f"{_where(ref.path)}: cannot be read: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):  # a FIFO named x.tar would block the reader
            raise BatchError(f"{_where(ref.path)} is {_file_kind(st.st_mode)}, not a file")
    if ref.kind == "folder":
        yield from _iter_folder(ref, max_file_bytes, defer_reads, defer_sidecars, remote_sidecars)
    elif ref.kind == "archive":
        yield from _iter_archive(ref, max_file_bytes, spool_dir if defer_reads else None)
    elif ref.kind == "manifest":
        yield from _iter_manifest(ref, max_file_bytes, defer_reads)
    else:
        raise BatchError(f"unknown batch kind {ref.kind!r}")
