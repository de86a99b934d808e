"""Ingest workers write the ``images`` rows themselves (one Lance fragment per chunk of
files) and the step commits once: the same table as the step's own write, the rows never
through the step, a repeat across chunks still refused, a killed worker costing nothing."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from prx_assets.core.ingest import runner as ingest
from prx_assets.core.ingest import sources
from prx_assets.core.ingest.runner import BatchIngest, ChunkTask, RowMeta, check_store_and_write
from prx_assets.core.ingest.sources import FileRead, resolve_batch
from prx_assets.core.lab import MANUAL, Lab
from prx_assets.core.lab import maintenance as mx
from prx_assets.core.tables import IMAGES, REJECTS
from prx_assets.demo.jpegs import solid_jpeg


def _jpeg(i: int) -> bytes:
    """Photo ``i``: its own size and colour, so its own key; calling it again makes a copy."""
    return solid_jpeg((96 + i, 64), (30 * i % 255, 90, 200 - 10 * i))


def _landing(root: Path) -> Path:
    """One folder batch: 11 photos, a truncated file, and byte-identical repeats of a photo
    both inside one chunk of 4 and across chunks (aliases)."""
    b = root / "landing" / "s" / "000"
    b.mkdir(parents=True)
    for i in range(11):
        (b / f"p{i:02d}.jpg").write_bytes(_jpeg(i))
    (b / "a_broken.jpg").write_bytes(_jpeg(3)[:-20])
    (b / "p00_copy.jpg").write_bytes(_jpeg(0))  # right after p00: same chunk
    (b / "zz_copy.jpg").write_bytes(_jpeg(1))  # last: another chunk than p01
    (b / "_SUCCESS").write_text("")
    return root / "landing"


def _table(lab: Lab) -> tuple[list[dict], list[dict]]:
    images = sorted(lab.read(IMAGES.name).to_pylist(), key=lambda r: r["key"])
    rejects = sorted(lab.read(REJECTS.name).to_pylist(), key=lambda r: r["path"])
    return images, rejects


def _by_step(landing: Path, lab: Lab) -> None:
    run = BatchIngest(
        resolve_batch(landing, "s.000"), workers=2, blob_sink=lab.local_blobs(IMAGES, "image")
    )
    lab.replace_partition(IMAGES, "s.000", run.image_batches(), stored_blobs=run.stored_blobs)
    lab.replace_partition(REJECTS, "s.000", run.rejects)


def _by_workers(landing: Path, lab: Lab, workers: int = 2) -> dict:
    run = BatchIngest(
        resolve_batch(landing, "s.000"),
        workers=workers,
        blob_sink=lab.local_blobs(IMAGES, "image"),
    )
    fragments = lab.partition_fragments(IMAGES, "s.000", stored_blobs=run.stored_blobs)
    written = run.write_images(fragments)
    result = lab.commit_partition(IMAGES, "s.000", written)
    lab.replace_partition(REJECTS, "s.000", run.rejects)
    result["fragments"] = sum(len(w.fragments) for w in written)
    return result


def test_workers_write_the_same_table_as_the_step_and_repeats_are_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "INGEST_CHUNK", 4)  # 14 files: 4 chunks, 4 fragments
    landing = _landing(tmp_path)
    step = Lab(tmp_path / "lab-step", policy=MANUAL)
    _by_step(landing, step)
    workers = Lab(tmp_path / "lab-workers", policy=MANUAL)
    result = _by_workers(landing, workers)

    assert result["rows_written"] == 11
    assert result["fragments"] == 4  # a fragment per chunk: none written by the step
    assert _table(workers) == _table(step)  # every column: thumbnails, previews, aliases
    images, rejects = _table(workers)
    assert {r["path"]: r["reason"] for r in rejects} == {
        "a_broken.jpg": "truncated",
        "p00_copy.jpg": "duplicate_bytes_in_batch",
        "zz_copy.jpg": "duplicate_bytes_in_batch",
    }
    assert all(r["preview"] and r["phash_thumbnail"] for r in images)
    # A rerun replaces the batch's rows with the same rows.
    again = _by_workers(landing, workers)
    assert again["rows_replaced"] == 11
    assert _table(workers) == _table(step)


def test_a_chunk_result_carries_references_not_pixels(tmp_path: Path) -> None:
    landing = _landing(tmp_path)
    lab = Lab(tmp_path / "lab", policy=MANUAL)
    fragments = lab.partition_fragments(IMAGES, "s.000", stored_blobs=("image",))
    folder = landing / "s" / "000"
    names = ["p00.jpg", "p00_copy.jpg", "a_broken.jpg", "p01.jpg"]
    items = tuple(
        (FileRead(os.fsencode(folder / n), 10 << 20), RowMeta(n, "s", None, None, None, None, None))
        for n in names
    )
    task = ChunkTask(items, 40_000_000, lab.local_blobs(IMAGES, "image"), fragments)
    out = check_store_and_write(task)
    assert out.positions == (0, 3)  # the in-chunk repeat and the broken file not written
    assert out.written is not None and out.written.rows == 2
    for pos in out.positions:
        key, (info, thumb, preview), stored, _ = out.checked[pos]
        assert stored and thumb is None and preview is None  # they went into the fragment
    assert out.checked[2][1][0] == "truncated"
    assert out.checked[1][1][2] is not None  # not written here: the step gets its preview

    # What the step receives for files written here: their checks and the fragment's
    # metadata, a few hundred bytes each, not their thumbnails and previews.
    names = [f"p{i:02d}.jpg" for i in range(8)]
    items = tuple(
        (FileRead(os.fsencode(folder / n), 10 << 20), RowMeta(n, "s", None, None, None, None, None))
        for n in names
    )
    out = check_store_and_write(ChunkTask(items, 40_000_000, task.sink, fragments))
    assert out.positions == tuple(range(8))
    pixels = BatchIngest(resolve_batch(landing, "s.000"), workers=1)
    previews = {
        r["path"]: len(r["preview"]) + len(r["phash_thumbnail"])
        for b in pixels.image_batches()
        for r in b.to_pylist()
    }
    per_file = len(pickle.dumps(out, protocol=5)) / len(names)
    assert per_file < 400, per_file
    assert per_file < min(previews[n] for n in names) / 4


def test_a_worker_killed_after_writing_its_fragment_costs_nothing(tmp_path: Path) -> None:
    """kill -9 of each worker right after its first fragment is written (crashpoint, in a
    fresh process so the pool's workers inherit it): the step checks those chunks' files
    again, writes their rows itself, and commits the same table; the dead workers' files
    are orphans, never rows."""
    landing = _landing(tmp_path)
    reference = Lab(tmp_path / "lab-ref", policy=MANUAL)
    _by_step(landing, reference)
    code = (
        "import sys; from pathlib import Path\n"
        "from prx_assets.core.ingest import runner as ingest\n"
        "from prx_assets.core.lab import MANUAL, Lab\n"
        "from prx_assets_tests.core.test_ingest_fragments import _by_workers\n"
        "ingest.INGEST_CHUNK = 4\n"
        "lab = Lab(sys.argv[2], policy=MANUAL)\n"
        "print(_by_workers(Path(sys.argv[1]), lab)['rows_written'])\n"
    )
    env = {**os.environ, "PRX_CRASH_AT": "ingest.chunk_written:1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(landing), str(tmp_path / "lab")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "11"
    lab = Lab(tmp_path / "lab", policy=MANUAL)
    assert _table(lab) == _table(reference)
    data = Path(lab.uri(IMAGES.name)) / "data"
    committed = {
        f.path for frag in lab.dataset(IMAGES.name).get_fragments() for f in frag.data_files()
    }
    assert len(list(data.iterdir())) > len(committed)  # the killed workers' files: orphans


def test_a_worker_that_does_not_see_the_shared_mount_refuses_its_chunk(tmp_path: Path) -> None:
    """``PRX_SHARED_FILESYSTEM=1`` set wrongly (a Ray node without the mount): the worker
    does not see the probe file the step just made, and refuses the chunk before touching
    any file (``write_images`` then fails the step on that refusal, rather than record the
    files as unreadable or commit rows stored on another machine)."""
    landing = _landing(tmp_path)
    lab = Lab(tmp_path / "lab", policy=MANUAL)
    fragments = lab.partition_fragments(IMAGES, "s.000", stored_blobs=("image",))
    folder = landing / "s" / "000"
    items = (
        (
            FileRead(os.fsencode(folder / "p00.jpg"), 10 << 20),
            RowMeta("p00.jpg", "s", None, None, None, None, None),
        ),
    )
    sink = lab.local_blobs(IMAGES, "image")
    task = ChunkTask(items, 40_000_000, sink, fragments, probe=str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match=ingest.NOT_SHARED):
        check_store_and_write(task)
    assert not [p for p in Path(sink.directory).rglob("*") if p.is_file()]  # nothing stored


def test_fragments_whose_files_are_missing_are_never_committed(tmp_path: Path) -> None:
    """A worker's fragment whose file this lab cannot see (written on a node without the
    mount, or removed) fails the commit; the batch keeps its previous rows."""
    landing = _landing(tmp_path)
    lab = Lab(tmp_path / "lab", policy=MANUAL)
    _by_workers(landing, lab)
    before = _table(lab)
    run = BatchIngest(resolve_batch(landing, "s.000"), blob_sink=lab.local_blobs(IMAGES, "image"))
    fragments = lab.partition_fragments(IMAGES, "s.000", stored_blobs=run.stored_blobs)
    written = run.write_images(fragments)
    gone = written[0].metadata()[0].data_files()[0].path
    (Path(lab.uri(IMAGES.name)) / "data" / gone).unlink()
    with pytest.raises(FileNotFoundError, match="not in the lab"):
        lab.commit_partition(IMAGES, "s.000", written)
    assert _table(lab) == before


def test_the_commits_compaction_rewrites_the_rows_on_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of more chunks than the index lag makes its commit compact them: the rows
    (thumbnails, previews) are rewritten by the pool's workers through Lance's distributed
    compaction, the step plans and commits; the table is the step path's all the same."""
    monkeypatch.setattr(ingest, "INGEST_CHUNK", 2)  # 14 files: 7 chunks, more than the lag (4)
    landing = _landing(tmp_path)
    step = Lab(tmp_path / "lab-step", policy=MANUAL)
    _by_step(landing, step)
    lab = Lab(tmp_path / "lab-workers")  # the default policy: the write path maintains
    _by_workers(landing, lab)  # the first commit builds the indexes over its fragments

    run = BatchIngest(
        resolve_batch(landing, "s.000"), workers=2, blob_sink=lab.local_blobs(IMAGES, "image")
    )
    written = run.write_images(lab.partition_fragments(IMAGES, "s.000", run.stored_blobs))
    on_workers = run.rewrite_on_workers()
    assert on_workers is not None  # the workers wrote the rows: they reach the lab
    jobs: list = []

    def recording(fn, items):
        jobs.extend(items)
        return on_workers(fn, items)

    lab.rewrite = recording
    result = lab.commit_partition(IMAGES, "s.000", written)
    lab.rewrite = None
    lab.replace_partition(REJECTS, "s.000", run.rejects)

    assert sum(len(w.fragments) for w in written) > lab.policy.index_lag_fragments
    assert result["maintenance"]["fragments_compacted"] >= 2, result["maintenance"]
    assert jobs and all(isinstance(j, mx.CompactionJob) for j in jobs)
    assert {f.id for j in jobs for f in j.task.fragments} <= {
        f.fragment_id for f in lab.dataset(IMAGES.name, result["version"]).get_fragments()
    }  # the tasks rewrote this commit's fragments
    assert len(lab.dataset(IMAGES.name).get_fragments()) < sum(len(w.fragments) for w in written)
    assert _table(lab) == _table(step)


def test_a_step_path_ingest_keeps_compaction_in_the_step(tmp_path: Path) -> None:
    """Where the workers did not write the rows (one worker: inline), the commit's
    compaction is not sent anywhere."""
    lab = Lab(tmp_path / "lab", policy=MANUAL)
    run = BatchIngest(
        resolve_batch(_landing(tmp_path), "s.000"),
        workers=1,
        blob_sink=lab.local_blobs(IMAGES, "image"),
    )
    run.write_images(lab.partition_fragments(IMAGES, "s.000", run.stored_blobs))
    assert run.rewrite_on_workers() is None


def _landing_with_sidecars(root: Path) -> Path:
    """Samples whose metadata is in sidecars: alt text and JSON, a malformed JSON sidecar of
    one image and of a two-image sample, an oversized sidecar (refused from its size, never
    read), and a byte-identical repeat carrying its own URL (an alias of the copy kept)."""
    b = root / "landing" / "s" / "000"
    b.mkdir(parents=True)
    for i in range(6):
        (b / f"p{i:02d}.jpg").write_bytes(_jpeg(i))
    (b / "p00.txt").write_text("a red <b>chair</b> & a lamp")
    (b / "p00.json").write_text(json.dumps({"url": "https://ex.org/p00", "license": "cc-by"}))
    (b / "p01.json").write_text("{not json")
    (b / "p02.png").write_bytes(solid_jpeg((40, 30), (9, 9, 9)))  # a JPEG named .png
    (b / "p02.json").write_text("[1, 2]")  # two images share this malformed sidecar
    (b / "p03.txt").write_bytes(b"x" * (sources.MAX_SIDECAR_BYTES + 1))
    (b / "p04.json").write_text(json.dumps({"id": "src-4", "source": "museum"}))
    (b / "p05_again.jpg").write_bytes(_jpeg(0))  # repeat of p00
    (b / "p05_again.json").write_text(json.dumps({"url": "https://mirror.ex/p00"}))
    (b / "_SUCCESS").write_text("")
    return root / "landing"


def test_workers_read_the_sidecars_and_the_tables_are_the_step_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk workers read each sample's sidecars with its image: this process opens
    none (its ``FileRead.read`` refuses sidecars here; the workers are other processes), and
    the images and rejects are the step path's, reasons, aliases' URLs and counts included."""
    monkeypatch.setattr(ingest, "INGEST_CHUNK", 3)  # the two-image sample spans chunks
    landing = _landing_with_sidecars(tmp_path)
    step = Lab(tmp_path / "lab-step", policy=MANUAL)
    _by_step(landing, step)

    read = sources.FileRead.read

    def not_sidecars(self: sources.FileRead) -> bytes:
        assert os.path.splitext(self.path)[1].decode() not in sources.SIDECAR_EXTENSIONS, (
            f"the step read the sidecar {self.path!r}"
        )
        return read(self)

    monkeypatch.setattr(sources.FileRead, "read", not_sidecars)
    workers = Lab(tmp_path / "lab-workers", policy=MANUAL)
    run = BatchIngest(
        resolve_batch(landing, "s.000"), workers=2, blob_sink=workers.local_blobs(IMAGES, "image")
    )
    written = run.write_images(workers.partition_fragments(IMAGES, "s.000", run.stored_blobs))
    workers.commit_partition(IMAGES, "s.000", written)
    workers.replace_partition(REJECTS, "s.000", run.rejects)

    assert _table(workers) == _table(step)
    images, rejects = _table(workers)
    by_path = {r["path"]: r for r in images}
    assert by_path["p00.jpg"]["alt_text"] == "a red <b>chair</b> & a lamp"
    assert (by_path["p00.jpg"]["url"], by_path["p00.jpg"]["license"]) == (
        "https://ex.org/p00",
        "cc-by",
    )
    assert (by_path["p04.jpg"]["source_id"], by_path["p04.jpg"]["source"]) == ("src-4", "museum")
    reasons = {r["path"]: r["reason"] for r in rejects}
    assert reasons == {
        "p01.json": "bad_sidecar",
        "p01.jpg": "bad_sidecar",
        "p02.json": "bad_sidecar",  # recorded once for its two images
        "p02.jpg": "bad_sidecar",
        "p02.png": "bad_sidecar",
        "p03.txt": "too_large",
        "p03.jpg": "bad_sidecar",
        "p05_again.jpg": "duplicate_bytes_in_batch",
    }
    alias = next(r for r in rejects if r["path"] == "p05_again.jpg")
    assert alias["url"] == "https://mirror.ex/p00"  # from the sidecar a worker read
    assert run.stats.seen == run.stats.accepted + run.stats.rejected == 11
