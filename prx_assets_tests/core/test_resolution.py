"""The resolution runner on a real lab: batches ingested from real files, then profiled."""

from __future__ import annotations

from pathlib import Path

import pytest

from prx_assets.core.ingest.runner import BatchIngest
from prx_assets.core.ingest.sources import resolve_batch
from prx_assets.core.lab import Lab
from prx_assets.core.resolution.runner import MissingImagesError, profile_batch
from prx_assets.core.tables import IMAGES, REJECTS, RESOLUTION
from prx_assets.demo.jpegs import solid_jpeg

# name -> (width, height): what the tier rule says about each is spelt out in the test.
SIZES = {
    "narrow.jpg": (300, 500),  # short side under 384: not used
    "small.jpg": (400, 400),  # fills no 512 shape: 512 with a recorded upscale
    "square.jpg": (600, 600),  # fills 512x512
    "large.jpg": (1100, 1100),  # fills 1024x1024
}


def _ingest(lab: Lab, landing: Path, batch: str, files: dict[str, bytes]) -> None:
    source, chunk = batch.split(".")
    folder = landing / source / chunk
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "_SUCCESS").write_text("")
    run = BatchIngest(resolve_batch(landing, batch))
    lab.replace_partition(IMAGES, batch, run.image_batches())
    lab.replace_partition(REJECTS, batch, run.rejects)


def _sorted_rows(lab: Lab, batch: str) -> list[dict]:
    rows = lab.read_batch(RESOLUTION.name, batch).to_pylist()
    return sorted(rows, key=lambda r: r["key"])


@pytest.fixture
def lab(tmp_path) -> Lab:
    lab = Lab(tmp_path / "lab")
    files = {
        name: solid_jpeg(size, (i * 40, 90, 200 - i * 40))
        for i, (name, size) in enumerate(SIZES.items())
    }
    _ingest(lab, tmp_path / "landing", "s.000", files)
    _ingest(lab, tmp_path / "landing", "s.001", {"other.jpg": solid_jpeg((700, 500), (7, 90, 193))})
    return lab


def test_each_image_gets_its_eligibility_and_tier_in_one_commit(lab):
    other = profile_batch(lab, "s.001")
    before = _sorted_rows(lab, "s.001")
    version = lab.version(RESOLUTION.name)
    run = profile_batch(lab, "s.000")

    assert run.version == version + 1 == lab.version(RESOLUTION.name)  # one commit
    assert (run.rows_written, run.rows_replaced) == (4, 0)
    path_of = {r["key"]: r["path"] for r in lab.read_batch(IMAGES.name, "s.000").to_pylist()}
    by_path = {path_of[r["key"]]: r for r in _sorted_rows(lab, "s.000")}
    assert {p: (r["width"], r["height"]) for p, r in by_path.items()} == SIZES
    assert {p: r["eligible"] for p, r in by_path.items()} == {
        "narrow.jpg": False,
        "small.jpg": True,
        "square.jpg": True,
        "large.jpg": True,
    }
    assert by_path["narrow.jpg"]["ineligible_reason"] == "short_side_below_384"
    assert by_path["narrow.jpg"]["max_tier"] is None
    assert {p: by_path[p]["max_tier"] for p in ("small.jpg", "square.jpg", "large.jpg")} == {
        "small.jpg": 512,
        "square.jpg": 512,
        "large.jpg": 1024,
    }
    assert by_path["large.jpg"]["megapixels"] == pytest.approx(1.21)

    summary = run.summary
    assert (summary.images, summary.eligible) == (4, 3)
    assert summary.ineligible_reasons == {"short_side_below_384": 1}
    assert summary.tier_counts == {"512": 2, "1024": 1, "2048": 0, "4096": 0}
    assert summary.upscaled_to_lowest_tier == 1  # small.jpg only
    assert run.histogram_png.startswith(b"\x89PNG")
    assert _sorted_rows(lab, "s.001") == before and other.rows_written == 1  # untouched


def test_a_rerun_replaces_the_batch_with_the_same_rows(lab):
    profile_batch(lab, "s.000")
    rows = _sorted_rows(lab, "s.000")
    again = profile_batch(lab, "s.000")
    assert (again.rows_written, again.rows_replaced) == (4, 4)
    assert _sorted_rows(lab, "s.000") == rows
    assert lab.count(RESOLUTION.name) == 4


def test_only_the_recorded_sizes_are_read_never_the_image_bytes(lab):
    asked: list[list[str] | None] = []
    read_batch = lab.read_batch
    lab.read_batch = lambda table, batch, columns=None: (
        asked.append((table, columns)) or read_batch(table, batch, columns)
    )
    profile_batch(lab, "s.000")
    assert asked == [(IMAGES.name, ["key", "batch", "width", "height"])]


def test_without_an_images_table_the_run_refuses_instead_of_writing_an_empty_profile(tmp_path):
    lab = Lab(tmp_path / "lab")
    with pytest.raises(MissingImagesError, match="materialise raw_images for s.000"):
        profile_batch(lab, "s.000")
    assert not lab.exists(RESOLUTION.name)


def test_a_batch_whose_files_were_all_rejected_has_an_empty_profile(lab, tmp_path):
    _ingest(lab, tmp_path / "landing", "bad.000", {"broken.jpg": b"\xff\xd8 not a jpeg"})
    assert lab.count(REJECTS.name, "batch = 'bad.000'") == 1
    run = profile_batch(lab, "bad.000")
    assert (run.summary.images, run.rows_written) == (0, 0)
    assert lab.count(RESOLUTION.name, "batch = 'bad.000'") == 0
