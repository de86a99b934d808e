"""Write one ingest partition's samples as mosaicml-streaming (MDS) directories, per bucket.

Layout: ``<root>/mds/<tier>/<H>x<W>/<batch>/`` holds ``index.json`` and ``shard.NNNNN.mds``
for the samples of partition ``batch`` that landed in that bucket. One directory per
(bucket, partition) lets a partition be rewritten without touching any other, and lets the
trainer build a stream per bucket from the directories it finds.

Atomicity: a directory is written under a hidden temporary sibling (``.<batch>.tmp``):
shards and ``index.json``, then its first skip-list generation
(``core/skiplists/sidecars.py``: sidecars + ``skiplists.json``) from the caller's ``skips_for``
callback, all fsynced, then renamed into place; a previous version is first renamed away
(``.<batch>.old``) and deleted after the new one is in. A reader of the final path
therefore sees the old complete directory, the new complete one, or (only in the instant
between the two renames, or after a crash there) nothing; never a partial one, and never
one without a complete skip-list generation written for its own ``index.json``. Readers
that list the tree (``discover_streams``, ``create_snapshot``) refuse it while a
``.<batch>.old`` is there without its ``<batch>`` (:func:`moved_away_batches`), so "nothing"
never passes for "no such directory". The next write of the same partition repairs such a
crash: it restores the old version if the final path is empty and deletes leftover
temporaries.

Recovery is O(1) in the bucket's other directories: a partition's temporaries have fixed
names (``.<batch>.tmp``, ``.<batch>.old``; they cannot collide with another batch's, nor with
a final name, which never starts with ``.``), so a write looks up its own two names and never
lists the bucket, however many batches it holds. A superseded ``.<batch>.old`` is condemned
before it is deleted (its ``index.json`` unlinked and the unlink made durable), so a kill
half-way through the deletion can never get a partial copy restored: only an ``.old`` that
still has its ``index.json`` was complete, and only such a one is put back.

Screening: this module knows nothing of the skip policy. ``skips_for(placements)`` gets the
placements of one directory (final ``relative_dir``, shard, index in shard) once its shards
are written, and returns ``{shard: {index_in_shard: [reason codes]}}``; ``skip_nothing`` is
the explicit choice for data that needs no screening (tests, benchmarks, synthetic data).

Published, not plain: ``index.json`` is MDSWriter's with its top-level version replaced by
``published.PUBLISHED_INDEX_VERSION``, so a plain ``streaming.StreamingDataset`` refuses the
directory (naming ``prx_assets.loader``) instead of yielding the samples its skip-lists
exclude (``core/shards/published.py``).

Determinism: samples are written sorted by key, with no compression, and MDSWriter puts no
timestamps or paths into shards or ``index.json`` (its JSON is key-sorted), so rewriting the
same samples gives byte-identical files.

Written by workers (``StagedPartition``, ``write_piece_shards``; what ``mds_shards`` uses,
``core/shards/pieces.py``): each worker encodes a piece of a bucket's samples into its own
shard file(s) inside the directory's staging location (``.<batch>.tmp/<token>/``); the step
renames them to ``shard.NNNNN.mds`` in piece order, writes the merged ``index.json`` (the
entries MDSWriter made, the same bytes as one MDSWriter would write for those shards) and
then follows the same rules as above: screened, fsynced, renamed into place.

Not for concurrent writers of the same partition (one run per partition at a time).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prx_assets.core.crashpoints import crashpoint
from prx_assets.core.durable import fsync_path, fsync_tree
from prx_assets.core.shards.mds_format import MDSShardWriter
from prx_assets.core.shards.published import mark_published
from prx_assets.core.skiplists.sidecars import write_partition_skiplists
from prx_assets.core.snapshots.pins import discard_directory

MDS_DIRNAME = "mds"
DEFAULT_SIZE_LIMIT = 128 << 20  # 128 MiB per shard, MDSWriter's ``size_limit``
# 'bytes', not 'jpeg': the JPEG is encoded once by us (q92, fixed subsampling) and stored
# verbatim. MDS's 'jpeg' encoding would re-encode any in-memory image at Pillow's default
# q75, and its reader returns a lazily decoded PIL image, while trainers usually want the
# raw bytes for their own (often GPU) decoder. The bytes on disk are identical either way.
BASE_COLUMNS: dict[str, str] = {
    "image": "bytes",
    "caption": "str",
    "key": "str",
    "orig_width": "int",
    "orig_height": "int",
    "tier": "int",
    "shape": "str",
    "source": "str",
    "license": "str",
}
_BATCH_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.=\-]*$")
_SHAPE_RE = re.compile(r"^(\d+)x(\d+)$")
_TMP_SUFFIX = ".tmp"  # ".<batch>.tmp": the directory being written
_OLD_SUFFIX = ".old"  # ".<batch>.old": the previous version, renamed away
SUPERSEDED_SUFFIX = _OLD_SUFFIX  # readers look for ".<batch>" + this (moved_away_batches)


@dataclass(frozen=True)
class MDSSample:
    """One training sample as it goes into a shard. ``shape`` is ``"<H>x<W>"``."""

    key: str
    image: bytes
    caption: str
    orig_width: int
    orig_height: int
    tier: int
    shape: str
    source: str
    license: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where a sample was written: enough to find it again without reading shards."""

    key: str
    tier: int
    shape: str
    batch: str
    shard: str  # e.g. "shard.00000.mds"
    index_in_shard: int  # 0-based within ``shard``
    sample_index: int  # 0-based within the partition directory (what StreamingDataset sees)

    @property
    def relative_dir(self) -> str:
        return relative_partition_dir(self.tier, self.shape, self.batch)


SkipsFor = Callable[[Sequence["Placement"]], Mapping[str, Mapping[int, Iterable[str]]]]


def skip_nothing(placements: Sequence[Placement]) -> dict[str, dict[int, list[str]]]:
    """A ``skips_for`` that screens every sample in: only for data that needs no decision."""
    return {}


@dataclass(frozen=True)
class PartitionDir:
    """One bucket x batch directory of the MDS tree: its tier, its shape and where it is."""

    tier: int
    shape: str
    path: Path

    @property
    def relative_dir(self) -> str:
        """``mds/<tier>/<H>x<W>/<batch>``: how ``shard_samples`` and skip decisions name it."""
        return relative_partition_dir(self.tier, self.shape, self.path.name)


def _check_batch(batch: str) -> None:
    if not isinstance(batch, str) or not _BATCH_RE.match(batch) or ".." in batch:
        raise ValueError(
            f"batch {batch!r} is not a safe directory name "
            "(letters, digits, '_', '-', '.', '='; not starting with '.'; no '..')"
        )


def _check_shape(shape: str) -> None:
    if not _SHAPE_RE.match(shape):
        raise ValueError(f"shape {shape!r} is not of the form '<H>x<W>'")


def bucket_dir(root: str | os.PathLike[str], tier: int, shape: str) -> Path:
    """``<root>/mds/<tier>/<H>x<W>``: the directory holding every partition of a bucket."""
    _check_shape(shape)
    return Path(root) / MDS_DIRNAME / str(int(tier)) / shape


def relative_partition_dir(tier: int, shape: str, batch: str) -> str:
    """``mds/<tier>/<H>x<W>/<batch>``: one partition's directory relative to the shards root.

    The one spelling of the layout: ``shard_samples.relative_dir``, skip decisions, sidecar
    paths and metadata all name a directory by this string.
    """
    _check_batch(batch)
    _check_shape(shape)
    return f"{MDS_DIRNAME}/{int(tier)}/{shape}/{batch}"


def partition_dir(root: str | os.PathLike[str], tier: int, shape: str, batch: str) -> Path:
    return Path(root) / relative_partition_dir(tier, shape, batch)


def _makedirs_durable(path: Path) -> None:
    """mkdir -p, fsyncing each parent whose entry we created, so the rename survives a crash."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_path(d.parent)


def _temporary_dir(bucket: Path, batch: str) -> Path:
    """Where ``batch``'s next version of this bucket is written before it is renamed in."""
    return bucket / f".{batch}{_TMP_SUFFIX}"


def _superseded_dir(bucket: Path, batch: str) -> Path:
    """Where ``batch``'s previous version of this bucket waits while the new one goes in."""
    return bucket / f".{batch}{_OLD_SUFFIX}"


class DirectoryMovedAway(RuntimeError):
    """A bucket directory a write moved away and did not put back: readers refuse the tree.

    Why: the lab still lists the directory while the tree lacks it, so a reader that listed
    only what is there would train on less without a word. The next write of the batch (its
    first step, :func:`recover_partition`) puts the directory back or finishes replacing it.
    """


def superseded_batch(name: str) -> str | None:
    """The batch whose moved-away directory ``name`` is (``.<batch>.old``), else None."""
    if not (name.startswith(".") and name.endswith(_OLD_SUFFIX)):
        return None
    batch = name[1 : -len(_OLD_SUFFIX)]
    return batch if _BATCH_RE.match(batch) and ".." not in batch else None


def moved_away_batches(names: Iterable[str]) -> list[str]:
    """Batches whose directory is moved away and not back, from one bucket's entry names.

    ``names``: every entry of one ``<tier>/<H>x<W>`` directory, hidden ones included (one
    listing). A batch is moved away while ``.<batch>.old`` is there and ``<batch>`` is not:
    a write killed between its two renames (or a removal of a directory the partition lost,
    killed before it finished), or one running right now. Its lab rows still name the
    directory, so a reader must not take the tree as complete.
    """
    present = set(names)
    return sorted(b for n in present if (b := superseded_batch(n)) is not None and b not in present)


def moved_away_message(root: str, relative_dirs: Sequence[str]) -> str:
    """The refusal for readers that found moved-away directories (names bounded, quoted)."""
    shown = ", ".join(repr(r[:200]) for r in relative_dirs[:10])
    more = f" and {len(relative_dirs) - 10} more" if len(relative_dirs) > 10 else ""
    batches = sorted({r.rsplit("/", 1)[-1][:120] for r in relative_dirs})[:10]
    return (
        f"{root[:300]}: {len(relative_dirs)} directories were moved away by a write that did "
        f"not finish (killed, or still running) and are not back: {shown}{more}. The lab "
        "still lists them, so reading this tree now would train on less than it should. "
        f"Rerun mds_shards for batch(es) {batches}: the write first restores each directory "
        "(or completes its replacement); then read again."
    )


def _discard_superseded(old: Path) -> None:
    """Delete a renamed-away version so that no kill part-way can get it restored.

    Its ``index.json`` goes first, durably: from then on the copy is incomplete by the rule
    ``_recover`` applies (restore only an ``.old`` that still has its ``index.json``), whatever
    order the rest is deleted in.
    """
    index = old / "index.json"
    if index.is_file():
        index.unlink()
        fsync_path(old)
        crashpoint("mds.old_condemned")
    shutil.rmtree(old)


def _recover(bucket: Path, batch: str) -> None:
    """Undo the leftovers of a crashed write of ``batch`` in one bucket directory.

    Looks up ``batch``'s two fixed temporary names only: never lists the bucket.
    """
    tmp = _temporary_dir(bucket, batch)
    if tmp.exists():
        shutil.rmtree(tmp)
    old = _superseded_dir(bucket, batch)
    if not old.exists():
        return
    final = bucket / batch
    # An ".old" copy was complete when it was renamed away; if nothing replaced it, the
    # crash hit between the two renames: put it back (unless its deletion had begun).
    if not final.exists() and (old / "index.json").is_file():
        os.rename(old, final)
        fsync_path(bucket)
    else:
        _discard(old, final)


def _bucket_dirs(root: str | os.PathLike[str]) -> list[tuple[int, str, Path]]:
    base = Path(root) / MDS_DIRNAME
    if not base.is_dir():
        return []
    found = []
    for tier_dir in base.iterdir():
        if not (tier_dir.is_dir() and tier_dir.name.isdigit()):
            continue
        for shape_dir in tier_dir.iterdir():
            if shape_dir.is_dir() and _SHAPE_RE.match(shape_dir.name):
                found.append((int(tier_dir.name), shape_dir.name, shape_dir))
    return sorted(found, key=lambda t: (t[0], _shape_key(t[1])))


def recover_partition(root: str | os.PathLike[str], batch: str) -> None:
    """Repair what a crashed write of ``batch`` left behind, in every bucket.

    Restores a previous version renamed away but never replaced, deletes temporaries.
    Every write of the partition calls this first. O(buckets): each bucket is checked for
    ``batch``'s own temporary names, none is listed.
    """
    _check_batch(batch)
    for _, _, bucket in _bucket_dirs(root):
        _recover(bucket, batch)


def _remove_atomically(final: Path) -> None:
    """Take a directory away in one step (rename), then delete it at leisure."""
    bucket, batch = final.parent, final.name
    old = _superseded_dir(bucket, batch)
    if old.exists():  # a leftover the partition's recovery already judged superseded
        _discard(old, final)
    os.rename(final, old)
    fsync_path(bucket)
    crashpoint("mds.stale_dir_moved_away")
    _discard(old, final)


def _discard(old: Path, final: Path) -> None:
    """Delete a superseded copy of ``final`` (index first, see :func:`_discard_superseded`),
    unless a live training snapshot pins it: then it is kept under ``<root>/retained/``
    (core/snapshots/pins.py; never read by discovery)."""
    root = final.parents[3]  # <root>/mds/<tier>/<H>x<W>/<batch>
    discard_directory(old, root, final.relative_to(root).as_posix(), remove=_discard_superseded)


def _columns(extra_columns: Mapping[str, str] | None) -> dict[str, str]:
    columns = dict(BASE_COLUMNS)
    for name, encoding in (extra_columns or {}).items():
        if name in BASE_COLUMNS:
            raise ValueError(f"extra column {name!r} collides with a base column")
        columns[name] = encoding
    return columns


def _row(sample: MDSSample, extra_names: set[str]) -> dict[str, Any]:
    if set(sample.extra) != extra_names:
        raise ValueError(
            f"sample {sample.key!r} has extra fields {sorted(sample.extra)}, "
            f"expected exactly {sorted(extra_names)}"
        )
    if not isinstance(sample.image, bytes | bytearray) or not sample.image:
        raise ValueError(f"sample {sample.key!r} has no image bytes")
    return {
        "image": bytes(sample.image),
        "caption": str(sample.caption),
        "key": str(sample.key),
        "orig_width": int(sample.orig_width),
        "orig_height": int(sample.orig_height),
        "tier": int(sample.tier),
        "shape": str(sample.shape),
        "source": str(sample.source),
        "license": str(sample.license),
        **sample.extra,
    }


def _placements(
    directory: Path, keys: Sequence[str], tier: int, shape: str, batch: str
) -> list[Placement]:
    index = json.loads((directory / "index.json").read_text())
    out: list[Placement] = []
    g = 0
    for shard in index["shards"]:
        name = shard["raw_data"]["basename"]
        for i in range(int(shard["samples"])):
            out.append(Placement(keys[g], tier, shape, batch, name, i, g))
            g += 1
    if g != len(keys):
        raise RuntimeError(f"index.json in {directory} lists {g} samples, wrote {len(keys)}")
    return out


def _write_mds(
    out: Path,
    samples: Iterable[MDSSample],
    columns: dict[str, str],
    size_limit: int,
    hashes: Sequence[str],
    tier: int,
    shape: str,
    taken: Set[str] = frozenset(),
) -> list[str]:
    """Stream ``samples`` (strictly increasing keys) into an MDS directory; the keys written.

    Samples are encoded one at a time, so only the shard being filled is held in memory.
    ``taken``: keys already written to another bucket of the partition (refused).
    """
    extra_names = set(columns) - set(BASE_COLUMNS)
    # JPEG bytes do not compress: no compression keeps shards readable by mmap
    writer = MDSShardWriter(out, columns, hashes, size_limit)
    keys: list[str] = []
    for s in samples:
        if s.tier != tier or s.shape != shape:
            raise ValueError(
                f"sample {s.key!r} is for bucket {s.tier}/{s.shape}, not {tier}/{shape}"
            )
        if s.key in taken:
            raise ValueError(
                f"sample key {s.key!r} appears in more than one bucket (again in {tier}/{shape})"
            )
        if keys and s.key <= keys[-1]:
            raise ValueError(
                f"sample keys must be strictly increasing: {s.key!r} after {keys[-1]!r} "
                "(duplicate sample key or unsorted stream)"
            )
        writer.write(_row(s, extra_names))  # refuses a sample larger than a shard
        keys.append(s.key)
        crashpoint("mds.sample_written")
    writer.finish(write_index=True)
    if keys:
        mark_published(out)  # plain streaming refuses it from here on (core/shards/published.py)
    return keys


def _stream_bucket(
    root: str | os.PathLike[str],
    batch: str,
    tier: int,
    shape: str,
    samples: Iterable[MDSSample],
    columns: dict[str, str],
    size_limit: int,
    hashes: Sequence[str],
    skips_for: SkipsFor,
    taken: Set[str] = frozenset(),
) -> list[Placement]:
    """Write one bucket directory from a key-sorted stream; an empty stream removes it."""
    if size_limit <= 0:
        raise ValueError(f"size_limit must be positive, got {size_limit}")
    final = partition_dir(root, tier, shape, batch)
    bucket = final.parent
    _makedirs_durable(bucket)
    _recover(bucket, batch)
    tmp = _temporary_dir(bucket, batch)
    try:
        keys = _write_mds(tmp, samples, columns, size_limit, hashes, tier, shape, taken)
        if not keys:
            if final.exists():
                _remove_atomically(final)
            return []
        fsync_tree(tmp)
        crashpoint("mds.tmp_written")
        placements = _placements(tmp, keys, tier, shape, batch)
        # The first skip-list generation, inside the temporary directory: the directory
        # never becomes visible unscreened.
        write_partition_skiplists(tmp, skips_for(placements))
        crashpoint("mds.tmp_screened")
        _swap_in(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return placements


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename a complete, screened, fsynced directory into place (the previous version
    renamed away first, deleted after the new one is in; module docstring)."""
    bucket, batch = final.parent, final.name
    if final.exists():
        old = _superseded_dir(bucket, batch)
        os.rename(final, old)
        crashpoint("mds.old_moved_away")
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)  # put the complete previous version back
            raise
        fsync_path(bucket)
        crashpoint("mds.dir_in_place")
        _discard(old, final)
    else:
        os.rename(tmp, final)
        fsync_path(bucket)
        crashpoint("mds.dir_in_place")


def write_bucket_partition(
    root: str | os.PathLike[str],
    batch: str,
    tier: int,
    shape: str,
    samples: Iterable[MDSSample],
    *,
    skips_for: SkipsFor,
    extra_columns: Mapping[str, str] | None = None,
    size_limit: int = DEFAULT_SIZE_LIMIT,
    hashes: Sequence[str] = (),
) -> list[Placement]:
    """Atomically (re)write ``<root>/mds/<tier>/<shape>/<batch>/``; placements in write order.

    ``extra_columns``: name -> MDS encoding; every sample's ``extra`` must have exactly
    these keys. ``hashes``: optional MDS shard hash algorithms recorded in index.json.
    Holds every sample in memory to sort them; ``write_partition_streams`` does not.
    """
    partition_dir(root, tier, shape, batch)  # validates batch and shape before anything else
    items = sorted(samples, key=lambda s: s.key)
    if not items:
        raise ValueError(f"no samples for bucket {tier}/{shape} of batch {batch!r}")
    keys = [s.key for s in items]
    dupes = sorted({k for k, n in zip(keys, keys[1:], strict=False) if k == n})
    if dupes:
        raise ValueError(f"duplicate sample keys in batch {batch!r}: {dupes[:5]}")
    for s in items:
        if s.tier != tier or s.shape != shape:
            raise ValueError(
                f"sample {s.key!r} is for bucket {s.tier}/{s.shape}, not {tier}/{shape}"
            )
    columns = _columns(extra_columns)
    extra_names = set(columns) - set(BASE_COLUMNS)
    for s in items:
        _row(s, extra_names)  # refuse bad samples before the write starts
    return _stream_bucket(root, batch, tier, shape, items, columns, size_limit, hashes, skips_for)


def list_partition_dirs(root: str | os.PathLike[str], batch: str) -> list[PartitionDir]:
    """Every complete directory of ``batch`` under ``<root>/mds``, ordered by tier and shape."""
    _check_batch(batch)
    return [
        PartitionDir(tier, shape, bucket / batch)
        for tier, shape, bucket in _bucket_dirs(root)
        if (bucket / batch / "index.json").is_file()
    ]


def _shape_key(shape: str) -> tuple[int, int]:
    m = _SHAPE_RE.match(shape)
    assert m is not None
    return int(m.group(1)), int(m.group(2))


def bucket_order(buckets: Iterable[tuple[int, str]]) -> list[tuple[int, str]]:
    """The order ``write_partition_streams`` writes buckets in (tier, then shape): a
    producer that renders every bucket in one stream must yield them in this order."""
    return sorted(buckets, key=lambda g: (int(g[0]), _shape_key(g[1])))


def write_partition_streams(
    root: str | os.PathLike[str],
    batch: str,
    streams: Mapping[tuple[int, str], Iterable[MDSSample]],
    *,
    skips_for: SkipsFor,
    extra_columns: Mapping[str, str] | None = None,
    size_limit: int = DEFAULT_SIZE_LIMIT,
    hashes: Sequence[str] = (),
) -> list[Placement]:
    """Write every bucket of one partition from lazy, key-sorted streams, one at a time.

    ``streams`` maps (tier, "<H>x<W>") to an iterable of that bucket's samples in strictly
    increasing key order (checked while writing; a violation fails that bucket, leaving its
    previous version in place). Each stream is consumed only while its bucket is written,
    so a generator that renders images on demand keeps memory to one shard plus whatever
    it buffers; buckets are written in ``bucket_order``, so one producer may feed every
    stream from a single pipeline that runs ahead into the next bucket. A stream that yields nothing, and every bucket of ``batch`` absent from
    ``streams``, loses its directory. New directories are written before stale ones are
    removed, so a crash in between can leave an image in two buckets until the rerun, but
    never in none. The same key in two buckets is refused before the second one is in place.
    ``skips_for`` screens each directory before it becomes visible (module docstring).
    """
    _check_batch(batch)
    if size_limit <= 0:
        raise ValueError(f"size_limit must be positive, got {size_limit}")
    for _tier, shape in streams:
        _check_shape(shape)
    columns = _columns(extra_columns)
    recover_partition(root, batch)
    placements: list[Placement] = []
    seen: set[str] = set()
    written: set[tuple[int, str]] = set()
    for tier, shape in bucket_order(streams):
        out = _stream_bucket(
            root,
            batch,
            int(tier),
            shape,
            streams[(tier, shape)],
            columns,
            size_limit,
            hashes,
            skips_for,
            taken=seen,
        )
        seen.update(p.key for p in out)
        if out:
            written.add((int(tier), shape))
        placements += out
    for d in list_partition_dirs(root, batch):
        if (d.tier, d.shape) not in written:
            _remove_atomically(d.path)
    return placements


def write_partition_buckets(
    root: str | os.PathLike[str],
    batch: str,
    samples: Iterable[MDSSample],
    *,
    skips_for: SkipsFor,
    extra_columns: Mapping[str, str] | None = None,
    size_limit: int = DEFAULT_SIZE_LIMIT,
    hashes: Sequence[str] = (),
) -> list[Placement]:
    """Write every bucket of one partition from samples held in memory (any order).

    See ``write_partition_streams`` for the guarantees; this one groups and sorts first.
    """
    _check_batch(batch)
    groups: dict[tuple[int, str], list[MDSSample]] = {}
    seen: set[str] = set()
    for s in samples:
        if s.key in seen:
            raise ValueError(f"duplicate sample key {s.key!r} in batch {batch!r}")
        seen.add(s.key)
        _check_shape(s.shape)
        groups.setdefault((int(s.tier), s.shape), []).append(s)
    streams = {g: sorted(items, key=lambda s: s.key) for g, items in groups.items()}
    return write_partition_streams(
        root,
        batch,
        streams,
        skips_for=skips_for,
        extra_columns=extra_columns,
        size_limit=size_limit,
        hashes=hashes,
    )


def partition_digest(directory: str | os.PathLike[str]) -> str:
    """sha256 identifying the exact content of one written partition directory.

    It is the hash of ``index.json`` when every shard's sha256 is recorded there (the
    index then commits to the shard bytes), else of ``index.json`` and every shard's bytes.
    An audit compares it with the digest recorded at write time to detect a rewrite.
    """
    directory = Path(directory)
    raw = (directory / "index.json").read_bytes()
    h = hashlib.sha256(raw)
    shards = json.loads(raw)["shards"]
    if all("sha256" in (s["raw_data"].get("hashes") or {}) for s in shards):
        return h.hexdigest()
    for s in shards:
        name = s["raw_data"]["basename"]
        h.update(b"\0" + name.encode() + b"\0")
        with open(directory / name, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def directory_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes of the regular files directly inside ``directory`` (shards, index, skip-lists)."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


# --------------------------------------------------------------------------- worker pieces


def write_piece_shards(
    out: Path,
    samples: Iterable[MDSSample],
    columns: dict[str, str],
    size_limit: int,
    hashes: Sequence[str],
) -> list[tuple[dict[str, Any], int]]:
    """Encode one piece's samples (strictly increasing keys) as MDS shard files in the new
    directory ``out``, exactly as MDSWriter encodes a directory (``mds_format``); each shard's index entry
    and sample count, in order (no ``index.json`` is kept: the step merges the entries).

    Run by a worker (``core/shards/pieces.py``); a sample too large for a whole shard is
    refused (``ValueError``), as by the step's writer.
    """
    if size_limit <= 0:
        raise ValueError(f"size_limit must be positive, got {size_limit}")
    extra_names = set(columns) - set(BASE_COLUMNS)
    writer = MDSShardWriter(out, columns, hashes, size_limit)
    last: str | None = None
    for s in samples:
        if last is not None and s.key <= last:
            raise ValueError(
                f"sample keys must be strictly increasing: {s.key!r} after {last!r} "
                "(duplicate sample key or unsorted stream)"
            )
        writer.write(_row(s, extra_names))
        last = s.key
    return [(dict(entry), int(entry["samples"])) for entry in writer.finish()]


def published_index_bytes(entries: Sequence[Mapping[str, Any]]) -> bytes:
    """The ``index.json`` of a directory with these shard entries, as ``mark_published``
    leaves MDSWriter's (key-sorted JSON, the published version): the same bytes."""
    from prx_assets.core.shards.published import PUBLISHED_INDEX_VERSION

    return json.dumps(
        {"shards": list(entries), "version": PUBLISHED_INDEX_VERSION}, sort_keys=True
    ).encode()


def shard_name(number: int) -> str:
    """A committed shard's file name: numbered through the directory, as MDSWriter names."""
    return f"shard.{number:05}.mds"


@dataclass(frozen=True)
class StagedShardRef:
    """A shard a worker staged (name in the staging location) and what the index says."""

    staged: str
    samples: int
    entry: Mapping[str, Any]
    data: bytes | None = None  # the bytes, when the worker could not reach the staging


@dataclass
class CommittedDir:
    """One directory ``StagedPartition.commit`` put in place."""

    placements: list[Placement]
    shards: dict[str, str]  # committed name -> staged name (what object storage copies)
    shard_bytes: int


class StagedPartition:
    """One partition's bucket directories, written by workers and committed here, one by one.

    Staging: for every planned bucket, ``<bucket>/.<batch>.tmp/<token>/`` (``token`` new per
    run), the directory that is renamed into place. Workers put their piece shards there
    (``staging(tier, shape)``), or, for a tree on object storage, in a staging prefix of
    the remote while this local directory gets only the index and skip-lists. ``commit``
    renames the staged files to ``shard.NNNNN.mds`` in piece order, writes the merged
    ``index.json`` and the first skip-list generation, fsyncs and renames the directory
    into place (``_swap_in``: the crash contract of the module docstring). ``finish``
    removes the directories of the batch no bucket wrote.

    A killed run leaves ``.<batch>.tmp``: the next run's ``recover_partition`` deletes it,
    and a worker of the killed run still writing finds its staging directory gone (workers
    never create it) instead of writing into the rerun's.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        batch: str,
        buckets: Iterable[tuple[int, str]],
        *,
        extra_columns: Mapping[str, str] | None = None,
        size_limit: int = DEFAULT_SIZE_LIMIT,
    ) -> None:
        _check_batch(batch)
        if size_limit <= 0:
            raise ValueError(f"size_limit must be positive, got {size_limit}")
        self.root = root
        self.batch = batch
        self.columns = _columns(extra_columns)
        self.size_limit = size_limit
        self.token = uuid.uuid4().hex[:16]
        self.taken: set[str] = set()
        self.written: set[tuple[int, str]] = set()
        recover_partition(root, batch)
        self._staging: dict[tuple[int, str], Path] = {}
        for tier, shape in bucket_order(buckets):
            bucket = bucket_dir(root, tier, shape)
            _makedirs_durable(bucket)
            tmp = _temporary_dir(bucket, batch)
            tmp.mkdir()
            (tmp / self.token).mkdir()
            self._staging[(int(tier), shape)] = tmp / self.token

    def staging(self, tier: int, shape: str) -> Path:
        return self._staging[(int(tier), shape)]

    def commit(
        self,
        tier: int,
        shape: str,
        shards: Sequence[StagedShardRef],
        keys: Sequence[str],
        *,
        skips_for: SkipsFor,
        local_shards: bool = True,
    ) -> CommittedDir:
        """Put one bucket directory in place from its staged shards (piece order) and the
        keys they hold (in order); an empty one removes the directory.

        ``local_shards`` False: the shard files are on object storage (this directory gets
        the index and skip-lists only; ``RemoteShardTree.publish_shards`` copies them).
        """
        tier = int(tier)
        tmp = self.staging(tier, shape)
        final = partition_dir(self.root, tier, shape, self.batch)
        try:
            self._check_keys(tier, shape, keys)
            if sum(s.samples for s in shards) != len(keys):
                raise RuntimeError(
                    f"bucket {tier}/{shape}: the staged shards hold "
                    f"{sum(s.samples for s in shards)} samples, the pieces reported {len(keys)}"
                )
            if not keys:
                if final.exists():
                    _remove_atomically(final)
                return CommittedDir([], {}, 0)
            names: dict[str, str] = {}
            entries = []
            for number, s in enumerate(shards):
                name = shard_name(number)
                names[name] = s.staged
                entry = json.loads(json.dumps(s.entry))
                entry["raw_data"]["basename"] = name
                entries.append(entry)
                if s.data is not None:
                    with open(tmp / name, "wb") as fh:  # the fallback: bytes came back
                        fh.write(s.data)
                elif local_shards:
                    os.rename(tmp / s.staged, tmp / name)
            self._drop_leftovers(tmp, set(names) if local_shards else set())
            (tmp / "index.json").write_bytes(published_index_bytes(entries))
            fsync_tree(tmp)
            crashpoint("mds.tmp_written")
            placements = _placements(tmp, list(keys), tier, shape, self.batch)
            write_partition_skiplists(tmp, skips_for(placements))
            crashpoint("mds.tmp_screened")
            _swap_in(tmp, final)
            self.taken.update(keys)
            self.written.add((tier, shape))
            size = sum(int(e["raw_data"]["bytes"]) for e in entries)
            return CommittedDir(placements, names, size)
        finally:
            shutil.rmtree(tmp.parent, ignore_errors=True)

    def _check_keys(self, tier: int, shape: str, keys: Sequence[str]) -> None:
        for prev, key in zip(keys, keys[1:], strict=False):
            if key <= prev:
                raise ValueError(
                    f"sample keys must be strictly increasing: {key!r} after {prev!r} "
                    "(duplicate sample key or unsorted stream)"
                )
        for key in keys:
            if key in self.taken:
                raise ValueError(
                    f"sample key {key!r} appears in more than one bucket (again in {tier}/{shape})"
                )

    @staticmethod
    def _drop_leftovers(tmp: Path, keep: Set[str]) -> None:
        """What a retried or abandoned piece attempt left in the staging directory."""
        for p in tmp.iterdir():
            if p.name in keep:
                continue
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()

    def finish(self) -> None:
        """Remove the batch's directories that this run did not write (stale buckets)."""
        for d in list_partition_dirs(self.root, self.batch):
            if (d.tier, d.shape) not in self.written:
                _remove_atomically(d.path)

    def discard(self) -> None:
        """Delete every staging directory left (a failed run); the rerun would too."""
        for tmp in self._staging.values():
            shutil.rmtree(tmp.parent, ignore_errors=True)
