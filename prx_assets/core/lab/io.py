"""Where the lab's bytes live: Lance datasets and pyarrow filesystems for a local path or
an ``s3://`` URI on the environment's endpoint (``core/storage.py``).

Why one place: every Lance call of the package must carry the same storage options (the
endpoint, ``allow_http``, region and credentials of an S3-compatible store; they hold
secrets, so they go to Lance only, never to a log or metadata), and every direct file
operation (blobs, version listings, orphan removal) the same filesystem.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lance
import pyarrow.fs as pafs

from prx_assets.core.storage import S3Settings, lance_storage_options


def storage_options(uri: str) -> dict[str, str] | None:
    """Lance's ``storage_options`` for ``uri`` (None for a local path)."""
    return lance_storage_options(uri)


# What the process-wide Lance session may hold: opened index segments, and file and
# manifest metadata. Bounded, so a long-lived process (a sensor daemon, the browser) does not
# grow with the tables it reads; the working set (the segments an index has now, each
# table's newest manifests) is a few MB per table (measured: the session settles at ~43 MB
# while one table grows to 3,000 partitions; 128 + 64 MB let it grow to ~200 MB for no gain).
INDEX_CACHE_BYTES = 32 * 1024 * 1024
METADATA_CACHE_BYTES = 16 * 1024 * 1024
_SESSION: tuple[int, lance.Session] | None = None


def session() -> lance.Session:
    """The Lance session every open of this process shares (a fresh one after a fork).

    Why: a dataset opened without one gets its own empty caches, so every operation read
    every index segment it probes from storage again (~0.1 ms each, growing with the delta
    segments an index holds). Index and data files are immutable and named by UUID or
    version, so a cached entry is never stale; the caches are bounded (LRU).
    """
    global _SESSION
    pid = os.getpid()
    if _SESSION is None or _SESSION[0] != pid:
        _SESSION = (
            pid,
            lance.Session(
                index_cache_size_bytes=INDEX_CACHE_BYTES,
                metadata_cache_size_bytes=METADATA_CACHE_BYTES,
            ),
        )
    return _SESSION[1]


# The newest version this process has seen of each local table (a hint, never trusted
# alone: see ``_latest_from_hint``).
_LATEST: dict[str, int] = {}
HINT_PROBES = 64  # newer manifests looked for one by one before listing instead


def _manifest_exists(uri: str, version: int, v2: bool) -> bool:
    name = f"{2**64 - 1 - version:020d}" if v2 else str(version)
    return os.path.exists(f"{uri}/_versions/{name}.manifest")


def _lance_hint(uri: str) -> int | None:
    """The version Lance's ``_versions/latest_version_hint.json`` names (Lance rewrites it
    after each commit to a local table), or None when it is absent or unreadable."""
    try:
        with open(f"{uri}/_versions/latest_version_hint.json", "rb") as fh:
            version = json.loads(fh.read(4096)).get("version")
    except (OSError, ValueError, AttributeError):
        return None
    return version if isinstance(version, int) and version >= 0 else None


def _latest_from_hint(uri: str) -> int | None:
    """The table's latest version from this process's last sight of it, or None (list).

    Why: Lance finds a local table's latest version by listing ``_versions``, one entry per
    kept version, on every open (~0.4 µs each: 2 ms at 5,000 versions, and retention keeps
    every version younger than its min age and every held one). A commit writes manifest
    ``v + 1`` atomically and versions are consecutive, so from a version known to exist the
    first missing successor manifest is the latest (a few ``stat`` calls), unless retention
    removed successors of a version it kept out of order (a pinned or held one): the
    version this process last saw may be exactly such a version, and its first missing
    successor would then be a gap, not the end (a stale read). So the probe starts from the
    newer of that version and the one Lance's own hint names: retention never removes the
    newest ``keep_versions``, and the hint lags the latest only by commits still writing it,
    so no gap lies beyond it. No readable hint, or its manifest gone: list. The answer is
    as fresh as a listing: a commit landing just after either is missed by both.
    """
    known = _LATEST.get(uri)
    if known is None or "://" in uri:
        return None
    hinted = _lance_hint(uri)
    if hinted is None:
        return None
    start = max(known, hinted)
    for v2 in (True, False):
        if _manifest_exists(uri, start, v2):
            version = start
            for _ in range(HINT_PROBES):
                if not _manifest_exists(uri, version + 1, v2):
                    _LATEST[uri] = version
                    return version
                version += 1
            return None
    return None


# One open dataset per object-store bucket this process reads, held so that Lance keeps
# the bucket's object store (see ``_hold_store``).
_STORE_HOLDERS: dict[tuple[int, str], lance.LanceDataset] = {}


def _hold_store(uri: str, ds: lance.LanceDataset) -> None:
    """Keep ``ds`` (the latest one opened in its bucket) alive for this process.

    Why: the session's registry holds a bucket's object store only while some dataset uses
    it, and each new store loads and parses the system's CA certificates (~880 KB of files
    here): every open, count and commit of a step on ``s3://`` paid that once more
    (``s3/test_lab_store_reuse.py`` counts the bytes read). One dataset per bucket: its
    manifest is all it keeps in memory."""
    if uri.startswith("s3://"):
        bucket = uri[5:].split("/", 1)[0]
        _STORE_HOLDERS[(os.getpid(), bucket)] = ds


def open_dataset(uri: str, version: int | None = None) -> lance.LanceDataset:
    """``lance.dataset(uri, version)`` with the storage options ``uri`` needs, on the
    process's shared session; the latest version without listing every manifest when this
    process has seen the table before (local tables)."""
    options = storage_options(uri)
    if version is None and (latest := _latest_from_hint(uri)) is not None:
        try:
            ds = lance.dataset(uri, version=latest, storage_options=options, session=session())
        except (ValueError, OSError):  # removed meanwhile (cleanup): list instead
            _LATEST.pop(uri, None)
        else:
            return ds
    ds = lance.dataset(uri, version=version, storage_options=options, session=session())
    _hold_store(uri, ds)
    if version is None:
        seen(uri, ds.version)
    return ds


def seen(uri: str, version: int) -> None:
    """Record that ``uri`` has ``version`` (after an open or a commit of this process)."""
    if "://" not in uri and version > _LATEST.get(uri, -1):
        _LATEST[uri] = version


def arrow_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem and path for ``uri``: s3:// on the environment's endpoint
    (credentials from pyarrow's default chain, the same environment), else local."""
    if not uri.startswith("s3://"):
        return pafs.FileSystem.from_uri(uri if "://" in uri else str(Path(uri).resolve()))
    s = S3Settings.from_env()
    endpoint = (s.endpoint_url or "").split("://", 1)[-1] or None
    scheme = "http" if s.allow_http else "https"
    return pafs.S3FileSystem(endpoint_override=endpoint, scheme=scheme, region=s.region), uri[5:]
