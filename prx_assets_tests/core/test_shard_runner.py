"""The shard stage's runners on a real demo batch: real Lance, real MDS read back by streaming.

No Dagster here: ``BatchAssignment`` and ``BatchShards`` are called as the assets call them,
on a lab filled by the real ingest and resolution code.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.core.captions.models import BackendIdentity, CaptionResult
from prx_assets.core.captions.tables import caption_rows
from prx_assets.core.lab import Lab
from prx_assets.core.shards.buckets import assign_bucket
from prx_assets.core.shards.mds import partition_digest
from prx_assets.core.shards.runner import (
    BatchAssignment,
    BatchShards,
    ScreeningRefused,
    ShardSettings,
)
from prx_assets.core.skiplists.policy import SkipPolicy
from prx_assets.core.skiplists.sidecars import current_generation, load_generation
from prx_assets.core.tables import (
    BUCKET_ASSIGNMENTS,
    CAPTION_CLASSES,
    CAPTIONS,
    RESOLUTION,
    SHARD_SAMPLES,
)
from prx_assets_tests.core.stage_inputs import (
    DEMO_BATCH,
    RecordingLab,
    ingest_demo_batch,
    read_mds_dir,
)
from prx_assets_tests.facts import plant_decision_facts

KEY = DEMO_BATCH
IDENTITY = BackendIdentity.create(kind="test", model_id="test-model", prompt_version="v-test")


def _captions(lab: Lab, keys: list[str], batch: str = KEY) -> None:
    results = [
        CaptionResult(k, f"caption of {k[:8]}", "test", "test-model", "v-test") for k in keys
    ]
    created = datetime(2024, 1, 1, tzinfo=UTC)
    lab.replace_partition(CAPTIONS, batch, caption_rows(batch, results, IDENTITY, "test", created))


@pytest.fixture
def world(data_root: Path):
    """The demo batch ingested, profiled, assigned, captioned but for one image, with every
    fact the policy needs (one image labelled text, one a copy of another)."""
    lab = RecordingLab(data_root / "lab")
    eligible = ingest_demo_batch(lab, data_root / "landing")
    assert len(eligible) >= 8
    BatchAssignment(lab, KEY).run()
    uncaptioned = eligible[0]
    _captions(lab, [k for k in eligible if k != uncaptioned])
    text, dup, keeper = eligible[1], eligible[2], eligible[3]
    plant_decision_facts(lab, KEY, eligible, labels={text: "text"}, copies={dup: keeper})
    planted = {text: ("class_text",), dup: ("duplicate",), uncaptioned: ("no_caption",)}
    return lab, data_root / "shards", eligible, planted


def test_assignment_runner_assigns_every_eligible_image_by_the_bucket_rule(data_root):
    lab = Lab(data_root / "lab")
    eligible = ingest_demo_batch(lab, data_root / "landing")
    out = BatchAssignment(lab, KEY).run()
    rows = {r["key"]: r for r in lab.read_batch(BUCKET_ASSIGNMENTS.name, KEY).to_pylist()}
    assert sorted(rows) == eligible and out.eligible == len(eligible)
    profile = lab.read_batch(RESOLUTION.name, KEY).to_pylist()
    sizes = {r["key"]: (r["width"], r["height"]) for r in profile}
    for key, row in rows.items():
        a = assign_bucket(*sizes[key])
        assert a is not None and (row["tier"], row["shape"]) == (a.tier, a.shape.name)
    fill = out.summary.fill
    assert sum(n for shapes in fill.values() for n in shapes.values()) == len(eligible)
    for row in rows.values():
        assert fill[row["tier"]][row["shape"]] >= 1
    assert out.summary.upscaled == sum(r["upscaled"] for r in rows.values())
    # The version reported is the commit that wrote the rows (indexes are built after it).
    committed = lab.read(BUCKET_ASSIGNMENTS.name, ["key"], f"batch = '{KEY}'", out.version)
    assert sorted(committed.column("key").to_pylist()) == eligible
    again = BatchAssignment(lab, KEY).run()  # a rerun replaces the partition: same rows
    assert again.summary == out.summary and again.version > out.version
    assert {r["key"]: r for r in lab.read_batch(BUCKET_ASSIGNMENTS.name, KEY).to_pylist()} == rows


def test_shard_runner_writes_screened_directories_that_streaming_reads_back(world):
    lab, root, eligible, planted = world
    out = BatchShards(lab, str(root), KEY, SkipPolicy(), ShardSettings(workers=1)).run()
    assert out.assigned == out.written == len(eligible) and not out.failures
    assert out.uncaptioned == {eligible[0]: "no caption row"}
    assert out.excluded == len(planted)
    assert out.policy_fingerprint == SkipPolicy().fingerprint()
    committed = lab.read(SHARD_SAMPLES.name, ["key"], f"batch = '{KEY}'", out.version)
    assert sorted(committed.column("key").to_pylist()) == eligible
    located = {r["key"]: r for r in lab.read_batch(SHARD_SAMPLES.name, KEY).to_pylist()}
    assert sorted(located) == eligible

    read = {}
    for d in out.directories:
        path = root / d.relative_dir
        samples = read_mds_dir(path)
        read.update({s["key"]: (d, i, s) for i, s in enumerate(samples)})
        assert d.samples == len(samples)
        assert d.generation == current_generation(path) is not None
        assert d.bytes == sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        # 64 canonical nodes by default: every bucket of a 20-image batch is small.
        assert d.hazards and f"{d.samples} samples <" in d.hazards[0]
    assert sorted(read) == eligible
    for key, (d, i, sample) in read.items():
        row = located[key]
        assert (row["relative_dir"], row["sample_index"]) == (d.relative_dir, i)
        assert row["dir_digest"] == partition_digest(root / d.relative_dir)
        assert sample["caption"] == ("" if key in out.uncaptioned else f"caption of {key[:8]}")
    # The first generation excludes exactly the planted decisions, at the written positions.
    at = {(r["relative_dir"], r["shard"], r["index_in_shard"]): k for k, r in located.items()}
    excluded = {}
    for d in out.directories:
        for shard, sl in load_generation(root / d.relative_dir).skiplists.items():
            for index, reasons in sl.as_mapping().items():
                excluded[at[(d.relative_dir, shard, index)]] = tuple(reasons)
    assert excluded == planted


def test_hazards_over_all_batches_count_the_buckets_this_batch_wrote_without_reading_them(world):
    """Findings: mds_shards read the whole shard_samples table on every partition run for
    one metadata field, then every row of the buckets it wrote (O(corpus) per step). The
    runner now counts a bucket's samples through its indexes and its shards by their first
    samples, up to the rule's threshold, and still counts those buckets over every batch."""
    lab, root, eligible, _ = world
    first = BatchShards(lab, str(root), KEY, SkipPolicy()).run()
    mine = {(d.tier, d.shape) for d in first.directories}
    shared = first.directories[0]
    foreign = (2048, "64x64")
    assert foreign not in mine
    other = [
        *[(f"{i:064x}", shared.tier, shared.shape, i) for i in range(3)],  # one more shard
        *[(f"{i + 10:064x}", *foreign, i) for i in range(5)],
    ]
    rows = [
        {"key": k, "batch": "other.000", "tier": t, "shape": shape, "shard": "shard.00000.mds"}
        | {"relative_dir": f"mds/{t}/{shape}/other.000", "index_in_shard": i}
        for k, t, shape, i in other
    ]
    lab.replace_partition(
        SHARD_SAMPLES, "other.000", pa.Table.from_pylist(rows, schema=SHARD_SAMPLES.schema)
    )

    lab.reads.clear()
    out = BatchShards(lab, str(root), KEY, SkipPolicy(), ShardSettings(canonical_nodes=200)).run()
    assert not [r for r in lab.reads if r[0] == SHARD_SAMPLES.name]  # no bucket read whole
    # The shared bucket is counted over both batches: this batch's samples plus three, its
    # shards plus the other batch's one.
    few_samples, few_shards = out.hazards_all_batches[f"{shared.tier}/{shared.shape}"]
    assert few_samples.startswith(f"{shared.samples + 3} samples <")
    assert few_shards == f"{shared.shards + 1} shards < canonical nodes = 200"
    assert f"{foreign[0]}/{foreign[1]}" not in out.hazards_all_batches
    # Enough shards (the count stops at the threshold): only the samples are too few.
    two = BatchShards(lab, str(root), KEY, SkipPolicy(), ShardSettings(canonical_nodes=2))
    problems = two.run().hazards_all_batches.get(f"{shared.tier}/{shared.shape}", [])
    assert not [p for p in problems if "shards" in p]
    # With the rule satisfied nothing is reported, per directory or over all batches.
    relaxed = BatchShards(lab, str(root), KEY, SkipPolicy(), ShardSettings(canonical_nodes=1))
    calm = relaxed.run()
    assert calm.hazards_all_batches == {} and not any(d.hazards for d in calm.directories)


def test_undecidable_skip_lists_refuse_the_batch_before_anything_is_written(world):
    lab, root, eligible, _ = world
    BatchShards(lab, str(root), KEY, SkipPolicy()).run()
    before = sorted((root / "mds").rglob("*"))
    rows_before = lab.read_batch(SHARD_SAMPLES.name, KEY)
    version_before = lab.version(SHARD_SAMPLES.name)
    classes = lab.read_batch(CAPTION_CLASSES.name, KEY).to_pylist()
    classes[0]["label"] = "not-a-label"  # a fact the policy cannot decide from
    lab.replace_partition(
        CAPTION_CLASSES, KEY, pa.Table.from_pylist(classes, schema=CAPTION_CLASSES.schema)
    )
    with pytest.raises(ScreeningRefused, match=f"{KEY}: cannot decide its skip-lists"):
        BatchShards(lab, str(root), KEY, SkipPolicy()).run()
    assert sorted((root / "mds").rglob("*")) == before
    assert lab.read_batch(SHARD_SAMPLES.name, KEY).equals(rows_before)
    assert lab.version(SHARD_SAMPLES.name) == version_before
