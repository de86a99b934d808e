"""A landing zone on S3 (moto on 127.0.0.1): the completion rules, staging, the sensor."""

from __future__ import annotations

import io

from dagster import DagsterInstance, SensorResult, build_sensor_context
from PIL import Image

from prx_assets.core.ingest.remote_landing import discover_landing, landing_batch
from prx_assets.core.ingest.runner import BatchIngest
from prx_assets.core.storage import open_store
from prx_assets.defs.ingest.sensors import landing_sensor
from prx_assets.defs.resources import LabResource


def _jpeg(size=(32, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (120, 30, 200)).save(buf, "JPEG")
    return buf.getvalue()


def test_only_complete_remote_batches_are_seen_and_staged(s3_prefix, tmp_path):
    landing = f"{s3_prefix}/landing"
    store = open_store(landing)
    store.put("src/c0/a.jpg", _jpeg())
    store.put("src/c0/b.jpg", b"x" * 5000)  # over the limit below: refused unread
    store.put("src/c0/a.txt", b"an alt text")
    store.put("src/c1.tar.partial", b"not yet")  # a producer's temporary name
    store.put("src/.c2/x.jpg", _jpeg())  # hidden
    assert discover_landing(landing) == []  # c0 has no _SUCCESS yet
    store.put("src/c0/_SUCCESS", b"")
    refs = discover_landing(landing)
    assert [r.key for r in refs] == ["src.c0"] and refs[0].kind == "folder"

    with landing_batch(landing, "src.c0", max_file_bytes=4000) as (ref, shown):
        assert shown == f"{landing}/src/c0"
        run = BatchIngest(ref, max_file_bytes=4000)
        images = [r for b in run.image_batches() for r in b.to_pylist()]
        rejects = run.rejects.to_pylist()
    assert [r["path"] for r in images] == ["a.jpg"]
    assert [(r["path"], r["reason"]) for r in rejects] == [("b.jpg", "too_large")]


def test_the_landing_sensor_lists_a_remote_prefix(s3_prefix, tmp_path):
    landing = f"{s3_prefix}/landing"
    store = open_store(landing)
    store.put("src/c0/a.jpg", _jpeg())
    lab = LabResource(data_root=str(tmp_path), landing_dir=landing)
    with DagsterInstance.ephemeral() as instance:
        with build_sensor_context(instance=instance, resources={"lab": lab}) as ctx:
            idle = landing_sensor(ctx)  # incomplete: nothing requested
            assert not isinstance(idle, SensorResult) or not idle.run_requests
        store.put("src/c0/_SUCCESS", b"")
        with build_sensor_context(instance=instance, resources={"lab": lab}) as ctx:
            result = landing_sensor(ctx)
    assert [r.partition_key for r in result.run_requests] == ["src.c0"]
