"""The dedup stage on the demo: hashes, cross-batch clusters, keeper flips and the sensor."""

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pytest
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    Definitions,
    SensorResult,
    build_sensor_context,
    instance_for_test,
    materialize,
)
from PIL import Image

from prx_assets.core.dedup.checks import hash_coverage
from prx_assets.core.dedup.decisions import DedupSettings
from prx_assets.core.dedup.dirty import read_dirty
from prx_assets.core.dedup.phash import phash_bytes
from prx_assets.core.dedup.planted import summarise_planted
from prx_assets.core.tables import IMAGE_HASHES, IMAGES, PHASH_CLUSTERS, RESOLUTION
from prx_assets.defs.dedup.assets import build_dedup_assets, hashes_complete_result
from prx_assets.defs.dedup.config import DedupConfigResource
from prx_assets.defs.dedup.sensors import build_dedup_sensor, dedup_reruns, settle_dedup
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource
from prx_assets.demo.jpegs import demo_photo, jpeg_bytes

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"
DOWNSTREAM = ("skip_lists",)
SENSOR = build_dedup_sensor(downstream=DOWNSTREAM)
CONFIG = DedupConfigResource()


def assets_for(config: DedupConfigResource = CONFIG) -> list:
    return [raw_images, resolution_profile, *build_dedup_assets(config)]


def resources(lab: LabResource, config: DedupConfigResource = CONFIG) -> dict:
    return {"lab": lab, "dedup": config}


def tick(instance, lab: LabResource, cursor=None, config=CONFIG, sensor=SENSOR) -> SensorResult:
    with build_sensor_context(
        instance=instance, cursor=cursor, resources=resources(lab, config)
    ) as ctx:
        result = sensor(ctx)
    assert isinstance(result, SensorResult)
    return result


def requested(result: SensorResult) -> dict[str, list[str]]:
    return {
        r.partition_key: [k.to_user_string() for k in r.asset_selection]
        for r in result.run_requests or []
    }


def execute(instance, lab: LabResource, config=CONFIG):
    """Run a sensor request here (skip_lists belongs to another stage: not built here)."""

    def run(batch: str, keys: list[AssetKey]) -> bool:
        mine = [k for k in keys if k.to_user_string() not in DOWNSTREAM]
        res = materialize(
            assets_for(config),
            selection=mine,
            partition_key=batch,
            instance=instance,
            resources=resources(lab, config),
        )
        checks = res.get_asset_check_evaluations()
        assert checks and all(e.passed for e in checks), [e.check_name for e in checks]
        return res.success

    return run


def clusters(lab: LabResource, batch: str | None = None) -> dict[tuple[str, str], dict]:
    store = lab.lab()
    table = (
        store.read_batch(PHASH_CLUSTERS.name, batch) if batch else store.read(PHASH_CLUSTERS.name)
    )
    return {(r["batch"], r["key"]): r for r in table.to_pylist()}


def key_of(lab: LabResource, batch: str, path: str) -> str:
    rows = lab.lab().read_batch(IMAGES.name, batch, ["key", "path"]).to_pylist()
    return next(r["key"] for r in rows if r["path"] == path)


def _clusters_metadata(res) -> dict:
    return {
        k: v.value
        for ev in res.get_asset_materialization_events()
        if ev.asset_key == AssetKey("phash_clusters")
        for k, v in ev.materialization.metadata.items()
    }


@dataclass
class Staged:
    root: Path
    lab: LabResource
    manifest: object
    metadata: dict[str, dict] = field(default_factory=dict)  # batch -> phash_clusters metadata
    checks: dict[tuple[str, str], bool] = field(default_factory=dict)
    before_settle: SensorResult | None = None
    after_settle: SensorResult | None = None
    reruns: list = field(default_factory=list)


@pytest.fixture(scope="module")
def staged(tmp_path_factory, demo_source) -> Staged:
    """The four demo batches through ingest and dedup in order, then the sensor's reruns."""
    landing, manifest = demo_source
    root = tmp_path_factory.mktemp("dedup") / "data"
    shutil.copytree(landing, root / "landing", symlinks=True)
    lab = LabResource(data_root=str(root))
    out = Staged(root, lab, manifest)
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, manifest.batches)
        for batch in manifest.batches:
            res = materialize(
                assets_for(), partition_key=batch, instance=instance, resources=resources(lab)
            )
            assert res.success
            out.metadata[batch] = _clusters_metadata(res)
            for ev in res.get_asset_check_evaluations():
                out.checks[(batch, ev.check_name)] = ev.passed
        out.before_settle = tick(instance, lab)
        out.reruns = settle_dedup(
            lab.lab(), CONFIG.settings(), set(manifest.batches), execute(instance, lab)
        )
        out.after_settle = tick(instance, lab)
    return out


def copy_of(staged: Staged, tmp_path: Path) -> LabResource:
    root = tmp_path / "data"
    shutil.copytree(staged.root, root, symlinks=True)
    return LabResource(data_root=str(root))


def add_batch(instance, lab: LabResource, chunk: str, files: dict[str, bytes]) -> str:
    """A new landing folder (written, then _SUCCESS), registered as a partition."""
    folder = lab.landing / "extra" / chunk
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "_SUCCESS").write_text("")
    key = f"extra.{chunk}"
    instance.add_dynamic_partitions(BATCHES.name, [key])
    return key


# --------------------------------------------------------------------------- the demo


def test_every_profiled_image_is_hashed_once_with_mode_and_version(staged):
    store = staged.lab.lab()
    ineligible = 0
    for batch in staged.manifest.batches:
        profile = store.read_batch(RESOLUTION.name, batch, ["key", "eligible"]).to_pylist()
        profiled = sorted(r["key"] for r in profile)
        ineligible += sum(not r["eligible"] for r in profile)
        hashed = store.read_batch(IMAGE_HASHES.name, batch).to_pylist()
        # Copies under the size cutoff too: an opt-out naming one reaches its cluster.
        assert sorted(r["key"] for r in hashed) == profiled and profiled
        assert {(r["phash_mode"], r["phash_version"]) for r in hashed} == {("fast", "fast-v1")}
        assert all(r["pixels"] > 0 and r["file_size"] > 0 for r in hashed)
        assert set(clusters(staged.lab, batch)) == {(batch, k) for k in profiled}
    assert ineligible > 0  # the demo holds images under the cutoff: the case is exercised
    indexes = {tuple(ix["fields"]) for ix in store.dataset(IMAGE_HASHES.name).list_indices()}
    assert ("phash",) in indexes
    assert staged.checks and all(staged.checks.values()), staged.checks


def test_planted_duplicates_are_found_with_the_larger_copy_kept(staged):
    summary = summarise_planted(staged.lab.lab(), staged.manifest)
    by_pair = {(p["copy"], p["original"]): p for p in summary["pairs"]}
    # coffee's 3/4 copy is 450x300: under the 384 px cutoff, never trained, but hashed, so
    # it joins its original's cluster (an opt-out naming only it reaches the original).
    assert summary["not_hashed"] == 0
    assert (
        by_pair[("public-skimage.003:coffee-dup-downscaled.jpg", "public-skimage.000:coffee.png")][
            "status"
        ]
        == "found"
    )
    assert summary["found"] == summary["keeper_is_higher_resolution"] == 4
    assert summary["missed"] == 0 and summary["planted"] == 4
    # Fast mode finds at least what the reference (imagehash) definition would.
    landing = staged.lab.landing
    reference_found = 0
    for copy, original in staged.manifest.planted_duplicates:
        if by_pair[(copy, original)]["status"] == "not_hashed":
            continue
        h = [
            phash_bytes((landing / b.replace(".", "/", 1) / p).read_bytes(), "reference").hash
            for b, p in (ref.split(":", 1) for ref in (copy, original))
        ]
        reference_found += h[0] == h[1]
    assert summary["found"] >= reference_found
    print(f"planted duplicates found (fast): {summary['found']}, reference: {reference_found}")


def test_metadata_reports_duplicates_sizes_and_a_gallery(staged):
    md = staged.metadata["public-skimage.003"]
    # Its four copies (three eligible, one under the size cutoff: hashed too) are
    # duplicates of larger images of earlier batches.
    assert md["images"] == 4 and md["duplicates_of_other_batches"] == 4
    assert md["kept"] == 0 and md["duplicates_within_batch"] == 0
    assert "| size | count |" in md["cluster_sizes"]
    assert (
        md["gallery"].startswith("![duplicate clusters")
        and "data:image/png;base64," in (md["gallery"])
    )
    assert md["radius"] == 0 and md["config_fingerprint"] == CONFIG.fingerprint()
    assert md["low_info_threshold"] == 1.0 and md["low_information"] == 0
    first = staged.metadata["public-skimage.000"]
    assert first["affected_other_batches"] == [] and first["dirty_rows_marked"] == 0
    # The studio batch holds larger (stretched/upscaled) copies of batch 000's originals.
    studio = staged.metadata["internal-studio.002"]
    assert studio["affected_other_batches"] == ["public-skimage.000"]
    assert studio["displaced_keepers_in_other_batches"] >= 1
    assert studio["duplicates_within_batch"] >= 1  # its colour-mode variants of one photo


def test_sensor_requested_exactly_the_flipped_batch_and_then_nothing(staged):
    assert requested(staged.before_settle) == {
        "public-skimage.000": ["phash_clusters", "skip_lists"]
    }
    (req,) = staged.before_settle.run_requests
    assert req.run_key.startswith("dedup:public-skimage.000:")
    assert [r.batch for r in staged.reruns] == ["public-skimage.000"]
    assert not staged.after_settle.run_requests
    assert read_dirty(staged.lab.lab()).num_rows == 0


def test_rematerialising_is_idempotent(staged, tmp_path):
    lab = copy_of(staged, tmp_path)
    before = clusters(lab)
    hashes = (
        lab.lab().read(IMAGE_HASHES.name).sort_by([("batch", "ascending"), ("key", "ascending")])
    )
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, staged.manifest.batches)
        res = materialize(
            assets_for()[2:],
            partition_key="public-skimage.003",
            instance=instance,
            resources=resources(lab),
        )
        assert res.success and all(e.passed for e in res.get_asset_check_evaluations())
        assert not requested(tick(instance, lab))
    again = (
        lab.lab().read(IMAGE_HASHES.name).sort_by([("batch", "ascending"), ("key", "ascending")])
    )
    assert clusters(lab) == before and again.equals(hashes)


# --------------------------------------------------------------------------- incremental


def test_a_higher_resolution_copy_in_a_new_batch_flips_only_the_old_keeper(staged, tmp_path):
    lab = copy_of(staged, tmp_path)
    retina = Image.open(PHOTOS / "retina.jpg").convert("RGB")  # only in batch 000, kept there
    up = retina.resize((retina.width * 2, retina.height * 2), Image.Resampling.LANCZOS)
    old_key = key_of(lab, "public-skimage.000", "retina.jpg")
    assert clusters(lab)[("public-skimage.000", old_key)]["is_keeper"]
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, staged.manifest.batches)
        new = add_batch(instance, lab, "004", {"retina-2x.jpg": jpeg_bytes(up)})
        res = materialize(
            assets_for(), partition_key=new, instance=instance, resources=resources(lab)
        )
        assert res.success
        md = _clusters_metadata(res)
        assert md["affected_other_batches"] == ["public-skimage.000"]
        assert (
            md["keepers_over_other_batches"] == 1 and md["displaced_keepers_in_other_batches"] == 1
        )
        new_key = key_of(lab, new, "retina-2x.jpg")
        assert clusters(lab, new)[(new, new_key)]["is_keeper"]
        assert clusters(lab)[("public-skimage.000", old_key)]["is_keeper"]  # not rerun yet

        # The sensor asks for exactly the batch whose decisions changed, once.
        first = tick(instance, lab)
        assert requested(first) == {"public-skimage.000": ["phash_clusters", "skip_lists"]}
        assert not tick(instance, lab, cursor=first.cursor).run_requests

        # A batch with no duplicates affects nobody.
        other = add_batch(
            instance,
            lab,
            "005",
            {"camera.jpg": jpeg_bytes(demo_photo(None, "camera.png"))},
        )
        res = materialize(
            assets_for(), partition_key=other, instance=instance, resources=resources(lab)
        )
        assert res.success
        md = _clusters_metadata(res)
        assert md["affected_other_batches"] == [] and md["clusters_with_duplicates"] == 0
        assert requested(tick(instance, lab)) == requested(first)  # still only batch 000

        for req in first.run_requests:
            assert execute(instance, lab)(req.partition_key, req.asset_selection)
        row = clusters(lab)[("public-skimage.000", old_key)]
        assert not row["is_keeper"]
        assert (row["keeper_batch"], row["keeper_key"], row["cluster_id"]) == (
            new,
            new_key,
            new_key,
        )
        assert read_dirty(lab.lab()).num_rows == 0
        assert not tick(instance, lab).run_requests

        # Nothing old was re-hashed, and only the flipped batch's clusters reran.
        def partitions(asset: str) -> set[str]:
            records = instance.fetch_materializations(
                AssetRecordsFilter(asset_key=AssetKey(asset)), limit=100
            ).records
            return {r.event_log_entry.dagster_event.partition for r in records}

        assert partitions("image_hashes") == {new, other}
        assert partitions("phash_clusters") == {new, other, "public-skimage.000"}


def test_a_radius_change_reruns_clusters_and_skip_lists_everywhere_and_nothing_upstream(
    staged, tmp_path
):
    lab = copy_of(staged, tmp_path)
    r2 = DedupConfigResource(radius=2)
    base_hashes, base_clusters = (a.code_versions_by_key[a.key] for a in assets_for()[2:])
    new_hashes, new_clusters = (a.code_versions_by_key[a.key] for a in assets_for(r2)[2:])
    assert new_hashes == base_hashes and new_clusters != base_clusters
    assert r2.fingerprint() in new_clusters
    sensor = build_dedup_sensor(downstream=DOWNSTREAM)
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, staged.manifest.batches)
        result = tick(instance, lab, config=r2, sensor=sensor)
        assert requested(result) == {
            b: ["phash_clusters", "skip_lists"] for b in staged.manifest.batches
        }
        # A mode change rehashes too.
        ref = DedupConfigResource(phash_mode="reference")
        assert requested(tick(instance, lab, config=ref)) == {
            b: ["image_hashes", "phash_clusters", "skip_lists"] for b in staged.manifest.batches
        }
        done = settle_dedup(
            lab.lab(), r2.settings(), set(staged.manifest.batches), execute(instance, lab, r2)
        )
        assert sorted(r.batch for r in done) == sorted(staged.manifest.batches)
        rows = clusters(lab).values()
        assert {(r["radius"], r["config_fingerprint"]) for r in rows} == {(2, r2.fingerprint())}
        assert not dedup_reruns(lab.lab(), r2.settings(), DOWNSTREAM, set(staged.manifest.batches))


def test_definitions_load_with_the_stage_and_its_sensor(lab_resource):
    defs = Definitions(
        assets=assets_for(),
        sensors=[build_dedup_sensor()],
        resources=resources(lab_resource),
    )
    Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    assert graph.get(AssetKey("phash_clusters")).parent_keys == {AssetKey("image_hashes")}
    assert AssetKey("resolution_profile") in graph.get(AssetKey("image_hashes")).parent_keys
    assert {graph.get(AssetKey(a)).group_name for a in ("image_hashes", "phash_clusters")} == {
        "dedup"
    }
    with pytest.raises(ValueError, match="radius must be in 0..8"):
        build_dedup_assets(DedupConfigResource(radius=12))
    assert DedupSettings().fingerprint() == CONFIG.fingerprint()


def test_the_hash_check_fails_on_missing_extra_or_outdated_rows():
    stored = pa.table(
        {"key": ["a", "b", "x"], "phash_version": ["fast-v1", "reference-v1", "fast-v1"]}
    )
    coverage = hash_coverage(["a", "b", "c"], stored, "fast-v1", {"c": "truncated: cut"})
    res = hashes_complete_result(coverage)
    assert not res.passed
    md = {k: v.value for k, v in res.metadata.items()}
    assert md["missing"] == ["c"] and md["unexpected"] == ["x"]
    assert md["other_phash_version"] == ["b"] and md["undecodable"] == ["c: truncated: cut"]
    ok = hashes_complete_result(hash_coverage(["a"], stored.slice(0, 1), "fast-v1", {}))
    assert ok.passed
