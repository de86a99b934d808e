"""A landing zone on S3 (moto on 127.0.0.1): the completion rules, staging, the sensor."""

from __future__ import annotations

import pytest
from dagster import DagsterInstance, SensorResult, SkipReason, build_sensor_context

from prx_assets.core.ingest.remote_landing import discover_landing, landing_batch
from prx_assets.core.ingest.runner import BatchIngest
from prx_assets.core.ingest.sources import BatchError, iter_candidates
from prx_assets.core.storage import open_store
from prx_assets.defs.ingest.sensors import landing_sensor
from prx_assets.defs.resources import LabResource
from prx_assets.demo.jpegs import solid_jpeg
from prx_assets_tests.s3.s3_calls import requests_of


def test_only_complete_remote_batches_are_seen_and_staged(s3_prefix, tmp_path):
    landing = f"{s3_prefix}/landing"
    store = open_store(landing)
    store.put("src/c0/a.jpg", solid_jpeg((32, 24), (120, 30, 200)))
    store.put("src/c0/b.jpg", b"x" * 5000)  # over the limit below: refused unread
    store.put("src/c0/a.txt", b"an alt text")
    store.put("src/c1.tar.partial", b"not yet")  # a producer's temporary name
    store.put("src/.c2/x.jpg", solid_jpeg((32, 24), (120, 30, 200)))  # hidden
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
    store.put("src/c0/a.jpg", solid_jpeg((32, 24), (120, 30, 200)))
    lab = LabResource(data_root=str(tmp_path), landing_dir=landing)
    with DagsterInstance.ephemeral() as instance:
        with build_sensor_context(instance=instance, resources={"lab": lab}) as ctx:
            idle = landing_sensor(ctx)  # incomplete: nothing requested
            assert not isinstance(idle, SensorResult) or not idle.run_requests
        store.put("src/c0/_SUCCESS", b"")
        with build_sensor_context(instance=instance, resources={"lab": lab}) as ctx:
            result = landing_sensor(ctx)
    assert [r.partition_key for r in result.run_requests] == ["src.c0"]


def test_staging_a_folder_batch_asks_nothing_per_image(s3_prefix):
    """Finding (bench_scaleout, Ray + S3): the step staging a landing batch sent a HEAD per
    object and a HEAD + GET per sidecar, ~18 ms of its CPU per image, then still a GET per
    sidecar (~4 ms). Sizes now come from the listing, and images and sidecars alike are left
    for the worker that checks the sample: no request per file here. A sidecar read through
    the batch (``iter_candidates(remote_sidecars=...)``) reads the object, not its
    placeholder."""
    landing = f"{s3_prefix}/landing"
    store = open_store(landing)
    for name in ("a", "b", "c"):
        store.put(f"src/c0/{name}.jpg", solid_jpeg((32, 24), (120, 30, 200)))
        store.put(f"src/c0/{name}.txt", f"alt text {name}".encode())
    store.put("src/c0/_SUCCESS", b"")
    with requests_of(store) as calls:
        reads: dict = {}
        with landing_batch(landing, "src.c0", max_file_bytes=1 << 20, remote_reads=reads) as (
            ref,
            _,
        ):
            staged = sorted(p.name for p in ref.path.iterdir())
            per_object = [(op, key) for op, key in calls if key.startswith(store.prefix)]
            # Read through the batch (the step path), a sidecar is the object's text.
            alts = {
                c.path: c.alt_text
                for c in iter_candidates(ref, defer_reads=True, remote_sidecars=reads)
            }
    assert staged == ["_SUCCESS", "a.jpg", "a.txt", "b.jpg", "b.txt", "c.jpg", "c.txt"]
    assert sorted(r.key for r in reads.values()) == [
        f"src/c0/{n}.{x}" for n in "abc" for x in ("jpg", "txt")
    ]
    assert ("GetObject", f"{store.prefix}/src/c0/_SUCCESS") in per_object  # it does see calls
    assert not [c for c in per_object if c[1].endswith((".jpg", ".txt"))], per_object
    assert alts == {f"{n}.jpg": f"alt text {n}" for n in "abc"}


def test_a_step_asks_only_about_its_own_remote_batch(s3_prefix):
    """Why: staging a batch ran ``discover_landing``, a HEAD per landed folder (10^4
    batches: 10^4 requests per step). Only entries whose names map to the key are asked
    about now; two entries for one key are still refused."""
    landing = f"{s3_prefix}/landing"
    store = open_store(landing)
    for i in range(12):
        store.put(f"src/c{i:02d}/a.jpg", solid_jpeg((32, 24), (120, 30, 200)))
        store.put(f"src/c{i:02d}/_SUCCESS", b"")
    store.put("src/x.tar", b"")
    store.put("src/x.csv", b"path\n")
    with requests_of(store) as calls:
        with landing_batch(landing, "src.c07") as (ref, shown):
            assert shown == f"{landing}/src/c07"
            assert sorted(p.name for p in ref.path.iterdir()) == ["_SUCCESS", "a.jpg"]
    heads = [key for op, key in calls if op == "HeadObject"]
    assert all("/src/c07/" in k or k.endswith("/src/_source.json") for k in heads), heads
    with pytest.raises(BatchError, match="two landing entries"):
        with landing_batch(landing, "src.x"):
            pass
    with pytest.raises(BatchError, match="no complete batch"):
        with landing_batch(landing, "src.c99"):
            pass


def test_the_remote_landing_sensor_asks_only_about_new_folders(s3_prefix, tmp_path):
    """Why: each tick asked for every landed folder's ``_SUCCESS`` (a HEAD per batch ever
    landed: 10^5 batches, 10^5 requests every 30 s). Registered keys are not asked about;
    a new folder is, and one that is not complete yet is not requested."""
    landing = f"{s3_prefix}/landing"
    store = open_store(landing)
    for i in range(8):
        store.put(f"src/c{i:02d}/a.jpg", solid_jpeg((32, 24), (120, 30, 200)))
        store.put(f"src/c{i:02d}/_SUCCESS", b"")
    lab = LabResource(data_root=str(tmp_path), landing_dir=landing)
    with DagsterInstance.ephemeral() as instance:
        with build_sensor_context(instance=instance, resources={"lab": lab}) as ctx:
            first = landing_sensor(ctx)
        assert sorted(r.partition_key for r in first.run_requests) == [
            f"src.c{i:02d}" for i in range(8)
        ]
        store.put("src/c08/a.jpg", solid_jpeg((32, 24), (120, 30, 200)))  # not complete
        store.put("src/c09/a.jpg", solid_jpeg((32, 24), (120, 30, 200)))
        store.put("src/c09/_SUCCESS", b"")
        with requests_of(store) as calls:
            with build_sensor_context(
                instance=instance, resources={"lab": lab}, cursor=first.cursor
            ) as ctx:
                second = landing_sensor(ctx)
        store.put("src/c03.tar", b"")  # a second entry for a registered key: still refused
        with build_sensor_context(
            instance=instance, resources={"lab": lab}, cursor=second.cursor
        ) as ctx:
            third = landing_sensor(ctx)
    assert [r.partition_key for r in second.run_requests] == ["src.c09"]
    heads = sorted(key.rsplit("/", 2)[-2] for op, key in calls if op == "HeadObject")
    assert heads == ["c08", "c09"], calls
    assert isinstance(third, SkipReason)  # nothing requested, the reason said
    assert "two landing entries map to partition 'src.c03'" in third.skip_message


def test_a_remote_manifest_batch_is_staged_with_its_files_not_other_batches(s3_prefix):
    """A manifest on S3 is staged with the files of its source it may name, but not the
    files of the source's other batches (a folder batch is ingested as its own partition)."""
    landing = f"{s3_prefix}/landing"
    store = open_store(landing)
    store.put("src/files/a.jpg", solid_jpeg((32, 24), (120, 30, 200)))
    store.put("src/files/b.jpg", solid_jpeg((32, 24), (20, 130, 200)))
    store.put("src/c0/x.jpg", solid_jpeg((32, 24), (20, 30, 220)))
    store.put("src/c0/_SUCCESS", b"")
    store.put("src/m0.csv", b"path,url\nfiles/a.jpg,https://e.x/a\nfiles/b.jpg,\nc0/x.jpg,\n")
    with landing_batch(landing, "src.m0") as (ref, shown):
        assert (ref.kind, shown) == ("manifest", f"{landing}/src/m0.csv")
        staged = sorted(
            p.relative_to(ref.path.parent).as_posix()
            for p in ref.path.parent.rglob("*")
            if p.is_file()
        )
        cands = {c.path: c for c in iter_candidates(ref)}
    assert staged == ["files/a.jpg", "files/b.jpg", "m0.csv"]
    assert cands["files/a.jpg"].error is None and cands["files/a.jpg"].url == "https://e.x/a"
    assert cands["files/b.jpg"].error is None
    assert cands["c0/x.jpg"].error[0] == "missing_file"  # another batch's file: not staged
