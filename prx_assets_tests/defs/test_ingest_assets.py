"""raw_images and resolution_profile as Dagster runs them: every file accounted for, reruns
and concurrent partitions safe, the lab maintainable, limits configured on the resource."""

import io
import os
import tarfile
from pathlib import Path

from dagster import DagsterInstance, materialize

from prx_assets.core.tables import IMAGES, REJECTS, RESOLUTION
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource
from prx_assets.demo.jpegs import solid_jpeg
from prx_assets_tests.spawned import spawn_pool

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
    with spawn_pool(2) as pool:
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


# --------------------------------------------------------------------------- issue 10


def _hostile_landing(landing: Path) -> dict[str, set[str]]:
    """A folder, a PAX tar and a GNU tar, each with names that are not UTF-8 or hold
    control characters; returns batch -> the printable paths expected in the lab."""
    raw_names = [b"caf\xe9.jpg", b"line\nbreak.jpg", b"ok.jpg", b"bell\x07.md"]
    folder = landing / "hostile" / "000"
    folder.mkdir(parents=True)
    for i, raw in enumerate(raw_names):
        with open(os.path.join(os.fsencode(folder), raw), "wb") as fh:
            fh.write(
                solid_jpeg(color=(i * 40, 10, 10)) if raw.endswith(b".jpg") else b"not an image"
            )
    (folder / "_SUCCESS").write_text("")
    expected = {"hostile.000": {"caf%E9.jpg", "line%0Abreak.jpg", "ok.jpg", "bell%07.md"}}
    for chunk, fmt in (("001", tarfile.PAX_FORMAT), ("002", tarfile.GNU_FORMAT)):
        with tarfile.open(
            landing / "hostile" / f"{chunk}.tar",
            "w",
            format=fmt,
            encoding="utf-8",
            errors="surrogateescape",
        ) as tar:
            for i, raw in enumerate(raw_names):
                data = (
                    solid_jpeg(color=(10, i * 40 + int(chunk), 10))
                    if raw.endswith(b".jpg")
                    else b"x"
                )
                info = tarfile.TarInfo(raw.decode("utf-8", "surrogateescape"))
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        expected[f"hostile.{chunk}"] = expected["hostile.000"]
    return expected


def test_names_that_are_not_utf8_never_fail_the_batch(instance, tmp_path):
    lab_resource = LabResource(data_root=str(tmp_path / "data"))
    expected = _hostile_landing(lab_resource.landing)
    instance.add_dynamic_partitions(BATCHES.name, sorted(expected))
    store = lab_resource.lab()
    for key, paths in sorted(expected.items()):
        result = _materialize(instance, lab_resource, key)
        md = result.asset_materializations_for_node("raw_images")[0].metadata
        assert md["seen"].value == len(paths) == md["accepted"].value + md["rejected"].value
        images = store.read(IMAGES.name, ["path"], filter=f"batch = '{key}'").to_pylist()
        rejects = store.read(REJECTS.name, filter=f"batch = '{key}'").to_pylist()
        assert {r["path"] for r in images} | {r["path"] for r in rejects} == paths
        assert {r["path"] for r in images} == {p for p in paths if p.endswith(".jpg")}
        assert [r["reason"] for r in rejects] == ["unsupported_extension"]


def test_the_file_size_limit_is_configured_on_the_lab_resource(instance, tmp_path):
    lab_resource = LabResource(data_root=str(tmp_path / "data"), max_file_bytes=500)
    folder = lab_resource.landing / "s" / "000"
    folder.mkdir(parents=True)
    (folder / "big.jpg").write_bytes(solid_jpeg(color=(200, 0, 0)))  # over 500 bytes
    (folder / "_SUCCESS").write_text("")
    assert (folder / "big.jpg").stat().st_size > 500
    instance.add_dynamic_partitions(BATCHES.name, ["s.000"])
    result = _materialize(instance, lab_resource, "s.000")
    md = result.asset_materializations_for_node("raw_images")[0].metadata
    assert (md["accepted"].value, md["rejected"].value, md["max_file_bytes"].value) == (0, 1, 500)
    (row,) = lab_resource.lab().read(REJECTS.name).to_pylist()
    assert row["reason"] == "too_large" and row["file_size"] == (folder / "big.jpg").stat().st_size
    assert row["key"] is None  # never read, so never hashed
