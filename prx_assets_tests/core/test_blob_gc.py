"""Blob collection: blobs only dropped versions named are deleted; those a retained or
pinned version names, or a write in flight just stored or reused, are kept."""

import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prx_assets.core.lab import MANUAL, BlobError, Lab, TableSpec

SPEC = TableSpec(
    name="imgs",
    schema=pa.schema([("batch", pa.string()), ("key", pa.string()), ("image", pa.large_binary())]),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"),),
    blobs=("image",),
)
HOUR = timedelta(hours=1)
LATER = 3 * 3600.0  # the collector's clock, this far ahead: every file is "old"


def _images(batch: str, n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "batch": [batch] * n,
            "key": [f"{batch}-{i}" for i in range(n)],
            "image": pa.array([rng.bytes(2000) for _ in range(n)], pa.large_binary()),
        },
        schema=SPEC.schema,
    )


def _refs(lab: Lab, version: int | None = None) -> set[str]:
    table = lab.dataset("imgs", version=version).to_table(columns=["image"])
    return set(table.column("image").to_pylist())


def _stored(lab: Lab) -> set[str]:
    root = Path(lab.blobs.table_dir("imgs"))
    return {p.name for p in root.rglob("*") if p.is_file() and len(p.name) == 64}


def _drop_old_versions(lab: Lab) -> None:
    lab.maintain(SPEC, retention=timedelta(0), keep_versions=1, version_min_age=timedelta(0))


def _readable(lab: Lab) -> None:
    for batch in {r["batch"] for r in lab.read("imgs", ["batch"]).to_pylist()}:
        assert lab.read_batch("imgs", batch, ["image"]).num_rows > 0  # every blob resolves


def test_blobs_only_dropped_versions_named_are_collected(tmp_path):
    lab = Lab(tmp_path, policy=MANUAL)
    lab.replace_partition(SPEC, "a", _images("a", 6, seed=1))
    lab.replace_partition(SPEC, "b", _images("b", 4, seed=2))
    first = _refs(lab)
    lab.replace_partition(SPEC, "a", _images("a", 5, seed=3))  # "a" re-ingested: new bytes
    now = _refs(lab)
    gone = first - now
    assert len(gone) == 6 and _stored(lab) == first | now

    # The previous version still names them: nothing is collected.
    kept = lab.sweep_blobs(SPEC, min_age=HOUR, now=time.time() + LATER)
    assert kept["deleted"] == 0 and _stored(lab) == first | now

    _drop_old_versions(lab)
    swept = lab.sweep_blobs(SPEC, min_age=HOUR, now=time.time() + LATER)
    assert swept["deleted"] == 6 and swept["deleted_bytes"] == 6 * 2000
    assert _stored(lab) == now
    _readable(lab)
    # A second run finds nothing more to do (idempotent).
    assert lab.sweep_blobs(SPEC, min_age=HOUR, now=time.time() + LATER)["deleted"] == 0


def test_a_pinned_versions_blobs_survive_until_it_is_unpinned(tmp_path):
    lab = Lab(tmp_path, policy=MANUAL)
    lab.replace_partition(SPEC, "a", _images("a", 4, seed=1))
    pinned = lab.version("imgs")
    lab.pin_versions("snapshot-1", {"imgs": pinned})
    old = _refs(lab)
    lab.replace_partition(SPEC, "a", _images("a", 4, seed=2))
    _drop_old_versions(lab)
    assert pinned in [v["version"] for v in lab.dataset("imgs").versions()]
    lab.sweep_blobs(SPEC, min_age=HOUR, now=time.time() + LATER)
    assert old <= _stored(lab)
    got = lab.dataset("imgs", version=pinned).to_table(columns=["image"]).column("image")
    for ref in got.to_pylist():
        assert len(lab.blobs.get("imgs", ref)) == 2000  # the snapshot's images still read
    lab.unpin("snapshot-1")
    _drop_old_versions(lab)
    lab.sweep_blobs(SPEC, min_age=HOUR, now=time.time() + LATER)
    assert not old & _stored(lab)
    _readable(lab)


def test_rows_deleted_after_a_retained_version_keep_their_blobs(tmp_path):
    """A fragment is read where it shows the most rows: a deletion in a later version
    does not hide a row an earlier retained version still has."""
    lab = Lab(tmp_path, policy=MANUAL)
    lab.replace_partition(SPEC, "a", _images("a", 4, seed=1))
    before = lab.version("imgs")
    lab.dataset("imgs").delete("key = 'a-1'")  # a deletion vector on the same fragment
    assert len(_refs(lab)) == 3
    lab.sweep_blobs(SPEC, min_age=HOUR, now=time.time() + LATER)
    assert _refs(lab, before) <= _stored(lab)


def test_a_blob_stored_or_reused_by_a_write_in_flight_is_spared(tmp_path):
    lab = Lab(tmp_path, policy=MANUAL)
    lab.replace_partition(SPEC, "a", _images("a", 2, seed=1))
    reused = sorted(_refs(lab))[0]
    lab.replace_partition(SPEC, "a", _images("a", 2, seed=2))
    _drop_old_versions(lab)
    path = lab.blobs.path("imgs", reused)
    old = time.time() - 2 * 3600
    os.utime(path, (old, old))
    # A writer stores new bytes and finds ``reused`` already stored; its commit is not in yet.
    fresh, written = lab.blobs.put("imgs", b"\xff" * 3000)
    assert written == 3000
    assert reused not in _refs(lab)  # no retained version names it any more
    original = _images("a", 2, seed=1).column("image")[0].as_py()
    ref, written = lab.blobs.put("imgs", original)
    assert ref == reused and written == 0 and os.stat(path).st_mtime > old  # touched
    swept = lab.sweep_blobs(SPEC, min_age=HOUR)  # the real clock: both are young
    assert swept["deleted"] == 0 and swept["kept_young"] >= 2
    assert {fresh, reused} <= _stored(lab)


def test_killed_writers_temporaries_go_and_foreign_files_stay(tmp_path):
    lab = Lab(tmp_path, policy=MANUAL)
    lab.replace_partition(SPEC, "a", _images("a", 2, seed=1))
    ref = sorted(_refs(lab))[0]
    leaf = Path(lab.blobs.path("imgs", ref)).parent
    partial = leaf / f"{'ab' * 32}.0123abcd.tmp"
    partial.write_bytes(b"half a pict")
    foreign = leaf / "README"
    foreign.write_text("not a blob")
    swept = lab.sweep_blobs(SPEC, min_age=HOUR, now=time.time() + LATER)
    assert swept["temporaries_deleted"] == 1 and swept["deleted"] == 0
    assert not partial.exists() and foreign.exists()
    _readable(lab)


def test_a_killed_writers_staged_copy_goes_once_old(tmp_path):
    # A big file is copied into ``.staging/`` while hashed (LocalBlobs.staging_path); a
    # worker killed mid-copy leaves it there, where no blob ever is.
    lab = Lab(tmp_path, policy=MANUAL)
    lab.replace_partition(SPEC, "a", _images("a", 2, seed=1))
    staged = Path(lab.blobs.local("imgs").staging_path())
    staged.write_bytes(b"half a big picture")
    swept = lab.sweep_blobs(SPEC, min_age=HOUR)  # young: a copy may be in progress
    assert swept["temporaries_deleted"] == 0 and staged.exists()
    swept = lab.sweep_blobs(SPEC, min_age=HOUR, now=time.time() + LATER)
    assert swept["temporaries_deleted"] == 1 and swept["deleted"] == 0
    assert not staged.exists()
    _readable(lab)


def test_passes_bound_memory_and_agree_with_one_pass(tmp_path):
    def collect(root: Path, per_pass: int) -> tuple[set[str], dict]:
        lab = Lab(root, policy=MANUAL)
        for i in range(3):
            lab.replace_partition(SPEC, f"b{i}", _images(f"b{i}", 8, seed=i))
        lab.replace_partition(SPEC, "b1", _images("b1", 8, seed=9))
        _drop_old_versions(lab)
        result = lab.sweep_blobs(
            SPEC, min_age=HOUR, max_refs_per_pass=per_pass, now=time.time() + LATER
        )
        return _stored(lab), result

    one, single = collect(tmp_path / "one", 10**9)
    many, multi = collect(tmp_path / "many", 2)
    assert single["passes"] == 1 and multi["passes"] > 8
    assert one == many and single["deleted"] == multi["deleted"] == 8
    assert single["referenced"] == multi["referenced"] == 24


def test_a_torn_blob_is_rewritten_by_the_next_write_of_its_bytes(tmp_path):
    lab = Lab(tmp_path, policy=MANUAL)
    rows = _images("a", 2, seed=1)
    lab.replace_partition(SPEC, "a", rows)
    ref = sorted(_refs(lab))[0]
    path = Path(lab.blobs.path("imgs", ref))
    path.write_bytes(b"")  # what a power loss before the data reached the disk can leave
    with pytest.raises(BlobError):
        lab.blobs.get("imgs", ref)
    assert lab.replace_partition(SPEC, "a", rows)["blob_bytes_written"] == 2000
    _readable(lab)


def test_references_stored_by_a_sink_are_committed_and_dangling_ones_refused(tmp_path):
    """``local_blobs`` + ``stored_blobs``: a worker stores the bytes, the rows carry the
    references; the commit checks each is stored, and refuses anything else."""
    lab = Lab(tmp_path / "lab", policy=MANUAL)
    lab.ensure(SPEC)
    sink = lab.local_blobs(SPEC, "image")
    assert sink is not None and lab.local_blobs(SPEC, "key") is None
    values = [b"first value" * 100, b"second value" * 100]
    refs = [sink.put(v)[0] for v in values]
    assert sink.put(values[0])[1] == 0  # stored once: the second put writes nothing
    as_refs = pa.schema([("batch", pa.string()), ("key", pa.string()), ("image", pa.string())])
    rows = pa.table({"batch": ["b"] * 2, "key": ["k0", "k1"], "image": refs}, schema=as_refs)
    lab.replace_partition(SPEC, "b", rows, stored_blobs=["image"])
    assert (
        lab.read_batch("imgs", "b", ["key", "image"]).sort_by("key").column("image").to_pylist()
        == values
    )
    before = lab.dataset("imgs").version

    dangling = rows.set_column(2, "image", pa.array(["ab" * 32, refs[1]], pa.string()))
    with pytest.raises(BlobError, match="not stored"):
        lab.replace_partition(SPEC, "b", dangling, stored_blobs=["image"])
    with pytest.raises(ValueError, match="needs sha256 references"):  # bytes, not references
        lab.replace_partition(SPEC, "b", _images("b", 2, 0), stored_blobs=["image"])
    with pytest.raises(ValueError, match="not blob-reference columns"):
        lab.replace_partition(SPEC, "b", rows, stored_blobs=["key"])
    assert lab.dataset("imgs").version == before  # nothing committed by the refusals
    assert lab.read_batch("imgs", "b", ["image"]).num_rows == 2


def test_a_sink_given_the_bytes_sha256_stores_them_there_and_a_wrong_one_is_refused_on_read(
    tmp_path,
):
    """``LocalBlobs.put(data, sha256=...)`` (ingest's workers pass the key they just hashed)
    stores at that address without hashing again; a wrong digest cannot pass a blob off as
    another value, because every read checks the bytes against their address."""
    import hashlib

    lab = Lab(tmp_path / "lab", policy=MANUAL)
    lab.ensure(SPEC)
    sink = lab.local_blobs(SPEC, "image")
    value = b"an image's bytes" * 64
    digest = hashlib.sha256(value).hexdigest()
    assert sink.put(value, sha256=digest) == (digest, len(value))
    assert sink.get(digest) == value and lab.blobs.get("imgs", digest) == value
    wrong = hashlib.sha256(b"another image").hexdigest()
    sink.put(value, sha256=wrong)
    with pytest.raises(BlobError, match="does not match its address"):
        sink.get(wrong)
    with pytest.raises(BlobError):
        lab.blobs.get("imgs", wrong)
