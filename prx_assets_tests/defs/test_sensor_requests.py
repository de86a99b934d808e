"""The sensors' shared loop: each stale state requested once, a bounded number per tick."""

import json

import pytest
from dagster import (
    AssetKey,
    ConfigurableResource,
    DefaultSensorStatus,
    Definitions,
    RunRequest,
    SensorResult,
    StaticPartitionsDefinition,
    asset,
    build_sensor_context,
    instance_for_test,
)

from prx_assets.defs.sensor_requests import request_once, rerun_sensor


def req(batch: str, state: str = "s0") -> RunRequest:
    return RunRequest(run_key=f"k:{batch}:{state}", partition_key=batch, tags={"why": state})


def keys(result: SensorResult) -> list[str]:
    return [r.run_key for r in result.run_requests or []]


def test_each_state_is_requested_once_and_the_rest_on_later_ticks():
    wanted = [req("a"), req("b"), req("c")]
    first = request_once(None, wanted, 2)
    assert keys(first) == ["k:a:s0", "k:b:s0"]
    assert json.loads(first.cursor) == ["k:a:s0", "k:b:s0"]
    second = request_once(first.cursor, wanted, 2)
    assert keys(second) == ["k:c:s0"]
    third = request_once(second.cursor, wanted, 2)
    assert not third.run_requests
    assert third.skip_reason.skip_message == "3 stale partition(s), all requested"
    # a answered (gone), b marked again (a new state, a new key): only b is asked for.
    changed = [req("b", "s1"), req("c")]
    fourth = request_once(third.cursor, changed, 2)
    assert keys(fourth) == ["k:b:s1"]
    assert json.loads(fourth.cursor) == ["k:b:s1", "k:c:s0"]  # a's and b's old keys dropped
    nothing = request_once(fourth.cursor, [], 2, state="marked")
    assert nothing.skip_reason.skip_message == "none marked" and nothing.cursor == "[]"


def test_a_request_without_a_run_key_is_refused():
    with pytest.raises(ValueError, match="needs a run key"):
        request_once(None, [RunRequest(partition_key="a")], 5)


class Stale(ConfigurableResource):
    """Stands in for a stage's resources: which partitions are stale."""

    batches: str = ""

    def stale(self) -> list[str]:
        return [b for b in self.batches.split(",") if b]


@asset(partitions_def=StaticPartitionsDefinition(["a", "b"]))
def target_asset() -> None:
    return None


def build(max_runs: int = 1):
    def wanted(context, stale: Stale) -> list[RunRequest]:
        return [
            RunRequest(
                run_key=f"k:{b}",
                partition_key=b,
                asset_selection=[AssetKey("target_asset")],
                tags={"reason": f"{b} is stale"},
            )
            for b in stale.stale()
        ]

    return rerun_sensor(
        wanted,
        name="test_rerun_sensor",
        targets=["target_asset"],
        description="test",
        max_runs_per_tick=max_runs,
        minimum_interval_seconds=30,
        default_status=DefaultSensorStatus.STOPPED,
        reason_tag="reason",
    )


def test_rerun_sensor_gets_the_resources_its_decision_names_on_both_paths():
    sensor = build()
    assert sensor.required_resource_keys == {"stale"}
    assert sensor.minimum_interval_seconds == 30
    assert sensor.default_status == DefaultSensorStatus.STOPPED
    with instance_for_test() as instance:
        # Invoked directly (tests, evaluate_sensor) ...
        with build_sensor_context(
            instance=instance, resources={"stale": Stale(batches="a,b")}
        ) as ctx:
            first = sensor(ctx)
        assert keys(first) == ["k:a"]
        # ... and evaluated as the daemon does, with the cursor carried over.
        defs = Definitions(
            assets=[target_asset], sensors=[sensor], resources={"stale": Stale(batches="a,b")}
        )
        Definitions.validate_loadable(defs)
        with build_sensor_context(
            instance=instance, cursor=first.cursor, definitions=defs, resources=defs.resources
        ) as ctx:
            tick = defs.resolve_sensor_def("test_rerun_sensor").evaluate_tick(ctx)
        assert [r.run_key for r in tick.run_requests] == ["k:b"]


def test_rerun_sensor_refuses_bad_shapes_when_built():
    with pytest.raises(ValueError, match="max_runs_per_tick must be >= 1"):
        build(max_runs=0)
    with pytest.raises(TypeError, match="context first"):
        rerun_sensor(
            lambda *, stale: [],
            name="x",
            targets=["target_asset"],
            description="x",
            max_runs_per_tick=1,
            minimum_interval_seconds=30,
            default_status=DefaultSensorStatus.STOPPED,
        )
