"""Discovery on object storage: list a remote MDS tree and resolve each live version.

``mds_shards`` publishes each bucket x batch directory on object storage as an immutable
version prefix named by a pointer object (``core/shards/remote.py``). The loader lists the
directories that have a pointer and gives streaming the *version's* URI as ``remote``, so
a training job reads one consistent directory even while a writer publishes the next one,
and its local cache is keyed by version (a flip never leaves a stale cached ``index.json``).
Endpoint and credentials come from the environment; streaming's S3 downloader reads
``S3_ENDPOINT_URL`` (set it to the same endpoint as ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

from collections.abc import Sequence

from prx_assets.core.shards.remote import live_partitions, resolve_live
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    MANIFEST_BASENAME,
    PartitionCounts,
    SkipListCorrupt,
    SkipListError,
    SkipListMissing,
    check_manifest_matches_index,
    parse_index,
    parse_manifest,
    verify_sidecar,
)
from prx_assets.core.storage import open_store


def remote_partitions(root: str, partitions: Sequence[str] | None) -> list[str]:
    """``partitions`` when given; else every live ``<tier>/<H>x<W>/<batch>`` of an ``s3://``
    tree (other schemes cannot be listed here: pass ``partitions``)."""
    if partitions is not None:
        return list(partitions)
    if not root.startswith("s3://"):
        raise ValueError(f"{root} cannot be listed: pass partitions=[tier/HxW/batch,...]")
    return live_partitions(root)


def resolve_remote_partition(mds_root: str, relpath: str) -> str:
    """The URI streaming reads for one directory: its live version on ``s3://`` trees, the
    directory itself elsewhere (trees not written through a pointer)."""
    if not mds_root.startswith("s3://"):
        return f"{mds_root}/{relpath}"
    return resolve_live(mds_root, relpath)


def remote_partition_counts(remote: str, skiplists: str) -> PartitionCounts | None:
    """A remote directory's sizes after its live generation, verified like the loader does
    (``SkipListMissing`` / ``SkipListStale`` / ``SkipListCorrupt`` when it cannot be trusted),
    so discovery refuses an unscreened remote directory as it refuses a local one and can
    leave out one whose every sample is skipped. None for schemes other than ``s3://``.
    ``skiplists="ignore-UNSAFE"``: counted without skip-lists (the caller warns)."""
    if not remote.startswith("s3://"):
        return None
    store = open_store(remote)
    index = store.get(INDEX_BASENAME)
    if index is None:
        raise SkipListError(f"{remote}: no {INDEX_BASENAME}: not an MDS directory")
    shards = parse_index(index, f"{remote}/{INDEX_BASENAME}")
    total = sum(n for _, n in shards)
    if skiplists != "require":
        return PartitionCounts(total, total, len(shards), len(shards))
    source = f"{remote}/{MANIFEST_BASENAME}"
    data = store.get(MANIFEST_BASENAME)
    if data is None:
        raise SkipListMissing(
            f"{source}: no skip-list manifest, so this directory was never screened and "
            "none of its samples may be trained on"
        )
    manifest = parse_manifest(data, source)
    check_manifest_matches_index(manifest, index, source)
    kept = []
    for entry, (_, n) in zip(manifest.entries, shards, strict=True):
        sidecar = store.get(entry.sidecar)
        if sidecar is None:
            raise SkipListCorrupt(f"{source} names {entry.sidecar}, which does not exist")
        kept.append(n - len(verify_sidecar(entry, sidecar, f"{remote}/{entry.sidecar}", n)))
    return PartitionCounts(total, sum(kept), len(shards), sum(1 for k in kept if k > 0))


def remote_version(remote: str) -> str:
    """The cache sub-directory of a resolved remote: its version name (``v-<digest16>``)."""
    last = remote.rstrip("/").rsplit("/", 1)[-1]
    return last if last.startswith("v-") else "live"


def absent_on_remote(exc: BaseException) -> bool:
    """True when streaming's S3 downloader failed because the object does not exist (404).

    streaming re-raises botocore's ``ClientError`` rather than ``FileNotFoundError``; the
    loader must tell "no manifest" (never screened: refused as such) from a failed fetch.
    Either way it refuses the directory.
    """
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    return str(response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey", "NotFound")
