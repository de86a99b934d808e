"""Export the training samples of a shard tree as a plain MDS tree, for tools without the loader.

Why: a published directory is readable by ``prx_assets.loader`` only (its ``index.json``
carries a version plain streaming refuses, ``core/shards/published.py``), because it holds
samples its skip-lists exclude. A tool that can only read plain MDS gets an *export*: the
same layout (``<out>/mds/<tier>/<H>x<W>/<batch>/``), plain version 2 indexes, and only the
samples the loader would yield, read through the very streams the loader builds
(``discover_streams`` + ``SkipListStream``): a missing, stale or tampered skip-list
generation refuses the export exactly as it refuses training, a directory replaced while it
is read raises ``ShardsReplaced``, and every remote shard copy is checked against the
index's sha256.

An export is a frozen copy: opt-outs published after it are not applied to it. Its
manifest (``export.json``) names, per directory, the ``index.json`` sha256 and the
skip-list generation it was cut from, so a later audit can tell which exports predate a
removal. A directory whose live generation changed while the export ran refuses the whole
export (run it again). The tree appears in one rename of a complete temporary directory,
never partial, and an existing ``out`` is never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prx_assets.core.durable import fsync_path, fsync_tree
from prx_assets.core.shards.mds import DEFAULT_SIZE_LIMIT, MDS_DIRNAME
from prx_assets.core.shards.mds_format import MDSShardWriter
from prx_assets.core.skiplists.sidecars import MANIFEST_BASENAME, parse_manifest
from prx_assets.loader.discover import discover_streams

EXPORT_MANIFEST = "export.json"
EXPORT_FORMAT = "prx-export"
EXPORT_VERSION = 1


class ExportError(RuntimeError):
    """The export could not be made as a faithful copy of the loader's view."""


@dataclass(frozen=True)
class ExportedDirectory:
    """One exported bucket x batch directory and what it was cut from."""

    relpath: str  # <tier>/<H>x<W>/<batch>
    index_sha256: str | None  # the source index.json the skip-lists were checked against
    generation: str | None  # the source's skip-list generation (manifest self-hash)
    samples: int  # in the source directory
    kept_samples: int  # written to the export (0: every sample skipped, no directory)


@dataclass(frozen=True)
class ExportOutcome:
    """Where the export went and, per source directory, what it was cut from."""

    out: Path
    directories: list[ExportedDirectory]

    @property
    def kept_samples(self) -> int:
        return sum(d.kept_samples for d in self.directories)

    @property
    def samples(self) -> int:
        return sum(d.samples for d in self.directories)


def _columns(readers: list[Any], where: str) -> dict[str, str]:
    first = readers[0]
    columns = dict(zip(first.column_names, first.column_encodings, strict=True))
    for reader in readers[1:]:
        if dict(zip(reader.column_names, reader.column_encodings, strict=True)) != columns:
            raise ExportError(f"{where}: shards with different columns")
    return columns


def _live_generation(stream: Any) -> str | None:
    data, source = stream._fetch(MANIFEST_BASENAME)
    return None if data is None else parse_manifest(data, source).generation


def _export_directory(bucket: Any, dest: Path, size_limit: int) -> ExportedDirectory:
    """Write one stream's kept samples to ``dest`` (a plain MDS directory)."""
    from streaming.base.constant import DEFAULT_TIMEOUT
    from streaming.base.world import World

    stream = bucket.to_stream()
    # The defaults StreamingDataset gives its streams (this one is used on its own).
    stream.apply_default(
        {
            "split": None,
            "download_retry": 2,
            "download_timeout": DEFAULT_TIMEOUT,
            "validate_hash": None,
            "keep_zip": False,
        }
    )
    readers = stream.get_shards(World.detect(), allow_unsafe_types=False)  # kept shards only
    writer = MDSShardWriter(dest, _columns(readers, stream.local_dir), ["sha256"], size_limit)
    written = 0
    for reader in readers:
        stream.prepare_shard(reader)  # a remote stream's copy, checked against its sha256
        for i in range(reader.samples):  # kept rows only (FilteredShard maps them)
            writer.write(reader.get_item(i))
            written += 1
    writer.finish(write_index=True)
    if written != stream.kept_samples:
        raise ExportError(
            f"{stream.local_dir}: wrote {written} samples, the skip-lists keep {stream.kept_samples}"
        )
    if _live_generation(stream) != stream.generation:
        raise ExportError(
            f"{stream.local_dir}: a new skip-list generation was published while it was "
            "exported; run the export again"
        )
    return ExportedDirectory(
        bucket.relpath, stream.index_sha256, stream.generation, stream.raw_samples, written
    )


def export_training_samples(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tiers: Collection[str | int] | None = None,
    shapes: Collection[str | tuple[int, int]] | None = None,
    batches: Collection[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    size_limit: int = DEFAULT_SIZE_LIMIT,
) -> ExportOutcome:
    """Write the samples the loader would yield from ``root`` as a plain MDS tree at ``out``.

    ``root``, the filters and ``cache_dir`` are ``discover_streams``'s (a URL root needs
    ``cache_dir``). ``out`` must not exist; it appears complete (shards, plain indexes,
    ``export.json``) in one rename, or not at all. A partition whose every sample is skipped
    has no directory in the export (listed in the manifest with ``kept_samples`` 0).
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise FileExistsError(f"{out} exists: an export never overwrites (remove it first)")
    out.parent.mkdir(parents=True, exist_ok=True)
    buckets = discover_streams(root, tiers, shapes, batches, cache_dir=cache_dir, drop_empty=False)
    if not buckets:
        raise ExportError(f"no screened partition under {root}: nothing to export")
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.export.tmp"
    tmp.mkdir()
    try:
        done: list[ExportedDirectory] = []
        for bucket in buckets:
            counts = bucket.counts
            if counts is not None and counts.kept_samples == 0:  # skipped whole: nothing to read
                m = bucket.manifest[1] if bucket.manifest else None  # its generation, if read
                done.append(
                    ExportedDirectory(
                        bucket.relpath,
                        m.index_sha256 if m else None,
                        m.generation if m else None,
                        counts.samples,
                        0,
                    )
                )
                continue
            dest = tmp / MDS_DIRNAME / bucket.relpath
            done.append(_export_directory(bucket, dest, size_limit))
        manifest = {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "source": os.fspath(root),
            "note": (
                "plain MDS holding only the samples the skip-lists kept at export time; "
                "opt-outs published later are NOT applied to this copy"
            ),
            "samples": sum(d.samples for d in done),
            "kept_samples": sum(d.kept_samples for d in done),
            "directories": [asdict(d) for d in done],
        }
        (tmp / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        fsync_tree(tmp)
        os.rename(tmp, out)  # fails if out appeared meanwhile (a non-empty directory)
        fsync_path(out.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
        raise
    return ExportOutcome(out, done)
