"""MDS writing: partition directories, atomic replacement, shard contents read back by streaming."""

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from prx_assets.core.shards.mds import (
    MDSSample,
    list_partition_dirs,
    partition_digest,
    partition_dir,
    recover_partition,
    relative_partition_dir,
    skip_nothing,
    write_bucket_partition,
    write_partition_buckets,
    write_partition_streams,
)
from prx_assets.core.shards.mds_format import MDSShardWriter
from prx_assets.core.shards.small_buckets import small_bucket_problems
from prx_assets.demo.jpegs import bucketed_photos
from prx_assets_tests.core.stage_inputs import read_mds_dir, streaming_memory_released


@pytest.fixture(scope="module")
def samples() -> list[MDSSample]:
    """Real bucketed q92 JPEGs of the demo photos that pass the 384 px cutoff."""
    out = [p.sample(f"demo/{p.stem}", f"a photo called {p.stem}") for p in bucketed_photos()]
    assert len(out) >= 8 and len({(s.tier, s.shape) for s in out}) >= 3
    return out


def _read_all(directory: Path) -> list[dict]:
    """Read a directory back with the official reader, as the trainer would."""
    return read_mds_dir(directory)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_streaming_dataset_reads_every_bucket(tmp_path: Path, samples: list[MDSSample]) -> None:
    placements = write_partition_buckets(
        tmp_path, "demo.b0", samples, size_limit=300_000, skips_for=skip_nothing
    )
    by_key = {s.key: s for s in samples}
    assert sorted(p.key for p in placements) == sorted(by_key)
    dirs = list_partition_dirs(tmp_path, "demo.b0")
    assert {(d.tier, d.shape) for d in dirs} == {(s.tier, s.shape) for s in samples}
    for d in dirs:
        assert d.path == tmp_path / "mds" / str(d.tier) / d.shape / "demo.b0"
        rows = _read_all(d.path)
        mine = sorted((p for p in placements if (p.tier, p.shape) == (d.tier, d.shape)),
                      key=lambda p: p.sample_index)  # fmt: skip
        assert [r["key"] for r in rows] == [p.key for p in mine]
        index = json.loads((d.path / "index.json").read_text())
        shard_sizes = {s["raw_data"]["basename"]: s["samples"] for s in index["shards"]}
        for p, row in zip(mine, rows, strict=True):
            s = by_key[p.key]
            assert (p.tier, p.shape, p.batch) == (s.tier, s.shape, "demo.b0")
            assert p.relative_dir == f"mds/{s.tier}/{s.shape}/demo.b0"
            assert (d.path / p.shard).is_file() and p.index_in_shard < shard_sizes[p.shard]
            assert row["caption"] == s.caption and row["key"] == s.key
            assert row["image"] == s.image
            assert (row["orig_width"], row["orig_height"]) == (s.orig_width, s.orig_height)
            assert (row["tier"], row["shape"]) == (s.tier, s.shape)
            assert (row["source"], row["license"]) == ("demo", "public-domain")
            img = Image.open(io.BytesIO(row["image"]))
            assert f"{img.height}x{img.width}" == s.shape
    # Shards really split at the limit and indices restart per shard.
    assert any(p.shard != "shard.00000.mds" and p.index_in_shard == 0 for p in placements)


def test_rerun_is_byte_identical(tmp_path: Path, samples: list[MDSSample]) -> None:
    write_partition_buckets(
        tmp_path, "demo.b0", samples, size_limit=300_000, skips_for=skip_nothing
    )
    first = _hashes(tmp_path)
    write_partition_buckets(
        tmp_path, "demo.b0", list(reversed(samples)), size_limit=300_000, skips_for=skip_nothing
    )
    assert _hashes(tmp_path) == first
    assert not [p for p in tmp_path.rglob(".*")]  # no temporaries left behind


def test_extra_columns(tmp_path: Path, samples: list[MDSSample]) -> None:
    s = samples[0]
    rich = [
        MDSSample(**{**s.__dict__, "key": f"k{i}", "extra": {"aesthetic": 5.5 + i, "tags": [i]}})
        for i in range(3)
    ]
    write_bucket_partition(
        tmp_path,
        "b",
        s.tier,
        s.shape,
        rich,
        extra_columns={"aesthetic": "float32", "tags": "json"},
        skips_for=skip_nothing,
    )
    rows = _read_all(partition_dir(tmp_path, s.tier, s.shape, "b"))
    assert [float(r["aesthetic"]) for r in rows] == [5.5, 6.5, 7.5]
    assert [r["tags"] for r in rows] == [[0], [1], [2]]
    with pytest.raises(ValueError, match="expected exactly"):
        write_bucket_partition(
            tmp_path,
            "b",
            s.tier,
            s.shape,
            rich,
            extra_columns={"aesthetic": "float32"},
            skips_for=skip_nothing,
        )
    with pytest.raises(ValueError, match="collides"):
        write_bucket_partition(
            tmp_path,
            "b",
            s.tier,
            s.shape,
            [s],
            extra_columns={"key": "str"},
            skips_for=skip_nothing,
        )


def test_moved_sample_leaves_no_stale_copy(tmp_path: Path, samples: list[MDSSample]) -> None:
    write_partition_buckets(tmp_path, "demo.b0", samples, skips_for=skip_nothing)
    write_partition_buckets(
        tmp_path, "demo.b1", samples, skips_for=skip_nothing
    )  # another partition, same buckets
    other = _hashes(tmp_path / "mds")
    moved_bucket = (samples[0].tier, samples[0].shape)
    kept = [s for s in samples if (s.tier, s.shape) != moved_bucket]
    write_partition_buckets(tmp_path, "demo.b0", kept, skips_for=skip_nothing)
    dirs = {(d.tier, d.shape) for d in list_partition_dirs(tmp_path, "demo.b0")}
    assert moved_bucket not in dirs and dirs == {(s.tier, s.shape) for s in kept}
    assert not partition_dir(tmp_path, *moved_bucket, "demo.b0").exists()
    # demo.b1 is untouched, byte for byte.
    after = _hashes(tmp_path / "mds")
    assert {k: v for k, v in other.items() if "demo.b1" in k} == {
        k: v for k, v in after.items() if "demo.b1" in k
    }
    write_partition_buckets(tmp_path, "demo.b0", [], skips_for=skip_nothing)
    assert list_partition_dirs(tmp_path, "demo.b0") == []


def test_crash_in_writer_loop_keeps_previous_version(
    tmp_path: Path, samples: list[MDSSample], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, shape = samples[0].tier, samples[0].shape
    bucket = [s for s in samples if (s.tier, s.shape) == (tier, shape)]
    final = partition_dir(tmp_path, tier, shape, "b")
    write_bucket_partition(
        tmp_path, "b", tier, shape, bucket[:2], size_limit=100_000, skips_for=skip_nothing
    )
    before = _hashes(final)

    real_write = MDSShardWriter.write
    calls = []

    def failing_write(self, sample):  # noqa: ANN001, ANN202
        calls.append(sample["key"])
        if len(calls) > 2:  # after a shard has already been flushed to the temp dir
            raise RuntimeError("disk full")
        return real_write(self, sample)

    monkeypatch.setattr(MDSShardWriter, "write", failing_write)
    with pytest.raises(RuntimeError, match="disk full"):
        write_bucket_partition(
            tmp_path, "b", tier, shape, bucket, size_limit=100_000, skips_for=skip_nothing
        )
    assert _hashes(final) == before
    assert [p.name for p in final.parent.iterdir()] == ["b"]  # temp dir cleaned up
    assert [r["key"] for r in _read_all(final)] == sorted(s.key for s in bucket[:2])
    # A first write that fails leaves nothing at the final path.
    with pytest.raises(RuntimeError, match="disk full"):
        calls.clear()
        write_bucket_partition(
            tmp_path, "new", tier, shape, bucket, size_limit=100_000, skips_for=skip_nothing
        )
    assert not partition_dir(tmp_path, tier, shape, "new").exists()


def _write_and_die_between_renames(root: Path, samples: list[MDSSample]) -> int:
    """Run a write in a forked child that is killed right after "old away", before "new in".

    A fork (not a fresh interpreter) so the child starts with streaming already imported;
    os._exit makes it a real death: no ``finally`` blocks, no cleanup.
    """
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            real_rename = os.rename

            def rename(src, dst):  # noqa: ANN001, ANN202
                real_rename(src, dst)
                if str(dst).endswith("/.b.old"):
                    os._exit(9)

            os.rename = rename
            write_partition_buckets(root, "b", samples, skips_for=skip_nothing)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_kill_between_renames_is_recovered(tmp_path: Path, samples: list[MDSSample]) -> None:
    bucket = [s for s in samples if (s.tier, s.shape) == (samples[0].tier, samples[0].shape)]
    final = partition_dir(tmp_path, bucket[0].tier, bucket[0].shape, "b")
    write_partition_buckets(tmp_path, "b", bucket[:1], skips_for=skip_nothing)
    before = _hashes(final)
    assert _write_and_die_between_renames(tmp_path, bucket) == 9
    # Killed between "old away" and "new in": nothing (not something partial) is readable.
    assert not final.exists()
    assert list_partition_dirs(tmp_path, "b") == []
    leftovers = sorted(p.name for p in final.parent.iterdir())
    assert leftovers == [".b.old", ".b.tmp"]  # its own fixed names, nothing else
    # Readers that list the tree refuse it, naming the directory, rather than read less.
    from prx_assets.core.snapshots.manifest import SnapshotError
    from prx_assets.core.snapshots.runner import _scan as snapshot_scan
    from prx_assets.loader.discover import DirectoryMovedAway, discover_streams

    rel = final.relative_to(tmp_path).as_posix()
    partition = rel.split("/", 1)[1]
    for kwargs in ({}, {"batches": ["b"]}, {"partitions": [partition]}):
        with pytest.raises(DirectoryMovedAway, match=f"'{rel}'.*Rerun mds_shards"):
            discover_streams(tmp_path, **kwargs)
    with pytest.raises(SnapshotError, match=f"'{rel}'"):
        snapshot_scan(tmp_path / "mds")
    recover_partition(tmp_path, "b")
    assert [b.relpath for b in discover_streams(tmp_path)] == [partition]
    assert _hashes(final) == before
    assert sorted(p.name for p in final.parent.iterdir()) == ["b"]
    write_partition_buckets(tmp_path, "b", bucket, skips_for=skip_nothing)
    assert [r["key"] for r in _read_all(final)] == sorted(s.key for s in bucket)


def test_bad_input(tmp_path: Path, samples: list[MDSSample]) -> None:
    s = samples[0]
    with pytest.raises(ValueError, match="not a safe directory name"):
        write_partition_buckets(tmp_path, "../escape", [s], skips_for=skip_nothing)
    with pytest.raises(ValueError, match="not a safe directory name"):
        write_partition_buckets(tmp_path, ".hidden", [s], skips_for=skip_nothing)
    with pytest.raises(ValueError, match="duplicate sample key"):
        write_partition_buckets(tmp_path, "b", [s, s], skips_for=skip_nothing)
    with pytest.raises(ValueError, match="not 512/999x999"):
        write_bucket_partition(tmp_path, "b", 512, "999x999", [s], skips_for=skip_nothing)
    with pytest.raises(ValueError, match="more than the shard size limit"):
        write_bucket_partition(
            tmp_path, "b", s.tier, s.shape, [s], size_limit=1000, skips_for=skip_nothing
        )
    with pytest.raises(ValueError, match="no samples"):
        write_bucket_partition(tmp_path, "b", s.tier, s.shape, [], skips_for=skip_nothing)
    with pytest.raises(ValueError, match="<H>x<W>"):
        write_bucket_partition(tmp_path, "b", 512, "big", [s], skips_for=skip_nothing)
    assert list_partition_dirs(tmp_path, "b") == []


def _by_bucket(samples: list[MDSSample]) -> dict[tuple[int, str], list[MDSSample]]:
    out: dict[tuple[int, str], list[MDSSample]] = {}
    for s in sorted(samples, key=lambda s: s.key):
        out.setdefault((s.tier, s.shape), []).append(s)
    return out


def test_streams_are_consumed_lazily_and_checked(tmp_path: Path, samples: list[MDSSample]) -> None:
    groups = _by_bucket(samples)
    consumed: list[str] = []

    def lazy(items: list[MDSSample]):  # noqa: ANN202
        for s in items:
            consumed.append(s.key)
            yield s

    placements = write_partition_streams(
        tmp_path, "b", {g: lazy(v) for g, v in groups.items()}, skips_for=skip_nothing
    )
    assert sorted(consumed) == sorted(p.key for p in placements) == sorted(s.key for s in samples)
    assert (
        write_partition_buckets(tmp_path / "other", "b", samples, skips_for=skip_nothing)
        == placements
    )
    before = _hashes(tmp_path)
    (big, items), (other, _) = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:2]
    assert len(items) >= 2
    with pytest.raises(ValueError, match="strictly increasing"):
        write_partition_streams(tmp_path, "b", {big: list(reversed(items))}, skips_for=skip_nothing)
    assert _hashes(tmp_path) == before  # the failed bucket kept its previous version
    # Buckets are written in (tier, H, W) order; a key already written is refused in a later one.
    first, second = sorted([big, other], key=lambda g: (g[0], *map(int, g[1].split("x"))))
    dup = MDSSample(**{**groups[first][0].__dict__, "tier": second[0], "shape": second[1]})
    with pytest.raises(ValueError, match="more than one bucket"):
        write_partition_streams(
            tmp_path, "b", {first: groups[first], second: [dup]}, skips_for=skip_nothing
        )
    # The first bucket was rewritten (same content), the offending one kept its old version.
    assert _hashes(tmp_path) == before
    # An empty stream, and a bucket left out, both lose their directory.
    write_partition_streams(
        tmp_path, "b", {big: iter(()), other: groups[other]}, skips_for=skip_nothing
    )
    assert {(d.tier, d.shape) for d in list_partition_dirs(tmp_path, "b")} == {other}


def test_partition_digest_pins_the_content(tmp_path: Path, samples: list[MDSSample]) -> None:
    s = samples[0]
    write_bucket_partition(
        tmp_path, "b", s.tier, s.shape, [s], hashes=("sha256",), skips_for=skip_nothing
    )
    d = partition_dir(tmp_path, s.tier, s.shape, "b")
    # With sha256 in index.json the index alone commits to every shard byte.
    assert partition_digest(d) == hashlib.sha256((d / "index.json").read_bytes()).hexdigest()
    write_bucket_partition(tmp_path, "plain", s.tier, s.shape, [s], skips_for=skip_nothing)
    plain = partition_dir(tmp_path, s.tier, s.shape, "plain")
    digest = partition_digest(plain)
    shard = plain / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, so index.json cannot notice
    shard.write_bytes(bytes(data))
    assert partition_digest(plain) != digest


def test_one_spelling_of_a_partition_directory(tmp_path: Path, samples: list[MDSSample]) -> None:
    """``relative_partition_dir`` is what the writer creates, what placements and listed
    directories report, and it refuses names that would escape the layout."""
    s = samples[0]
    rel = relative_partition_dir(s.tier, s.shape, "demo.b0")
    assert rel == f"mds/{s.tier}/{s.shape}/demo.b0"
    assert partition_dir(tmp_path, s.tier, s.shape, "demo.b0") == tmp_path / rel
    placements = write_bucket_partition(
        tmp_path, "demo.b0", s.tier, s.shape, [s], skips_for=skip_nothing
    )
    assert {p.relative_dir for p in placements} == {rel}
    assert [d.relative_dir for d in list_partition_dirs(tmp_path, "demo.b0")] == [rel]
    assert (tmp_path / rel / "index.json").is_file()
    for bad_shape, bad_batch in (
        ("16x", "b0"),
        ("../x", "b0"),
        ("16x16", "../b0"),
        ("16x16", ".b0"),
    ):
        with pytest.raises(ValueError, match="not"):
            relative_partition_dir(1024, bad_shape, bad_batch)


def test_small_bucket_rule() -> None:
    assert small_bucket_problems(64, 64, 64) == []
    assert small_bucket_problems(8 * 32, 8, 8, 32) == []
    problems = small_bucket_problems(63, 2, 64)
    assert len(problems) == 2 and "63 samples" in problems[0] and "2 shards" in problems[1]
    assert small_bucket_problems(100, 8, 8, 16) == [
        "100 samples < canonical nodes x device batch = 8 x 16"
    ]
    with pytest.raises(ValueError, match=">= 1"):
        small_bucket_problems(1, 1, 0)


def test_each_directory_appears_with_its_first_skiplist_generation(
    tmp_path: Path, samples: list[MDSSample]
) -> None:
    """The callback screens a directory inside its temporary copy, before the rename."""
    from prx_assets.core.skiplists.sidecars import load_generation
    from prx_assets.loader import SkipListDataset

    calls: list[tuple[str, bool]] = []

    def screen(placements):  # noqa: ANN001, ANN202
        (rel,) = {p.relative_dir for p in placements}
        calls.append((rel, (tmp_path / rel).exists()))
        if len(placements) < 2:
            return {}  # screened, nothing skipped (a stream cannot be empty)
        first = min(placements, key=lambda p: p.key)  # skip each directory's first key
        return {first.shard: {first.index_in_shard: ["opt_out"]}}

    placements = write_partition_buckets(tmp_path, "b", samples, skips_for=screen)
    dirs = sorted({p.relative_dir for p in placements})
    assert sorted(rel for rel, _ in calls) == dirs
    assert not any(existed for _, existed in calls)  # called before anything was visible
    screened_out = 0
    for rel in dirs:
        mine = [p for p in placements if p.relative_dir == rel]
        first = min(mine, key=lambda p: p.key)
        live = load_generation(tmp_path / rel).skiplists
        gone = {first.key} if len(mine) > 1 else set()
        screened_out += len(gone)
        if gone:
            assert live[first.shard].indices == (first.index_in_shard,)
        assert sum(len(s) for s in live.values()) == len(gone)
        with streaming_memory_released():
            ds = SkipListDataset(local=str(tmp_path / rel), batch_size=1)
            kept = sorted(s["key"] for s in ds)
            del ds
        assert kept == sorted(p.key for p in mine if p.key not in gone)
    assert screened_out >= 1

    # A callback that fails leaves the previous version (with its generation) in place.
    before = _hashes(tmp_path)

    def broken(placements):  # noqa: ANN001, ANN202
        raise RuntimeError("policy unavailable")

    with pytest.raises(RuntimeError, match="policy unavailable"):
        write_partition_buckets(tmp_path, "b", samples, skips_for=broken)
    assert _hashes(tmp_path) == before
    assert not [p for p in tmp_path.rglob(".*")]
    # And a callback naming a shard the directory does not have is refused the same way.
    with pytest.raises(ValueError, match="not shards of"):
        write_partition_buckets(
            tmp_path, "b", samples, skips_for=lambda p: {"shard.99999.mds": {0: ["opt_out"]}}
        )
    assert _hashes(tmp_path) == before


# -- recovery is scoped to the partition written (issue 12) ---------------------------------

_LISTED: list[str] | None = None  # directories listed while a test records (audit events)


def _audit(event: str, args: tuple) -> None:
    if _LISTED is not None and event in ("os.listdir", "os.scandir") and args:
        path = args[0]
        if isinstance(path, bytes | str | os.PathLike):
            _LISTED.append(os.path.abspath(os.fsdecode(path)))


sys.addaudithook(_audit)  # permanent for the process; records only inside _listings()


@contextlib.contextmanager
def _listings() -> Iterator[list[str]]:
    """Every directory the interpreter lists inside the block (os.listdir/os.scandir)."""
    global _LISTED
    _LISTED = []
    try:
        yield _LISTED
    finally:
        _LISTED = None


def test_a_write_never_lists_its_bucket(tmp_path: Path, samples: list[MDSSample]) -> None:
    """Finding: recovery listed the whole bucket directory twice on every write, so a write
    cost O(the batches beside it). A write (new, rewrite, removal) now looks up its own
    temporary names only, and leaves the siblings' entries (hidden ones too) alone."""
    bucket_samples = [
        s for s in samples if (s.tier, s.shape) == (samples[0].tier, samples[0].shape)
    ]
    tier, shape = bucket_samples[0].tier, bucket_samples[0].shape
    for i in range(6):
        write_partition_buckets(tmp_path, f"s{i:02d}", bucket_samples[:1], skips_for=skip_nothing)
    bucket = partition_dir(tmp_path, tier, shape, "s00").parent
    stranger = bucket / ".s03.tmp"  # another partition's leftover: not this write's business
    stranger.mkdir()
    siblings = sorted(p.name for p in bucket.iterdir())
    sibling_files = _hashes(bucket)
    with _listings() as listed:
        write_partition_buckets(tmp_path, "b", bucket_samples, skips_for=skip_nothing)
        assert [r["key"] for r in _read_all(bucket / "b")] == sorted(s.key for s in bucket_samples)
        write_partition_buckets(tmp_path, "b", bucket_samples[:1], skips_for=skip_nothing)
        write_partition_buckets(tmp_path, "b", [], skips_for=skip_nothing)  # removal
    assert listed, "the recorder saw nothing: it would prove nothing"
    assert str(bucket.resolve()) not in {os.path.realpath(p) for p in listed}
    assert sorted(p.name for p in bucket.iterdir()) == siblings
    assert _hashes(bucket) == sibling_files


def _write_and_die_while_deleting_superseded(
    root: Path, samples: list[MDSSample], bucket: Path
) -> int:
    """A forked child rewrites ``b``; it dies (os._exit: no cleanup) once it has deleted one
    file of a superseded copy in ``bucket``, as a kill during that deletion would leave it."""
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:

            def dying_rmtree(path, *args, **kwargs):  # noqa: ANN001, ANN202
                path = Path(path)
                if path.parent == bucket and path.name.startswith(".b.old"):
                    victim = sorted(p for p in path.iterdir() if p.name != "index.json")[0]
                    victim.unlink()
                    os._exit(9)
                return real_rmtree(path, *args, **kwargs)

            real_rmtree = shutil.rmtree
            shutil.rmtree = dying_rmtree
            write_partition_buckets(root, "b", samples, skips_for=skip_nothing)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_copy_whose_deletion_began_is_never_restored(
    tmp_path: Path, samples: list[MDSSample]
) -> None:
    """Finding: a kill part-way through deleting a directory the partition dropped left a
    partial copy that the next write restored into view (its ``index.json`` survived, a
    shard did not). Deletion now condemns the copy first; only complete copies come back."""
    by_bucket = _by_bucket(samples)
    (a, kept), (b, dropped) = sorted(by_bucket.items())[:2]
    write_partition_buckets(tmp_path, "b", kept + dropped, skips_for=skip_nothing)
    gone = partition_dir(tmp_path, b[0], b[1], "b")
    assert _write_and_die_while_deleting_superseded(tmp_path, kept, gone.parent) == 9
    assert not gone.exists()
    recover_partition(tmp_path, "b")  # what the next write does first
    assert not gone.exists(), "a partly deleted copy was put back into view"
    assert not list(gone.parent.glob(".b.*"))
    assert [d.relative_dir for d in list_partition_dirs(tmp_path, "b")] == [
        relative_partition_dir(a[0], a[1], "b")
    ]
    write_partition_buckets(tmp_path, "b", kept, skips_for=skip_nothing)
    assert not [p for p in tmp_path.rglob(".*")]
