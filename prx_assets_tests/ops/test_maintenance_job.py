"""The lance_maintenance job removes files and blobs a killed writer left, and refuses
unsafe ages."""

import os
import time
from pathlib import Path

import pytest
from lance.fragment import write_fragments

from prx_assets.core.tables import IMAGES
from prx_assets.definitions import build_defs
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource

KEY = "public-sklearn.001"


def _data_files(uri: str) -> set[str]:
    return {p.name for p in (Path(uri) / "data").iterdir()}


def test_the_job_removes_unreferenced_files_past_the_age_and_keeps_the_table(
    instance, lab_resource: LabResource
):
    from dagster import materialize

    from prx_assets.defs.ingest.assets import raw_images

    instance.add_dynamic_partitions(BATCHES.name, [KEY])
    assert materialize(
        [raw_images], partition_key=KEY, instance=instance, resources={"lab": lab_resource}
    ).success
    store = lab_resource.lab()
    uri = store.uri(IMAGES.name)
    rows_before = store.dataset(IMAGES.name).count_rows()
    referenced = _data_files(uri)
    # What a raw_images run killed after writing its fragments leaves behind.
    sample = store.dataset(IMAGES.name).to_table().slice(0, 2)  # as stored: blob references
    write_fragments(sample, uri, schema=sample.schema)
    orphans = _data_files(uri) - referenced
    assert orphans
    then = time.time() - 3 * 86400
    for name in orphans:
        os.utime(Path(uri) / "data" / name, (then, then))
    # ... and the blob such a run stored before it was killed (no version names it).
    lost, _ = store.blobs.put(IMAGES.name, b"an image no row names")
    os.utime(store.blobs.path(IMAGES.name, lost), (then, then))

    job = build_defs(lab_resource.data_root).resolve_job_def("lance_maintenance")
    result = job.execute_in_process(instance=instance)
    assert result.success
    tables = result.output_for_node("compact_lab_tables")
    images = next(t for t in tables if t["table"] == IMAGES.name)
    assert images["orphan_files_removed"] == len(orphans)
    assert not (orphans & _data_files(uri))
    assert store.dataset(IMAGES.name).count_rows() == rows_before
    store.dataset(IMAGES.name).validate()
    assert images["blobs"]["deleted"] == 1 and not os.path.exists(
        store.blobs.path(IMAGES.name, lost)
    )
    assert store.read_batch(IMAGES.name, KEY, ["key", "image"]).num_rows == rows_before


def test_the_job_refuses_an_orphan_age_below_the_floor(lab_resource: LabResource):
    job = build_defs(lab_resource.data_root).resolve_job_def("lance_maintenance")
    config = {"ops": {"compact_lab_tables": {"config": {"orphan_min_age_hours": 0}}}}
    with pytest.raises(Exception, match="orphan_min_age_hours"):
        job.execute_in_process(run_config=config)


def test_the_job_keeps_versions_by_count_and_never_drops_a_pinned_one(
    instance, lab_resource: LabResource
):
    from dagster import materialize

    from prx_assets.defs.ingest.assets import raw_images

    instance.add_dynamic_partitions(BATCHES.name, [KEY])
    store = lab_resource.lab()
    for _ in range(2):  # two identical runs: versions to drop, the same rows
        assert materialize(
            [raw_images], partition_key=KEY, instance=instance, resources={"lab": lab_resource}
        ).success
    first = min(v["version"] for v in store.dataset(IMAGES.name).versions())
    pinned = first + 1  # the first run's commit
    store.pin_versions("snapshot-test", {IMAGES.name: pinned})
    rows = store.dataset(IMAGES.name, version=pinned).count_rows()
    job = build_defs(lab_resource.data_root).resolve_job_def("lance_maintenance")
    config = {"keep_versions": 1, "version_min_age_minutes": 0}
    result = job.execute_in_process(
        instance=instance, run_config={"ops": {"compact_lab_tables": {"config": config}}}
    )
    assert result.success
    kept = [v["version"] for v in store.dataset(IMAGES.name).versions()]
    assert kept == [pinned, store.version(IMAGES.name)]  # the pinned one and the newest
    assert store.dataset(IMAGES.name, version=pinned).count_rows() == rows  # files intact
    assert store.pinned_versions() == {IMAGES.name: {pinned}}
