"""Write one ingest partition's samples as mosaicml-streaming (MDS) directories, per bucket.

Layout: ``<root>/mds/<tier>/<H>x<W>/<batch>/`` holds ``index.json`` and ``shard.NNNNN.mds``
for the samples of partition ``batch`` that landed in that bucket. One directory per
(bucket, partition) lets a partition be rewritten without touching any other, and lets the
trainer build a stream per bucket from the directories it finds.

Atomicity: a directory is written under a hidden temporary sibling
(``.<batch>.tmp-<uuid>``), fsynced, then renamed into place; a previous version is first
renamed away (``.<batch>.old-<uuid>``) and deleted after the new one is in. A reader of the
final path therefore sees the old complete directory, the new complete one, or (only in the
instant between the two renames, or after a crash there) nothing; never a partial one.
The next write of the same partition repairs such a crash: it restores the old version if
the final path is empty and deletes leftover temporaries.

Determinism: samples are written sorted by key, with no compression, and MDSWriter puts no
timestamps or paths into shards or ``index.json`` (its JSON is key-sorted), so rewriting the
same samples gives byte-identical files.

Not for concurrent writers of the same partition (one run per partition at a time).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"


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
        return f"{MDS_DIRNAME}/{self.tier}/{self.shape}/{self.batch}"


@dataclass(frozen=True)
class PartitionDir:
    tier: int
    shape: str
    path: Path


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


def partition_dir(root: str | os.PathLike[str], tier: int, shape: str, batch: str) -> Path:
    _check_batch(batch)
    return bucket_dir(root, tier, shape) / batch


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for child in sorted(path.iterdir()):
        if child.is_file():
            _fsync_path(child)
    _fsync_path(path)


def _makedirs_durable(path: Path) -> None:
    """mkdir -p, fsyncing each parent whose entry we created, so the rename survives a crash."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        _fsync_path(d.parent)


def _leftovers(bucket: Path, batch: str, mark: str) -> list[Path]:
    pattern = re.compile(re.escape(f".{batch}{mark}") + r"[0-9a-f]{32}$")
    return sorted(p for p in bucket.iterdir() if pattern.match(p.name))


def _recover(bucket: Path, batch: str) -> None:
    """Undo the leftovers of a crashed write of ``batch`` in one bucket directory."""
    if not bucket.is_dir():
        return
    final = bucket / batch
    for tmp in _leftovers(bucket, batch, _TMP_MARK):
        shutil.rmtree(tmp)
    for old in _leftovers(bucket, batch, _OLD_MARK):
        # An ".old-" copy was complete when it was renamed away; if nothing replaced it,
        # the crash hit between the two renames: put it back.
        if not final.exists() and (old / "index.json").is_file():
            os.rename(old, final)
            _fsync_path(bucket)
        else:
            shutil.rmtree(old)


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
    Every write of the partition calls this first.
    """
    _check_batch(batch)
    for _, _, bucket in _bucket_dirs(root):
        _recover(bucket, batch)


def _remove_atomically(final: Path) -> None:
    """Take a directory away in one step (rename), then delete it at leisure."""
    old = final.parent / f".{final.name}{_OLD_MARK}{uuid.uuid4().hex}"
    os.rename(final, old)
    _fsync_path(final.parent)
    shutil.rmtree(old)


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
    rows: list[dict[str, Any]],
    columns: dict[str, str],
    size_limit: int,
    hashes: Sequence[str],
) -> None:
    # Imported here: streaming pulls in torch (seconds), which listing/cleanup never need.
    from streaming import MDSWriter

    writer = MDSWriter(
        out=str(out),
        columns=columns,
        compression=None,  # JPEG bytes do not compress; keeps shards readable by mmap
        hashes=list(hashes),
        size_limit=size_limit,
    )
    try:
        for row in rows:
            encoded = writer.encode_sample(row)
            if len(encoded) + writer.extra_bytes_per_sample + writer.extra_bytes_per_shard > (
                size_limit
            ):
                raise ValueError(
                    f"sample {row['key']!r} encodes to {len(encoded)} bytes, more than the "
                    f"shard size limit {size_limit}"
                )
            writer.write(row)
    except BaseException:
        writer.cancel_future_jobs()
        raise
    writer.finish()


def write_bucket_partition(
    root: str | os.PathLike[str],
    batch: str,
    tier: int,
    shape: str,
    samples: Iterable[MDSSample],
    *,
    extra_columns: Mapping[str, str] | None = None,
    size_limit: int = DEFAULT_SIZE_LIMIT,
    hashes: Sequence[str] = (),
) -> list[Placement]:
    """Atomically (re)write ``<root>/mds/<tier>/<shape>/<batch>/``; placements in write order.

    ``extra_columns``: name -> MDS encoding; every sample's ``extra`` must have exactly
    these keys. ``hashes``: optional MDS shard hash algorithms recorded in index.json.
    """
    final = partition_dir(root, tier, shape, batch)
    items = sorted(samples, key=lambda s: s.key)
    if not items:
        raise ValueError(f"no samples for bucket {tier}/{shape} of batch {batch!r}")
    if size_limit <= 0:
        raise ValueError(f"size_limit must be positive, got {size_limit}")
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
    rows = [_row(s, extra_names) for s in items]

    bucket = final.parent
    _makedirs_durable(bucket)
    _recover(bucket, batch)
    tmp = bucket / f".{batch}{_TMP_MARK}{uuid.uuid4().hex}"
    try:
        _write_mds(tmp, rows, columns, size_limit, hashes)
        _fsync_tree(tmp)
        placements = _placements(tmp, keys, tier, shape, batch)
        if final.exists():
            old = bucket / f".{batch}{_OLD_MARK}{uuid.uuid4().hex}"
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(old, final)  # put the complete previous version back
                raise
            _fsync_path(bucket)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
            _fsync_path(bucket)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return placements


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


def write_partition_buckets(
    root: str | os.PathLike[str],
    batch: str,
    samples: Iterable[MDSSample],
    *,
    extra_columns: Mapping[str, str] | None = None,
    size_limit: int = DEFAULT_SIZE_LIMIT,
    hashes: Sequence[str] = (),
) -> list[Placement]:
    """Write every bucket of one partition and drop its directories in buckets now empty.

    New directories are written before stale ones are removed, so a crash in between can
    leave an image in two buckets until the rerun, but never in none.
    """
    _check_batch(batch)
    recover_partition(root, batch)
    groups: dict[tuple[int, str], list[MDSSample]] = {}
    seen: set[str] = set()
    for s in samples:
        if s.key in seen:
            raise ValueError(f"duplicate sample key {s.key!r} in batch {batch!r}")
        seen.add(s.key)
        _check_shape(s.shape)
        groups.setdefault((int(s.tier), s.shape), []).append(s)
    placements: list[Placement] = []
    for tier, shape in sorted(groups, key=lambda g: (g[0], _shape_key(g[1]))):
        placements += write_bucket_partition(
            root,
            batch,
            tier,
            shape,
            groups[(tier, shape)],
            extra_columns=extra_columns,
            size_limit=size_limit,
            hashes=hashes,
        )
    for d in list_partition_dirs(root, batch):
        if (d.tier, d.shape) not in groups:
            _remove_atomically(d.path)
    return placements
