"""The landing zone on object storage: list a remote prefix, stage one batch locally.

A remote landing zone (``s3://bucket/landing``) has the local layout
(``<source>/<chunk>/`` folders complete once ``_SUCCESS`` exists, ``<chunk>.tar``/``.tgz``
archives, ``<chunk>.parquet``/``.csv`` manifests, ``_source.json`` defaults) and the same
naming rules (``.``/``_`` prefixes and ``.tmp``/``.partial`` suffixes are ignored). On object
storage one PUT is atomic, so an archive or manifest is complete once it is listed; a folder
is complete once its marker is listed, which producers put last.

``discover_landing`` lists sources and entries one level at a time (never the whole bucket)
and gives the same ``BatchRef`` keys as the local ``discover_batches``. ``landing_batch``
downloads one batch into a temporary local landing zone (the entry, the source's defaults,
and for a manifest the source folder's other, non-batch files it may reference) and
resolves it there, so ingest, its decoding policy and its rejection rules run unchanged.
An object over ``max_file_bytes`` is not downloaded: a sparse placeholder of its size
stands in, which the local size check refuses as ``too_large`` before reading (archives
are fetched whole: their members are checked from their headers).

With ``remote_reads`` (a dict to fill), a folder batch's image files are not downloaded
here: each is staged as a sparse placeholder of its listed size (so listing, grouping,
naming and size checks run unchanged) and the dict maps the placeholder's path to a
``RemoteRead``, the object's reference, which the process that validates the image
downloads itself (a Ray worker on another node: ``runner.BatchIngest(remote_reads=...)``).
Sidecars are left there the same way: the worker that checks a sample's image reads them
(``sources.sidecar_metadata``), and anything else that reads one reads the object, never
its placeholder (``iter_candidates(remote_sidecars=...)``). Archives and manifests are
staged as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prx_assets.core.ingest.sources import (
    IMAGE_EXTENSIONS,
    MAX_SIDECAR_BYTES,
    MISSING_FILE,
    READY_MARKER,
    SIDECAR_EXTENSIONS,
    SOURCE_DEFAULTS_FILE,
    UNREADABLE,
    BatchError,
    BatchRef,
    FileRefused,
    _split_last_ext,
    _too_large,
    batch_key,
    discover_batches,
    entry_chunk,
    key_part,
    key_parts,
    resolve_batch,
)
from prx_assets.core.storage import (
    ObjectStore,
    ObjectTooLarge,
    S3Store,
    is_remote,
    join,
    open_store,
)
from prx_assets.core.text import printable_name


def _ignored(name: str) -> bool:
    return name.startswith((".", "_")) or name.endswith((".tmp", ".partial"))


def _remote_entries(store: ObjectStore, source: str) -> list[tuple[str, str, str]]:
    """(entry name, chunk, kind) of every complete batch entry of one remote source."""
    return [e for e in _named_entries(store, source) if _complete(store, source, *e)]


def _complete(store: ObjectStore, source: str, entry: str, chunk: str, kind: str) -> bool:
    """Whether a named entry is a whole batch: a folder once its marker is there (one
    ``HEAD``), an archive or manifest as soon as it is listed (one PUT is atomic)."""
    return kind != "folder" or store.size(f"{source}/{entry}/{READY_MARKER}") is not None


def _named_entries(store: ObjectStore, source: str) -> list[tuple[str, str, str]]:
    """(entry, chunk, kind) of every entry of one remote source that names a batch, from one
    listing and the names alone (a folder's marker is not asked about here)."""
    dirs, files = store.children(source)
    named = [(d, entry_chunk(d, True)) for d in dirs] + [(f, entry_chunk(f, False)) for f in files]
    return sorted((entry, *ck) for entry, ck in named if ck is not None)


def discover_landing(
    landing: str | os.PathLike[str], known: Callable[[str], bool] | None = None
) -> list[BatchRef]:
    """Every complete batch of a local or remote landing zone, sorted by key.

    ``known`` (remote only): keys already registered, left out of the answer. A folder's
    marker is asked about (a HEAD) only where its key is not known, or where another entry
    maps to the same key (refused as two entries, as without ``known``): the landing
    sensor's tick asks about new folders, not about every folder ever landed."""
    text = os.fspath(landing)
    if not is_remote(text):
        return discover_batches(Path(text))
    store = open_store(text)
    by_key: dict[str, list[tuple[str, str, str, str, str]]] = {}
    sources, _ = store.children("")
    for source in sources:
        if _ignored(source):
            continue
        for entry, chunk, kind in _named_entries(store, source):
            src, ch = printable_name(source.encode()), printable_name(chunk.encode())
            by_key.setdefault(batch_key(src, ch), []).append((source, entry, kind, src, ch))
    found: dict[str, BatchRef] = {}
    for key in sorted(by_key):
        group = by_key[key]
        if known is not None and len(group) == 1 and known(key):
            continue  # registered, and nothing else claims its key: no request
        for source, entry, kind, src, ch in group:
            if not _complete(store, source, entry, ch, kind):
                continue  # not complete yet
            ref = BatchRef(key, src, ch, Path(source) / entry, kind)
            if key in found:
                raise BatchError(
                    f"two landing entries map to partition {key!r}: "
                    f"{found[key].path} and {ref.path}; rename one"
                )
            found[key] = ref
    return [found[k] for k in sorted(found) if known is None or not known(k)]


def _find_remote(store: ObjectStore, key: str) -> BatchRef | None:
    """The remote batch of partition ``key`` (as ``discover_landing`` finds it), asking only
    about entries whose names map to it: a step's requests do not grow with the landing
    zone's other batches (``discover_landing`` asks for every folder's marker)."""
    parts = key_parts(key)
    if parts is None:
        return None
    found: list[BatchRef] = []
    sources, _ = store.children("")
    for source in sources:
        if _ignored(source) or key_part(source) != parts[0]:
            continue
        for entry, chunk, kind in _named_entries(store, source):
            if key_part(chunk) != parts[1]:
                continue
            if not _complete(store, source, entry, chunk, kind):
                continue
            src, ch = printable_name(source.encode()), printable_name(chunk.encode())
            if batch_key(src, ch) == key:
                found.append(BatchRef(key, src, ch, Path(source) / entry, kind))
    if len(found) > 1:
        raise BatchError(
            f"two landing entries map to partition {key!r}: {found[0].path} and "
            f"{found[1].path}; rename one"
        )
    return found[0] if found else None


def _local_rel(key: str) -> Path:
    """A remote key as a path that cannot leave the staging directory."""
    parts = [{"..": "%2E%2E", ".": "%2E"}.get(p, p) for p in key.split("/") if p]
    return Path(*parts)


@dataclass(frozen=True)
class RemoteRead:
    """One landing object for the process that validates it to download (a Ray worker on
    any node), with ``sources.FileRead``'s interface and refusals. Picklable: the landing
    zone's URI, the object's key, the size it was listed with and the limit; no
    credentials (the worker's environment supplies them, ``core/storage.py``).

    Bounded: the object is refused as ``too_large`` (the reader's own detail) past
    ``max_bytes`` without being read whole; missing is ``missing_file``; an object whose
    size differs from the listed one is ``unreadable``. Any other failure (the endpoint
    unreachable, credentials refused) raises: in a worker that is the item's failure, and
    the step process then reads the object itself (``BatchIngest._key_of``), which fails
    the step with the storage's error, as a failed download while staging does.
    """

    landing: str
    key: str
    expected: int
    max_bytes: int
    path: bytes  # the local placeholder's path (its name in ``remote_reads``)
    quoted: str | None = None
    temporary: bool = False  # never a spooled copy: nothing to delete

    def read(self) -> bytes:
        """The object's bytes, or ``FileRefused`` (missing, too large, changed, failed)."""
        if self.expected > self.max_bytes:
            raise _too_large(self.expected, self.max_bytes)
        store = open_store(self.landing)
        assert isinstance(store, S3Store)
        try:
            data = store.get(self.key, self.max_bytes)
        except ObjectTooLarge:
            size = store.size(self.key)
            got = size if size is not None else self.max_bytes + 1
            raise _too_large(got, self.max_bytes) from None
        if data is None:
            raise FileRefused(MISSING_FILE, "does not exist")
        if len(data) != self.expected:
            raise FileRefused(
                UNREADABLE,
                f"changed since it was listed ({self.expected:,} bytes, now {len(data):,})",
            )
        return data

    def size(self) -> int:
        return self.expected

    def sha256(self) -> str:
        return hashlib.sha256(self.read()).hexdigest()


#: A listed object at most this size is staged with one GET (``download_file`` asks its
#: size first: a second round trip per sidecar); larger ones (archives) are downloaded.
_ONE_GET_BYTES = 8 << 20


def _stage(
    store: ObjectStore,
    key: str,
    dest: Path,
    max_file_bytes: int | None,
    remote_reads: dict[bytes, RemoteRead] | None = None,
    landing: str = "",
    listed: int | None = None,
    made: set[Path] | None = None,
) -> None:
    """Stage one object under ``dest``; ``listed``: its size from a listing (else asked);
    ``made``: the directories staged so far (one ``mkdir`` per directory, not per object)."""
    target = dest / _local_rel(key)
    if made is None or target.parent not in made:
        target.parent.mkdir(parents=True, exist_ok=True)
        if made is not None:
            made.add(target.parent)
    size = listed if listed is not None else store.size(key)
    if max_file_bytes is not None and size is not None and size > max_file_bytes:
        with open(target, "wb") as fh:  # sparse: refused as too_large, never read
            fh.truncate(size)
        return
    ext = _split_last_ext(key)[1]
    if (
        remote_reads is not None
        and max_file_bytes is not None
        and size is not None
        and (ext in IMAGE_EXTENSIONS or ext in SIDECAR_EXTENSIONS)
    ):
        with open(target, "wb") as fh:  # sparse: listed and checked here, read elsewhere
            fh.truncate(size)
        path = os.fsencode(target)
        limit = MAX_SIDECAR_BYTES if ext in SIDECAR_EXTENSIONS else max_file_bytes
        remote_reads[path] = RemoteRead(landing, key, size, limit, path)
        return
    if listed is not None and listed <= _ONE_GET_BYTES:
        data = store.get(key, _ONE_GET_BYTES)
        if data is not None:  # gone since listed: absent here too, as a failed download
            target.write_bytes(data)
        return
    store.download(key, target)


@contextlib.contextmanager
def landing_batch(
    landing: str | os.PathLike[str],
    key: str,
    max_file_bytes: int | None = None,
    remote_reads: dict[bytes, RemoteRead] | None = None,
) -> Iterator[tuple[BatchRef, str]]:
    """The batch ``key`` as a local ``BatchRef`` and where it lives (shown in metadata).

    Local landing zones are used in place (``remote_reads`` stays empty: workers on other
    nodes cannot read this machine's disk, so their images still travel with the tasks);
    remote batches are staged into a temporary directory for as long as the context is
    open. ``remote_reads``: a dict to fill with the folder images left on object storage
    for their validators to download (see the module docstring).
    """
    text = os.fspath(landing)
    if not is_remote(text):
        ref = resolve_batch(Path(text), key)
        yield ref, printable_name(os.fsencode(ref.path))
        return
    store = open_store(text)
    remote = _find_remote(store, key)
    if remote is None:
        raise BatchError(f"no complete batch for partition {key!r} under {text}")
    source, entry = remote.path.parts[0], remote.path.name
    with tempfile.TemporaryDirectory(prefix="prx-landing-") as tmp:
        dest = Path(tmp)
        if store.size(f"{source}/{SOURCE_DEFAULTS_FILE}") is not None:
            _stage(store, f"{source}/{SOURCE_DEFAULTS_FILE}", dest, None)
        if remote.kind == "folder":
            made: set[Path] = set()
            for k, size in store.list_sizes(f"{source}/{entry}").items():
                _stage(store, k, dest, max_file_bytes, remote_reads, text, size, made)
        else:
            _stage(store, f"{source}/{entry}", dest, None)
        if remote.kind == "manifest":
            # What a manifest may name: the source folder's files outside other batches.
            others = {e for e, _, _ in _remote_entries(store, source)} - {entry}
            for k in store.list(source):
                top = k.split("/")[1]
                if top not in others and top != entry and top != SOURCE_DEFAULTS_FILE:
                    _stage(store, k, dest, max_file_bytes)
        yield resolve_batch(dest, key), join(text, source, entry)


def upload_landing(local: str | os.PathLike[str], landing: str) -> int:
    """Copy a local landing zone to a remote one the way a producer must: each folder's
    files first and its ``_SUCCESS`` marker last, so no sensor sees a partial folder.
    Returns the number of objects put (the demo and tests use it; producers do the same)."""
    store = open_store(landing)
    root = Path(local)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    markers = [p for p in files if p.name == READY_MARKER]
    for path in [p for p in files if p.name != READY_MARKER] + markers:
        store.put_file(path.relative_to(root).as_posix(), path)
    return len(files)
