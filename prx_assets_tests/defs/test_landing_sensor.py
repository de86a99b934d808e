"""The landing sensor registers each complete batch once and requests its run once, across
ticks, hand registrations and partitions deleted by hand."""

import json
import shutil

from dagster import SensorResult, SkipReason, build_sensor_context

from prx_assets.defs.ingest.sensors import landing_sensor
from prx_assets.defs.partitions import BATCHES


def _tick(instance, lab_resource, cursor):
    with build_sensor_context(
        instance=instance, cursor=cursor, resources={"lab": lab_resource}
    ) as ctx:
        result = landing_sensor(ctx)
        return result, ctx.cursor


def _skipped(result) -> bool:
    """Nothing requested: a plain skip, or a skip that still records the scan's state."""
    if isinstance(result, SkipReason):
        return True
    return result.skip_reason is not None and not result.run_requests


def _apply(instance, result: SensorResult) -> list[str]:
    keys = [k for req in result.dynamic_partitions_requests for k in req.partition_keys]
    instance.add_dynamic_partitions(BATCHES.name, keys)
    return keys


def test_each_batch_is_registered_once_across_ticks(instance, lab_resource, demo_manifest):
    result, _ = _tick(instance, lab_resource, None)
    assert isinstance(result, SensorResult)
    keys = _apply(instance, result)
    assert keys == sorted(demo_manifest.batches)
    assert [r.partition_key for r in result.run_requests] == keys
    assert all(r.run_key == f"landing:{r.partition_key}" for r in result.run_requests)
    cursor = result.cursor

    again, _ = _tick(instance, lab_resource, cursor)
    assert _skipped(again)

    # A new batch appears: only it is registered and requested.
    landing = lab_resource.landing
    shutil.copytree(landing / "public-skimage" / "003", landing / "public-skimage" / "004")
    third, _ = _tick(instance, lab_resource, cursor)
    assert [r.partition_key for r in third.run_requests] == ["public-skimage.004"]
    assert _apply(instance, third) == ["public-skimage.004"]
    assert _skipped(_tick(instance, lab_resource, third.cursor)[0])


def test_a_partition_deleted_by_hand_is_not_recreated(instance, lab_resource):
    result, _ = _tick(instance, lab_resource, None)
    _apply(instance, result)
    instance.delete_dynamic_partition(BATCHES.name, "public-sklearn.001")
    again, _ = _tick(instance, lab_resource, result.cursor)
    assert _skipped(again)


def test_batches_registered_by_hand_are_not_requested_again(instance, lab_resource):
    instance.add_dynamic_partitions(BATCHES.name, ["public-sklearn.001"])
    result, _ = _tick(instance, lab_resource, None)
    assert "public-sklearn.001" not in [r.partition_key for r in result.run_requests]


def test_incomplete_folder_is_not_picked_up(instance, lab_resource):
    landing = lab_resource.landing
    partial = landing / "public-skimage" / "009"
    partial.mkdir()
    (partial / "x.jpg").write_bytes(b"...")
    result, _ = _tick(instance, lab_resource, None)
    assert "public-skimage.009" not in [r.partition_key for r in result.run_requests]


def test_the_cursor_stays_small_however_many_numbered_batches(instance, lab_resource):
    """Finding: the cursor held every registered key as JSON (170 KB at 10,000 batches).
    Numbered chunks now cost a few bytes per source, and every guarantee still holds: each
    batch requested once, a deleted partition not re-created, a new batch noticed."""
    bulk = lab_resource.landing / "bulk"
    bulk.mkdir()
    for i in range(2000):
        (bulk / f"{i:05d}.csv").write_text("path\n")  # complete once it exists (manifests)
    first, _ = _tick(instance, lab_resource, None)
    keys = _apply(instance, first)
    assert {f"bulk.{i:05d}" for i in range(2000)} <= set(keys)
    assert len(first.cursor) < 1000, f"cursor is {len(first.cursor)} bytes"
    assert _skipped(_tick(instance, lab_resource, first.cursor)[0])
    instance.delete_dynamic_partition(BATCHES.name, "bulk.01234")
    assert _skipped(_tick(instance, lab_resource, first.cursor)[0])
    (bulk / "02000.csv").write_text("path\n")
    (bulk / "not-numbered.csv").write_text("path\n")
    third, _ = _tick(instance, lab_resource, first.cursor)
    assert sorted(r.partition_key for r in third.run_requests) == [
        "bulk.02000",
        "bulk.not-numbered",
    ]
    _apply(instance, third)
    assert _skipped(_tick(instance, lab_resource, third.cursor)[0])


def test_a_cursor_of_the_previous_format_is_still_honoured(instance, lab_resource):
    """An upgrade forgets nothing: a v1 cursor (JSON list) keeps a deleted partition out."""
    result, _ = _tick(instance, lab_resource, None)
    keys = _apply(instance, result)
    instance.delete_dynamic_partition(BATCHES.name, keys[0])
    legacy = json.dumps(sorted(keys))
    assert _skipped(_tick(instance, lab_resource, legacy)[0])


def test_a_damaged_cursor_requests_nothing(instance, lab_resource):
    """Fail closed: a cursor that cannot be read would forget what was registered."""
    for damaged in ("v2:not-base64!", "{}", "v2:" + "eJyrrgUAAXUA+Q=="):
        result, _ = _tick(instance, lab_resource, damaged)
        assert isinstance(result, SkipReason) and "cursor unreadable" in result.skip_message
