"""Any worker count gives the same output: one vs two processes through ingest, pHash and shards.

The same demo batch is run end to end through the core runners twice, into two data roots,
once inline (1 worker) and once on a two-process pool; every lab row and every byte of the
shard tree must agree. A bad image fails the same way in a worker as inline.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from prx_assets.core.dedup.decisions import DedupSettings
from prx_assets.core.dedup.runner import BatchHashes
from prx_assets.core.ingest.runner import BatchIngest
from prx_assets.core.ingest.sources import resolve_batch
from prx_assets.core.lab import Lab
from prx_assets.core.resolution.profile import profile_images
from prx_assets.core.shards.plan import NO_USABLE_CAPTION
from prx_assets.core.shards.render import BucketRenderer
from prx_assets.core.shards.runner import BatchAssignment, BatchShards, ShardSettings
from prx_assets.core.skiplists.policy import SkipPolicy
from prx_assets.core.tables import (
    BUCKET_ASSIGNMENTS,
    IMAGE_HASHES,
    IMAGES,
    REJECTS,
    RESOLUTION,
    SHARD_SAMPLES,
)
from prx_assets.core.workers import InlinePool, ProcessPool
from prx_assets_tests.core.stage_inputs import DEMO_BATCH
from prx_assets_tests.core.test_shard_runner import _captions
from prx_assets_tests.facts import plant_decision_facts

KEY = DEMO_BATCH


def _run_everything(root: Path, landing: Path, workers: int) -> dict:
    """Ingest, profile, hash, assign, caption, plant facts, shard; what each wrote."""
    lab = Lab(root / "lab")
    lab.ensure(IMAGES)
    # As raw_images runs it: the validating process (a worker, or inline) stores the blobs.
    sink = lab.local_blobs(IMAGES, "image")
    run = BatchIngest(resolve_batch(landing, KEY), workers=workers, blob_sink=sink)
    lab.replace_partition(IMAGES, KEY, run.image_batches(), stored_blobs=run.stored_blobs)
    lab.replace_partition(REJECTS, KEY, run.rejects)
    sizes = lab.read_batch(IMAGES.name, KEY, ["key", "batch", "width", "height"])
    lab.replace_partition(RESOLUTION, KEY, profile_images(sizes))
    hashes = BatchHashes(lab, KEY, DedupSettings(), workers=workers).run()
    assert hashes.coverage.complete
    hash_rows = lab.read_batch(IMAGE_HASHES.name, KEY).sort_by("key").to_pylist()
    profile = lab.read_batch(RESOLUTION.name, KEY, ["key", "eligible"]).to_pylist()
    eligible = sorted(r["key"] for r in profile if r["eligible"])  # all are hashed; these train
    BatchAssignment(lab, KEY).run()
    _captions(lab, eligible[1:])
    plant_decision_facts(lab, KEY, eligible, copies={eligible[2]: eligible[3]})
    out = BatchShards(
        lab, str(root / "shards"), KEY, SkipPolicy(), ShardSettings(workers=workers)
    ).run()
    assert out.written == len(eligible) and not out.failures
    files = {
        str(p.relative_to(root / "shards")): p.read_bytes()
        for p in sorted((root / "shards").rglob("*"))
        if p.is_file()
    }
    return {
        "images": lab.read_batch(IMAGES.name, KEY).sort_by("key").to_pylist(),
        "rejects": lab.read_batch(REJECTS.name, KEY).sort_by("path").to_pylist(),
        "image_hashes": hash_rows,
        "shard_samples": lab.read_batch(SHARD_SAMPLES.name, KEY).sort_by("key").to_pylist(),
        "files": files,
        "lab": lab,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, demo_source) -> dict[int, dict]:
    landing, _ = demo_source
    out = {}
    for workers in (1, 2):
        root = tmp_path_factory.mktemp(f"workers{workers}")
        shutil.copytree(landing, root / "landing", symlinks=True)
        out[workers] = _run_everything(root, root / "landing", workers)
    return out


@pytest.mark.parametrize("table", ["images", "rejects", "image_hashes", "shard_samples"])
def test_lab_rows_are_the_same_for_one_and_two_workers(runs: dict, table: str) -> None:
    one, two = runs[1][table], runs[2][table]
    assert one, f"{table} is empty: nothing was compared"
    assert one == two


def test_shard_tree_is_byte_identical_for_one_and_two_workers(runs: dict) -> None:
    one, two = runs[1]["files"], runs[2]["files"]
    assert any(name.endswith(".mds") for name in one)
    assert sorted(one) == sorted(two)
    assert [name for name in one if one[name] != two[name]] == []


def _render_inline_and_in_workers(lab: Lab, rows: list[dict]) -> tuple[list[str], dict]:
    """Render ``rows`` inline and on two worker processes; both must log the same, and
    that (keys written, failures) is returned."""
    captions = {r["key"]: NO_USABLE_CAPTION for r in rows}
    logs = []
    for pool in (InlinePool(), ProcessPool(2)):
        renderer = BucketRenderer(lab.view(), KEY, captions, pool=pool)
        written = [s.key for s in renderer.samples(rows)]
        pool.close()
        logs.append((written, renderer.log.failures))
    assert logs[0] == logs[1]
    return logs[0]


def test_a_bad_image_fails_the_same_in_a_worker_as_inline(runs: dict) -> None:
    lab: Lab = runs[1]["lab"]
    rows = lab.read_batch(BUCKET_ASSIGNMENTS.name, KEY).sort_by("key").to_pylist()[:4]
    rows[1] = {**rows[1], "source_width": rows[1]["source_width"] + 7}  # not these bytes' size
    rows[2] = {**rows[2], "key": "0" * 64}  # no bytes for this key
    written, failures = _render_inline_and_in_workers(lab, rows)
    assert written == [rows[0]["key"], rows[3]["key"]]
    assert failures[rows[1]["key"]].startswith("AssignmentMismatch: assignment is for a")
    assert failures["0" * 64].startswith("image_missing")


def test_an_altered_source_blob_fails_that_image_alone_for_any_worker_count(
    runs: dict, tmp_path: Path
) -> None:
    """Workers read and check each source blob themselves: an altered one is that image's
    render failure (the same inline), never other bytes rendered into the shards."""
    src: Lab = runs[1]["lab"]
    lab_root = tmp_path / "lab"
    shutil.copytree(src.root, lab_root)
    lab = Lab(lab_root)
    rows = lab.read_batch(BUCKET_ASSIGNMENTS.name, KEY).sort_by("key").to_pylist()[:3]
    victim = rows[1]["key"]
    blob = Path(lab.blobs.path(IMAGES.name, victim))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    written, failures = _render_inline_and_in_workers(lab, rows)
    assert written == [rows[0]["key"], rows[2]["key"]]
    assert failures[victim].startswith("BlobError:") and "does not match" in failures[victim]
