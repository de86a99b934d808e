"""Garbage collection of the blob store: delete the blobs no retained version of a table
names, so replaced and deleted images stop costing storage.

Mark: every fragment of every version Lance still keeps (retention and pins decide which;
a pinned training snapshot's version is one of them) is read once, at the earliest
retained version that holds it (a fragment's deletions only grow, so that is where it
shows the most rows), for the blob-reference columns only. Sweep: a blob is deleted only
when no marked reference names it **and** its file is older than ``min_age``, measured
from when the collection started.

Why the age: a writer stores its blobs before the commit that names them. A blob it
stores anew has a fresh mtime; a blob it finds already stored is touched
(``BlobStore.put``), so it is fresh too. A commit that lands after the mark therefore only
names blobs younger than ``min_age`` unless the write took longer than ``min_age`` from
first blob to commit; ``min_age`` must exceed the longest such write (the maintenance job
uses its orphan age, at least an hour).

Memory is bounded: references are collected in passes over ranges of their first two hex
digits (sha256 spreads them evenly), each pass holding about ``max_refs_per_pass``.

Object storage is refused for now: a blob found already stored cannot be made fresh there
without rewriting its bytes, so the age rule would not protect it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.core.lab.blobs import STAGING_DIR, BlobStore
from prx_assets.core.lab.io import open_dataset

#: About this many references are held in memory at once (~100 bytes each in a set).
MAX_REFS_PER_PASS = 5_000_000
_HEX2 = [f"{i:02x}" for i in range(256)]
_HEX = frozenset("0123456789abcdef")


def _is_ref(name: str) -> bool:
    return len(name) == 64 and _HEX.issuperset(name)


@dataclass(frozen=True)
class BlobSweep:
    """What one collection of a table's blobs did."""

    table: str
    skipped: str = ""  # why nothing was collected, if so
    versions: int = 0
    fragments_read: int = 0
    passes: int = 0
    referenced: int = 0  # distinct blobs some retained version names
    examined: int = 0  # blob files looked at
    deleted: int = 0
    deleted_bytes: int = 0
    kept_young: int = 0  # unnamed, but younger than min_age (maybe a write in flight)
    temporaries_deleted: int = 0  # partial files of killed writers, older than min_age

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fragments_by_earliest_version(uri: str) -> tuple[int, list[Callable[[], Any]]]:
    """The number of retained versions and, per distinct fragment, a reader of it at the
    earliest retained version holding it."""
    latest = open_dataset(uri)
    seen: dict[int, tuple[int, lance.LanceDataset]] = {}
    versions = sorted(v["version"] for v in latest.versions())
    for version in versions:
        ds = latest.checkout_version(version)
        for fragment in ds.get_fragments():
            seen.setdefault(fragment.fragment_id, (version, ds))
    readers = [
        (lambda ds=ds, fid=fid: ds.get_fragment(fid)) for fid, (_v, ds) in sorted(seen.items())
    ]
    return len(versions), readers


def _prefix_ranges(rows: int, max_refs_per_pass: int) -> list[frozenset[str]]:
    passes = min(256, max(1, math.ceil(rows / max(1, max_refs_per_pass))))
    step = math.ceil(256 / passes)
    return [frozenset(_HEX2[i : i + step]) for i in range(0, 256, step)]


def _marked(
    fragments: Sequence[Callable[[], Any]], columns: Sequence[str], prefixes: frozenset[str]
) -> set[str]:
    out: set[str] = set()
    every = len(prefixes) == 256
    for get in fragments:
        table = get().to_table(columns=list(columns))
        for name in columns:
            refs = table.column(name).drop_null()
            if not every:
                heads = pc.utf8_slice_codeunits(refs, 0, 2)
                refs = refs.filter(pc.is_in(heads, value_set=pa.array(sorted(prefixes))))
            out.update(refs.to_pylist())
    return out


def sweep_blobs(
    uri: str,
    store: BlobStore,
    table: str,
    columns: Sequence[str],
    min_age: timedelta,
    *,
    max_refs_per_pass: int = MAX_REFS_PER_PASS,
    now: float | None = None,
) -> BlobSweep:
    """Delete ``table``'s blobs that no retained version names and that are older than
    ``min_age``. The caller holds the table's maintenance lock (no version cleanup runs
    meanwhile); a version vanishing anyway makes Lance raise, and nothing is deleted."""
    if not columns:
        return BlobSweep(table, skipped="the table has no blob columns")
    if not store.is_local:
        return BlobSweep(
            table,
            skipped="blob collection on object storage is not supported yet (a reused blob "
            "cannot be marked fresh there without rewriting it)",
        )
    cutoff = (time.time() if now is None else now) - min_age.total_seconds()
    n_versions, fragments = _fragments_by_earliest_version(uri)
    rows = sum(get().count_rows() for get in fragments)
    ranges = _prefix_ranges(rows, max_refs_per_pass)
    base = store.table_dir(table)
    referenced = examined = deleted = deleted_bytes = young = temporaries = 0
    for prefixes in ranges:
        marked = _marked(fragments, columns, prefixes)
        referenced += len(marked)
        for first in sorted(prefixes):
            top = os.path.join(base, first)
            if not os.path.isdir(top):
                continue
            for second in sorted(os.listdir(top)):
                leaf = os.path.join(top, second)
                if not os.path.isdir(leaf):
                    continue
                with os.scandir(leaf) as entries:
                    for entry in entries:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        is_blob = _is_ref(entry.name)
                        if not is_blob and not (
                            entry.name.endswith(".tmp") and _is_ref(entry.name[:64])
                        ):
                            continue  # not the store's: never touched
                        examined += 1
                        if is_blob and entry.name in marked:
                            continue
                        info = entry.stat(follow_symlinks=False)
                        if info.st_mtime >= cutoff:
                            young += 1
                            continue
                        os.unlink(entry.path)
                        if is_blob:
                            deleted += 1
                            deleted_bytes += info.st_size
                        else:
                            temporaries += 1
    # Staged values a killed writer left (``LocalBlobs.staging_path``): never a blob, never
    # renamed into place once older than ``min_age`` (a live copy is seconds old).
    staging = os.path.join(base, STAGING_DIR)
    if os.path.isdir(staging):
        with os.scandir(staging) as entries:
            for entry in entries:
                if not entry.name.endswith(".tmp") or not entry.is_file(follow_symlinks=False):
                    continue
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
                    temporaries += 1
    return BlobSweep(
        table,
        versions=n_versions,
        fragments_read=len(fragments) * len(ranges),
        passes=len(ranges),
        referenced=referenced,
        examined=examined,
        deleted=deleted,
        deleted_bytes=deleted_bytes,
        kept_young=young,
        temporaries_deleted=temporaries,
    )
