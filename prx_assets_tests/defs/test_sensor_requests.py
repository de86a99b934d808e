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

from prx_assets.defs.sensor_requests import request_once, request_ranges_once, rerun_sensor


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
    for per_run, bridge in ((0, 0), (10, -1)):
        with pytest.raises(ValueError, match="max_partitions_per_run must be >= 1"):
            rerun_sensor(
                lambda context: [],
                name="x",
                targets=["target_asset"],
                description="x",
                max_runs_per_tick=1,
                minimum_interval_seconds=30,
                default_status=DefaultSensorStatus.STOPPED,
                max_partitions_per_run=per_run,
                max_bridge=bridge,
            )


def test_opt_out_settings_refuse_runs_of_no_partition():
    from pydantic import ValidationError

    from prx_assets.defs.skiplists.config import OptOutResource

    with pytest.raises(ValidationError):
        OptOutResource(max_partitions_per_run=0)
    with pytest.raises(ValidationError):
        OptOutResource(max_bridge=-1)


ORDER = [f"p{i:02d}" for i in range(12)]
START, END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def sel(batch: str, state: str = "s0") -> RunRequest:
    return RunRequest(
        run_key=f"k:{batch}:{state}",
        partition_key=batch,
        asset_selection=[AssetKey("x")],
        tags={"why": f"{batch} {state}", "t": "1"},
    )


def test_ranges_are_requested_once_per_state_and_the_rest_on_later_ticks():
    wanted = [sel(b) for b in ("p01", "p02", "p03", "p07", "p11")]
    first = request_ranges_once(None, wanted, 1, ORDER, 4, 1, reason_tag="why")
    (run,) = first.run_requests
    assert (run.tags[START], run.tags[END]) == ("p01", "p03") and run.partition_key is None
    assert run.tags["prx/partitions"] == "3" and run.tags["t"] == "1"
    assert run.tags["why"] == "3 partition(s); p01 s0" and run.run_key.startswith("k:p01..p03:")
    assert json.loads(first.cursor) == ["k:p01:s0", "k:p02:s0", "k:p03:s0"]
    second = request_ranges_once(first.cursor, wanted, 5, ORDER, 4, 1, reason_tag="why")
    # p07 and p11 are too far apart to bridge: a plain partition run each.
    assert [(r.partition_key, r.run_key) for r in second.run_requests] == [
        ("p07", "k:p07:s0"),
        ("p11", "k:p11:s0"),
    ]
    third = request_ranges_once(second.cursor, wanted, 5, ORDER, 4, 1)
    assert not third.run_requests and "5 stale partition(s), all requested" in str(
        third.skip_reason.skip_message
    )
    # p02 marked again (a new state): requested alone; the settled ones drop out.
    again = request_ranges_once(third.cursor, [sel("p02", "s1"), sel("p07")], 5, ORDER, 4, 1)
    assert keys(again) == ["k:p02:s1"] and json.loads(again.cursor) == ["k:p02:s1", "k:p07:s0"]


def test_ranges_bridge_small_gaps_and_one_per_run_is_request_once():
    wanted = [sel("p00"), sel("p02"), sel("p03")]
    (run,) = request_ranges_once(None, wanted, 5, ORDER, 10, 1).run_requests
    assert run.tags["prx/partitions"] == "4" and run.tags["prx/bridged_partitions"] == "1"
    plain = request_ranges_once(None, wanted, 5, ORDER, 1, 0)
    assert keys(plain) == keys(request_once(None, wanted, 5))


def test_ranges_refuse_mixed_selections_and_two_states_of_one_partition():
    other = RunRequest(run_key="k:p05:s0", partition_key="p05", asset_selection=[AssetKey("y")])
    with pytest.raises(ValueError, match="one asset selection"):
        request_ranges_once(None, [sel("p00"), other], 5, ORDER, 10, 1)
    with pytest.raises(ValueError, match="one state per partition"):
        request_ranges_once(None, [sel("p00"), sel("p00", "s1")], 5, ORDER, 10, 1)


def test_a_partition_outside_the_order_is_still_requested_alone():
    result = request_ranges_once(None, [sel("p00"), sel("p01"), sel("gone")], 5, ORDER, 10, 1)
    assert [(r.partition_key, r.run_key) for r in result.run_requests][1:] == [
        ("gone", "k:gone:s0")
    ]
    assert "k:gone:s0" in json.loads(result.cursor)
