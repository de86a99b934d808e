"""The MDS tree on object storage: immutable version prefixes, one pointer object each.

Object stores have no rename, so the local protocol (write a hidden sibling, rename it into
place) becomes "write every part, then one small object last". For a bucket x batch
directory ``mds/<tier>/<H>x<W>/<batch>`` the remote layout is::

    <rel>/_live.json                      # the pointer: which version is live (one PUT)
    <rel>/v-<digest16>/index.json         # a complete MDS directory, never rewritten:
    <rel>/v-<digest16>/shard.00000.mds    #   shards, index.json, its skip-list
    <rel>/v-<digest16>/...skip.json       #   generation (sidecars + skiplists.json)
    <rel>/v-<digest16>/skiplists.json

``<digest16>`` is the first 16 hex digits of ``partition_digest`` (the sha256 of an
``index.json`` that records every shard's sha256): the version name commits to the shard
bytes, so a rerun with the same samples writes the same prefix and the same objects.

Why a pointer rather than ``index.json`` last at a fixed path: rewriting shards in place
under a live ``index.json`` would let a reader that already holds the old index fetch new
shard bytes and apply the old skip-lists to the wrong samples. Versions are immutable, so
a reader resolves the pointer once and reads a consistent directory; a pointer flip is one
atomic PUT.

Writes (``RemoteShardTree``):

- ``mds_shards``: the workers upload their pieces' shard files into a staging prefix of
  the run, ``<rel>/_staging/<token>/`` (``core/shards/pieces.py``: no shard byte passes
  through the step); each directory's ``index.json`` and first skip-list generation are
  written locally (``core/shards/mds.py``, ``StagedPartition``), then per directory: the
  staged shards are copied server side into the version prefix (``CopyObject``; shards
  of a directory written locally are uploaded), then sidecars, ``index.json`` and
  ``skiplists.json`` are uploaded, then the pointer is put, then superseded versions and
  the staging prefix are deleted (a killed run's staging is swept the same way by the next
  publish: no pointer ever names it). A directory the partition no longer has loses its
  pointer first (invisible at once), then its objects. A kill anywhere leaves each
  directory's pointer on its old or its new complete version (or, for a directory being
  removed, none): never a partial one; the rerun sweeps what the killed writer left.
- ``skip_lists``: the live versions of the batch are mirrored locally (``index.json``, the
  live generation), the new generations are staged there (``core/skiplists/sidecars.py``),
  then *every* directory's new sidecars are uploaded before the first ``skiplists.json``
  is replaced, and each directory's manifest is one PUT (old or new generation, never a
  mix). The fail-closed contract is the local one: a reader checks the manifest against
  the version's own ``index.json`` and every sidecar's sha256.

Readers: :func:`live_partitions` lists ``<tier>/<H>x<W>/<batch>`` with a pointer,
:func:`resolve_live` returns a version's URI (what ``StreamingDataset`` gets as ``remote``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prx_assets.core.crashpoints import crashpoint
from prx_assets.core.shards.mds import (
    MDS_DIRNAME,
    PartitionDir,
    list_partition_dirs,
    partition_digest,
)
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    MANIFEST_BASENAME,
    SIDECAR_SUFFIX,
    canonical_json,
    parse_manifest,
)
from prx_assets.core.storage import ObjectStore, StorageError, is_remote, join, open_store

POINTER_BASENAME = "_live.json"
POINTER_FORMAT = "prx-mds-pointer"
POINTER_VERSION = 1
VERSION_PREFIX = "v-"
STAGING_DIR = "_staging"  # <rel>/_staging/<token>/: shards a run's workers staged
_VERSION_CHARS = 16


class PointerCorrupt(StorageError):
    """A pointer object that is not what a writer puts (fail closed: the directory is refused)."""


@dataclass(frozen=True)
class LiveDir:
    """One visible remote directory: its relative path, live version and that version's URI."""

    relative_dir: str  # mds/<tier>/<H>x<W>/<batch>
    version: str  # v-<digest16>
    index_sha256: str
    uri: str

    @property
    def key_prefix(self) -> str:
        return f"{self.relative_dir}/{self.version}"


def version_of(local_dir: str | os.PathLike[str]) -> str:
    """The version prefix name of a written local directory (content addressed)."""
    return VERSION_PREFIX + partition_digest(local_dir)[:_VERSION_CHARS]


def encode_pointer(version: str, index_sha256: str) -> bytes:
    payload = {
        "format": POINTER_FORMAT,
        "version": POINTER_VERSION,
        "dir": version,
        "index_sha256": index_sha256,
    }
    payload["sha256"] = hashlib.sha256(canonical_json(payload)).hexdigest()
    return canonical_json(payload) + b"\n"


def parse_pointer(data: bytes, source: str) -> tuple[str, str]:
    """(version, index_sha256) of pointer bytes; anything unexpected is ``PointerCorrupt``."""
    try:
        obj = json.loads(data)
        body = {k: v for k, v in obj.items() if k != "sha256"}
        ok = (
            obj.get("format") == POINTER_FORMAT
            and obj.get("version") == POINTER_VERSION
            and hashlib.sha256(canonical_json(body)).hexdigest() == obj.get("sha256")
            and isinstance(obj.get("dir"), str)
            and obj["dir"].startswith(VERSION_PREFIX)
            and "/" not in obj["dir"]
        )
    except (ValueError, AttributeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise PointerCorrupt(f"{source}: not a valid {POINTER_FORMAT} v{POINTER_VERSION} object")
    return obj["dir"], obj["index_sha256"]


def read_live(store: ObjectStore, relative_dir: str) -> LiveDir | None:
    """The live version of one remote directory, or None when it has no pointer."""
    data = store.get(f"{relative_dir}/{POINTER_BASENAME}", max_bytes=64 << 10)
    if data is None:
        return None
    version, index_sha = parse_pointer(data, join(store.uri, relative_dir, POINTER_BASENAME))
    return LiveDir(relative_dir, version, index_sha, join(store.uri, relative_dir, version))


def _bucket_prefixes(store: ObjectStore) -> list[str]:
    """``mds/<tier>/<H>x<W>`` prefixes of the remote tree (one listing per level)."""
    out = []
    tiers, _ = store.children(MDS_DIRNAME)
    for tier in tiers:
        if not tier.isdigit():
            continue
        shapes, _ = store.children(f"{MDS_DIRNAME}/{tier}")
        out += [f"{MDS_DIRNAME}/{tier}/{s}" for s in shapes if "x" in s]
    return out


def live_partitions(shards_uri: str) -> list[str]:
    """Every ``<tier>/<H>x<W>/<batch>`` with a pointer under ``shards_uri/mds``."""
    store = open_store(shards_uri)
    found = []
    for bucket in _bucket_prefixes(store):
        batches, _ = store.children(bucket)
        for batch in batches:
            _, files = store.children(f"{bucket}/{batch}")
            if POINTER_BASENAME in files:
                found.append(f"{bucket}/{batch}"[len(MDS_DIRNAME) + 1 :])
    return sorted(found)


def resolve_live(mds_uri: str, relpath: str) -> str:
    """The URI of the live version of ``<mds_uri>/<relpath>`` (``SkipListMissing``-like
    refusal when it has none: a listed directory that vanished is not "empty")."""
    store = open_store(mds_uri)
    data = store.get(f"{relpath}/{POINTER_BASENAME}", max_bytes=64 << 10)
    if data is None:
        raise StorageError(f"{join(mds_uri, relpath)}: no {POINTER_BASENAME}: not a live directory")
    version, _ = parse_pointer(data, join(mds_uri, relpath, POINTER_BASENAME))
    return join(mds_uri, relpath, version)


@dataclass(frozen=True)
class StagedShards:
    """One directory's shards as its workers staged them on the remote: the staging key
    prefix and committed name -> staged name (``mds.CommittedDir.shards``)."""

    key: str
    shards: Mapping[str, str]


def _indexed_sizes(directory: Path) -> dict[str, int]:
    """Shard name -> bytes, as ``index.json`` records them."""
    shards = json.loads((directory / INDEX_BASENAME).read_bytes())["shards"]
    return {s["raw_data"]["basename"]: int(s["raw_data"]["bytes"]) for s in shards}


def _upload_order(names: Sequence[str]) -> list[str]:
    """Shards, then sidecars, then ``index.json``, then the manifest (last inside a version)."""
    shards = sorted(n for n in names if not n.endswith(SIDECAR_SUFFIX) and n.startswith("shard."))
    sidecars = sorted(n for n in names if n.endswith(SIDECAR_SUFFIX))
    rest = [n for n in (INDEX_BASENAME, MANIFEST_BASENAME) if n in names]
    return shards + sidecars + rest


class RemoteShardTree:
    """A runner's view of a shard tree: the tree itself when local, else a local work copy.

    ``local_root`` is where ``core/shards/mds.py`` and ``core/skiplists/sidecars.py`` write;
    for an ``s3://`` tree it is a temporary directory that ``publish_shards`` and
    ``publish_skiplists`` push to the remote (module docstring), and ``close`` deletes.
    """

    def __init__(self, shards_root: str, batch: str) -> None:
        self.shards_root = shards_root
        self.batch = batch
        self.remote = is_remote(shards_root)
        self._tmp = tempfile.mkdtemp(prefix="prx-shards-") if self.remote else None
        self.local_root = self._tmp or shards_root
        self.store: ObjectStore | None = open_store(shards_root) if self.remote else None
        self.pulled: dict[str, LiveDir] = {}

    def __enter__(self) -> RemoteShardTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _store(self) -> ObjectStore:
        assert self.store is not None
        return self.store

    def live_dirs(self) -> list[LiveDir]:
        """The batch's directories with a pointer on the remote, by relative path."""
        store = self._store()
        out = []
        for bucket in _bucket_prefixes(store):
            live = read_live(store, f"{bucket}/{self.batch}")
            if live is not None:
                out.append(live)
        return out

    # -- mds_shards -------------------------------------------------------------------------

    def staging_key(self, relative_dir: str, token: str) -> str:
        """Where a run's workers put one directory's shards on the remote (``pieces.py``):
        ``<rel>/_staging/<token>``, which no pointer names; ``publish_shards`` copies them
        into the version prefix and deletes it with the directory's other stale objects (a
        killed run's is swept by the next publish of the batch)."""
        return f"{relative_dir}/{STAGING_DIR}/{token}"

    def staging_uri(self, relative_dir: str, token: str) -> str:
        return join(self.shards_root, self.staging_key(relative_dir, token))

    def discard_staging(self, token: str) -> None:
        """Delete a failed run's staged shards (best effort: the next publish sweeps them)."""
        if not self.remote:
            return
        store = self._store()
        for bucket in _bucket_prefixes(store):
            self._delete(store, store.list(self.staging_key(f"{bucket}/{self.batch}", token)))

    def publish_shards(self, staged: Mapping[str, StagedShards] | None = None) -> list[LiveDir]:
        """Push every local directory of the batch, then remove the remote ones it lacks.

        ``staged``: per relative directory, the shards its workers put on the remote (the
        local directory then holds only the index and skip-lists): they are copied server
        side into the version prefix, never through this process.

        The batch's remote objects are listed once, before anything is written: one listing
        per bucket prefix of the tree (not a pointer read per prefix for the live ones and
        another for the unpointed ones, nor two more listings and a ``HEAD`` per object for
        each directory published), which is what each directory's stale objects, the
        directories this batch no longer has and those no pointer protects are found from.
        Whatever this run writes after the listing is kept, so listing first removes
        nothing the run wrote.
        """
        if not self.remote:
            return []
        store = self._store()
        local = {d.relative_dir: d for d in list_partition_dirs(self.local_root, self.batch)}
        listed = self._batch_objects(store)
        staged = staged or {}
        published = [
            self._publish_dir(store, d, staged.get(rel), listed.get(rel, {}))
            for rel, d in sorted(local.items())
        ]
        for rel, objects in sorted(listed.items()):
            if rel in local:
                continue
            pointer = f"{rel}/{POINTER_BASENAME}"
            if pointer in objects:  # a directory the batch no longer has
                store.delete([pointer])  # invisible first
                crashpoint("storage.stale_pointer_removed")
                store.delete([k for k in objects if k != pointer])
            else:  # no pointer protects it: a killed first write, a killed removal
                self._delete(store, list(objects))
        return published

    def _batch_objects(self, store: ObjectStore) -> dict[str, dict[str, int]]:
        """Every ``<bucket>/<batch>`` directory of this batch on the remote that holds an
        object: its objects and their sizes (from the listing itself)."""
        out = {}
        for bucket in _bucket_prefixes(store):
            rel = f"{bucket}/{self.batch}"
            if objects := store.list_sizes(rel):
                out[rel] = objects
        return out

    def _publish_dir(
        self,
        store: ObjectStore,
        d: PartitionDir,
        staged: StagedShards | None,
        listed: Mapping[str, int],
    ) -> LiveDir:
        """Publish one directory: its version's objects, then its pointer, then the stale
        objects ``listed`` (the directory's objects before this publish) holds."""
        version = version_of(d.path)
        prefix = f"{d.relative_dir}/{version}"
        sizes = {p.name: p.stat().st_size for p in d.path.iterdir() if p.is_file()}
        remote_shards: dict[str, str] = {}
        if staged is not None:
            indexed = _indexed_sizes(d.path)
            for name, staged_name in staged.shards.items():
                if name not in sizes:
                    remote_shards[name] = f"{staged.key}/{staged_name}"
                    sizes[name] = indexed[name]
        names = list(sizes)
        present = {k[len(prefix) + 1 :]: n for k, n in listed.items() if k.startswith(prefix + "/")}
        for name in _upload_order(names):
            size = sizes[name]
            # Inside a version prefix every name but the manifest is content-determined
            # (the version commits to shards and index; sidecars are content addressed).
            if name != MANIFEST_BASENAME and present.get(name) == size:
                continue
            if name in remote_shards:
                store.copy(remote_shards[name], f"{prefix}/{name}")  # server side
                if store.size(f"{prefix}/{name}") != size:
                    raise StorageError(
                        f"{join(store.uri, prefix, name)}: the staged shard is not the size "
                        "its index entry records (a worker's upload was replaced?)"
                    )
            else:
                store.put_file(f"{prefix}/{name}", d.path / name)
            crashpoint("storage.object_uploaded")
        crashpoint("storage.shards_uploaded")
        index_sha = hashlib.sha256((d.path / INDEX_BASENAME).read_bytes()).hexdigest()
        pointer = encode_pointer(version, index_sha)
        if store.get(f"{d.relative_dir}/{POINTER_BASENAME}", 64 << 10) != pointer:
            store.put(f"{d.relative_dir}/{POINTER_BASENAME}", pointer)
            crashpoint("storage.pointer_published")
        live = LiveDir(d.relative_dir, version, index_sha, join(store.uri, prefix))
        keep = set(_upload_order(names))
        stale = [
            k
            for k in listed
            if k != f"{d.relative_dir}/{POINTER_BASENAME}"
            and not (k.startswith(prefix + "/") and k.rsplit("/", 1)[-1] in keep)
        ]
        self._delete(store, stale)
        return live

    @staticmethod
    def _delete(store: ObjectStore, keys: list[str]) -> None:
        """Delete stale objects: one request per 1,000 (``DeleteObjects``), not one each."""
        if keys:
            store.delete(keys)
            crashpoint("storage.stale_removed")

    # -- skip_lists -------------------------------------------------------------------------

    def pull_generations(self) -> dict[str, LiveDir]:
        """Mirror each live directory's ``index.json`` and live generation into ``local_root``.

        Shards are not fetched: the skip-list writer needs only the index (which records
        every shard's sha256, so the directory digest is the index's). A directory whose
        index records no shard hashes is fetched whole (its digest covers the shard bytes).
        """
        if not self.remote:
            return {}
        store = self._store()
        self.pulled = {}
        for live in self.live_dirs():
            dest = mirror_generation(live, store, Path(self.local_root) / live.relative_dir)
            shards = json.loads((dest / INDEX_BASENAME).read_bytes())["shards"]
            if not all("sha256" in (s["raw_data"].get("hashes") or {}) for s in shards):
                for s in shards:
                    name = s["raw_data"]["basename"]
                    if not store.download(f"{live.key_prefix}/{name}", dest / name):
                        raise StorageError(f"{live.uri}/{name} is missing")
            self.pulled[live.relative_dir] = live
        return self.pulled

    def publish_skiplists(self, relative_dirs: Sequence[str]) -> None:
        """Push the generations staged and published in the local mirror, as one unit:
        every directory's new sidecars first, then one manifest PUT per directory (in the
        order given), then the superseded sidecars are deleted."""
        if not self.remote:
            return
        store = self._store()
        plans = []
        for rel in relative_dirs:
            live = self.pulled.get(rel)
            if live is None:
                raise StorageError(f"{rel} was not pulled before its skip-lists were written")
            local = Path(self.local_root) / rel
            manifest = (local / MANIFEST_BASENAME).read_bytes()
            sidecars = sorted(parse_manifest(manifest, str(local)).sidecars)
            listed = store.list(live.key_prefix)  # once: what is stale is found from it too
            present = {k.rsplit("/", 1)[-1] for k in listed}
            for name in sidecars:
                if name not in present:
                    store.put_file(f"{live.key_prefix}/{name}", local / name)
                    crashpoint("storage.object_uploaded")
            crashpoint("storage.generation_staged")
            plans.append((live, manifest, set(sidecars), listed))
        for live, manifest, _, _ in plans:
            now = read_live(store, live.relative_dir)
            if now is None or now.version != live.version:
                raise StorageError(
                    f"{live.uri} was replaced while its skip-lists were written: rerun skip_lists"
                )
            if store.get(f"{live.key_prefix}/{MANIFEST_BASENAME}") != manifest:
                store.put(f"{live.key_prefix}/{MANIFEST_BASENAME}", manifest)
                crashpoint("storage.manifest_put")
        for _, _, keep, listed in plans:
            # Listed before this publish: a sidecar it uploaded is in ``keep`` anyway.
            stale = [
                k for k in listed if k.endswith(SIDECAR_SUFFIX) and k.rsplit("/", 1)[-1] not in keep
            ]
            self._delete(store, stale)


def mirror_generation(live: LiveDir, store: ObjectStore, dest: str | os.PathLike[str]) -> Path:
    """Copy one live version's index and live skip-list generation (no shards) into ``dest``:
    what ``load_generation`` verifies. The index must be the one the pointer names; a
    sidecar the manifest names but the store lacks is left absent (the check then fails)."""
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    index = store.get(f"{live.key_prefix}/{INDEX_BASENAME}")
    if index is None or hashlib.sha256(index).hexdigest() != live.index_sha256:
        raise StorageError(f"{live.uri}: {INDEX_BASENAME} is missing or not the pointer's")
    (out / INDEX_BASENAME).write_bytes(index)
    manifest = store.get(f"{live.key_prefix}/{MANIFEST_BASENAME}")
    if manifest is not None:
        (out / MANIFEST_BASENAME).write_bytes(manifest)
        for sidecar in parse_manifest(manifest, live.uri).sidecars:
            data = store.get(f"{live.key_prefix}/{sidecar}")
            if data is not None:
                (out / sidecar).write_bytes(data)
    return out


def mirror_version(live: LiveDir, store: ObjectStore, dest: str | os.PathLike[str]) -> Path:
    """Download one live version whole into ``dest`` (tools and tests: audit a remote dir)."""
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for key in store.list(live.key_prefix):
        store.download(key, out / key.rsplit("/", 1)[-1])
    return out
