"""The dedup runners on a real lab built from the demo photos (real ingest, real Lance).

``CountingLab`` is a real ``Lab`` that also records every read (``Lab.read`` and the reads of
its views), so the tests can say how often a run read what: the double-work proof.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from PIL import Image

from prx_assets.core.dedup.corpus import lookup_by_keys
from prx_assets.core.dedup.decisions import DedupSettings
from prx_assets.core.dedup.dirty import read_dirty
from prx_assets.core.dedup.phash import hash_to_int64, phash_bytes
from prx_assets.core.dedup.runner import BatchClusters, BatchHashes, InputNotReady
from prx_assets.core.ingest.runner import BatchIngest
from prx_assets.core.ingest.sources import batch_key, resolve_batch
from prx_assets.core.lab import Lab, LabView, TableSpec
from prx_assets.core.resolution.profile import profile_images
from prx_assets.core.tables import (
    DEDUP_DIRTY,
    DEDUP_STATE,
    IMAGE_HASHES,
    IMAGES,
    PHASH_CLUSTERS,
    RESOLUTION,
)
from prx_assets.core.workers import InlinePool
from prx_assets.demo.jpegs import encoded
from prx_assets_tests.conftest import PHOTOS

S0 = DedupSettings()


class CountingView(LabView):
    def read(self, table: str, columns=None, filter=None, **scan: Any) -> pa.Table:
        self.lab.reads.append((table, filter))
        return super().read(table, columns, filter, **scan)


class CountingLab(Lab):
    """A real lab; ``reads`` lists (table, filter) of every read made through it."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, str | None]] = []

    def read(self, table, columns=None, filter=None, version=None) -> pa.Table:
        self.reads.append((table, filter))
        return super().read(table, columns, filter, version)

    def view(self, versions=None) -> CountingView:
        return CountingView(self, versions)

    def count_reads(self, table: str, *, filter_starts: str = "", has: str = "") -> int:
        return sum(
            1
            for t, f in self.reads
            if t == table and (f or "").startswith(filter_starts) and has in (f or "")
        )


def png(name: str, level: int = 6, size: tuple[int, int] | None = None) -> bytes:
    """A demo photo as PNG: the same pixels at another compression level are other bytes
    (another key, another file size) with the same hash."""
    img = Image.open(PHOTOS / name).convert("RGB")
    if size:
        img = img.resize(size, Image.Resampling.LANCZOS)
    return encoded(img, "PNG", compress_level=level)


def land_and_ingest(lab: Lab, landing: Path, chunk: str, files: dict[str, bytes]) -> str:
    """A landing folder through the real ingest and resolution logic into the lab."""
    folder = landing / "src" / chunk
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "_SUCCESS").write_text("")
    key = batch_key("src", chunk)
    run = BatchIngest(resolve_batch(landing, key))
    lab.replace_partition(IMAGES, key, run.image_batches())
    images = lab.read_batch(IMAGES.name, key, ["key", "batch", "width", "height"])
    lab.replace_partition(RESOLUTION, key, profile_images(images))
    return key


def key_of(lab: Lab, batch: str, path: str) -> str:
    rows = lab.read_batch(IMAGES.name, batch, ["key", "path"]).to_pylist()
    return next(r["key"] for r in rows if r["path"] == path)


def decide(lab: Lab, batch: str, settings: DedupSettings = S0, chunk: int = 2):
    BatchHashes(lab, batch, settings, read_chunk=2).run()
    return BatchClusters(lab, batch, settings, lookup_chunk=chunk).run()


def sorted_rows(lab: Lab, spec: TableSpec, columns: Sequence[str] | None = None) -> pa.Table:
    return lab.read(spec.name, columns).sort_by([("batch", "ascending"), ("key", "ascending")])


# --------------------------------------------------------------------------- BatchHashes


def test_batch_hashes_hashes_every_profiled_image_and_verifies_what_it_stored(tmp_path):
    lab = Lab(tmp_path / "lab")
    files = {"astronaut.png": png("astronaut.png"), "rocket.png": png("rocket.jpg")}
    files["small.png"] = png("chelsea.png")  # 451x300: under the 384 px cutoff
    batch = land_and_ingest(lab, tmp_path / "landing", "000", files)
    out = BatchHashes(lab, batch, S0, read_chunk=1).run()  # one image per chunk
    # The small copy is hashed too (not eligible for training): an opt-out naming only it
    # must reach its larger copies through their cluster.
    assert (out.to_hash, out.ineligible, out.hashed, out.low_information) == (3, 1, 3, 0)
    assert out.coverage.complete and out.coverage.missing == []
    # Hashed from the thumbnails ingest stored from its validation decode: no bytes read
    # (test_ingest_thumbnails.py proves they are the hasher's own, bit for bit).
    assert out.bytes_read == 0
    # The reported version is the commit that holds these rows (index commits follow it).
    at = lab.read(IMAGE_HASHES.name, ["key"], version=out.lance_version).column("key")
    assert sorted(at.to_pylist()) == sorted(
        lab.read(IMAGE_HASHES.name, ["key"]).column("key").to_pylist()
    )
    assert lab.read(IMAGE_HASHES.name, ["key"], version=out.lance_version - 1).num_rows == 0
    stored = {r["key"]: r for r in lab.read_batch(IMAGE_HASHES.name, batch).to_pylist()}
    for path in ("astronaut.png", "rocket.png", "small.png"):
        row = stored[key_of(lab, batch, path)]
        want = phash_bytes(files[path], "fast")
        assert row["phash"] == hash_to_int64(want.hash) and row["phash_version"] == "fast-v1"
        w, h = Image.open(io.BytesIO(files[path])).size
        assert row["pixels"] == w * h and row["file_size"] == len(files[path])
    # A rerun stores the same rows.
    before = sorted_rows(lab, IMAGE_HASHES)
    BatchHashes(lab, batch, S0).run()
    assert sorted_rows(lab, IMAGE_HASHES).equals(before)


def test_workers_write_the_hash_rows_and_a_failed_chunk_is_written_by_the_step(
    tmp_path, monkeypatch
):
    """Process workers read their chunk's thumbnails and write the rows as fragments (the
    step commits them once); the rows are the step path's, bit for bit. A chunk whose
    worker fails is hashed and written by the step: the same rows, none lost."""
    from prx_assets.core.dedup import runner

    lab = Lab(tmp_path / "lab")
    files = {f"{i}.png": png(name, level=i) for i, name in enumerate(["astronaut.png", "rocket.jpg", "coffee.png"])}  # fmt: skip
    batch = land_and_ingest(lab, tmp_path / "landing", "000", files)

    monkeypatch.setattr(BatchHashes, "_workers_write", lambda self, pool: False)
    BatchHashes(lab, batch, S0, read_chunk=2).run()
    by_step = sorted_rows(lab, IMAGE_HASHES)
    monkeypatch.undo()

    lab.delete(IMAGE_HASHES.name, "batch IS NOT NULL")
    run = BatchHashes(lab, batch, S0, read_chunk=2, workers=2, executor="process")
    assert run._workers_write(runner.make_pool("process", 1))
    out = run.run()
    assert out.coverage.complete and out.hashed == 3 and out.chunks_hashed_by_step == 0
    assert sorted_rows(lab, IMAGE_HASHES).equals(by_step)

    calls: list[int] = []
    real = runner.hash_and_write

    def first_fails(task):
        calls.append(len(task.keys))
        if len(calls) == 1:
            raise ConnectionError("worker lost")
        return real(task)

    monkeypatch.setattr(runner, "hash_and_write", first_fails)
    reported: list[str] = []
    out = BatchHashes(lab, batch, S0, read_chunk=2, executor="inline", report=reported.append).run()
    assert calls == [2, 2, 1]  # the failed chunk again (in the step), then the last one
    assert out.coverage.complete and sorted_rows(lab, IMAGE_HASHES).equals(by_step)
    # Not silent: a misconfigured shared mount or a lost node shows in the outcome and log.
    assert out.chunks_hashed_by_step == 1 and "worker lost" in (out.first_worker_error or "")
    assert any("the step hashes it" in line and "worker lost" in line for line in reported)


def test_reference_mode_and_ray_workers_without_the_lab_hash_in_the_step(tmp_path, monkeypatch):
    """The yardstick mode, and workers on other nodes that cannot reach a local lab, leave
    reading and writing to the step."""

    class OtherNodes:
        same_machine = False

    lab = Lab(tmp_path / "lab")
    monkeypatch.delenv("PRX_SHARED_FILESYSTEM", raising=False)
    assert not BatchHashes(lab, "b", S0)._workers_write(OtherNodes())
    monkeypatch.setenv("PRX_SHARED_FILESYSTEM", "1")
    assert BatchHashes(lab, "b", S0)._workers_write(OtherNodes())
    reference = DedupSettings(phash_mode="reference")
    assert not BatchHashes(lab, "b", reference)._workers_write(InlinePool())


def test_batch_hashes_refuses_without_its_inputs(tmp_path):
    lab = Lab(tmp_path / "lab")
    with pytest.raises(InputNotReady, match="no resolution table yet"):
        BatchHashes(lab, "src.000", S0).run()
    batch = land_and_ingest(lab, tmp_path / "landing", "000", {"a.png": png("astronaut.png")})
    lab.delete(IMAGES.name, "batch IS NOT NULL")  # resolution profiled it, the image is gone
    with pytest.raises(InputNotReady, match=r"1 profiled image\(s\) of src.000 are not in"):
        BatchHashes(lab, batch, S0).run()
    assert lab.version(IMAGE_HASHES.name) is None  # nothing written
    with pytest.raises(ValueError, match="read_chunk must be >= 1"):
        BatchHashes(lab, batch, S0, read_chunk=0)


# --------------------------------------------------------------------------- BatchClusters


def test_batch_clusters_flips_an_old_keeper_queues_its_batch_and_the_rerun_settles(tmp_path):
    lab, landing = Lab(tmp_path / "lab"), tmp_path / "landing"
    old = land_and_ingest(
        lab, landing, "000", {"astro.png": png("astronaut.png", 9), "cam.png": png("camera.png")}
    )
    first = decide(lab, old)
    assert first.plan.changes == [] and first.dirty_marked == 0 and first.pending_dirty == 0
    assert first.kept == 2 and first.keepers.one_keeper and first.keepers.keeper_largest
    # The same pixels, a larger file: the new copy is the keeper now.
    new = land_and_ingest(lab, landing, "001", {"astro-big.png": png("astronaut.png", 0)})
    out = decide(lab, new)
    astro, big = key_of(lab, old, "astro.png"), key_of(lab, new, "astro-big.png")
    assert [(c.batch, c.key, c.after) for c in out.plan.changes] == [
        (old, astro, f"duplicate of {new}:{big}")
    ]
    assert out.plan.stats.affected_batches == [old] and out.kept == 1
    assert (out.dirty_marked, out.pending_dirty, out.rechecked, out.raced) == (1, 1, False, [])
    assert read_dirty(lab, old).column("key").to_pylist() == [astro]
    at = lab.read(PHASH_CLUSTERS.name, ["batch"], version=out.lance_version)
    assert new in at.column("batch").to_pylist()
    (state,) = lab.read_batch(DEDUP_STATE.name, new).to_pylist()
    assert state["config_fingerprint"] == S0.fingerprint() and state["kept"] == 1
    # What the dedup sensor then asks for: the old batch's clusters, which clear its mark.
    rerun = BatchClusters(lab, old, S0, lookup_chunk=2).run()
    assert rerun.dirty_cleared == 1 and rerun.pending_dirty == 0 and rerun.plan.changes == []
    row = lookup_by_keys(
        lab,
        PHASH_CLUSTERS.name,
        PHASH_CLUSTERS.schema,
        [(old, astro)],
        ["is_keeper", "keeper_batch"],
    )
    assert not row.column("is_keeper")[0].as_py()
    assert row.column("keeper_batch")[0].as_py() == new
    # Deciding again changes nothing stored.
    before = sorted_rows(lab, PHASH_CLUSTERS, list(PHASH_CLUSTERS.schema.names))
    assert BatchClusters(lab, new, S0).run().dirty_marked == 0
    assert sorted_rows(lab, PHASH_CLUSTERS, list(PHASH_CLUSTERS.schema.names)).equals(before)


def test_batch_clusters_refuses_without_hashes(tmp_path):
    with pytest.raises(InputNotReady, match="no image_hashes table yet"):
        BatchClusters(Lab(tmp_path / "lab"), "src.000", S0).run()
    with pytest.raises(ValueError, match="lookup_chunk must be >= 1"):
        BatchClusters(Lab(tmp_path / "lab"), "src.000", S0, lookup_chunk=0)


def _corpus(lab: Lab, landing: Path, settings: DedupSettings) -> str:
    """Three batches, hashed and decided; returns the last one's key (not decided yet)."""
    for chunk, names in (("000", ("astronaut.png", "brick.png")), ("001", ("rocket.jpg",))):
        batch = land_and_ingest(lab, landing, chunk, {n: png(n) for n in names})
        decide(lab, batch, settings)
    last = land_and_ingest(
        lab,
        landing,
        "002",
        {"astro-copy.png": png("astronaut.png", 0), "china.png": png("china.jpg")},
    )
    BatchHashes(lab, last, settings).run()
    return last


@pytest.mark.parametrize("radius", [0, 2])
def test_one_cluster_run_reads_the_corpus_once_and_the_dirty_queue_once(tmp_path, radius):
    settings = DedupSettings(radius=radius)
    lab = CountingLab(tmp_path / "lab")
    last = _corpus(lab, tmp_path / "landing", settings)
    hashes = lab.read(IMAGE_HASHES.name, ["phash", "ac_energy"]).to_pylist()
    eligible = sum(1 for r in hashes if r["ac_energy"] >= settings.low_info_threshold)
    lab.reads.clear()
    out = BatchClusters(lab, last, settings).run()
    # gather_corpus starts with the batch's own hashes: one gather, one such read.
    own = f"batch = '{last}' AND phash_version"
    assert lab.count_reads(IMAGE_HASHES.name, filter_starts=own) == 1
    # At radius > 0 the corpus' hashes are scanned (no batch filter): once.
    scans = lab.count_reads(IMAGE_HASHES.name, filter_starts="phash_version = ")
    assert scans == (1 if radius else 0)
    assert out.lookups.get("corpus_hashes_scanned", 0) == (eligible if radius else 0)
    # The queue is read once (this batch's marks); the pending total is a count.
    assert lab.count_reads(DEDUP_DIRTY.name) == 1
    assert out.plan.stats.duplicates_of_other_batches == 0  # the larger file is the keeper
    assert out.plan.stats.keepers_over_other_batches == 1 and not out.rechecked


class HashesLandDuringTheRun(CountingLab):
    """Another batch's image_hashes commit lands between this run's corpus read and its
    write (the race the recheck closes): injected right before phash_clusters is written."""

    def __init__(self, root: str | Path, deciding: str, hashed_meanwhile: str) -> None:
        super().__init__(root)
        self.deciding, self.hashed_meanwhile = deciding, hashed_meanwhile

    def replace_partition(self, spec, batch, data, attempts: int = 8) -> dict:
        if spec is PHASH_CLUSTERS and batch == self.deciding and self.hashed_meanwhile:
            BatchHashes(Lab(self.root), self.hashed_meanwhile, S0).run()  # another run's write
            self.hashed_meanwhile = ""
        return super().replace_partition(spec, batch, data, attempts)


def test_hashes_landing_during_a_run_make_it_decide_again_and_mark_itself(tmp_path):
    landing = tmp_path / "landing"
    probe = Lab(tmp_path / "lab")
    mine = land_and_ingest(probe, landing, "000", {"astro.png": png("astronaut.png", 9)})
    other = land_and_ingest(probe, landing, "001", {"astro-big.png": png("astronaut.png", 0)})
    BatchHashes(probe, mine, S0).run()
    lab = HashesLandDuringTheRun(tmp_path / "lab", mine, other)
    out = BatchClusters(lab, mine, S0).run()
    astro, big = key_of(lab, mine, "astro.png"), key_of(lab, other, "astro-big.png")
    # Decided before the other batch's hashes were visible: kept ...
    assert [r["is_keeper"] for r in out.plan.rows.to_pylist()] == [True]
    # ... and the recheck saw them, so this batch's own row is queued for a rerun.
    assert out.rechecked
    assert [(c.batch, c.key, c.before, c.after) for c in out.raced] == [
        (mine, astro, f"keeper of {mine}:{astro}", f"duplicate of {other}:{big}")
    ]
    assert read_dirty(lab, mine).column("detected_by").to_pylist() == [mine]
    assert out.dirty_marked == 1 and out.pending_dirty == 1
    assert lab.count_reads(IMAGE_HASHES.name, filter_starts=f"batch = '{mine}' AND") == 2
