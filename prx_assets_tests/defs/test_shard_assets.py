"""The bucket_assignments and mds_shards assets materialised on real lab data."""

import hashlib
import io
import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from dagster import materialize
from PIL import Image

from prx_assets.core.shards.buckets import assign_bucket
from prx_assets.core.shards.mds import partition_digest
from prx_assets.core.shards.resize import estimate_jpeg_quality
from prx_assets.core.shards.tables import written_without_caption
from prx_assets.core.skiplists.sidecars import (
    current_generation,
    load_generation,
    read_index_shards,
)
from prx_assets.core.tables import BUCKET_ASSIGNMENTS, CAPTIONS, IMAGES, RESOLUTION, SHARD_SAMPLES
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.shards.assets import bucket_assignments, mds_shards
from prx_assets.defs.skiplists.config import SkipPolicyResource
from prx_assets_tests.core.stage_inputs import read_mds_dir
from prx_assets_tests.loader_keys import loader_keys

KEY = "public-skimage.000"
SHARD_LIMIT = 1_000_000  # not the default: the run config must reach the writer
RUN_CONFIG = {"ops": {"mds_shards": {"config": {"shard_size_limit": SHARD_LIMIT}}}}


def _caption(key: str) -> str:
    return f"test caption for {key[:12]}"


def _write_captions(store, keys: list[str]) -> None:
    """A stand-in for the captions asset: rows of the CAPTIONS contract for ``keys``."""
    now = datetime(2024, 1, 1, tzinfo=UTC)
    rows = []
    for k in sorted(keys):
        fallback = int(k[-1], 16) % 2 == 0  # a property of the key, not of the key set
        rows.append(
            {
                "key": k,
                "batch": KEY,
                "caption": _caption(k),
                "word_count": 4,
                "length_ok": False,
                "is_fallback": fallback,
                "fallback_reason": "test" if fallback else None,
                "backend": "alt_text" if fallback else "transformers",
                "model_id": "test-model",
                "prompt_version": "v-test",
                "prompt_hash": "0" * 64,
                "params": "{}",
                "backend_fingerprint": f"fp-{int(fallback)}",
                "created_at": now,
            }
        )
    store.replace_partition(CAPTIONS, KEY, pa.Table.from_pylist(rows, schema=CAPTIONS.schema))


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _partition_dirs(root: Path) -> list[Path]:
    return sorted(p for p in (root / "mds").glob(f"*/*/{KEY}") if p.is_dir())


def _shard_rows(store) -> list[dict]:
    return sorted(store.read_batch(SHARD_SAMPLES.name, KEY).to_pylist(), key=lambda r: r["key"])


@pytest.fixture
def built(instance, lab_resource, demo_manifest):
    """The demo batch ingested and profiled, captions for all eligible images but one."""
    instance.add_dynamic_partitions(BATCHES.name, [KEY])
    ok = materialize(
        [raw_images, resolution_profile],
        partition_key=KEY,
        instance=instance,
        resources={"lab": lab_resource},
    )
    assert ok.success
    store = lab_resource.lab()
    res = store.read_batch(RESOLUTION.name, KEY).to_pylist()
    eligible = sorted(r["key"] for r in res if r["eligible"])
    ineligible = sorted(r["key"] for r in res if not r["eligible"])
    assert len(eligible) >= 8 and ineligible
    uncaptioned = eligible[0]
    _write_captions(store, [k for k in eligible if k != uncaptioned])
    return store, eligible, ineligible, uncaptioned


def _shards(instance, lab_resource):
    result = materialize(
        [bucket_assignments, mds_shards],
        partition_key=KEY,
        instance=instance,
        resources={"lab": lab_resource, "skip_policy": SkipPolicyResource()},
        run_config=RUN_CONFIG,
    )
    assert result.success
    return result


def test_assignments_and_shards_end_to_end(instance, lab_resource, built) -> None:
    store, eligible, ineligible, uncaptioned = built
    planted = _plant_decisions(store, eligible)
    result = _shards(instance, lab_resource)
    root = Path(lab_resource.shards_root)

    # Assignments: one row per eligible image, exactly the bucket rule's answer.
    sizes = {
        r["key"]: (r["width"], r["height"])
        for r in store.read_batch(RESOLUTION.name, KEY).to_pylist()
    }
    assigned = {r["key"]: r for r in store.read_batch(BUCKET_ASSIGNMENTS.name, KEY).to_pylist()}
    assert sorted(assigned) == eligible
    for key, row in assigned.items():
        a = assign_bucket(*sizes[key])
        assert a is not None
        assert (row["tier"], row["shape"], row["scale"]) == (a.tier, a.shape.name, a.scale)
        box = (row["crop_left"], row["crop_top"], row["crop_right"], row["crop_bottom"])
        assert box == a.crop_box and row["upscaled"] == a.upscaled
    md_a = result.asset_materializations_for_node("bucket_assignments")[0].metadata
    assert md_a["assigned"].value == len(eligible)
    assert md_a["upscaled"].value == sum(r["upscaled"] for r in assigned.values())
    assert md_a["fill_tier_1024"].value.startswith("![bucket fill, tier 1024](data:image/png")
    # The fill at a glance: one heat map, tier x aspect.
    assert md_a["bucket_fill_map"].value.startswith("![bucket fill: tier x aspect](data:image/")
    tiers_used = {r["tier"] for r in assigned.values()}
    table = md_a["images_per_tier"].value
    listed = [int(t) for t in re.findall(r"\| `(\d+)` \|", table)]
    assert listed == sorted(listed) and tiers_used <= set(listed)  # 512 before 1024: numeric
    for tier in tiers_used:
        total = sum(r["tier"] == tier for r in assigned.values())
        assert (
            "| `total` |" in md_a["bucket_fill"].value and str(total) in md_a["bucket_fill"].value
        )

    # Shards: every directory reads back with StreamingDataset; each sample is right. Every
    # assigned image is written, the one without a caption with an empty one.
    expected_keys = set(eligible)
    dirs = _partition_dirs(root)
    assert {f"mds/{d.parent.parent.name}/{d.parent.name}/{KEY}" for d in dirs} == {
        f"mds/{r['tier']}/{r['shape']}/{KEY}" for k, r in assigned.items() if k in expected_keys
    }
    images = {
        r["key"]: r
        for r in store.read_batch(IMAGES.name, KEY, ["key", "source", "license"]).to_pylist()
    }
    seen: dict[str, tuple[Path, int]] = {}
    read = {d: read_mds_dir(d) for d in dirs}
    for d in dirs:
        for i, row in enumerate(read[d]):
            key = row["key"]
            a = assigned[key]
            assert key not in seen
            seen[key] = (d, i)
            assert row["caption"] == ("" if key == uncaptioned else _caption(key))
            assert (d.parent.parent.name, d.parent.name) == (str(a["tier"]), a["shape"])
            assert (row["tier"], row["shape"]) == (a["tier"], a["shape"])
            assert (row["orig_width"], row["orig_height"]) == sizes[key]
            assert (row["source"], row["license"]) == (
                images[key]["source"] or "",
                images[key]["license"] or "",
            )
            if key != uncaptioned:
                assert row["caption_model"] == "test-model" and row["caption_fingerprint"]
            assert row["upscaled"] == int(a["upscaled"])
            img = Image.open(io.BytesIO(row["image"]))
            assert img.format == "JPEG" and img.mode == "RGB"
            assert img.size == (a["width"], a["height"])
            assert estimate_jpeg_quality(row["image"]) == 92
    assert set(seen) == expected_keys
    assert not set(seen) & set(ineligible)  # nothing under the cutoff is written

    # Each directory came with its first skip-list generation: the planted decisions and
    # the missing caption, at the samples' exact positions.
    excluded = {**{k: (r,) for k, r in planted.items()}, uncaptioned: ("no_caption",)}
    found = {}
    for d in dirs:
        live = load_generation(d).skiplists
        for i, row in enumerate(read[d]):
            shard, index = _position(d, i)
            if index in live[shard].as_mapping():
                found[row["key"]] = live[shard].as_mapping()[index]
    assert found == excluded

    # The configured shard size limit reached the writer (splitting at it: core tests).
    for d in dirs:
        shards = json.loads((d / "index.json").read_text())["shards"]
        assert {s["size_limit"] for s in shards} == {SHARD_LIMIT}
        assert all("sha256" in s["raw_data"]["hashes"] for s in shards)

    # SHARD_SAMPLES locates every sample: directory, shard, index in shard, sample index.
    located = _shard_rows(store)
    assert [r["key"] for r in located] == sorted(expected_keys)
    for r in located:
        d = root / r["relative_dir"]
        assert seen[r["key"]] == (d, r["sample_index"])
        assert r["dir_digest"] == partition_digest(d)
        index = json.loads((d / "index.json").read_text())
        before = 0
        for shard in index["shards"]:
            if shard["raw_data"]["basename"] == r["shard"]:
                break
            before += shard["samples"]
        else:
            pytest.fail(f"shard {r['shard']} not in {d}/index.json")
        assert before + r["index_in_shard"] == r["sample_index"]
        assert r["index_in_shard"] < shard["samples"]
        sample = read[d][r["sample_index"]]  # the directory as StreamingDataset reads it
        assert sample["key"] == r["key"]
        assert hashlib.sha256(sample["image"]).hexdigest() == r["jpeg_sha256"]
        assert len(sample["image"]) == r["jpeg_bytes"]

    md = result.asset_materializations_for_node("mds_shards")[0].metadata
    assert md["samples_written"].value == len(expected_keys)
    assert md["not_written"].value == 0 and md["not_written_keys"].value == []
    assert md["written_without_caption"].value == 1
    assert md["uncaptioned_keys"].value == {"no caption row": [uncaptioned]}
    assert md["excluded_by_first_skiplists"].value == len(excluded)
    for reason in ("no_caption", "class_text", "duplicate"):
        assert f"| `{reason}` | 1 |" in md["first_skiplist_reasons"].value
    assert md["skip_policy_fingerprint"].value == SkipPolicyResource().fingerprint()
    assert md["skiplist_generations"].value == {
        str(d.relative_to(root)): current_generation(d) for d in dirs
    }
    assert sorted(md["tree"].value) == sorted(str(d.relative_to(root)) for d in dirs)
    assert md["jpeg"].value == "quality 92, subsampling 4:4:4"
    assert "4:4:4" in md["jpeg_subsampling_reason"].value
    # Every bucket of this tiny batch is far under 64 samples: all flagged as hazards.
    assert set(md["small_bucket_hazards"].value) == set(md["tree"].value)
    # The bucket table flags each row briefly; the rule is stated once, not on every row.
    rows = [r for r in md["buckets"].value.splitlines() if r.startswith("| `")]
    assert len(rows) == len(dirs) and all("few samples, few shards" in r for r in rows)
    assert not any("canonical nodes" in r for r in rows)
    assert "canonical_nodes x device_batch_size" in md["hazard_rule"].value
    written_mb = sum(f.stat().st_size for d in dirs for f in d.iterdir()) / 1e6
    assert md["mb_written"].value == pytest.approx(written_mb, abs=0.01)


def test_rerun_is_byte_identical_and_a_bucket_can_empty(instance, lab_resource, built) -> None:
    store, eligible, _, uncaptioned = built
    _plant_decisions(store, eligible)
    _shards(instance, lab_resource)
    root = Path(lab_resource.shards_root)
    first = _tree_hashes(root)
    assert any(k.endswith("/skiplists.json") for k in first)  # skip-lists are in the tree
    first_rows = _shard_rows(store)
    result = _shards(instance, lab_resource)
    assert _tree_hashes(root) == first
    assert _shard_rows(store) == first_rows
    assert not [p for p in root.rglob(".*")]  # no temporaries left behind
    md = result.asset_materializations_for_node("mds_shards")[0].metadata
    assert md["written_without_caption"].value == 1

    # Captions vanish for every image of one bucket: its directory is rewritten with empty
    # captions and every sample of it is skipped; the rest of the tree is untouched.
    gone = next(r["relative_dir"] for r in first_rows if r["key"] != uncaptioned)
    lost = {r["key"] for r in first_rows if r["relative_dir"] == gone}
    _write_captions(store, [k for k in eligible if k not in lost and k != uncaptioned])
    _shards(instance, lab_resource)
    assert all(len(sl) == sl_samples for sl, sl_samples in _skip_counts(root / gone))
    live = load_generation(root / gone).skiplists.values()
    assert {code for sl in live for codes in sl.reasons for code in codes} == {"no_caption"}
    assert not lost & set(loader_keys(root))
    assert {k: v for k, v in _tree_hashes(root).items() if not k.startswith(gone)} == {
        k: v for k, v in first.items() if not k.startswith(gone)
    }

    # No captions at all: everything is still written and accounted for, nothing trains.
    _write_captions(store, [])
    result = _shards(instance, lab_resource)
    md = result.asset_materializations_for_node("mds_shards")[0].metadata
    assert md["samples_written"].value == len(eligible)
    assert md["written_without_caption"].value == len(eligible)
    assert md["excluded_by_first_skiplists"].value == len(eligible)
    assert [r["key"] for r in _shard_rows(store)] == sorted(eligible)
    assert all(written_without_caption(r) for r in _shard_rows(store))

    # A bucket nobody is assigned to any more loses its directory.
    _write_captions(store, eligible)
    rows = store.read_batch(BUCKET_ASSIGNMENTS.name, KEY)
    keep = [r for r in rows.to_pylist() if f"mds/{r['tier']}/{r['shape']}/{KEY}" != gone]
    store.replace_partition(
        BUCKET_ASSIGNMENTS, KEY, pa.Table.from_pylist(keep, schema=BUCKET_ASSIGNMENTS.schema)
    )
    assert materialize(
        [mds_shards],
        partition_key=KEY,
        instance=instance,
        resources={"lab": lab_resource, "skip_policy": SkipPolicyResource()},
        run_config=RUN_CONFIG,
    ).success
    assert not (root / gone).exists()
    assert [r["key"] for r in _shard_rows(store)] == sorted(r["key"] for r in keep)


def _skip_counts(d: Path) -> list[tuple[object, int]]:
    """(skip list, samples in its shard) per shard of a directory's live generation."""
    sizes = dict(read_index_shards(d))
    return [(sl, sizes[name]) for name, sl in load_generation(d).skiplists.items()]


def _position(d: Path, sample_index: int) -> tuple[str, int]:
    """(shard, index in shard) of the ``sample_index``-th sample of a directory."""
    for name, n in read_index_shards(d):
        if sample_index < n:
            return name, sample_index
        sample_index -= n
    raise IndexError(sample_index)


def test_stage_contract() -> None:
    from dagster import AssetKey

    for asset, kind in ((bucket_assignments, "lance"), (mds_shards, "mds")):
        spec = next(iter(asset.specs))
        assert spec.group_name == "shards" and spec.kinds == {kind}
        assert asset.partitions_def == BATCHES and spec.code_version
    deps = {d.asset_key for d in next(iter(mds_shards.specs)).deps}
    assert deps == {AssetKey("bucket_assignments"), AssetKey("captions")}
    assert {d.asset_key for d in next(iter(bucket_assignments.specs)).deps} == {
        AssetKey("resolution_profile")
    }


# -- findings of issue 10 ----------------------------------------------------------------


def _plant_decisions(store, keys: list[str]) -> dict[str, str]:
    """Every fact the policy needs for ``keys`` (nothing pending): one image labelled text,
    one a smaller copy of another (its keeper, eligible and written). Returns key -> reason."""
    from prx_assets_tests.facts import plant_decision_facts

    text, dup, keeper = keys[1], keys[2], keys[3]
    plant_decision_facts(store, KEY, keys, labels={text: "text"}, copies={dup: keeper})
    return {text: "class_text", dup: "duplicate"}


def test_mds_shards_alone_never_exposes_unscreened_samples(instance, lab_resource, built) -> None:
    """Finding: mds_shards rewrote directories without sidecars and the default loader then
    trained on duplicates and excluded classes until skip_lists ran again."""
    store, eligible, _, uncaptioned = built
    planted = _plant_decisions(store, eligible)
    _shards(instance, lab_resource)
    root = Path(lab_resource.shards_root)
    written = {r["key"] for r in _shard_rows(store)}
    assert set(planted) <= written
    yielded = loader_keys(root)
    assert len(yielded) == len(set(yielded))
    assert not set(yielded) & set(planted)
    assert uncaptioned not in yielded
    assert set(yielded) == written - set(planted) - {uncaptioned}


def test_an_image_without_caption_is_written_and_skipped_as_no_caption(
    instance, lab_resource, built
) -> None:
    """Finding: images without a usable caption were silently left out of every shard."""
    store, eligible, _, uncaptioned = built
    _plant_decisions(store, eligible)
    _shards(instance, lab_resource)
    root = Path(lab_resource.shards_root)
    rows = {r["key"]: r for r in _shard_rows(store)}
    assert uncaptioned in rows  # written ...
    r = rows[uncaptioned]
    raw = read_mds_dir(root / r["relative_dir"])[r["sample_index"]]
    assert raw["key"] == uncaptioned and raw["caption"] == ""
    yielded = loader_keys(root)
    assert yielded and uncaptioned not in yielded  # ... and never trained on


def test_the_screener_decides_the_whole_partition_and_refuses_undecided_samples(built) -> None:
    from prx_assets.core.shards.mds import Placement
    from prx_assets.core.shards.screening import ShardScreener
    from prx_assets.core.skiplists.policy import SkipPolicy, SkipPolicyError

    store, eligible, _, uncaptioned = built
    planted = _plant_decisions(store, eligible)
    text = next(k for k, r in planted.items() if r == "class_text")
    planned = {(512, "16x24"): [k for k in eligible if k != text], (1024, "32x16"): [text]}
    screener = ShardScreener(store, KEY, SkipPolicy(), planned, {uncaptioned})
    assert {d.sample.key for d in screener.planned.decisions} == set(eligible)
    # Decisions land at the positions the writer reports, in the final directory.
    placed = [Placement(text, 1024, "32x16", KEY, "shard.00003.mds", 5, 17)]
    assert screener(placed) == {"shard.00003.mds": {5: ["class_text"]}}
    (decided,) = screener.decisions().decisions
    assert (decided.sample.relative_dir, decided.sample.index_in_shard) == (
        f"mds/1024/32x16/{KEY}",
        5,
    )
    no_caption = Placement(uncaptioned, 512, "16x24", KEY, "shard.00000.mds", 0, 0)
    assert screener([no_caption]) == {"shard.00000.mds": {0: ["no_caption"]}}
    stranger = Placement("f" * 64, 512, "16x24", KEY, "shard.00000.mds", 1, 1)
    with pytest.raises(SkipPolicyError, match="without a skip decision"):
        screener([stranger])
