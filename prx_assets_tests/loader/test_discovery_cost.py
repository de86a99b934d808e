"""Loader discovery reads one small file per directory (issue 12), and the counts it takes
from that file are claims the dataset checks: a manifest whose counts disagree with its
index or its sidecars stops the loader; it never changes what is yielded."""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from prx_assets.core.skiplists.sidecars import (
    MANIFEST_BASENAME,
    SkipListCorrupt,
    canonical_json,
    load_generation,
)
from prx_assets.loader import ShapeBatchedLoader, discover_streams

from .conftest import MdsRoot

_OPENED: list[str] | None = None  # files opened while a test records (audit events)


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and args and isinstance(args[0], str | bytes):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # permanent for the process; records only inside _opens()


@contextlib.contextmanager
def _opens() -> Iterator[list[str]]:
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


def _per_partition(opened: list[str], m: MdsRoot) -> Counter[str]:
    dirs = {str(m.dir(rel).resolve()): rel for rel in m.shards}
    return Counter(dirs[os.path.dirname(p)] for p in opened if os.path.dirname(p) in dirs)


def _loader(m: MdsRoot) -> ShapeBatchedLoader:
    return ShapeBatchedLoader(discover_streams(m.root), batch_size=4, num_canonical_nodes=1)


def test_discovery_reads_at_most_one_small_file_per_directory(mds_root: MdsRoot):
    """Finding: discovery read index.json twice, the manifest and every sidecar of each
    directory (then the dataset read them all again): 1.8 s of 2.5 s at 10,000 directories."""
    skipped = mds_root.apply_skips({"0/16x24/b1": {0: {0: ["opt_out"], 3: ["duplicate"]}}})
    with _opens() as opened:
        found = discover_streams(mds_root.root)
    per_dir = _per_partition(opened, mds_root)
    assert set(per_dir) == set(mds_root.shards) and set(per_dir.values()) == {1}
    assert {os.path.basename(p) for p in opened if "/mds/" in p} == {MANIFEST_BASENAME}
    by_rel = {b.relpath: b.counts for b in found}
    assert by_rel["0/16x24/b1"].kept_samples == 40 - 2 and by_rel["0/16x24/b1"].samples == 40
    keys = {
        k for b in ShapeBatchedLoader(found, batch_size=4, num_canonical_nodes=1) for k in b["key"]
    }
    assert keys == mds_root.all_keys() - skipped


def _rewrite_manifest(d: Path, edit) -> None:  # noqa: ANN001
    """Re-sign the manifest after ``edit(obj)``: a consistent-looking lie (self-hash valid)."""
    obj = json.loads((d / MANIFEST_BASENAME).read_bytes())
    edit(obj)
    body = {k: v for k, v in obj.items() if k != "sha256"}
    import hashlib

    obj["sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    (d / MANIFEST_BASENAME).write_bytes(canonical_json(obj) + b"\n")


def test_counts_the_manifest_claims_are_checked_by_the_dataset(mds_root: MdsRoot):
    rel = "0/16x24/b1"
    skipped = mds_root.apply_skips({rel: {1: {2: ["opt_out"]}}})
    d = mds_root.dir(rel)

    def hide_the_skip(obj: dict) -> None:
        obj["shards"][1]["skipped"] = 0

    _rewrite_manifest(d, hide_the_skip)
    found = discover_streams(mds_root.root)  # discovery believes it: every sample kept
    assert {b.relpath: b.counts.kept_samples for b in found}[rel] == 40
    # The dataset is built from the claim; the first read of that shard checks it, before
    # any of the shard's samples is returned.
    loader = ShapeBatchedLoader(found, batch_size=4, num_canonical_nodes=1)
    seen: set[str] = set()
    with pytest.raises(SkipListCorrupt, match="its manifest says 0"):
        for batch in loader:
            seen.update(batch["key"])
    assert not seen & set(mds_root.shards[rel][1])
    with pytest.raises(SkipListCorrupt, match="its manifest says 0"):
        load_generation(d)
    assert skipped  # the opted-out sample exists and was never yielded

    def more_samples(obj: dict) -> None:
        obj["shards"][1]["skipped"] = 1
        obj["shards"][1]["samples"] += 1

    _rewrite_manifest(d, more_samples)
    with pytest.raises(SkipListCorrupt, match="index.json"):
        _loader(mds_root)


def test_a_missing_sidecar_stops_the_loader_at_its_shard_though_discovery_never_reads_it(
    mds_root: MdsRoot,
):
    rel = "1/24x16/b0"
    mds_root.apply_skips({rel: {0: {1: ["opt_out"]}}})
    live = load_generation(mds_root.dir(rel))
    found = discover_streams(mds_root.root)
    (mds_root.dir(rel) / live.manifest.entries[0].sidecar).unlink()
    loader = ShapeBatchedLoader(found, batch_size=4, num_canonical_nodes=1)
    seen: set[str] = set()
    with pytest.raises(SkipListCorrupt, match="is gone"):
        for batch in loader:
            seen.update(batch["key"])
    assert not seen & set(mds_root.shards[rel][0])


def test_a_version_1_manifest_is_counted_through_its_sidecars(mds_root: MdsRoot):
    rel = "0/16x24/b0"
    skipped = mds_root.apply_skips({rel: {0: {0: ["opt_out"]}, 2: {1: ["duplicate"]}}})

    def to_v1(obj: dict) -> None:
        obj["version"] = 1
        for entry in obj["shards"]:
            del entry["samples"], entry["skipped"]

    _rewrite_manifest(mds_root.dir(rel), to_v1)
    found = discover_streams(mds_root.root)
    assert {b.relpath: b.counts.kept_samples for b in found}[rel] == 38
    keys = {
        k for b in ShapeBatchedLoader(found, batch_size=4, num_canonical_nodes=1) for k in b["key"]
    }
    assert keys == mds_root.all_keys() - skipped


def test_a_generation_published_after_discovery_is_the_one_applied(mds_root: MdsRoot):
    """The manifest discovery read is reused at construction only when the file there holds
    the same bytes: a generation published in between (by rename, as writers do) is read,
    and so is one written in place with the old file's inode, size and mtime (so a check of
    file identity alone would have missed it)."""
    rel = "0/16x24/b0"
    d = mds_root.dir(rel)
    first, second, third = (mds_root.shards[rel][0][i] for i in (1, 2, 3))
    mds_root.apply_skips({rel: {0: {1: ["opt_out"]}}})
    discovered = (d / MANIFEST_BASENAME).stat()
    keep = d.parent / "kept-manifest"  # holds the first generation's inode
    os.link(d / MANIFEST_BASENAME, keep)
    found = discover_streams(mds_root.root)

    mds_root.apply_skips({rel: {0: {2: ["opt_out"]}}})  # published (a new inode)
    published = load_generation(d)
    assert (d / MANIFEST_BASENAME).stat().st_ino != discovered.st_ino
    loader = ShapeBatchedLoader(found, batch_size=4, num_canonical_nodes=1)
    keys = {k for b in loader for k in b["key"]}
    assert second not in keys and first in keys  # the new generation, not the discovered one
    (stream,) = [s for s in loader.datasets["16x24"].streams if s.local.endswith(rel)]
    assert stream.generation == published.generation
    del loader

    mds_root.apply_skips({rel: {0: {3: ["opt_out"]}}})
    newest = (d / MANIFEST_BASENAME).read_bytes()
    assert len(newest) == discovered.st_size
    with open(keep, "r+b") as fh:  # the newest generation, in the first one's file
        fh.write(newest)
    os.utime(keep, ns=(discovered.st_atime_ns, discovered.st_mtime_ns))
    os.replace(keep, d / MANIFEST_BASENAME)
    now = (d / MANIFEST_BASENAME).stat()
    identity = ("st_dev", "st_ino", "st_size", "st_mtime_ns")
    assert [getattr(now, a) for a in identity] == [getattr(discovered, a) for a in identity]
    keys = {
        k for b in ShapeBatchedLoader(found, batch_size=4, num_canonical_nodes=1) for k in b["key"]
    }
    assert third not in keys and {first, second} <= keys


def test_a_directory_rewritten_after_discovery_is_refused(mds_root: MdsRoot, tmp_path: Path):
    """New shards under an unchanged manifest: the discovered manifest bytes still match
    the file, and are still checked against the index streaming loads (stale: refused)."""
    from prx_assets.core.skiplists.sidecars import SkipListStale

    from .conftest import write_partition

    rel = "1/24x16/b0"
    found = discover_streams(mds_root.root)
    fresh = tmp_path / "rewrite"
    write_partition(fresh, "1", "24x16", "b0", 32, key_suffix="-v2")
    for f in (fresh / "1" / "24x16" / "b0").iterdir():
        os.replace(f, mds_root.dir(rel) / f.name)
    with pytest.raises(SkipListStale, match="written for another index.json"):
        ShapeBatchedLoader(found, batch_size=4, num_canonical_nodes=1)


def test_whole_file_reads_are_exact_at_every_size(tmp_path: Path):
    """``read_whole_file`` returns a file's bytes whatever their size (empty, at and across
    its first-read boundary, megabytes) and refuses an absent file."""
    from prx_assets.loader.dataset import _FIRST_READ, read_whole_file

    rng = random.Random(12)
    for size in (0, 1, 399, _FIRST_READ - 1, _FIRST_READ, _FIRST_READ + 1, 3 * 2**20 + 7):
        path = tmp_path / f"f{size}"
        data = rng.randbytes(size)
        path.write_bytes(data)
        assert read_whole_file(str(path)) == data
    with pytest.raises(FileNotFoundError):
        read_whole_file(str(tmp_path / "absent"))


def test_shard_readers_are_streamings_own(mds_root: MdsRoot):
    """The dataset builds each shard reader through streaming's ``reader_from_json`` without
    its deep copy; the readers equal streaming's own, attribute for attribute, and the
    entry handed over is left as it was (streaming still edits a copy)."""
    from streaming.base.format import reader_from_json
    from streaming.base.world import World

    from prx_assets.loader import SkipListStream
    from prx_assets.loader.dataset import _ParsedHere

    d = mds_root.dir("0/16x24/b0")
    stream = SkipListStream(local=str(d))
    ours, raw = stream._readers_and_index(World.detect(), allow_unsafe_types=False)
    assert raw == (d / "index.json").read_bytes()
    entries = json.loads(raw)["shards"]
    theirs = [reader_from_json(str(d), "", info) for info in entries]
    assert [vars(r) for r in ours] == [vars(r) for r in theirs] and len(ours) >= 3
    assert all(type(r) is type(t) for r, t in zip(ours, theirs, strict=True))
    wrapped = _ParsedHere(entries[0])
    reader_from_json(str(d), "", wrapped)  # streaming edits its copy, never the entry
    assert wrapped == entries[0] and {"version", "format"} <= set(wrapped)
