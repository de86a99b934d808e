import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from prx_assets.core.sources import (
    BatchError,
    describe_batch,
    discover_batches,
    iter_candidates,
    resolve_batch,
)


def _jpeg(color=(10, 20, 30), size=(400, 400)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "JPEG")
    return buf.getvalue()


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
    (src / "000" / "a.jpg").write_bytes(_jpeg())
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
    (b / "cat.jpg").write_bytes(_jpeg())
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
            (tarfile.TarInfo("ok.jpg"), _jpeg()),
            (tarfile.TarInfo("ok.txt"), b"alt text"),
            (tarfile.TarInfo("../up.jpg"), _jpeg()),
            (tarfile.TarInfo("a/../../up2.jpg"), _jpeg()),
            (tarfile.TarInfo("/abs.jpg"), _jpeg()),
            (link, None),
            (hard, None),
            (tarfile.TarInfo("big.jpg"), _jpeg(size=(900, 900))),
        ],
    )
    ref = resolve_batch(tmp_path, "s.001")
    cands = {c.path: c for c in iter_candidates(ref, max_member_bytes=6000)}
    assert cands["ok.jpg"].error is None and cands["ok.jpg"].alt_text == "alt text"
    for name in (
        "../up.jpg",
        "a/../../up2.jpg",
        "/abs.jpg",
        "evil-link.jpg",
        "hard.jpg",
        "big.jpg",
    ):
        assert cands[name].error is not None and cands[name].error[0] == "unsafe_path", name
        assert cands[name].data is None
    # Nothing was written outside (nothing is extracted at all).
    assert not (tmp_path / "up.jpg").exists()


def test_damaged_archive_keeps_what_was_read_and_records_damage(tmp_path):
    (tmp_path / "s").mkdir()
    good = tmp_path / "good.tar"
    _tar(good, [(tarfile.TarInfo(f"{i}.jpg"), _jpeg()) for i in range(3)])
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
    (src / "_files" / "a.jpg").write_bytes(_jpeg())
    (tmp_path / "secret.jpg").write_bytes(_jpeg())
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
