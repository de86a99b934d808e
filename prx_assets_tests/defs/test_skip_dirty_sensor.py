"""skip_dirty_sensor: requests skip_lists for exactly the partitions skip_dirty lists."""

from datetime import UTC, datetime, timedelta

from dagster import AssetKey, SensorResult, build_sensor_context

from prx_assets.core.dedup.decisions import DecisionChange
from prx_assets.core.dedup.dirty import mark_dirty
from prx_assets.core.skiplists.decisions import (
    SkipChange,
    clear_skip_dirty,
    mark_skip_dirty,
    read_skip_dirty,
)
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.skiplists.sensors import build_skip_dirty_sensor, skip_dirty_reruns

T0 = datetime(2024, 1, 1, tzinfo=UTC)


def _mark(lab, batch: str, key: str, at: datetime = T0) -> None:
    mark_skip_dirty(lab, [SkipChange(batch, key, "c", "duplicate", "kept")], "src.other", at)


def _tick(sensor, instance, lab_resource, cursor=None) -> SensorResult:
    with build_sensor_context(
        instance=instance, resources={"lab": lab_resource}, cursor=cursor
    ) as ctx:
        return sensor(ctx)


def test_requests_marked_registered_partitions_once_per_state(instance, lab_resource):
    lab = lab_resource.lab()
    instance.add_dynamic_partitions(BATCHES.name, ["src.x", "src.y", "src.w"])
    _mark(lab, "src.x", "k1")
    _mark(lab, "src.x", "k2")
    _mark(lab, "src.y", "k3")  # also awaits a dedup rerun, which reruns skip_lists too
    _mark(lab, "src.z", "k4")  # not a partition (deleted): resurrects nothing
    mark_dirty(lab, [DecisionChange("src.y", "k3", "c", "keeper", "duplicate")], "src.other", T0)
    sensor = build_skip_dirty_sensor()

    result = _tick(sensor, instance, lab_resource)
    assert [(r.partition_key, r.asset_selection) for r in result.run_requests] == [
        ("src.x", [AssetKey("skip_lists")])
    ]
    assert (
        "2 recorded decision(s) contradicted by src.other"
        in result.run_requests[0].tags["prx/skip_dirty_reason"]
    )
    # The same state is not requested again; a new mark is a new state.
    again = _tick(sensor, instance, lab_resource, result.cursor)
    assert not again.run_requests
    _mark(lab, "src.x", "k5", T0 + timedelta(hours=1))
    newer = _tick(sensor, instance, lab_resource, again.cursor)
    assert [r.partition_key for r in newer.run_requests] == ["src.x"]
    assert newer.run_requests[0].run_key != result.run_requests[0].run_key
    # Without deferring to the dedup sensor, y is requested too.
    assert sorted(skip_dirty_reruns(lab, {"src.x", "src.y"}, defer_to_dedup=False)) == [
        "src.x",
        "src.y",
    ]
    # Cleared marks: nothing left to request.
    clear_skip_dirty(lab, read_skip_dirty(lab, "src.x").column("dirty_id").to_pylist())
    assert sorted(skip_dirty_reruns(lab, {"src.x", "src.y", "src.z"})) == ["src.z"]


def test_partitions_beyond_the_tick_limit_come_on_later_ticks(instance, lab_resource):
    lab = lab_resource.lab()
    batches = [f"src.{i}" for i in range(3)]
    instance.add_dynamic_partitions(BATCHES.name, batches)
    for b in batches:
        _mark(lab, b, "k")
    sensor = build_skip_dirty_sensor(max_runs_per_tick=2, max_partitions_per_run=1)
    first = _tick(sensor, instance, lab_resource)
    second = _tick(sensor, instance, lab_resource, first.cursor)
    got = [r.partition_key for r in first.run_requests + second.run_requests]
    assert sorted(got) == batches and len(first.run_requests) == 2
    assert not _tick(sensor, instance, lab_resource, second.cursor).run_requests


def test_marked_partitions_run_together_once_per_state(instance, lab_resource):
    """The default: the marked partitions as one run over their range; requested once
    while their marks stay, and a new mark on one of them is a new request for it."""
    lab = lab_resource.lab()
    batches = [f"src.{i}" for i in range(3)]
    instance.add_dynamic_partitions(BATCHES.name, batches)
    for b in batches:
        _mark(lab, b, "k")
    sensor = build_skip_dirty_sensor()
    first = _tick(sensor, instance, lab_resource)
    (run,) = first.run_requests
    assert run.partition_key is None and run.tags["prx/partitions"] == "3"
    assert run.tags["dagster/asset_partition_range_start"] == "src.0"
    assert run.tags["dagster/asset_partition_range_end"] == "src.2"
    assert run.tags["prx/skip_dirty_reason"].startswith("3 partition(s); ")
    assert not _tick(sensor, instance, lab_resource, first.cursor).run_requests
    _mark(lab, "src.1", "other")  # a new mark: a new state of src.1 alone
    again = _tick(sensor, instance, lab_resource, first.cursor)
    assert [r.partition_key for r in again.run_requests] == ["src.1"]
