"""Find the bucket partitions of an MDS root and turn each into one skip-list stream.

Layout (written by ``prx_assets.core.shards.mds``): ``<root>/mds/<tier>/<H>x<W>/<batch>/`` holds one
``index.json`` and its shards. One stream per partition keeps shape buckets apart (a batch
must be one tensor shape) and lets the caller weight tiers, batches or whole roots (e.g. a
public and an internal root) with streaming's ``repeat`` per stream.

Where the data lives:
- ``discover_streams(root)``: ``root`` is a local directory, read in place.
- ``discover_streams(root, cache_dir=...)``: ``root`` is the *remote*; streaming copies the
  shards it needs into ``cache_dir`` and ``SkipListStream`` fetches the sidecars beside
  ``index.json``. ``root`` may be a local path or an object-store URL (``s3://``, ``gs://``,
  ``oci://``, ... anything streaming's downloaders handle, with their usual credentials).
  An ``s3://`` tree written by ``mds_shards`` is listed and each directory resolved to its
  live version (``loader/remote.py``); other URLs need ``partitions=[...]``.

Tiers are the bucket table's pixel tiers (``core/shards/buckets.py``: 512, 1024, 2048, 4096), the
directory names under ``mds/``. A filter that matches no partition at all is an error that
lists what there is (a typo must not silently train on nothing, or on everything else).

Local partitions are counted through their skip-lists, so an unscreened directory stops
discovery (``SkipListMissing``) unless ``skiplists="ignore-UNSAFE"`` is passed on purpose.
A directory a write moved away and did not put back (``.<batch>.old`` without ``<batch>``:
a write killed between its two renames) stops it too (``DirectoryMovedAway``, naming the
directory), when the filters select it: the lab still lists it, and reading only what is
there would train on less without a word. The next write of the batch restores it.

Cost: discovery lists each bucket directory once and reads one small file per partition,
its skip-list manifest (``skiplists.json``, version 2 states each shard's sample and skip
counts), so it stays a fraction of what ``StreamingDataset`` itself spends per stream at
10,000 directories. Those counts only lay the streams out (and leave fully skipped
partitions out); they are not trusted for what is yielded: ``SkipListStream`` checks the
manifest against the ``index.json`` streaming loaded and every sidecar against the manifest,
counts included, and stops on any disagreement. A version 1 manifest (no counts) is counted
the old way, through its index and sidecars.
"""

from __future__ import annotations

import hashlib
import os
import urllib.parse
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from prx_assets.core.shards.mds import (
    MDS_DIRNAME,
    SUPERSEDED_SUFFIX,
    DirectoryMovedAway,
    moved_away_batches,
    moved_away_message,
)
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    MANIFEST_BASENAME,
    Manifest,
    PartitionCounts,
    SkipListError,
    SkipListMissing,
    manifest_counts,
    parse_manifest,
    partition_counts,
    unscreened_partition_counts,
)
from prx_assets.loader.dataset import (
    IGNORE_SKIPLISTS_UNSAFE,
    REQUIRE_SKIPLISTS,
    check_skiplists_mode,
    collection_paused,
    read_whole_file,
    warn_unscreened,
)
from prx_assets.loader.remote import (
    remote_partition_counts,
    remote_partitions,
    remote_version,
    resolve_remote_partition,
)
from prx_assets.loader.streams import (
    BucketStream,
    PartitionFilter,
    natural_order,
    parse_shape,
    repeat_for,
)


def _is_url(root: str) -> bool:
    return bool(urllib.parse.urlparse(root).scheme) and not os.path.exists(root)


def _subdirs(path: str) -> list[str]:
    """Names of the visible subdirectories of ``path``, from one listing (no stat per entry
    where the file system reports entry types). Hidden entries are the writer's in-flight or
    superseded copies (``.<batch>.tmp``, ``.<batch>.old``)."""
    with os.scandir(path) as entries:
        return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())


def _bucket_entries(path: str) -> tuple[list[str], list[str]]:
    """(visible subdirectories, every entry name) of one bucket directory, one listing."""
    with os.scandir(path) as entries:
        names, dirs = [], []
        for e in entries:
            names.append(e.name)
            if not e.name.startswith(".") and e.is_dir():
                dirs.append(e.name)
    return sorted(dirs), names


def _scan(mds_root: Path) -> tuple[list[str], list[str]]:
    """``<tier>/<H>x<W>/<batch>`` of every visible batch directory, and of every directory a
    write moved away and did not put back (``.<batch>.old`` without ``<batch>``, see
    ``mds.moved_away_batches``): one listing per bucket.

    Whether a directory is a partition (has ``index.json``) is settled when it is counted,
    by the one file read there (``_local_counts``), not by a stat per directory here.
    """
    found, moved = [], []
    root = os.fspath(mds_root)
    for tier in _subdirs(root):
        for shape in _subdirs(os.path.join(root, tier)):
            parse_shape(shape)
            batches, names = _bucket_entries(os.path.join(root, tier, shape))
            found += [f"{tier}/{shape}/{b}" for b in batches]
            moved += [f"{tier}/{shape}/{b}" for b in moved_away_batches(names)]
    return found, moved


def _moved_away(mds_root: str, relpath: str) -> bool:
    """Whether an explicitly named local partition is moved away (see ``_scan``)."""
    parts = relpath.strip("/").split("/")
    if len(parts) != 3:
        return False  # refused as malformed where it is read
    bucket = os.path.join(mds_root, parts[0], parts[1])
    batch = parts[2]
    return not os.path.isdir(os.path.join(bucket, batch)) and os.path.lexists(
        os.path.join(bucket, f".{batch}{SUPERSEDED_SUFFIX}")
    )


def _local_counts(
    where: str, skiplists: str, scanned: bool
) -> tuple[PartitionCounts, tuple[bytes, Manifest] | None] | None:
    """A local partition's counts from one small file (and that file, parsed, when it is
    the manifest); None if ``where`` is not a partition.

    Screened (the default): the manifest's version 2 counts (a version 1 manifest: through
    index and sidecars). No manifest: ``SkipListMissing`` where there is an ``index.json``
    (fail closed), None where a scanned directory has neither (not a partition). Unscreened
    on purpose: the index's counts.
    """
    if skiplists == IGNORE_SKIPLISTS_UNSAFE:
        if scanned and not os.path.isfile(os.path.join(where, INDEX_BASENAME)):
            return None
        warn_unscreened(where, stacklevel=4)
        return unscreened_partition_counts(where), None
    source = f"{where}/{MANIFEST_BASENAME}"
    try:
        data = read_whole_file(source)
    except FileNotFoundError:
        if os.path.isfile(os.path.join(where, INDEX_BASENAME)):
            raise SkipListMissing(
                f"{where}: no skip-list manifest ({MANIFEST_BASENAME}); the directory was never "
                "screened (materialise skip_lists for its batch), so none of its samples may "
                f"be trained on (skiplists={IGNORE_SKIPLISTS_UNSAFE!r} reads it unscreened)"
            ) from None
        if scanned:
            return None
        raise SkipListError(f"no {INDEX_BASENAME} in {where}: not an MDS partition") from None
    manifest = parse_manifest(data, source)
    counts = manifest_counts(manifest)
    return (counts if counts is not None else partition_counts(where)), (data, manifest)


@collection_paused()  # long-lived objects per directory: dataset.collection_paused
def discover_streams(
    root: str | os.PathLike[str],
    tiers: Collection[str | int] | None = None,
    shapes: Collection[str | tuple[int, int]] | None = None,
    batches: Collection[str] | None = None,
    weights: Mapping[str, float] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    partitions: Sequence[str] | None = None,
    source: str | None = None,
    drop_empty: bool = True,
    skiplists: str = REQUIRE_SKIPLISTS,
    snapshot: str | None = None,
    pinned_changes: str = "refuse",
) -> list[BucketStream]:
    """Bucket partitions under ``root/mds`` (or ``root`` itself if it has no ``mds/``).

    Filters keep partitions whose tier (e.g. ``512``) / shape ((H, W) or ``"HxW"``) / batch
    is listed; filters that together match nothing raise ``ValueError``. ``weights`` maps
    fnmatch patterns over ``"<tier>/<H>x<W>/<batch>"`` to streaming's ``repeat`` (first match
    wins; unmatched partitions get 1). With ``drop_empty`` a local partition whose every
    sample is skipped is left out with a warning (streaming cannot hold an empty stream).
    ``skiplists="ignore-UNSAFE"`` counts local partitions without their skip-lists (and
    warns). Sorted by tier, shape, batch.

    ``snapshot``: read exactly the directories and skip-list generations training snapshot
    ``snapshot`` froze (local roots; ``prx_assets.loader.snapshots``), refusing any that
    changed unless ``pinned_changes="reproduce-UNSAFE"``.
    """
    check_skiplists_mode(skiplists)
    if snapshot is not None:
        from prx_assets.loader.snapshots import snapshot_streams

        if cache_dir is not None or partitions is not None or skiplists != REQUIRE_SKIPLISTS:
            raise ValueError("snapshot= reads a local root with its skip-lists only")
        return list(
            snapshot_streams(
                root, snapshot, tiers, shapes, batches, weights, pinned_changes=pinned_changes
            )
        )
    root_str = os.fspath(root)
    is_url = _is_url(root_str)
    if is_url and cache_dir is None:
        raise ValueError(f"{root_str} is a URL: pass cache_dir (streaming needs a local cache)")
    if is_url:
        mds_root_str = root_str.rstrip("/") + "/mds"
        relpaths = remote_partitions(root_str, partitions)
        moved: list[str] = []  # a remote directory flips in one PUT (core/shards/remote.py)
    else:
        base = Path(root_str)
        mds_root = base / "mds" if (base / "mds").is_dir() else base
        if not mds_root.is_dir():
            raise FileNotFoundError(f"no MDS root at {mds_root}")
        mds_root_str = str(mds_root)
        if partitions is not None:
            relpaths, moved = (
                list(partitions),
                [p for p in partitions if _moved_away(mds_root_str, p)],
            )
        else:
            relpaths, moved = _scan(mds_root)

    wanted = PartitionFilter.of(tiers, shapes, batches)
    cache_tag = source or hashlib.blake2s(root_str.encode(), digest_size=4).hexdigest()

    _refuse_moved_away(mds_root_str, moved, wanted)
    out: list[BucketStream] = []
    matched = 0
    for relpath in relpaths:
        parts = relpath.strip("/").split("/")
        if len(parts) != 3:
            raise ValueError(f"partition {relpath!r} is not <tier>/<H>x<W>/<batch>")
        tier, shape_name, batch = parts
        shape = parse_shape(shape_name)
        if not wanted.selects(tier, shape_name, batch):
            continue
        where = f"{mds_root_str}/{relpath}" if is_url else os.path.join(mds_root_str, relpath)
        counts, manifest = None, None
        if is_url:  # the live version on s3:// (counted through its skip-lists)
            where = resolve_remote_partition(mds_root_str, relpath)
            counts = remote_partition_counts(where, skiplists)
        else:
            local = _local_counts(where, skiplists, scanned=partitions is None)
            if local is None:
                continue  # a scanned directory holding no partition
            counts, manifest = local
        matched += 1
        if counts is not None and counts.kept_samples == 0 and drop_empty:
            warnings.warn(
                f"{where}: all {counts.samples} samples are skipped; partition left out",
                stacklevel=2,
            )
            continue
        if cache_dir is None:
            remote, local = None, where
        elif is_url:  # cached under the version's own name: a flip never meets a stale index
            remote = where
            local = os.path.join(os.fspath(cache_dir), cache_tag, relpath, remote_version(remote))
        else:
            remote, local = where, os.path.join(os.fspath(cache_dir), cache_tag, relpath)
        out.append(
            BucketStream(
                relpath=relpath,
                tier=tier,
                height=shape[0],
                width=shape[1],
                batch=batch,
                local=local,
                remote=remote,
                repeat=repeat_for(relpath, weights),
                source=source,
                counts=counts,
                manifest=manifest if cache_dir is None else None,
            )
        )
    if relpaths and not matched and (tiers, shapes, batches) != (None, None, None):
        raise ValueError(_nothing_matched(mds_root_str, relpaths, tiers, shapes, batches))
    out.sort(
        key=lambda b: (
            natural_order(b.tier),
            b.height,
            b.width,
            natural_order(b.batch),
            b.source or "",
        )
    )
    return out


def _refuse_moved_away(mds_root: str, moved: Sequence[str], wanted: PartitionFilter) -> None:
    """``DirectoryMovedAway`` when a partition the filters select is moved away."""
    hit = [
        f"{MDS_DIRNAME}/{relpath.strip('/')}"
        for relpath in moved
        if wanted.selects(*relpath.strip("/").split("/"))
    ]
    if hit:
        raise DirectoryMovedAway(moved_away_message(mds_root, sorted(hit)))


def _nothing_matched(
    root: str,
    relpaths: Sequence[str],
    tiers: Collection[str | int] | None,
    shapes: Collection[str | tuple[int, int]] | None,
    batches: Collection[str] | None,
) -> str:
    parts = [p.strip("/").split("/") for p in relpaths]
    have = {
        "tiers": sorted({p[0] for p in parts if len(p) == 3}, key=natural_order),
        "shapes": sorted({p[1] for p in parts if len(p) == 3}),
        "batches": sorted({p[2] for p in parts if len(p) == 3}, key=natural_order),
    }
    asked = {"tiers": tiers, "shapes": shapes, "batches": batches}
    wanted = ", ".join(f"{k}={sorted(map(str, v))}" for k, v in asked.items() if v is not None)
    found = "; ".join(f"{k} {v[:20]}" for k, v in have.items())
    return f"no partition under {root} matches {wanted}; there are {found}"


def group_by_shape(buckets: Sequence[BucketStream]) -> dict[str, list[BucketStream]]:
    """Buckets of the same (H, W), whatever their tier, batch or source, train together."""
    groups: dict[str, list[BucketStream]] = {}
    for b in sorted(buckets, key=lambda b: (b.height, b.width)):
        groups.setdefault(b.shape_name, []).append(b)
    return groups
