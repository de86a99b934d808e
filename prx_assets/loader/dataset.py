"""A ``StreamingDataset`` whose sample space is the shards *minus their skip-lists*.

Why filter at shard level, before partitioning
----------------------------------------------
mosaicml-streaming derives everything that makes multi-rank training deterministic from
one list: the number of samples in each shard. From it come the global sample ids (the
``Spanner``), the epoch size, the shuffle units (``py1e`` shuffles within shard-sized
blocks), the split over canonical nodes, ranks and workers, the rank padding that keeps
every rank's count equal, and the meaning of ``sample_in_epoch`` in a checkpoint.

Dropping skipped samples *while iterating* (yield-time filtering) would break all of it:
ranks that happen to hit more skips run short (a DDP hang at the end of the epoch),
``len()`` lies, and a checkpoint's "N samples seen" no longer names a position in the
order. So the skip-lists are applied where streaming reads the shard list:
``SkipListStream.get_shards`` wraps each shard reader in a ``FilteredShard`` whose
``samples`` is the *kept* count and whose index ``i`` maps to the i-th kept row of the
real shard; a shard with nothing left is not returned at all (never downloaded, never
partitioned, no empty yields). ``StreamingDataset.__init__`` then builds its spanner,
offsets, epoch size, shuffle and partitions over the filtered counts with its own code, so
every guarantee streaming gives (equal per-rank counts, elastic resumption across world
sizes with the same ``num_canonical_nodes``, exact ``state_dict`` resumption) holds in the
filtered sample space. No streaming module is patched.

Skip-lists change over time (shards never do), so a checkpoint records the digest of the
skip-lists it was taken against; resuming against a different digest raises
``SkipListChanged`` unless ``allow_skiplist_change=True`` (then the position is reused in
the new space: exact from the next epoch on, approximate for the rest of this one).

Published trees only: ``mds_shards`` writes ``index.json`` with a top-level version plain
streaming refuses (naming this loader; ``core/shards/published.py``), so that no reader that
ignores skip-lists can read the directory by accident. This loader reads that version and
refuses a plain version 2 index (``UnpublishedIndex``: a directory written before, or an
export) unless skip-lists are ignored on purpose.

Fail closed: every stream needs its directory's live skip-list generation (the
``skiplists.json`` manifest and the sidecars it names, ``core/skiplists/sidecars.py``), written for
the very ``index.json`` streaming loaded; a missing manifest or a manifest for another index
stops the dataset's construction, a missing, altered or out-of-range sidecar stops it with
``SkipListError``. A directory read in place has its manifest verified at construction
(which gives every shard's kept count) and each sidecar verified against the manifest when
its shard is first read, before any of its samples is returned (``FilteredShard``): building
the dataset then reads no sidecar, the cost that kept construction far from plain streaming with
real skip-lists (``benchmarks/bench_tree_growth.py --skip-every 7``). The sidecars of a
superseded generation outlive it (``sidecars.DEFAULT_RETENTION_S``), so a job built before an
opt-out keeps reading the generation it was built on, as a job holding every skip-list in
memory did; past the retention, its next new shard stops it. A remote stream fetches every
sidecar at construction, into the cache.
Reading without skip-lists is a deliberate, loud choice: ``skiplists="ignore-UNSAFE"``
(``IGNORE_SKIPLISTS_UNSAFE``), which warns (``UnscreenedDataWarning``) on every stream it
opens and digests differently from any screened sample space.

Skip-lists hold only for the shards they were written for. ``mds_shards`` reruns replace a
directory whole (renamed into place), so a stream pins the directory it read its index,
manifest and sidecars from (``DirectoryPin``: device and inode, the same before the first
read and after the last, else read again). Read in place, every sample read is checked
against the pin (``PinnedShard``, ``FilteredShard``). Copied from a remote into the cache,
every shard download must have the sha256 the loaded index records (``mds_shards`` records
it) and, from a remote that is a plain path, come from the pinned directory
(``SkipListStream._download_file``); object-store versions are immutable prefixes besides
(``core/shards/remote.py``). A replaced directory or a mismatching copy raises
``ShardsReplaced``, and nothing more is read from it. A failure in streaming's download
thread, which streaming turns into a short epoch, is raised at the epoch's end.

The manifest and sidecars of remote streams are fetched fresh on every dataset construction
(they are small and may have changed) with streaming's own downloader for the remote's scheme
(s3://, gs://, oci://, a local path, ...) and mirrored into the local cache beside
``index.json``. A generation switched on the remote between the manifest and a sidecar
fetch is read again from its new manifest.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
import os
import time
import uuid
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
from streaming import Stream, StreamingDataset
from streaming.base.constant import TICK
from streaming.base.format import reader_from_json
from streaming.base.storage import CloudDownloader
from streaming.base.storage.download import S3Downloader
from streaming.base.util import wait_for_file_to_exist
from streaming.base.world import World

from prx_assets.core.shards import small_buckets
from prx_assets.core.shards.published import published_index
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    MANIFEST_BASENAME,
    SIDECAR_SUFFIX,
    Manifest,
    ManifestEntry,
    SkipList,
    SkipListCorrupt,
    SkipListError,
    SkipListMissing,
    SkipListStale,
    check_manifest_lists_shards,
    check_manifest_written_for,
    digest_generations,
    known_empty,
    parse_manifest,
    verify_sidecar,
)
from prx_assets.loader.locks import remove_dead_streaming_locks
from prx_assets.loader.remote import absent_on_remote

# The small-bucket rule in the loader's words: kept samples and shards, its parameter names.
LOADER_TERMS = small_buckets.RuleTerms(
    "kept samples", "kept shards", "num_canonical_nodes", "batch_size", "×"
)

REQUIRE_SKIPLISTS = "require"
IGNORE_SKIPLISTS_UNSAFE = "ignore-UNSAFE"
SKIPLIST_MODES = (REQUIRE_SKIPLISTS, IGNORE_SKIPLISTS_UNSAFE)
_FETCH_ATTEMPTS = 3


class UnscreenedDataWarning(UserWarning):
    """Data read with ``skiplists="ignore-UNSAFE"``: opted-out and excluded samples included."""


# Shown every time, not once per call site: each unscreened stream is worth a line.
warnings.filterwarnings("always", category=UnscreenedDataWarning)


def check_skiplists_mode(mode: str) -> str:
    if mode not in SKIPLIST_MODES:
        raise ValueError(
            f"skiplists={mode!r}: use {REQUIRE_SKIPLISTS!r} (the default) or, to read "
            f"unscreened data on purpose, {IGNORE_SKIPLISTS_UNSAFE!r}"
        )
    return mode


def warn_unscreened(what: str, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{what}: read WITHOUT skip-lists (skiplists={IGNORE_SKIPLISTS_UNSAFE!r}): opted-out, "
        "duplicate and excluded samples are all yielded; never train on this",
        UnscreenedDataWarning,
        stacklevel=stacklevel,
    )


PREFIX_RACE_ATTEMPTS = 20  # see SkipListDataset._init_streaming


def lost_prefix_race(exc: FileExistsError) -> bool:
    """Whether ``exc`` is streaming's machine-wide prefix race lost (``_init_streaming``):
    another process registered the same first free shared-memory prefix a moment before."""
    return str(exc.filename or "").endswith("_locals")


class SkipListChanged(RuntimeError):
    """A checkpoint was taken against other skip-lists than the ones loaded now."""

    def __init__(self, saved: str | None, current: str) -> None:
        saved_txt = saved[:16] if saved else "none (checkpoint predates skip-lists)"
        super().__init__(
            f"skip-lists changed since the checkpoint (saved digest {saved_txt}, current "
            f"{current[:16]}): resuming would replay or drop samples of this epoch. Pass "
            f"allow_skiplist_change=True to resume anyway."
        )
        self.saved = saved
        self.current = current


class SnapshotChanged(RuntimeError):
    """A pinned file differs from what the snapshot froze (or a resume crosses snapshots)."""


def snapshot_of(streams: Collection[Any]) -> str | None:
    """The one snapshot a set of streams/buckets reads (None: live data); a mix is an error."""
    ids = {getattr(s, "snapshot", None) or getattr(s, "snapshot_id", None) for s in streams}
    if len(ids) > 1:
        raise ValueError(f"streams of different snapshots (or none) mixed: {sorted(map(str, ids))}")
    return next(iter(ids), None)


def check_resume_snapshot(saved: str | None, current: str | None) -> None:
    """A checkpoint resumes only under the snapshot it was taken with."""
    if saved != current:
        raise SnapshotChanged(
            f"the checkpoint was taken on snapshot {saved!r}, this loader reads {current!r}"
        )


class SkipListMismatchAcrossRanks(RuntimeError):
    """Ranks loaded different skip-lists (a sidecar changed while the job was starting)."""


class SmallBucketWarning(UserWarning):
    """A bucket with fewer kept samples than ``num_canonical_nodes * batch_size`` or fewer
    kept shards than ``num_canonical_nodes`` (see ``small_bucket_problems``)."""


class ShardsReplaced(SkipListStale):
    """A stream's directory was replaced after its index and skip-lists were read.

    ``mds_shards`` rewrites a bucket x batch directory by renaming a complete new one into
    place (``core/shards/mds.py``). A dataset built before that holds the old index and the
    old skip-lists, which name samples by position: read against the new shards they would
    skip the wrong rows and yield excluded ones. So no further sample is read from it.
    """


@dataclass(slots=True)
class DirectoryPin:
    """The identity (device, inode) of the directory a stream's index, manifest and
    skip-lists were read from; ``check`` refuses once the path names another directory.

    Why the directory: a rerun replaces the whole directory (one rename), and skip-list
    refreshes only add files inside it, which leave its identity alone. Plain ints, so a
    stream pickled into a dataloader worker checks against the same directory.
    """

    path: str
    dev: int
    ino: int

    @classmethod
    def take(cls, path: str) -> DirectoryPin:
        st = os.stat(path)
        return cls(path, st.st_dev, st.st_ino)

    def check(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.refuse()
        if st.st_ino != self.ino or st.st_dev != self.dev:
            self.refuse()

    def refuse(self) -> NoReturn:
        raise ShardsReplaced(
            f"{self.path} was replaced (an mds_shards rerun) after this dataset read its "
            "index and skip-lists: they no longer describe its shards, so no further "
            "sample is read from it. Build the dataset again (resuming from a checkpoint "
            "needs allow_skiplist_change=True if the skip-lists changed)"
        )


class _ShardView:
    """A shard reader seen through a sample mapping, optionally pinned to its directory.

    Every attribute but the sample count and indexing (files, sizes, download and eviction)
    is the real reader's, so caching works on whole shard files. With a ``pin``, each
    sample read is followed by the pin's check: a read from a directory that is no longer
    the pinned one raises ``ShardsReplaced`` instead of returning (also when the read itself
    failed on the new files). One ``stat`` per sample.
    """

    reader: Any
    pin: DirectoryPin | None
    samples: int

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        reader = self.__dict__.get("reader")
        if reader is None:
            raise AttributeError(name)
        return getattr(reader, name)

    @property
    def size(self) -> int:
        return self.samples

    def __len__(self) -> int:
        return self.samples

    def _read(self, real: int) -> dict[str, Any]:
        pin = self.pin
        if pin is None:
            return self.reader.get_item(real)
        try:
            sample = self.reader.get_item(real)
        except Exception:
            pin.check()  # a failure on a replaced directory's files is that, not a bad shard
            raise
        # After the read: had its open found another directory at the path, the path
        # names that one (or a later one) now, never the pinned one again: a version
        # renamed away is put back only when nothing replaced it (``mds._recover``).
        pin.check()
        return sample


class FilteredShard(_ShardView):
    """A shard reader seen through its skip-list.

    ``samples``/``len``/indexing are in kept space: index ``i`` is the ``i``-th kept row of
    the real shard. The kept rows are a Python list: one list lookup (plus the pin's check,
    for a directory read in place) is the whole per-sample overhead.

    ``skipped``: the shard's verified skip indices (strictly increasing, each a sample of
    the shard: ``SkipList.check_range``), or None with ``sidecar`` = (path, manifest entry)
    for a shard read in place: the sidecar is then read and verified against the entry
    (sha256, schema, range, and the skip count the kept count was built from) on the
    shard's first read, in the process that reads, before any of its samples is returned.
    Building the dataset touches every shard of every directory, a training process reads
    a few of them (measured with ``benchmarks/bench_tree_growth.py --samples-per-dir 1000
    --skip-every 7``). The kept rows are derived at the same moment.
    """

    def __init__(
        self,
        reader: Any,
        skipped: tuple[int, ...] | None,
        pin: DirectoryPin | None = None,
        sidecar: tuple[str, ManifestEntry] | None = None,
    ) -> None:
        if skipped is None and (sidecar is None or sidecar[1].skipped is None):
            raise ValueError("a deferred sidecar needs its manifest entry's skip count")
        self.reader = reader
        self.skipped = skipped
        self.sidecar = sidecar
        count = len(skipped) if skipped is not None else int(sidecar[1].skipped)  # type: ignore[index, arg-type]
        self.samples = int(reader.samples) - count
        self.pin = pin
        self._keep: list[int] | None = None

    def verified_skips(self) -> tuple[int, ...]:
        """The skip indices, reading and verifying a deferred sidecar first."""
        skipped = self.skipped
        if skipped is not None:
            return skipped
        assert self.sidecar is not None
        path, entry = self.sidecar
        try:
            data = read_whole_file(path)
        except FileNotFoundError:
            if self.pin is not None:
                self.pin.check()  # the directory was replaced: that is what to say
            raise SkipListCorrupt(
                f"{path} is gone: the skip-list generation this dataset was built on names "
                "it (superseded longer ago than the retention, PRX_SKIPLIST_RETENTION_S, or "
                "deleted); none of its shard's samples is read. Build the dataset again"
            ) from None
        if self.pin is not None:
            self.pin.check()  # read from the directory the index and manifest came from
        skiplist = verify_sidecar(entry, data, path, int(self.reader.samples))
        self.skipped = skiplist.indices
        return skiplist.indices

    @property
    def keep(self) -> list[int]:
        """The real index of each kept row (Python ints)."""
        keep = self._keep
        if keep is None:
            mask = np.ones(int(self.reader.samples), dtype=bool)
            mask[np.asarray(self.verified_skips(), dtype=np.int64)] = False
            keep = self._keep = np.flatnonzero(mask).tolist()
        return keep

    def real_index(self, idx: int) -> int:
        return self.keep[idx]

    def get_item(self, idx: int) -> dict[str, Any]:
        keep = self._keep
        return self._read((keep if keep is not None else self.keep)[idx])

    def __getitem__(self, idx: int) -> dict[str, Any]:
        # List indexing gives negative indices and IndexError for free.
        keep = self._keep
        return self._read((keep if keep is not None else self.keep)[idx])


class PinnedShard(_ShardView):
    """A shard with nothing skipped, read in place from a pinned directory (``_ShardView``)."""

    def __init__(self, reader: Any, pin: DirectoryPin) -> None:
        self.reader = reader
        self.samples = int(reader.samples)
        self.pin = pin

    def real_index(self, idx: int) -> int:
        return idx

    def get_item(self, idx: int) -> dict[str, Any]:
        if idx < 0 or idx >= self.samples:
            raise IndexError(f"sample {idx} of a {self.samples}-sample shard")
        return self._read(idx)

    __getitem__ = get_item


def _shard_name(reader: Any) -> str:
    return reader.raw_data.basename


def _recorded_sha256(readers: Sequence[Any]) -> dict[str, str]:
    """basename -> sha256 of every shard file (raw or compressed) whose index entry records it."""
    out = {}
    for reader in readers:
        for info in (i for pair in reader.file_pairs for i in pair if i is not None):
            sha = (info.hashes or {}).get("sha256")
            if sha:
                out[info.basename] = sha
    return out


def _file_sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


_FIRST_READ = 1 << 14  # holds any manifest, sidecar or index of a few dozen shards


def read_whole_file(path: str) -> bytes:
    """A local file's bytes, without a Python file object; ``FileNotFoundError`` if absent.

    One ``open``, reads until end of file (two for a small file: its bytes, then the empty
    read that proves the end) and one ``close``: about half the CPU of ``open(path,
    "rb").read()`` (no buffered reader, no ``fstat`` or ``isatty`` probe), which counts for the
    small files the loader reads per directory (manifest, index, sidecars: four at each of
    10,000 directories). A big file gets its remaining size from ``fstat`` and one read.
    Contents are checked by hash downstream, so a torn read fails closed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, _FIRST_READ)
        if len(data) == _FIRST_READ:
            data += os.read(fd, max(os.fstat(fd).st_size - _FIRST_READ, 0) + 1)
        more = os.read(fd, 1 << 16) if data else b""
        if not more:
            return data
        parts = [data, more]
        while more := os.read(fd, 1 << 16):
            parts.append(more)
        return b"".join(parts)
    finally:
        os.close(fd)


class _ParsedHere(dict):
    """One shard's entry of an ``index.json`` a stream has just parsed for its own readers.

    streaming's ``MDSReader.from_json`` deep-copies the entry it is given, so that a reader
    never shares objects with its caller; this entry comes from index bytes the stream has
    just parsed and drops once its reader is built, so nothing else can see the lists the
    reader keeps, and a shallow copy builds the same reader through streaming's own code
    (version and format checks included) for a sixth of the CPU: 12 → 2 µs per shard here,
    about 13 µs per directory, a sixth of plain construction at 10,000 directories.
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return dict(self)


_DOWNLOADERS: dict[tuple[int, type, str | None, str], CloudDownloader] = {}
# What an S3 downloader's client is built from (boto3 reads the rest of its configuration
# from files these select): a change makes a new one, so a stale endpoint is never reused.
_S3_CLIENT_ENV = (
    "S3_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "MOSAICML_STREAMING_AWS_REQUESTER_PAYS",
)


def shared_downloader(remote: str | None) -> CloudDownloader:
    """The downloader this process uses for ``remote``: one for every S3 stream, one per
    remote otherwise.

    Streaming builds a downloader per ``Stream``, and our own fetches built one per file;
    each S3 downloader makes its own client (a new boto3 session, which parses botocore's
    service model again, and an endpoint resolver), so a loader over many directories paid
    that for every index, manifest and sidecar at start-up (8 clients for a 2-directory
    tree: ``test_the_loader_builds_one_s3_client_per_process...``). An S3 downloader's
    client comes only from the environment (``_S3_CLIENT_ENV``, part of the key), never
    from the path, so all S3 streams share one (boto3 clients are thread-safe). Other downloaders may bind to the
    first path they see (SFTP's host, Azure's account), so they are shared only by the
    files of one remote, as streaming does. Keyed by process id too: a forked child builds
    its own rather than use a parent's connections.
    """
    fresh = CloudDownloader.get(remote)
    if isinstance(fresh, S3Downloader):
        env = "\0".join(os.environ.get(name, "\1") for name in _S3_CLIENT_ENV)
        key = (os.getpid(), type(fresh), None, hashlib.sha256(env.encode()).hexdigest())
    else:
        key = (os.getpid(), type(fresh), remote, "")
    return _DOWNLOADERS.setdefault(key, fresh)


class SkipListStream(Stream):
    """A ``Stream`` that applies its directory's live skip-list generation when listing shards.

    Arguments are streaming's ``Stream`` ones (``remote`` may be any URL streaming can read,
    or a local path it copies from; ``local`` is the cache, or the data itself when there is
    no remote), plus ``skiplists`` (``"require"``, the default, or ``"ignore-UNSAFE"``).
    After ``get_shards``: ``generation`` (the manifest's self-hash, for the digest; None
    when read unscreened), ``index_sha256``, ``dropped_shards``, ``raw_samples`` and
    ``kept_samples``.
    """

    def __init__(
        self,
        *,
        remote: str | None = None,
        local: str | None = None,
        split: str | None = None,
        proportion: float | None = None,
        repeat: float | None = None,
        choose: int | None = None,
        download_retry: int | None = None,
        download_timeout: float | None = None,
        validate_hash: str | None = None,
        keep_zip: bool | None = None,
        skiplists: str = REQUIRE_SKIPLISTS,
        known_manifest: tuple[bytes, Manifest] | None = None,
    ) -> None:
        check_skiplists_mode(skiplists)
        super().__init__(
            remote=remote,
            local=local,
            split=split,
            proportion=proportion,
            repeat=repeat,
            choose=choose,
            download_retry=download_retry,
            download_timeout=download_timeout,
            validate_hash=validate_hash,
            keep_zip=keep_zip,
        )
        self.skiplists = skiplists
        # Manifest bytes already parsed and verified on their own (by discovery): reused only
        # when the manifest read at construction is byte for byte the same.
        self.known_manifest = known_manifest
        self.generation: str | None = None
        self.index_sha256: str | None = None  # of the index the skip-lists were checked against
        self.dropped_shards: list[str] = []
        self.raw_samples = 0
        self.kept_samples = 0
        self._where: tuple[tuple[Any, ...], str, bool] | None = None  # see _local_dir_and_mode
        self._pin: DirectoryPin | None = None  # see _pinned_read
        self._shard_sha256: dict[str, str] = {}  # see _download_file
        self._downloader = shared_downloader(self.remote)  # streaming's, for index and shards

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A stream unpickled in a dataloader worker shares that process's downloader too.
        self.__dict__.update(state)
        self._downloader = shared_downloader(self.remote)

    @classmethod
    def from_stream(cls, stream: Stream, skiplists: str = REQUIRE_SKIPLISTS) -> SkipListStream:
        """The same stream (paths, weights, download settings) with skip-lists applied."""
        return cls(
            remote=stream.remote,
            local=stream.local,
            split=stream.split or None,
            proportion=stream._proportion,
            repeat=stream._repeat,
            choose=stream._choose,
            download_retry=stream._download_retry,
            download_timeout=stream._download_timeout,
            validate_hash=stream.validate_hash,
            keep_zip=stream._keep_zip,
            skiplists=skiplists,
            known_manifest=getattr(stream, "known_manifest", None),
        )

    @property
    def local_dir(self) -> str:
        return self._local_dir_and_mode()[0]

    def _reads_local(self) -> bool:
        return self._local_dir_and_mode()[1]

    def _local_dir_and_mode(self) -> tuple[str, bool]:
        """(the directory read or cached into, whether it is read in place: no remote, or
        the remote is that directory), worked out once per (remote, local, split): the
        path arithmetic ran on every file fetch, three times per directory."""
        key = (self.remote, self.local, self.split)
        where = getattr(self, "_where", None)
        if where is None or where[0] != key:
            local_dir = os.path.normpath(os.path.join(self.local, self.split))
            in_place = self.remote is None or os.path.abspath(self.remote) == os.path.abspath(
                self.local
            )
            where = self._where = (key, local_dir, in_place)
        return where[1], where[2]

    def _fetch(self, name: str) -> tuple[bytes | None, str]:
        """A file of this stream's directory (None when absent) and where it came from."""
        local_dir, in_place = self._local_dir_and_mode()
        local_path = f"{local_dir}/{name}"  # the manifest, or a sidecar it names: plain names
        if in_place:
            try:
                return read_whole_file(local_path), local_path
            except FileNotFoundError:
                return None, local_path
        remote_path = os.path.join(self.remote, self.split, name)
        tmp = f"{local_path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.download"
        timeout = getattr(self, "download_timeout", 60.0)
        attempts = 1 + int(getattr(self, "download_retry", 2))
        downloader = shared_downloader(self.remote)
        for attempt in range(attempts):
            try:
                downloader.download(remote_path, tmp, timeout)
                break
            except Exception as exc:
                if isinstance(exc, FileNotFoundError) or absent_on_remote(exc):
                    # Absent on the remote: drop any stale mirror so the cache tells the truth.
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(local_path)
                    return None, remote_path
                downloader.clean_up()  # a failed client is rebuilt on the next try
                if attempt == attempts - 1:
                    raise
                time.sleep(min(0.5 * 2**attempt, 8.0))
        with open(tmp, "rb") as fh:
            data = fh.read()
        os.replace(tmp, local_path)  # atomic; concurrent ranks write identical mirrors
        return data, remote_path

    def _fetch_index(self, world: World, path: str) -> bytes:
        """The ``index.json`` of a stream whose cache lacks it, fetched as ``Stream.get_shards``
        fetches it (the local leader downloads to a temporary name and renames it, the other
        local ranks wait for the file), then read back."""
        if world.is_local_leader:
            if not self.remote:
                raise SkipListError(f"no {INDEX_BASENAME} at {path}: not an MDS partition")
            tmp = self._download_file(INDEX_BASENAME, INDEX_BASENAME + ".tmp")
            os.rename(tmp, path)
        else:
            index_file = os.path.join(self.remote or "", self.split or "", INDEX_BASENAME)
            wait_for_file_to_exist(
                path,
                TICK,
                self.download_timeout,
                f"Index file {index_file} -> {path} took too long to download or failed to "
                "download. Either increase the `download_timeout` value or check the local "
                "rank 0 traceback.",
            )
        return read_whole_file(path)

    def _readers_and_index(self, world: World, allow_unsafe_types: bool) -> tuple[list[Any], bytes]:
        """Streaming's shard readers and the exact ``index.json`` bytes they were built from.

        The index is read once (fetched first when a cache lacks it: ``_fetch_index``) and
        the readers are built from those bytes the way ``Stream.get_shards`` does
        (``reader_from_json`` on entries nothing else holds: see ``_ParsedHere``,
        ``validate``). Its top-level version must be the published one
        (``core/shards/published.py``), which plain streaming refuses: a plain version 2
        index is ``UnpublishedIndex`` unless skip-lists are ignored on purpose.
        """
        path = os.path.join(self.local, self.split, INDEX_BASENAME)
        try:
            index_raw = read_whole_file(path)
        except FileNotFoundError:
            index_raw = self._fetch_index(world, path)
        obj = published_index(
            index_raw, path, allow_plain=self.skiplists == IGNORE_SKIPLISTS_UNSAFE
        )
        readers = []
        for info in obj["shards"]:
            reader = reader_from_json(self.local, self.split, _ParsedHere(info))
            reader.validate(allow_unsafe_types)
            readers.append(reader)
        return readers, index_raw

    def _load_skiplists(
        self, readers: list[Any], index_raw: bytes
    ) -> tuple[str, list[SkipList | ManifestEntry]]:
        """The live generation for these readers (built from ``index_raw``): (generation id,
        per reader its verified ``SkipList`` or, read in place from a version 2 manifest,
        the ``ManifestEntry`` whose sidecar ``FilteredShard`` verifies on the shard's first
        read). The manifest is verified here, whole, against the index and the readers."""
        for attempt in range(_FETCH_ATTEMPTS):
            data, source = self._fetch(MANIFEST_BASENAME)
            if data is None:
                raise SkipListMissing(
                    f"{source}: no skip-list manifest, so this directory was never screened "
                    f"and none of its samples may be trained on (pass "
                    f"skiplists={IGNORE_SKIPLISTS_UNSAFE!r} to read unscreened data on purpose)"
                )
            known = self.known_manifest
            manifest = known[1] if known and known[0] == data else parse_manifest(data, source)
            try:
                check_manifest_written_for(manifest, index_raw, source)
            except SkipListStale as exc:
                if self._reads_local():
                    raise
                raise SkipListStale(
                    f"{exc}; the cached {INDEX_BASENAME} under {self.local_dir} predates the "
                    "remote's current directory: clear that cache directory"
                ) from None
            # The readers were built from these very index bytes: check the manifest's
            # shards (and counts) against them instead of parsing the index a second time.
            check_manifest_lists_shards(
                manifest, [(_shard_name(r), int(r.samples)) for r in readers], source
            )
            # In place, a sidecar is read when its shard is (the superseded generation's
            # files outlive it: sidecars.DEFAULT_RETENTION_S); copied from a remote, every
            # sidecar is fetched now, into the cache beside the index.
            defer = self._reads_local() and manifest.has_counts
            out: list[SkipList | ManifestEntry] = []
            for entry, reader in zip(manifest.entries, readers, strict=True):
                if known_empty(entry):
                    out.append(SkipList.empty(entry.shard))
                    continue
                if defer:
                    out.append(entry)
                    continue
                sidecar, where = self._fetch(entry.sidecar)
                if sidecar is None:
                    break
                out.append(verify_sidecar(entry, sidecar, where, reader.samples))
            else:
                if not self._reads_local():
                    self._drop_stale_mirrors(manifest.sidecars)
                return manifest.generation, out
            # A named sidecar is gone: a new generation was published (and ours swept)
            # between the two reads, unless the manifest still names it.
            again, _ = self._fetch(MANIFEST_BASENAME)
            if again == data or attempt == _FETCH_ATTEMPTS - 1:
                raise SkipListCorrupt(f"{source} names {entry.sidecar}, which does not exist")
        raise AssertionError("unreachable")

    def _drop_stale_mirrors(self, live: frozenset[str]) -> None:
        """Cached sidecars of superseded generations (remote streams only; best effort)."""
        if self._reads_local() or not os.path.isdir(self.local_dir):
            return
        for entry in os.listdir(self.local_dir):
            if entry.endswith(SIDECAR_SUFFIX) and entry not in live:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.local_dir, entry))

    def _pin_path(self) -> str | None:
        """The directory whose replacement would void what construction read: the local
        one read in place, or a remote that is a plain path (copied into the cache on
        demand). None for object-store remotes: ``mds_shards`` publishes there into
        immutable version prefixes (``core/shards/remote.py``), and every download is
        checked against the index's sha256 anyway (``_download_file``)."""
        if self._reads_local():
            return self.local_dir
        if self.remote is not None and "://" not in self.remote:
            return os.path.normpath(os.path.join(self.remote, self.split))
        return None

    def _pinned_read(
        self, world: World, allow_unsafe_types: bool
    ) -> tuple[list[Any], str, list[SkipList | ManifestEntry]]:
        """Readers, generation and skip-lists, all read from one directory: its identity is
        the same before the index is read and after the last sidecar (else read again),
        and is kept as ``_pin`` for the reads that follow."""
        path = self._pin_path()
        self._pin = None  # downloads made here are bracketed by the identities below
        for _ in range(_FETCH_ATTEMPTS):
            before = DirectoryPin.take(path) if path is not None else None
            readers, index_raw = self._readers_and_index(world, allow_unsafe_types)
            generation, skiplists = self._load_skiplists(readers, index_raw)
            after = DirectoryPin.take(path) if path is not None else None
            if before == after:
                self._pin = after
                self.index_sha256 = hashlib.sha256(index_raw).hexdigest()
                return readers, generation, skiplists
        raise ShardsReplaced(
            f"{path} was replaced {_FETCH_ATTEMPTS} times while its index and skip-lists "
            "were read: an mds_shards rerun is rewriting it; build the dataset when it is done"
        )

    def _download_file(self, from_basename: str, to_basename: str | None = None) -> str:
        """streaming's download of one file, refused (the copy removed, never used) when it
        is not the file the loaded index describes: its sha256 differs from the one the
        index records (any remote: a rewritten or corrupt object), or a pinned path remote
        was replaced before the copy ended (also when the index records no sha256)."""
        if self._reads_local():
            return super()._download_file(from_basename, to_basename)
        pin = self._pin
        if pin is not None:
            pin.check()
        local = super()._download_file(from_basename, to_basename)
        try:
            if pin is not None:
                pin.check()
            expected = self._shard_sha256.get(from_basename)
            if expected is not None and _file_sha256(local) != expected:
                raise ShardsReplaced(
                    f"{os.path.join(self.remote or '', self.split, from_basename)} is not the "
                    "file the index this dataset loaded describes (its sha256 differs): the "
                    "remote directory was rewritten or the copy is corrupt; build the "
                    "dataset again"
                )
        except ShardsReplaced:
            with contextlib.suppress(FileNotFoundError):
                os.remove(local)
            raise
        return local

    def get_shards(self, world: World, allow_unsafe_types: bool) -> list[Any]:
        self.dropped_shards = []
        if self.skiplists == IGNORE_SKIPLISTS_UNSAFE:
            readers, _ = self._readers_and_index(world, allow_unsafe_types)
            self.raw_samples = int(sum(r.samples for r in readers))
            warn_unscreened(self.remote or self.local_dir, stacklevel=4)
            self.generation = None
            self.kept_samples = self.raw_samples
            return readers
        readers, self.generation, skiplists = self._pinned_read(world, allow_unsafe_types)
        in_place = self._reads_local()
        # What each download must match (nothing is downloaded for a stream read in place).
        self._shard_sha256 = {} if in_place else _recorded_sha256(readers)
        self.raw_samples = int(sum(r.samples for r in readers))
        # Read in place, every sample read checks the directory is still the pinned one;
        # into a cache, each shard download does (``_download_file``).
        pin = self._pin if in_place else None
        kept_readers: list[Any] = []
        for reader, skiplist in zip(readers, skiplists, strict=True):
            name = _shard_name(reader)
            if isinstance(skiplist, ManifestEntry):  # verified on the shard's first read
                if skiplist.skipped == reader.samples:
                    self.dropped_shards.append(name)  # every sample skipped, by its count
                else:
                    path = f"{self.local_dir}/{skiplist.sidecar}"
                    kept_readers.append(FilteredShard(reader, None, pin, (path, skiplist)))
                continue
            skiplist.check_range(reader.samples)  # verified when read; kept here too
            if skiplist.indices and len(skiplist.indices) == reader.samples:
                self.dropped_shards.append(name)  # every sample skipped
            elif skiplist.indices:
                kept_readers.append(FilteredShard(reader, skiplist.indices, pin))
            else:
                kept_readers.append(reader if pin is None else PinnedShard(reader, pin))
        self.kept_samples = int(sum(r.samples for r in kept_readers))
        if not kept_readers:
            raise SkipListError(
                f"every sample of {self.remote or self.local_dir} is skipped "
                f"({self.raw_samples} samples in {len(readers)} shards): leave this stream out"
            )
        return kept_readers


def small_bucket_problems(
    kept_samples: int, kept_shards: int, num_canonical_nodes: int, batch_size: int
) -> list[str]:
    """Why a bucket is too small: the rule behind ``SmallBucketWarning``.

    The rule ``mds_shards`` reports at write time (``core/shards/small_buckets.py``), judged
    on kept samples and shards and stated in the loader's parameter names.
    """
    return small_buckets.small_bucket_problems(
        kept_samples, kept_shards, num_canonical_nodes, batch_size, LOADER_TERMS
    )


def default_num_canonical_nodes(shuffle_algo: str = "py1e") -> int:
    """What streaming picks when none is given (fix it for the whole run to resume elastically)."""
    nodes = World.detect().num_nodes
    return 64 * nodes if shuffle_algo in ("py1s", "py2s") else nodes


@contextlib.contextmanager
def _peeks_released(keep: Callable[[], int | None]) -> Iterator[None]:
    """Close, when the block ends, the shared-memory segments streaming only peeked at in it.

    streaming keeps every ``SharedMemory`` it opens, and its file descriptor, until the
    process exits (one atexit handler each), including attachments it made only to read a
    value and then dropped: to pick its prefix, ``StreamingDataset.__init__`` attaches to the
    ``_locals`` segment of every live prefix on the machine, and every epoch's ``_resume``
    attaches to the dataset's resume segment. A trainer building one dataset per bucket held
    O(buckets²) descriptors plus O(buckets) per epoch: 1,343 after constructing the 11
    buckets of the small demo, past a 1,024 limit. Attachments made in the block (never a
    segment this process created) under any prefix other than ``keep()`` are closed when it
    ends; everything else keeps its atexit handler.
    """
    from streaming.base.shared.memory import SharedMemory

    held: list[SharedMemory] = []
    real_register = atexit.register

    def register(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        owner = getattr(f, "__self__", None)
        if isinstance(owner, SharedMemory) and not args and not kwargs:
            held.append(owner)
            return f
        return real_register(f, *args, **kwargs)

    atexit.register = register  # type: ignore[assignment]
    try:
        yield
    finally:
        atexit.register = real_register
        kept = keep()
        for shm in held:
            if _is_peek(shm, kept):
                with contextlib.suppress(Exception):  # a peer may have unlinked it already
                    shm.cleanup()
            else:
                real_register(shm.cleanup)


def _is_peek(shm: Any, kept_prefix: int | None) -> bool:
    """An attachment (not a segment this process created) outside the kept prefix."""
    if shm.created_shms or not shm.opened_shms:
        return False
    name = str(getattr(shm.opened_shms[0], "name", "")).lstrip("/")
    prefix, _, _ = name.partition("_")
    return prefix.isdigit() and int(prefix) != kept_prefix


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Pause CPython's cyclic garbage collector for the block (as it was after).

    Building a loader allocates a few dozen long-lived objects per directory (streams,
    readers, shard views, parsed manifests); every ~700 net allocations CPython runs a
    collection, and its full collections re-traverse every object still alive: at 10,000
    directories a large share of the construction CPU went to collections that free nothing
    (seen in a one-off timing with the collector on and off; the effect on the whole is
    what ``benchmarks/bench_tree_growth.py`` measures). Reference counting still frees
    everything acyclic meanwhile; cycles made in the block are collected after it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class SkipListDataset(StreamingDataset):
    """``StreamingDataset`` over ``SkipListStream``s: the sample space excludes skipped rows.

    Takes every ``StreamingDataset`` keyword. Plain ``Stream``s are converted with
    ``SkipListStream.from_stream``; ``remote``/``local`` make one stream. Adds
    ``allow_skiplist_change`` and ``skiplists`` (``"require"``, the default: every stream
    needs a valid skip-list generation; ``"ignore-UNSAFE"``: read unscreened, warning each
    time; a ``SkipListStream`` passed in keeps its own setting). ``skiplist_digest``
    identifies the filtered sample space and travels in ``state_dict``. ``bucket_name``
    labels warnings.
    """

    def __init__(
        self,
        *,
        streams: Sequence[Stream] | None = None,
        remote: str | None = None,
        local: str | None = None,
        split: str | None = None,
        allow_skiplist_change: bool = False,
        skiplists: str = REQUIRE_SKIPLISTS,
        bucket_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_skiplists_mode(skiplists)
        with collection_paused():
            if streams:
                if remote or local:
                    raise ValueError("pass either streams or remote/local, not both")
                streams = [
                    s if isinstance(s, SkipListStream) else SkipListStream.from_stream(s, skiplists)
                    for s in streams
                ]
            else:
                if not (remote or local):
                    raise ValueError("pass streams, or remote and/or local")
                streams = [
                    SkipListStream(remote=remote, local=local, split=split, skiplists=skiplists)
                ]
            if kwargs.get("replication") not in (None, 1):
                raise ValueError("replication is not supported with skip-lists (untested)")
            streams = self._init_streaming(streams, kwargs)
            self.allow_skiplist_change = allow_skiplist_change
            self.bucket_name = bucket_name or ", ".join(s.remote or s.local_dir for s in streams)
            self.skiplist_digest = digest_generations([s.generation for s in streams])
            self.snapshot = snapshot_of(streams)  # the training snapshot read (None: live data)
            self.raw_num_samples = int(sum(s.raw_samples for s in streams))
            self.dropped_shards = [
                (s.local_dir, name) for s in streams for name in s.dropped_shards
            ]
            self._check_ranks_agree()
            self._warn_if_small()

    def _init_streaming(
        self, streams: list[SkipListStream], kwargs: dict[str, Any]
    ) -> list[SkipListStream]:
        """``StreamingDataset.__init__``, retried when it loses streaming's prefix race.

        streaming registers a machine-wide shared-memory prefix as "the first free number":
        two processes constructing datasets at the same moment (two jobs on one node, test
        suites side by side) can pick the same one, and the loser gets ``FileExistsError``
        on ``/<prefix>_locals``. Retrying (with fresh copies of the streams: streaming sets
        their weights during the first attempt) picks the next free number. Only outside
        ``torch.distributed``: there the prefix is agreed between ranks through barriers,
        which a one-rank retry would unbalance, so the error is raised as streaming raises it.
        Returns the streams the dataset was built from.
        """
        import torch.distributed as dist

        # Streaming's dead file locks would make this prefix search slower on every node
        # that has run many jobs (``locks``).
        remove_dead_streaming_locks()
        distributed = dist.is_available() and dist.is_initialized()
        attempts = 1 if distributed else PREFIX_RACE_ATTEMPTS
        for attempt in range(attempts):
            try:
                # Its own prefix's attachments stay (non-leader ranks read them later).
                with _peeks_released(lambda: getattr(self, "_shm_prefix_int", None)):
                    super().__init__(streams=streams, **kwargs)
                return streams
            except FileExistsError as exc:
                if attempt + 1 == attempts or not lost_prefix_race(exc):
                    raise
                streams = [type(s).from_stream(s, s.skiplists) for s in streams]
                time.sleep(0.02 * (attempt + 1))
        raise AssertionError("unreachable")

    def _check_ranks_agree(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, self.skiplist_digest)
        if len(set(digests)) != 1:
            raise SkipListMismatchAcrossRanks(
                f"ranks loaded different skip-lists for {self.bucket_name}: "
                f"{[d[:12] for d in digests]}; do not rewrite sidecars while a job starts"
            )

    def _warn_if_small(self) -> None:
        if not isinstance(self.batch_size, int):
            return
        ncn = self.num_canonical_nodes or default_num_canonical_nodes(self.shuffle_algo)
        problems = small_bucket_problems(self.num_samples, self.num_shards, ncn, self.batch_size)
        if problems and World.detect().rank == 0:
            warnings.warn(
                f"bucket {self.bucket_name} is small: " + "; ".join(problems),
                SmallBucketWarning,
                stacklevel=3,
            )

    def on_exception(self, future: Any) -> None:
        """streaming's callback for its download and ready threads; the error is also kept
        for ``__iter__`` (streaming itself only ends the epoch early, and raises a generic
        error at the next one)."""
        error = future.exception()
        if error is not None:
            self._background_error = error
        super().on_exception(future)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """streaming's iteration; an epoch its background threads cut short raises what
        stopped them (e.g. ``ShardsReplaced``, a failed download) instead of ending as if
        complete: a short epoch must not pass for a whole one."""
        self._background_error: BaseException | None = None
        yield from super().__iter__()
        error = self._background_error
        if error is not None:
            raise error

    def _resume(self, world: World, epoch: int) -> tuple[int, int]:
        """streaming's ``_resume``, without keeping its read-only attachment for the process."""
        with _peeks_released(lambda: None):
            return super()._resume(world, epoch)

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        state = super().state_dict(num_samples, from_beginning)
        state["skiplist_digest"] = self.skiplist_digest
        if self.snapshot is not None:
            state["snapshot"] = self.snapshot
        return state

    def check_resume_digest(self, obj: dict[str, Any]) -> None:
        """Raise ``SkipListChanged`` if ``obj`` was saved against other skip-lists."""
        saved = obj.get("skiplist_digest")
        if saved == self.skiplist_digest:
            return
        if not self.allow_skiplist_change:
            raise SkipListChanged(saved, self.skiplist_digest)
        warnings.warn(
            f"resuming {self.bucket_name} against changed skip-lists "
            f"({str(saved)[:12]} -> {self.skiplist_digest[:12]}); the rest of this epoch "
            f"is approximate, later epochs are exact",
            stacklevel=3,
        )

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        check_resume_snapshot(obj.get("snapshot"), self.snapshot)
        self.check_resume_digest(obj)
        super().load_state_dict(
            {k: v for k, v in obj.items() if k not in ("skiplist_digest", "snapshot")}
        )
