"""BatchIngest on real files: every entry is seen and accounted for, rows stay bounded, and
a batch written through the lab twice leaves the same rows."""

import gzip
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from prx_assets.core.ingest import runner as ingest
from prx_assets.core.ingest.runner import BatchIngest
from prx_assets.core.ingest.sources import STREAM_ABOVE_BYTES, discover_batches, resolve_batch
from prx_assets.core.lab import Lab
from prx_assets.core.tables import IMAGES, REJECTS
from prx_assets.demo.jpegs import encoded, solid_jpeg
from prx_assets_tests.bounds import MIB, fail_after, peak_rss_growth
from prx_assets_tests.fixtures_files import sparse_tar


def _run(ref, **kw) -> tuple[BatchIngest, list[dict], list[dict]]:
    run = BatchIngest(ref, **kw)
    images = [row for b in run.image_batches() for row in b.to_pylist()]
    return run, images, run.rejects.to_pylist()


def test_symlinks_special_files_and_their_samples_are_all_seen(tmp_path):
    b = tmp_path / "s" / "000"
    b.mkdir(parents=True)
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "x.jpg").write_bytes(solid_jpeg(color=(1, 2, 3)))
    (outside / "alt.txt").write_text("alt")
    (b / "photo.jpg").write_bytes(solid_jpeg(color=(200, 0, 0)))
    (b / "photo.txt").symlink_to(outside / "alt.txt")
    (b / "gallery").symlink_to(outside / "sub", target_is_directory=True)
    (b / "fine.jpg").write_bytes(solid_jpeg(color=(0, 200, 0)))
    os.mkfifo(b / "pipe.png")
    (b / "_SUCCESS").write_text("")
    with fail_after(10):
        run, images, rejects = _run(resolve_batch(tmp_path, "s.000"))
    assert run.stats.seen == 5 == run.stats.accepted + run.stats.rejected
    assert [r["path"] for r in images] == ["fine.jpg"]
    assert {r["path"]: r["reason"] for r in rejects} == {
        "gallery": "symlink",
        "photo.txt": "symlink",
        "photo.jpg": "bad_sidecar",
        "pipe.png": "not_a_file",
    }
    assert dict(run.stats.reasons) == {"symlink": 2, "bad_sidecar": 1, "not_a_file": 1}


def test_a_source_folder_named_with_invalid_utf8_gets_a_printable_source(tmp_path):
    src = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    os.makedirs(os.path.join(src, b"000"))
    Path(os.fsdecode(os.path.join(src, b"000", b"a.jpg"))).write_bytes(solid_jpeg(color=(9, 9, 9)))
    Path(os.fsdecode(os.path.join(src, b"000", b"_SUCCESS"))).write_text("")
    (ref,) = discover_batches(tmp_path)
    assert (ref.key, ref.source) == ("caf-E9.000", "caf%E9")
    _, images, _ = _run(ref)
    assert [(r["source"], r["path"]) for r in images] == [("caf%E9", "a.jpg")]
    pa.RecordBatch.from_pylist(images, schema=IMAGES.schema)  # valid UTF-8 throughout


def test_rejection_details_are_bounded_whatever_the_name(tmp_path):
    b = tmp_path / "s" / "000"
    b.mkdir(parents=True)
    long_stem = "n" * 250  # a legal 254-byte file name
    (b / f"{long_stem}.bin").write_bytes(b"x")
    (b / "_SUCCESS").write_text("")
    _, _, (row,) = _run(resolve_batch(tmp_path, "s.000"))
    assert row["path"] == f"{long_stem}.bin"  # the key stays whole (lossless)
    assert row["reason"] == "unsupported_extension" and len(row["detail"]) < 300


def test_record_batches_are_bounded_by_image_bytes(tmp_path, monkeypatch):
    b = tmp_path / "s" / "000"
    b.mkdir(parents=True)
    for i in range(6):
        (b / f"{i}.jpg").write_bytes(solid_jpeg(color=(i * 40, 0, 0)))
    (b / "_SUCCESS").write_text("")
    run = BatchIngest(resolve_batch(tmp_path, "s.000"))
    assert [x.num_rows for x in run.image_batches()] == [6]  # under both bounds: one batch
    monkeypatch.setattr(ingest, "BYTES_PER_RECORD_BATCH", 1)  # every image is over it
    run = BatchIngest(resolve_batch(tmp_path, "s.000"))
    assert [x.num_rows for x in run.image_batches()] == [1] * 6


def _png_rgba() -> bytes:
    return encoded(Image.new("RGBA", (40, 30), (0, 0, 255, 128)), "PNG")


def _mixed_batch(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """One of each outcome: two accepted images and four kinds of refusal."""
    b = tmp_path / "s" / "000"
    b.mkdir(parents=True)
    # noise: most of the file is scan data, so a cut lands in it
    photo = encoded(Image.effect_noise((160, 120), 60).convert("RGB"), "JPEG")
    files = {
        "a.jpg": photo,
        "b.png": _png_rgba(),
        "copy.jpg": photo,  # the same bytes as a.jpg
        "cut.jpg": photo[: len(photo) // 2],
        "text.jpg": b"just some text, not an image",
        "empty.jpg": b"",
    }
    for name, data in files.items():
        (b / name).write_bytes(data)
    (b / "_SUCCESS").write_text("")
    return tmp_path, files


def test_every_file_of_a_mixed_batch_is_an_image_or_a_refusal_with_its_reason(tmp_path):
    landing, files = _mixed_batch(tmp_path)
    run = BatchIngest(resolve_batch(landing, "s.000"))
    with pytest.raises(RuntimeError, match="consume image_batches"):
        _ = run.rejects  # incomplete until the stream is consumed: never a partial answer
    images = [row for b in run.image_batches() for row in b.to_pylist()]
    rejects = {r["path"]: r for r in run.rejects.to_pylist()}

    assert {r["path"]: r["key"] for r in images} == {
        "a.jpg": hashlib.sha256(files["a.jpg"]).hexdigest(),
        "b.png": hashlib.sha256(files["b.png"]).hexdigest(),
    }
    assert all(r["image"] == files[r["path"]] for r in images)  # the original bytes
    assert {r["path"]: (r["format"], r["conversion"]) for r in images} == {
        "a.jpg": ("JPEG", "none"),
        "b.png": ("PNG", "alpha_on_white"),
    }
    assert {p: r["reason"] for p, r in rejects.items()} == {
        "copy.jpg": "duplicate_bytes_in_batch",
        "cut.jpg": "truncated",
        "text.jpg": "not_an_image",
        "empty.jpg": "empty_file",
    }
    assert "a.jpg" in rejects["copy.jpg"]["detail"]
    assert rejects["copy.jpg"]["key"] == hashlib.sha256(files["a.jpg"]).hexdigest()
    stats = run.stats
    assert (stats.seen, stats.accepted, stats.rejected) == (6, 2, 4)
    assert stats.bytes_accepted == len(files["a.jpg"]) + len(files["b.png"])
    assert dict(stats.formats) == {"JPEG": 1, "PNG": 1}
    assert dict(stats.conversions) == {"none": 1, "alpha_on_white": 1}


def test_a_batch_written_through_the_lab_twice_leaves_identical_rows(tmp_path):
    landing, _ = _mixed_batch(tmp_path)
    lab = Lab(tmp_path / "lab")

    def ingest() -> tuple[dict, dict]:
        run = BatchIngest(resolve_batch(landing, "s.000"))
        written = lab.replace_partition(IMAGES, "s.000", run.image_batches())
        return written, lab.replace_partition(REJECTS, "s.000", run.rejects)

    def content() -> tuple[list[dict], list[dict]]:
        images = sorted(lab.read(IMAGES.name).to_pylist(), key=lambda r: r["key"])
        rejects = sorted(lab.read(REJECTS.name).to_pylist(), key=lambda r: r["path"])
        return images, rejects

    first = ingest()
    before = content()
    again = ingest()
    assert [w["rows_written"] for w in first] == [2, 4]
    assert [(w["rows_written"], w["rows_replaced"]) for w in again] == [(2, 2), (4, 4)]
    assert content() == before  # byte-identical, image bytes included


def test_workers_store_the_blobs_and_the_rows_equal_the_parents_path(tmp_path):
    """With a blob sink the validating process stores each accepted file's bytes (a worker
    here) and the rows carry references; written through the lab they read back the same
    bytes as the path where the parent stores them, for 1 and 2 workers. Refused files are
    never stored."""
    from prx_assets.core.lab import MANUAL

    b = tmp_path / "s" / "000"
    b.mkdir(parents=True)
    files = {f"p{i}.jpg": solid_jpeg(color=(40 * i, 90, 200 - 30 * i)) for i in range(5)}
    files["broken.jpg"] = files["p0.jpg"][: len(files["p0.jpg"]) - 20]  # no end of image
    for name, data in files.items():
        (b / name).write_bytes(data)
    (b / "_SUCCESS").write_text("")
    read = {}
    for label, workers, sink in (("parent", 1, False), ("inline", 1, True), ("two", 2, True)):
        lab = Lab(tmp_path / f"lab-{label}", policy=MANUAL)
        lab.ensure(IMAGES)
        run = BatchIngest(
            resolve_batch(tmp_path, "s.000"),
            workers=workers,
            blob_sink=lab.local_blobs(IMAGES, "image") if sink else None,
        )
        assert run.stored_blobs == (("image",) if sink else ())
        lab.replace_partition(IMAGES, "s.000", run.image_batches(), stored_blobs=run.stored_blobs)
        rows = lab.read_batch(IMAGES.name, "s.000", ["path", "key", "image"]).to_pylist()
        read[label] = sorted((r["path"], r["key"], r["image"]) for r in rows)
        assert [r["reason"] for r in run.rejects.to_pylist()] == ["truncated"]
        stored = {p.name for p in Path(lab.blobs.table_dir("images")).rglob("*") if p.is_file()}
        assert stored == {
            hashlib.sha256(d).hexdigest() for n, d in files.items() if n != "broken.jpg"
        }
    assert read["parent"] == read["inline"] == read["two"]
    assert {p for p, _, _ in read["two"]} == {n for n in files if n != "broken.jpg"}


def test_deferred_reads_refuse_what_the_parent_would_and_change_no_row(tmp_path, monkeypatch):
    """With a blob sink, the validating process reads each image itself (the parent lists,
    reads sidecars and ships no image bytes). Files that change between listing and reading
    get the refusals the parent's own read gives (gone, swapped for a link); the rows of the
    untouched files equal the eager path's, for 1 and 2 workers."""
    from prx_assets.core.ingest.sources import iter_candidates
    from prx_assets.core.lab import MANUAL

    b = tmp_path / "s" / "000"
    b.mkdir(parents=True)

    def write_batch() -> None:
        for i in range(4):
            (b / f"p{i}.jpg").unlink(missing_ok=True)
            (b / f"p{i}.jpg").write_bytes(solid_jpeg(color=(60 * i, 90, 200 - 40 * i)))
            (b / f"p{i}.txt").write_text(f"photo {i}")
        (b / "elsewhere.bin").unlink(missing_ok=True)
        (b / "_SUCCESS").write_text("")

    write_batch()
    ref = resolve_batch(tmp_path, "s.000")
    listed = {c.path: c for c in iter_candidates(ref, defer_reads=True)}
    assert sorted(listed) == [f"p{i}.jpg" for i in range(4)]
    assert all(c.data is None and c.deferred is not None for c in listed.values())
    assert listed["p2.jpg"].alt_text == "photo 2"  # sidecars are read while listing

    def sabotaged(*args, **kwargs):
        candidates = list(iter_candidates(*args, **kwargs))  # listed (and stat'ed) first
        (b / "p1.jpg").unlink()
        (b / "p3.jpg").rename(b / "elsewhere.bin")
        (b / "p3.jpg").symlink_to(b / "elsewhere.bin")
        yield from candidates

    def run(workers: int) -> tuple[list, list]:
        lab = Lab(tmp_path / f"lab-{workers}-{len(list(tmp_path.iterdir()))}", policy=MANUAL)
        lab.ensure(IMAGES)
        it = BatchIngest(ref, workers=workers, blob_sink=lab.local_blobs(IMAGES, "image"))
        rows = [r for batch in it.image_batches() for r in batch.to_pylist()]
        rejects = [(r["path"], r["reason"]) for r in it.rejects.to_pylist()]
        assert it.stats.seen == 4 == it.stats.accepted + it.stats.rejected
        return sorted((r["path"], r["key"], r["file_size"]) for r in rows), sorted(rejects)

    eager = BatchIngest(ref)  # no blob sink: the parent reads every file
    eager_rows = sorted(
        (r["path"], r["key"], r["file_size"])
        for bt in eager.image_batches()
        for r in bt.to_pylist()
    )
    assert run(1) == run(2) == (eager_rows, [])
    monkeypatch.setattr(ingest, "iter_candidates", sabotaged)
    for workers in (1, 2):
        write_batch()
        rows, rejects = run(workers)
        assert rows == [r for r in eager_rows if r[0] in ("p0.jpg", "p2.jpg")]
        assert rejects == [("p1.jpg", "missing_file"), ("p3.jpg", "symlink")]


# --------------------------------------------------------------------------- issue 30: big members


def _bmp(size: tuple[int, int]) -> bytes:
    """An uncompressed BMP (allowed format) of ``size``: over 8 MiB for 1800 x 1700."""
    ramp = np.tile(np.arange(size[0], dtype=np.uint8), (size[1], 1))
    return encoded(Image.fromarray(np.dstack([ramp, 255 - ramp, ramp // 2])), "BMP")


def _archive_with_a_big_member(source: Path, suffix: str, big: int, photo: bytes) -> None:
    """``<source>/001<suffix>``: a ``big``-byte member of zeros (an image name, not an image:
    a hole on disk for a plain tar), an 8+ MiB BMP and a small JPEG."""
    plain = source / "001.tar.plain"
    sparse_tar(
        plain, [("big.png", big), ("photo.bmp", photo), ("ok.jpg", solid_jpeg(color=(9,) * 3))]
    )
    if suffix == ".tar":
        plain.rename(source / "001.tar")
        return
    with open(plain, "rb") as src, gzip.open(source / f"001{suffix}", "wb", compresslevel=1) as out:
        shutil.copyfileobj(src, out, 1 << 20)
    plain.unlink()


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_a_big_archive_member_is_never_held_whole(tmp_path, monkeypatch, suffix):
    """A member far over the 8 MiB spool threshold (and under the per-file limit) goes
    through a temporary file and the blob store's staging copy, never through memory: the
    whole ingest (reading, hashing, decoding, storing; one inline worker, so this process
    does all of it) peaks well under the member's size. A big member that is an image is
    accepted with the same key and bytes as if it had been read whole."""
    big = 192 * MIB
    spool = tmp_path / "tmp"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    source = tmp_path / "landing" / "s"
    source.mkdir(parents=True)
    photo = _bmp((1800, 1700))
    assert len(photo) > STREAM_ABOVE_BYTES
    _archive_with_a_big_member(source, suffix, big, photo)
    (source / "000").mkdir()
    (source / "000" / "warm.jpg").write_bytes(solid_jpeg(color=(1, 1, 1)))
    (source / "000" / "_SUCCESS").write_text("")
    lab = Lab(tmp_path / "lab")
    sink = lab.local_blobs(IMAGES, "image")

    def ingest(key: str) -> BatchIngest:
        run = BatchIngest(resolve_batch(tmp_path / "landing", key), workers=1, blob_sink=sink)
        lab.replace_partition(IMAGES, key, run.image_batches(), stored_blobs=run.stored_blobs)
        lab.replace_partition(REJECTS, key, run.rejects)
        return run

    ingest("s.000")  # warm: Lance's first writes allocate what every later one reuses
    sink = lab.local_blobs(IMAGES, "image")
    run, growth = peak_rss_growth(lambda: ingest("s.001"))
    assert growth < big // 4, (
        f"peak RSS grew by {growth / MIB:.0f} MiB for a {big // MIB} MiB member"
    )
    assert (run.stats.seen, run.stats.accepted, run.stats.rejected) == (3, 2, 1)
    (refused,) = lab.read_batch(REJECTS.name, "s.001").to_pylist()
    assert (refused["path"], refused["reason"], refused["file_size"]) == (
        "big.png",
        "not_an_image",
        big,
    )
    assert refused["key"] == hashlib.sha256(bytes(big)).hexdigest()
    rows = {r["path"]: r for r in lab.read_batch(IMAGES.name, "s.001").to_pylist()}
    assert rows["photo.bmp"]["key"] == hashlib.sha256(photo).hexdigest()
    assert rows["photo.bmp"]["image"] == photo  # read back through the blob store, checked
    assert (rows["photo.bmp"]["width"], rows["photo.bmp"]["file_size"]) == (1800, len(photo))
    assert list(spool.iterdir()) == []  # every spooled member and its directory removed
    assert list((Path(sink.directory) / ".staging").iterdir()) == []
