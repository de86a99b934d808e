import gc
import hashlib
import io
import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
import streaming
from dagster import materialize
from PIL import Image

from prx_assets.core.buckets import assign_bucket
from prx_assets.core.mds import partition_digest
from prx_assets.core.resize import estimate_jpeg_quality
from prx_assets.core.shard_tables import BUCKET_ASSIGNMENTS, SHARD_SAMPLES
from prx_assets.core.tables import CAPTIONS, IMAGES, RESOLUTION
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.shards.assets import bucket_assignments, mds_shards

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"
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


def _read_dir(directory: Path) -> list[dict]:
    """Every sample of one directory with the official reader, in index order."""
    ds = streaming.StreamingDataset(local=str(directory), batch_size=1, shuffle=False)
    try:
        rows = [dict(ds[i]) for i in range(len(ds))]
        assert [r["key"] for r in ds] == [r["key"] for r in rows]
    finally:
        del ds
        gc.collect()
    return rows


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
        resources={"lab": lab_resource},
        run_config=RUN_CONFIG,
    )
    assert result.success
    return result


def test_assignments_and_shards_end_to_end(instance, lab_resource, built) -> None:
    store, eligible, ineligible, uncaptioned = built
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
    tiers_used = {r["tier"] for r in assigned.values()}
    for tier in tiers_used:
        total = sum(r["tier"] == tier for r in assigned.values())
        assert (
            "| `total` |" in md_a["bucket_fill"].value and str(total) in md_a["bucket_fill"].value
        )

    # Shards: every directory reads back with StreamingDataset; each sample is right.
    expected_keys = set(eligible) - {uncaptioned}
    dirs = _partition_dirs(root)
    assert {f"mds/{d.parent.parent.name}/{d.parent.name}/{KEY}" for d in dirs} == {
        f"mds/{r['tier']}/{r['shape']}/{KEY}" for k, r in assigned.items() if k in expected_keys
    }
    images = {
        r["key"]: r
        for r in store.read_batch(IMAGES.name, KEY, ["key", "source", "license"]).to_pylist()
    }
    seen: dict[str, tuple[Path, int]] = {}
    read = {d: _read_dir(d) for d in dirs}
    for d in dirs:
        for i, row in enumerate(read[d]):
            key = row["key"]
            a = assigned[key]
            assert key not in seen
            seen[key] = (d, i)
            assert row["caption"] == _caption(key)
            assert (d.parent.parent.name, d.parent.name) == (str(a["tier"]), a["shape"])
            assert (row["tier"], row["shape"]) == (a["tier"], a["shape"])
            assert (row["orig_width"], row["orig_height"]) == sizes[key]
            assert (row["source"], row["license"]) == (
                images[key]["source"] or "",
                images[key]["license"] or "",
            )
            assert row["caption_model"] == "test-model" and row["caption_fingerprint"]
            assert row["upscaled"] == int(a["upscaled"])
            img = Image.open(io.BytesIO(row["image"]))
            assert img.format == "JPEG" and img.mode == "RGB"
            assert img.size == (a["width"], a["height"])
            assert estimate_jpeg_quality(row["image"]) == 92
    assert set(seen) == expected_keys
    assert not set(seen) & set(ineligible)  # nothing under the cutoff is written
    assert uncaptioned not in seen

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
    assert md["skipped"].value == 1
    assert md["skipped_keys"].value == {"no_caption": [uncaptioned]}
    assert "`no_caption` | 1" in md["skip_reasons"].value
    assert sorted(md["tree"].value) == sorted(str(d.relative_to(root)) for d in dirs)
    assert md["jpeg"].value == "quality 92, subsampling 4:4:4"
    assert "4:4:4" in md["jpeg_subsampling_reason"].value
    # Every bucket of this tiny batch is far under 64 samples: all flagged as hazards.
    assert set(md["small_bucket_hazards"].value) == set(md["tree"].value)
    written_mb = sum(f.stat().st_size for d in dirs for f in d.iterdir()) / 1e6
    assert md["mb_written"].value == pytest.approx(written_mb, abs=0.01)


def test_rerun_is_byte_identical_and_a_bucket_can_empty(instance, lab_resource, built) -> None:
    store, eligible, _, uncaptioned = built
    _shards(instance, lab_resource)
    root = Path(lab_resource.shards_root)
    first = _tree_hashes(root)
    first_rows = _shard_rows(store)
    result = _shards(instance, lab_resource)
    assert _tree_hashes(root) == first
    assert _shard_rows(store) == first_rows
    assert not [p for p in root.rglob(".*")]  # no temporaries left behind
    assert result.asset_materializations_for_node("mds_shards")[0].metadata["skipped"].value == 1

    # Captions vanish for every image of one bucket: its directory goes, the rest stays.
    gone = first_rows[0]["relative_dir"]
    keep = [r["key"] for r in first_rows if r["relative_dir"] != gone]
    _write_captions(store, keep)
    _shards(instance, lab_resource)
    assert not (root / gone).exists()
    after = _shard_rows(store)
    assert [r["key"] for r in after] == sorted(keep)
    assert {k: v for k, v in _tree_hashes(root).items() if not k.startswith(gone)} == {
        k: v for k, v in first.items() if not k.startswith(gone)
    }

    # No captions at all: nothing is written, every eligible image is reported.
    _write_captions(store, [])
    result = _shards(instance, lab_resource)
    md = result.asset_materializations_for_node("mds_shards")[0].metadata
    assert md["samples_written"].value == 0 and md["skipped"].value == len(eligible)
    assert _partition_dirs(root) == [] and _shard_rows(store) == []
    assert uncaptioned in md["skipped_keys"].value["no_caption"]


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


def _jpeg(name: str, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.open(PHOTOS / name).convert("RGB").resize(size).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_renderer_skips_a_broken_image_and_keeps_the_rest(tmp_path: Path) -> None:
    from prx_assets.core.lab import Lab
    from prx_assets.core.shard_tables import (
        BucketRenderer,
        RenderFailures,
        assignment_from_row,
        assignment_rows,
        plan_shards,
    )

    store = Lab(tmp_path / "lab")
    good = _jpeg("coffee.png", (900, 600))
    images = {"a-good": good, "b-broken": good[: len(good) // 2], "c-good": good}
    rows = [
        {"key": k, "batch": "b0", "width": 900, "height": 600, "image": v, "source": "s"}
        for k, v in images.items()
    ]
    store.replace_partition(IMAGES, "b0", pa.Table.from_pylist(rows, schema=IMAGES.schema))
    assignments = assignment_rows(
        pa.Table.from_pylist(rows).select(["key", "batch", "width", "height"])
    )
    a = assignment_from_row(assignments.to_pylist()[0])
    assert a == assign_bucket(900, 600)
    captions = pa.Table.from_pylist(
        [{"key": k, "caption": f"c {k}", "is_fallback": False} for k in images]
    )
    plan = plan_shards(assignments, captions)
    ((bucket, planned),) = plan.buckets.items()
    renderer = BucketRenderer(store.dataset(IMAGES.name), "b0", plan.captions, chunk_size=2)
    samples = list(renderer.samples(planned))
    assert [s.key for s in samples] == ["a-good", "c-good"]
    assert samples[0].image == samples[1].image  # same source, same bytes
    assert set(renderer.log.failures) == {"b-broken"}
    assert "truncated" in renderer.log.failures["b-broken"]
    # A systematic fault (every image failing) stops the run instead of emptying shards.
    strict = BucketRenderer(store.dataset(IMAGES.name), "b0", plan.captions, max_failures=0)
    with pytest.raises(RenderFailures, match="1 images of batch 'b0' failed.*b-broken"):
        list(strict.samples(planned))
    # Inconsistent inputs are refused with a specific message.
    bad = {**assignments.to_pylist()[0], "shape": "1x1"}
    with pytest.raises(ValueError, match="disagrees"):
        assignment_from_row(bad)
    with pytest.raises(ValueError, match="two caption rows"):
        plan_shards(assignments, pa.concat_tables([captions, captions]))
    with pytest.raises(ValueError, match="resample must be"):
        BucketRenderer(None, "b0", {}, resample="nearest")
    tiny = pa.table({"key": ["k"], "batch": ["b0"], "width": [100], "height": [100]})
    with pytest.raises(ValueError, match="under the bucket cutoff"):
        assignment_rows(tiny)
