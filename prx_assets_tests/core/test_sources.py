"""The landing zone as ingest reads it: complete batches only, folders, archives and manifests
kept inside their batch, names made printable without loss, oversize entries refused unread."""

import io
import json
import os
import socket
import tarfile
from pathlib import Path
from urllib.parse import unquote_to_bytes

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from prx_assets.core.ingest.sources import (
    DEFAULT_MAX_FILE_BYTES,
    BatchError,
    describe_batch,
    discover_batches,
    iter_candidates,
    resolve_batch,
)
from prx_assets.demo.jpegs import encoded, solid_jpeg
from prx_assets_tests.bounds import MIB, fail_after, peak_rss_growth, sparse_file
from prx_assets_tests.fixtures_files import sparse_tar

# The stand-in photo most of these tests land: 400 x 400, one colour (others vary the colour).
PHOTO = solid_jpeg((400, 400), (10, 20, 30))


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)


def test_discovery_needs_complete_batches_and_ignores_partial_names(tmp_path):
    src = tmp_path / "web"
    (src / "000").mkdir(parents=True)
    (src / "000" / "a.jpg").write_bytes(PHOTO)
    (src / "001").mkdir()
    (src / "001" / "_SUCCESS").write_text("")
    (src / ".002.partial").mkdir()
    (src / "003.tar.tmp").write_bytes(b"")
    (src / "004.parquet").write_bytes(b"")
    (src / "notes.md").write_text("not a batch")
    keys = [r.key for r in discover_batches(tmp_path)]
    assert keys == ["web.001", "web.004"]  # 000 lacks _SUCCESS; hidden/tmp ignored


def test_two_entries_with_one_key_are_refused(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "x.tar").write_bytes(b"")
    (tmp_path / "s" / "x.csv").write_text("path\n")
    with pytest.raises(BatchError, match="two landing entries"):
        discover_batches(tmp_path)


def test_folder_batch_reads_webdataset_sidecars(tmp_path):
    b = tmp_path / "s" / "000"
    b.mkdir(parents=True)
    (b / "cat.jpg").write_bytes(PHOTO)
    (b / "cat.txt").write_text("a cat on a sofa")
    (b / "cat.json").write_text(json.dumps({"url": "https://x/cat", "license": "CC0"}))
    (b / "readme.md").write_text("not an image")
    (b / "_SUCCESS").write_text("")
    (tmp_path / "s" / "_source.json").write_text(json.dumps({"license": "default-lic"}))
    ref = resolve_batch(tmp_path, "s.000")
    cands = {c.path: c for c in iter_candidates(ref)}
    assert set(cands) == {"cat.jpg", "readme.md"}
    cat = cands["cat.jpg"]
    assert (cat.alt_text, cat.url, cat.license, cat.source) == (
        "a cat on a sofa",
        "https://x/cat",
        "CC0",
        "s",
    )
    assert cands["readme.md"].error[0] == "unsupported_extension"


def test_archive_refuses_traversal_absolute_links_and_oversize(tmp_path):
    (tmp_path / "s").mkdir()
    path = tmp_path / "s" / "001.tar"
    link = tarfile.TarInfo("evil-link.jpg")
    link.type = tarfile.SYMTYPE
    link.linkname = "../../etc/passwd"
    hard = tarfile.TarInfo("hard.jpg")
    hard.type = tarfile.LNKTYPE
    hard.linkname = "ok.jpg"
    _tar(
        path,
        [
            (tarfile.TarInfo("ok.jpg"), PHOTO),
            (tarfile.TarInfo("ok.txt"), b"alt text"),
            (tarfile.TarInfo("../up.jpg"), PHOTO),
            (tarfile.TarInfo("a/../../up2.jpg"), PHOTO),
            (tarfile.TarInfo("/abs.jpg"), PHOTO),
            (link, None),
            (hard, None),
            (tarfile.TarInfo("big.jpg"), solid_jpeg((900, 900), (10, 20, 30))),
        ],
    )
    ref = resolve_batch(tmp_path, "s.001")
    cands = {c.path: c for c in iter_candidates(ref, max_file_bytes=6000)}
    assert cands["ok.jpg"].error is None and cands["ok.jpg"].alt_text == "alt text"
    for name in (
        "../up.jpg",
        "a/../../up2.jpg",
        "/abs.jpg",
        "evil-link.jpg",
        "hard.jpg",
    ):
        assert cands[name].error is not None and cands[name].error[0] == "unsafe_path", name
        assert cands[name].data is None
    assert cands["big.jpg"].error[0] == "too_large" and cands["big.jpg"].data is None
    # Nothing was written outside (nothing is extracted at all).
    assert not (tmp_path / "up.jpg").exists()


def test_damaged_archive_keeps_what_was_read_and_records_damage(tmp_path):
    (tmp_path / "s").mkdir()
    good = tmp_path / "good.tar"
    _tar(good, [(tarfile.TarInfo(f"{i}.jpg"), PHOTO) for i in range(3)])
    data = good.read_bytes()
    (tmp_path / "s" / "002.tar").write_bytes(data[: len(data) // 2 + 700])
    ref = resolve_batch(tmp_path, "s.002")
    cands = list(iter_candidates(ref))
    assert any(c.error and c.error[0] == "corrupt_archive" for c in cands)
    assert any(c.error is None for c in cands)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_manifest_paths_stay_inside_the_source_folder(tmp_path, fmt):
    src = tmp_path / "s"
    (src / "_files").mkdir(parents=True)
    (src / "_files" / "a.jpg").write_bytes(PHOTO)
    (tmp_path / "secret.jpg").write_bytes(PHOTO)
    rows = [
        {"path": "_files/a.jpg", "caption": "alt a", "licence": "L1", "url": "u1", "id": "7"},
        {"path": "../secret.jpg", "caption": None, "licence": None, "url": None, "id": None},
        {"path": "_files/gone.jpg", "caption": None, "licence": None, "url": None, "id": None},
    ]
    if fmt == "csv":
        lines = ["path,caption,licence,url,id"] + [
            ",".join("" if v is None else str(v) for v in r.values()) for r in rows
        ]
        (src / "003.csv").write_text("\n".join(lines) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(rows), src / "003.parquet")
    ref = resolve_batch(tmp_path, "s.003")
    cands = {c.path: c for c in iter_candidates(ref)}
    a = cands["_files/a.jpg"]
    assert (a.alt_text, a.license, a.url, a.source_id, a.error) == ("alt a", "L1", "u1", "7", None)
    assert cands["../secret.jpg"].error[0] == "unsafe_path"
    assert cands["_files/gone.jpg"].error[0] == "missing_file"


def test_manifest_without_path_column_is_a_clear_batch_error(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "004.csv").write_text("file_name,caption\nx.jpg,hi\n")
    ref = resolve_batch(tmp_path, "s.004")
    with pytest.raises(BatchError, match="no path column"):
        list(iter_candidates(ref))


def test_register_by_hand_validates_the_path(tmp_path):
    (tmp_path / "landing" / "s" / "007").mkdir(parents=True)
    with pytest.raises(BatchError, match="_SUCCESS"):
        describe_batch(tmp_path / "landing" / "s" / "007", tmp_path / "landing")
    (tmp_path / "landing" / "s" / "007" / "_SUCCESS").write_text("")
    assert describe_batch(tmp_path / "landing" / "s" / "007", tmp_path / "landing").key == "s.007"
    with pytest.raises(BatchError, match="not a <landing>"):
        describe_batch(tmp_path / "landing" / "s", tmp_path / "landing")


# --------------------------------------------------------------------------- issue 10: names


def _folder_batch(tmp_path: Path, chunk: str = "000") -> Path:
    b = tmp_path / "s" / chunk
    b.mkdir(parents=True)
    (b / "_SUCCESS").write_text("")
    return b


def _write_raw(directory: Path, raw_name: bytes, data: bytes) -> None:
    with open(os.path.join(os.fsencode(directory), raw_name), "wb") as fh:
        fh.write(data)


# Raw names a filesystem or tar can hold, and the printable path each must get.
HOSTILE_NAMES = {
    b"caf\xe9.jpg": "caf%E9.jpg",  # Latin-1, not UTF-8
    b"\xff\xfe.jpg": "%FF%FE.jpg",
    b"new\nline.jpg": "new%0Aline.jpg",
    b"esc\x1b[31m.jpg": "esc%1B[31m.jpg",
    b"100%.jpg": "100%25.jpg",
    "rtl\u202egpj.jpg".encode(): "rtl%E2%80%AEgpj.jpg",
    "café.jpg".encode(): "café.jpg",
}


def _assert_printable_and_lossless(paths: set[str]) -> None:
    for p in paths:
        p.encode("utf-8")  # a lone surrogate here is what failed the Lance write
        assert p.isprintable(), p
    assert {unquote_to_bytes(p) for p in paths} == set(HOSTILE_NAMES)


def test_folder_names_that_are_not_utf8_or_hold_controls_get_printable_lossless_paths(tmp_path):
    b = _folder_batch(tmp_path)
    for i, raw in enumerate(HOSTILE_NAMES):
        _write_raw(b, raw, solid_jpeg((400, 400), (i * 30, 0, 0)))
    _write_raw(b, b"caf\xe9.txt", b"alt text of the Latin-1 name")
    cands = {c.path: c for c in iter_candidates(resolve_batch(tmp_path, "s.000"))}
    assert set(cands) == set(HOSTILE_NAMES.values())
    _assert_printable_and_lossless(set(cands))
    assert all(c.error is None and c.data for c in cands.values())
    assert cands["caf%E9.jpg"].alt_text == "alt text of the Latin-1 name"


@pytest.mark.parametrize(
    ("fmt", "suffix"),
    [
        (tarfile.PAX_FORMAT, ".tar"),
        (tarfile.GNU_FORMAT, ".tar"),
        (tarfile.USTAR_FORMAT, ".tar"),
        (tarfile.PAX_FORMAT, ".tar.gz"),
    ],
)
def test_tar_member_names_that_are_not_utf8_get_printable_lossless_paths(tmp_path, fmt, suffix):
    (tmp_path / "s").mkdir()
    path = tmp_path / "s" / f"001{suffix}"
    mode = "w:gz" if suffix == ".tar.gz" else "w"
    with tarfile.open(path, mode, format=fmt, encoding="utf-8", errors="surrogateescape") as tar:
        for i, raw in enumerate(HOSTILE_NAMES):
            data = solid_jpeg((400, 400), (0, i * 30, 0))
            info = tarfile.TarInfo(raw.decode("utf-8", "surrogateescape"))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cands = {c.path: c for c in iter_candidates(resolve_batch(tmp_path, "s.001"))}
    assert set(cands) == set(HOSTILE_NAMES.values())
    _assert_printable_and_lossless(set(cands))
    assert all(c.error is None and c.data for c in cands.values())


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_manifest_paths_that_are_not_utf8_name_the_real_file(tmp_path, fmt):
    src = tmp_path / "s"
    (src / "_files").mkdir(parents=True)
    _write_raw(src / "_files", b"caf\xe9.jpg", PHOTO)
    if fmt == "csv":
        (src / "005.csv").write_bytes(b"path,caption\n_files/caf\xe9.jpg,une caf\xe9\n")
    else:
        table = pa.table({"path": pa.array([b"_files/caf\xe9.jpg"], pa.binary())})
        pq.write_table(table, src / "005.parquet")
    (c,) = iter_candidates(resolve_batch(tmp_path, "s.005"))
    assert c.path == "_files/caf%E9.jpg" and c.error is None and c.data == PHOTO
    if fmt == "csv":
        assert c.alt_text == "une caf\ufffd"  # metadata text: undecodable bytes replaced


def test_a_name_too_long_for_any_filesystem_is_rejected_as_bad_filename(tmp_path):
    (tmp_path / "s").mkdir()
    path = tmp_path / "s" / "006.tar"
    long_name = "d/" * 3000 + "x.jpg"  # PAX can hold it; no filesystem path can
    _tar_pax(path, [(long_name, PHOTO), ("ok.jpg", solid_jpeg((400, 400), (1, 2, 3)))])
    cands = list(iter_candidates(resolve_batch(tmp_path, "s.006")))
    bad = [c for c in cands if c.error and c.error[0] == "bad_filename"]
    assert len(bad) == 1 and bad[0].data is None
    assert len(bad[0].path) < 300 and "more bytes" in bad[0].path
    assert len(bad[0].error[1]) < 600
    assert any(c.path == "ok.jpg" and c.error is None for c in cands)


def _tar_pax(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


# --------------------------------------------------------------------------- issue 10: sizes


def test_default_limit_refuses_big_folder_files_before_reading_them(tmp_path):
    b = _folder_batch(tmp_path)
    sparse_file(b / "huge.jpg", 1536 * MIB)  # 1.5 GB, a hole on disk
    sparse_file(b / "just-over.png", DEFAULT_MAX_FILE_BYTES + 1)
    (b / "small.jpg").write_bytes(PHOTO)
    ref = resolve_batch(tmp_path, "s.000")
    cands, growth = peak_rss_growth(lambda: {c.path: c for c in iter_candidates(ref)})
    assert growth < 64 * MIB, f"peak RSS grew by {growth / MIB:.0f} MiB"
    for name, size in (("huge.jpg", 1536 * MIB), ("just-over.png", DEFAULT_MAX_FILE_BYTES + 1)):
        c = cands[name]
        assert c.error is not None and c.error[0] == "too_large", name
        assert c.data is None and c.size == size
        assert f"{DEFAULT_MAX_FILE_BYTES:,}" in c.error[1]
    assert cands["small.jpg"].error is None


def test_default_limit_refuses_big_tar_members_and_sample_groups_before_reading(tmp_path):
    (tmp_path / "s").mkdir()
    path = tmp_path / "s" / "001.tar"
    small = PHOTO
    sparse_tar(
        path,
        [
            # One WebDataset sample of 3 x 400 MB: each member is under the limit, the
            # sample (held in memory together) is not.
            ("sample.jpg", 400 * MIB),
            ("sample.png", 400 * MIB),
            ("sample.webp", 400 * MIB),
            ("huge.jpg", 600 * MIB),
            ("ok.jpg", small),
        ],
    )
    ref = resolve_batch(tmp_path, "s.001")
    cands, growth = peak_rss_growth(lambda: {c.path: c for c in iter_candidates(ref)})
    assert growth < 64 * MIB, f"peak RSS grew by {growth / MIB:.0f} MiB"
    for name in ("sample.jpg", "sample.png", "sample.webp", "huge.jpg"):
        assert cands[name].error[0] == "too_large", name
        assert cands[name].data is None
    assert "sample" in cands["sample.png"].error[1] and cands["sample.png"].size == 400 * MIB
    assert cands["ok.jpg"].error is None and cands["ok.jpg"].data == small


@pytest.mark.parametrize(
    "kind",
    [tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME],
    ids=["pax", "global", "gnu"],
)
def test_a_huge_extended_header_is_refused_before_it_is_read(tmp_path, kind):
    """tarfile reads a pax or GNU long-name header whole before its member: 800 MB of
    header (a hole on disk) would sit in memory. It is refused by its size instead."""
    (tmp_path / "s").mkdir()
    path = tmp_path / "s" / "003.tar"
    small = PHOTO
    sparse_tar(path, [("ok.jpg", small), ("later.jpg", small)])
    first = tarfile.TarInfo("ok.jpg")
    first.size = len(small)
    start = len(first.tobuf(format=tarfile.PAX_FORMAT)) + -(-len(small) // 512) * 512
    header = tarfile.TarInfo("././@PaxHeader" if kind != tarfile.GNUTYPE_LONGNAME else "x")
    header.type, header.size = kind, 800 * MIB
    with open(path, "r+b") as fh:  # the extended header goes between the two members
        rest = (fh.seek(start), fh.read())[1]
        fh.seek(start)
        fh.write(header.tobuf(format=tarfile.USTAR_FORMAT))
        fh.seek(start + 512 + header.size)
        fh.write(rest)
    ref = resolve_batch(tmp_path, "s.003")
    cands, growth = peak_rss_growth(lambda: list(iter_candidates(ref)))
    assert growth < 64 * MIB, f"peak RSS grew by {growth / MIB:.0f} MiB"
    assert [c.path for c in cands if c.error is None] == ["ok.jpg"]  # what came before
    damage = [c.error for c in cands if c.error]
    assert len(damage) == 1 and damage[0][0] == "corrupt_archive"
    assert f"{800 * MIB:,} bytes" in damage[0][1] and "1,048,576-byte limit" in damage[0][1]


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_a_compressed_archive_is_read_once_and_an_oversized_sample_still_refused(tmp_path):
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, (600, 600, 3), dtype=np.uint8) for _ in range(4)]
    # incompressible JPEGs: the .tar.gz is about as big as its members
    photos = [encoded(Image.fromarray(a), "JPEG", quality=95) for a in noise]
    limit = len(photos[0]) + len(photos[1]) - 1  # "big" (two members) is over it
    (tmp_path / "s").mkdir()
    path = tmp_path / "s" / "004.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [
            ("a.jpg", photos[0]),
            ("big.jpg", photos[1]),
            ("big.png", photos[0]),
            ("c.jpg", photos[2]),
            ("d.jpg", photos[3]),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ref = resolve_batch(tmp_path, "s.004")
    before = _bytes_read()
    cands = {c.path: c for c in iter_candidates(ref, limit)}
    read = _bytes_read() - before
    size = path.stat().st_size
    assert read < 1.5 * size, f"read {read:,} bytes of a {size:,}-byte archive"
    assert [p for p, c in cands.items() if c.error is None] == ["a.jpg", "c.jpg", "d.jpg"]
    for name in ("big.jpg", "big.png"):
        assert cands[name].error[0] == "too_large" and "sample 'big'" in cands[name].error[1]
        assert cands[name].data is None
    assert cands["d.jpg"].data == photos[3]


def test_manifest_rows_over_the_limit_are_refused_before_reading(tmp_path):
    src = tmp_path / "s"
    (src / "_files").mkdir(parents=True)
    sparse_file(src / "_files" / "huge.jpg", 1536 * MIB)
    (src / "007.csv").write_text("path\n_files/huge.jpg\n")
    ref = resolve_batch(tmp_path, "s.007")
    cands, growth = peak_rss_growth(lambda: list(iter_candidates(ref)))
    assert growth < 64 * MIB, f"peak RSS grew by {growth / MIB:.0f} MiB"
    assert [c.error[0] for c in cands] == ["too_large"]


def test_the_file_size_limit_is_configurable_and_inclusive(tmp_path):
    b = _folder_batch(tmp_path)
    (b / "at.jpg").write_bytes(b"x" * 1000)
    (b / "over.jpg").write_bytes(b"x" * 1001)
    cands = {c.path: c for c in iter_candidates(resolve_batch(tmp_path, "s.000"), 1000)}
    assert cands["at.jpg"].error is None and cands["at.jpg"].data == b"x" * 1000
    assert cands["over.jpg"].error[0] == "too_large" and cands["over.jpg"].data is None


# --------------------------------------------------------------------------- issue 10: kinds


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_manifest_rows_naming_directories_or_fifos_are_not_a_file(tmp_path, fmt):
    src = tmp_path / "s"
    (src / "_files" / "a-dir.jpg").mkdir(parents=True)
    os.mkfifo(src / "_files" / "pipe.jpg")
    paths = ["_files/a-dir.jpg", "_files/pipe.jpg", "_files/gone.jpg"]
    if fmt == "csv":
        (src / "008.csv").write_text("path\n" + "\n".join(paths) + "\n")
    else:
        pq.write_table(pa.table({"path": paths}), src / "008.parquet")
    with fail_after(10):
        cands = {c.path: c for c in iter_candidates(resolve_batch(tmp_path, "s.008"))}
    assert cands["_files/a-dir.jpg"].error[0] == "not_a_file"
    assert "directory" in cands["_files/a-dir.jpg"].error[1]
    assert cands["_files/pipe.jpg"].error[0] == "not_a_file"
    assert "FIFO" in cands["_files/pipe.jpg"].error[1]
    assert cands["_files/gone.jpg"].error[0] == "missing_file"


def test_folder_special_files_and_symlinks_are_counted_as_rejections(tmp_path):
    b = _folder_batch(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "hidden-photo.jpg").write_bytes(PHOTO)
    (outside / "cat.txt").write_text("alt text from outside the batch")
    (b / "cat.jpg").write_bytes(solid_jpeg((400, 400), (5, 5, 5)))
    (b / "cat.txt").symlink_to(outside / "cat.txt")  # a symlinked sidecar
    (b / "linked-dir").symlink_to(outside, target_is_directory=True)
    (b / "link.jpg").symlink_to(outside / "hidden-photo.jpg")
    (b / "inside-link.jpg").symlink_to(b / "cat.jpg")
    os.mkfifo(b / "pipe.jpg")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(b / "sock.jpg"))
        (b / "ok.jpg").write_bytes(solid_jpeg((400, 400), (9, 9, 9)))
        with fail_after(10):
            cands = {c.path: c for c in iter_candidates(resolve_batch(tmp_path, "s.000"))}
    reasons = {p: (c.error[0] if c.error else None) for p, c in cands.items()}
    assert reasons == {
        "cat.jpg": "bad_sidecar",  # its metadata (URL, id, licence) is not trusted
        "cat.txt": "symlink",
        "linked-dir": "symlink",
        "link.jpg": "symlink",
        "inside-link.jpg": "symlink",
        "pipe.jpg": "not_a_file",
        "sock.jpg": "not_a_file",
        "ok.jpg": None,
    }
    assert "cat.txt" in cands["cat.jpg"].error[1]
    assert all(c.data is None for p, c in cands.items() if p != "ok.jpg")


def test_names_differing_only_in_extension_case_are_all_seen(tmp_path):
    b = _folder_batch(tmp_path)
    (b / "a.jpg").write_bytes(solid_jpeg((400, 400), (1, 1, 1)))
    (b / "a.JPG").write_bytes(solid_jpeg((400, 400), (2, 2, 2)))
    paths = sorted(c.path for c in iter_candidates(resolve_batch(tmp_path, "s.000")))
    assert paths == ["a.JPG", "a.jpg"]


def test_a_malformed_json_sidecar_refuses_its_image(tmp_path):
    b = _folder_batch(tmp_path)
    (b / "x.jpg").write_bytes(PHOTO)
    (b / "x.json").write_text('{"url": "https://x/1", ')
    cands = {c.path: c for c in iter_candidates(resolve_batch(tmp_path, "s.000"))}
    assert cands["x.json"].error[0] == "bad_sidecar"
    assert cands["x.jpg"].error[0] == "bad_sidecar" and cands["x.jpg"].data is None


def test_a_fifo_named_like_an_archive_or_manifest_is_a_clear_batch_error(tmp_path):
    (tmp_path / "s").mkdir()
    for name in ("009.tar", "010.csv"):
        os.mkfifo(tmp_path / "s" / name)
    for key in ("s.009", "s.010"):
        with fail_after(10), pytest.raises(BatchError, match="FIFO"):
            list(iter_candidates(resolve_batch(tmp_path, key)))


# --------------------------------------------------------------------------- issue 30: names


def test_a_folder_file_with_dots_in_its_stem_is_an_image_with_its_sidecars(tmp_path):
    b = _folder_batch(tmp_path)
    (b / "IMG.2019.07.14.jpg").write_bytes(PHOTO)
    (b / "IMG.2019.07.14.txt").write_text("a beach in July")
    (b / "IMG.2019.07.14.json").write_text(json.dumps({"url": "https://x/beach", "id": "7"}))
    (b / "photo.final.PNG").write_bytes(solid_jpeg((400, 400), (1, 2, 3)))  # any case, no sidecar
    (b / "notes.v2.md").write_text("not an image")
    cands = {c.path: c for c in iter_candidates(resolve_batch(tmp_path, "s.000"))}
    assert set(cands) == {"IMG.2019.07.14.jpg", "photo.final.PNG", "notes.v2.md"}
    beach = cands["IMG.2019.07.14.jpg"]
    assert beach.error is None and beach.data is not None
    assert (beach.alt_text, beach.url, beach.source_id) == (
        "a beach in July",
        "https://x/beach",
        "7",
    )
    assert cands["photo.final.PNG"].error is None
    assert cands["notes.v2.md"].error[0] == "unsupported_extension"


def test_archives_keep_the_webdataset_first_dot_grouping(tmp_path):
    # In a tar the key is the name up to the first dot: ``a.seg.png`` is a member of
    # sample ``a`` (extension ``.seg.png``, not an image), and ``a.txt`` is its alt text.
    (tmp_path / "s").mkdir()
    _tar_pax(
        tmp_path / "s" / "000.tar",
        [
            ("a.jpg", PHOTO),
            ("a.seg.png", solid_jpeg((400, 400), (9, 9, 9))),
            ("a.txt", b"a red square"),
        ],
    )
    cands = {c.path: c for c in iter_candidates(resolve_batch(tmp_path, "s.000"))}
    assert set(cands) == {"a.jpg", "a.seg.png"}
    assert cands["a.jpg"].error is None and cands["a.jpg"].alt_text == "a red square"
    assert cands["a.seg.png"].error[0] == "unsupported_extension"


def test_a_step_resolves_its_batch_without_inspecting_the_others(tmp_path, monkeypatch):
    """Why: ``resolve_batch`` ran ``discover_batches``, which stats every entry's marker, on
    every step (10^5 landed batches: seconds before any work). Only entries whose names map
    to the key are looked at now, with the same answers and refusals."""
    import prx_assets.core.ingest.sources as sources

    for i in range(30):
        (tmp_path / "s" / f"{i:03d}").mkdir(parents=True)
        (tmp_path / "s" / f"{i:03d}" / "_SUCCESS").write_text("")
    (tmp_path / "s" / "a b").mkdir()  # maps to s.a-b
    (tmp_path / "s" / "a b" / "_SUCCESS").write_text("")
    (tmp_path / "s" / "open").mkdir()  # no marker: not a batch yet
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.tar").write_bytes(b"")  # t.x twice: refused wherever it is asked
    (tmp_path / "t" / "x.csv").write_text("path\n")
    inspected: list[str] = []
    real = sources._chunk_name

    def counted(entry: Path):  # noqa: ANN202
        inspected.append(entry.name)
        return real(entry)

    monkeypatch.setattr(sources, "_chunk_name", counted)
    ref = resolve_batch(tmp_path, "s.007")
    assert (ref.key, ref.kind, ref.path) == ("s.007", "folder", tmp_path / "s" / "007")
    assert inspected == ["007"]
    assert resolve_batch(tmp_path, "s.a-b").path == tmp_path / "s" / "a b"
    for missing in ("s.open", "s.999", "u.007", "s.007.x", "no-dot"):
        with pytest.raises(BatchError, match="no complete batch"):
            resolve_batch(tmp_path, missing)
    with pytest.raises(BatchError, match="two landing entries"):
        resolve_batch(tmp_path, "t.x")
    (tmp_path / "s" / "a-b").mkdir()  # a second entry for s.a-b
    (tmp_path / "s" / "a-b" / "_SUCCESS").write_text("")
    with pytest.raises(BatchError, match="two landing entries"):
        resolve_batch(tmp_path, "s.a-b")
    monkeypatch.setattr(sources, "_chunk_name", real)
    with pytest.raises(BatchError, match="two landing entries"):
        discover_batches(tmp_path)  # the whole zone: refused as before


def test_folder_paths_are_relative_to_the_batch_at_any_depth(tmp_path):
    """The listing names each file by its path under the batch (sliced from the walked path,
    not ``relpath``): nested folders keep their sidecars, and only the batch's own
    ``_SUCCESS`` is the marker (a nested one is a file like any other)."""
    b = tmp_path / "s" / "000"
    (b / "a" / "b").mkdir(parents=True)
    (b / "top.jpg").write_bytes(PHOTO)
    (b / "a" / "mid.jpg").write_bytes(PHOTO)
    (b / "a" / "b" / "deep.jpg").write_bytes(PHOTO)
    (b / "a" / "b" / "deep.txt").write_text("deep alt")
    (b / "a" / "_SUCCESS").write_text("")
    (b / "_SUCCESS").write_text("")
    for landing in (tmp_path, Path(os.path.relpath(tmp_path))):
        cands = {c.path: c for c in iter_candidates(resolve_batch(landing, "s.000"))}
        assert set(cands) == {"top.jpg", "a/mid.jpg", "a/b/deep.jpg", "a/_SUCCESS"}
        assert cands["a/b/deep.jpg"].alt_text == "deep alt"
        assert cands["a/_SUCCESS"].error[0] == "unsupported_extension"
