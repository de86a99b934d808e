import multiprocessing as mp

from dagster import DagsterInstance, materialize

from prx_assets.core.tables import IMAGES, REJECTS, RESOLUTION
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource

ASSETS = [raw_images, resolution_profile]


def _materialize(instance, lab_resource, key: str):
    result = materialize(
        ASSETS, partition_key=key, instance=instance, resources={"lab": lab_resource}
    )
    assert result.success
    return result


def _snapshot(lab_resource, table: str) -> list[dict]:
    rows = lab_resource.lab().read(table).to_pylist()
    return sorted(rows, key=lambda r: (r["batch"], r.get("key") or "", r.get("path") or ""))


def test_every_input_file_is_accounted_for(instance, lab_resource, demo_manifest):
    instance.add_dynamic_partitions(BATCHES.name, demo_manifest.batches)
    store = lab_resource.lab()
    for key in demo_manifest.batches:
        result = _materialize(instance, lab_resource, key)
        md = result.asset_materializations_for_node("raw_images")[0].metadata
        seen, acc, rej = md["seen"].value, md["accepted"].value, md["rejected"].value
        assert seen == demo_manifest.counts[key] == acc + rej
        assert store.dataset(IMAGES.name).count_rows(f"batch = '{key}'") == acc
        assert store.dataset(REJECTS.name).count_rows(f"batch = '{key}'") == rej
        assert store.dataset(RESOLUTION.name).count_rows(f"batch = '{key}'") == acc
    # Every planted bad file is rejected with its specific reason.
    rejects = {(r["batch"], r["path"]): r for r in store.read(REJECTS.name).to_pylist()}
    for where, reason in demo_manifest.bad_files.items():
        batch, path = where.split(":", 1)
        assert rejects[(batch, path)]["reason"] == reason, where
        assert rejects[(batch, path)]["detail"]


def test_resolution_profile_flags_small_images_and_renders_a_histogram(
    instance, lab_resource, demo_manifest
):
    key = "public-skimage.000"
    instance.add_dynamic_partitions(BATCHES.name, [key])
    result = _materialize(instance, lab_resource, key)
    md = result.asset_materializations_for_node("resolution_profile")[0].metadata
    assert md["histogram"].value.startswith("![resolution histogram](data:image/png;base64,")
    assert md["eligible"].value + md["ineligible"].value == md["images"].value
    store = lab_resource.lab()
    rows = {r["key"]: r for r in store.read(RESOLUTION.name, filter=f"batch = '{key}'").to_pylist()}
    paths = {
        r["path"]: r["key"]
        for r in store.read(IMAGES.name, ["path", "key"], filter=f"batch = '{key}'").to_pylist()
    }
    for small in demo_manifest.small_images:
        batch, path = small.split(":", 1)
        row = rows[paths[path]]
        assert not row["eligible"] and row["max_tier"] is None
        assert row["ineligible_reason"].startswith("short_side_below")
    for row in rows.values():
        assert row["eligible"] == (min(row["width"], row["height"]) >= 384)
        if row["eligible"]:
            assert row["max_tier"] in (512, 1024, 2048, 4096)


def test_rematerialising_is_idempotent(instance, lab_resource):
    key = "public-sklearn.001"
    instance.add_dynamic_partitions(BATCHES.name, [key])
    _materialize(instance, lab_resource, key)
    before = {t: _snapshot(lab_resource, t) for t in ("images", "rejects", "resolution")}
    _materialize(instance, lab_resource, key)
    after = {t: _snapshot(lab_resource, t) for t in ("images", "rejects", "resolution")}
    assert after == before
    assert len(before["images"]) > 0


def _run_in_own_process(instance_ref, data_root: str, key: str) -> bool:
    instance = DagsterInstance.from_ref(instance_ref)
    result = materialize(
        ASSETS,
        partition_key=key,
        instance=instance,
        resources={"lab": LabResource(data_root=data_root)},
    )
    return result.success


def test_two_partitions_materialised_concurrently_lose_no_rows(
    instance, lab_resource, demo_manifest
):
    keys = demo_manifest.batches[:2]
    instance.add_dynamic_partitions(BATCHES.name, keys)
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        ok = pool.starmap(
            _run_in_own_process,
            [(instance.get_ref(), lab_resource.data_root, k) for k in keys],
        )
    assert ok == [True, True]
    store = lab_resource.lab()
    for key in keys:
        accepted = store.dataset(IMAGES.name).count_rows(f"batch = '{key}'")
        rejected = store.dataset(REJECTS.name).count_rows(f"batch = '{key}'")
        assert accepted + rejected == demo_manifest.counts[key]
        assert store.dataset(RESOLUTION.name).count_rows(f"batch = '{key}'") == accepted
    # Both runs are recorded in the instance.
    records = instance.get_run_records()
    assert {r.dagster_run.tags.get("dagster/partition") for r in records} >= set(keys)


def test_maintenance_job_compacts_every_table(instance, lab_resource, demo_manifest):
    from prx_assets.definitions import build_defs

    instance.add_dynamic_partitions(BATCHES.name, demo_manifest.batches)
    for key in demo_manifest.batches:
        _materialize(instance, lab_resource, key)
    store = lab_resource.lab()
    assert len(store.dataset(IMAGES.name).get_fragments()) == len(demo_manifest.batches)
    job = build_defs(lab_resource.data_root).resolve_job_def("lance_maintenance")
    result = job.execute_in_process(
        instance=instance,
        run_config={"ops": {"compact_lab_tables": {"config": {"retention_days": 0}}}},
    )
    assert result.success
    for table in (IMAGES.name, RESOLUTION.name):
        ds = store.dataset(table)
        assert len(ds.get_fragments()) == 1, table
        assert {ix["name"] for ix in ds.list_indices()} >= {"key_idx", "batch_idx"}
    assert store.dataset(IMAGES.name).count_rows() == sum(
        store.dataset(IMAGES.name).count_rows(f"batch = '{k}'") for k in demo_manifest.batches
    )
