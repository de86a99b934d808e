"""Batched reruns: the partitions a list or a policy change reaches, planned as runs over
ranges of the partitions' order (``plan_partition_runs``)."""

import random

import pytest

from prx_assets.core.skiplists.reruns import PartitionRun, plan_partition_runs

KEYS = [f"b{i:03d}" for i in range(40)]


def _covered(runs: list[PartitionRun]) -> list[str]:
    return [k for r in runs for k in r.batches]


def test_contiguous_partitions_run_together_up_to_the_cap():
    runs = plan_partition_runs(KEYS, KEYS[5:30], max_per_run=10, max_bridge=0)
    assert [r.batches for r in runs] == [
        tuple(KEYS[5:15]),
        tuple(KEYS[15:25]),
        tuple(KEYS[25:30]),
    ]
    assert all(r.wanted == r.batches and not r.bridged for r in runs)
    assert [(r.first, r.last) for r in runs] == [
        ("b005", "b014"),
        ("b015", "b024"),
        ("b025", "b029"),
    ]


def test_small_gaps_are_bridged_and_large_ones_split():
    wanted = ["b001", "b003", "b004", "b010", "b020"]
    runs = plan_partition_runs(KEYS, wanted, max_per_run=100, max_bridge=5)
    # b004 -> b010: a gap of 5 (b005..b009) is bridged; b010 -> b020: 9 is not.
    assert [r.batches for r in runs] == [tuple(KEYS[1:11]), ("b020",)]
    assert runs[0].wanted == ("b001", "b003", "b004", "b010")
    assert runs[0].bridged == ("b002", "b005", "b006", "b007", "b008", "b009")
    no_bridge = plan_partition_runs(KEYS, wanted, max_per_run=100, max_bridge=0)
    assert [r.batches for r in no_bridge] == [("b001",), ("b003", "b004"), ("b010",), ("b020",)]


def test_a_bridge_never_pushes_a_run_past_its_cap():
    runs = plan_partition_runs(KEYS, ["b000", "b004", "b005"], max_per_run=4, max_bridge=8)
    assert all(len(r.batches) <= 4 for r in runs)
    assert [r.wanted for r in runs] == [("b000",), ("b004", "b005")]


def test_unknown_keys_are_not_planned_and_order_is_the_partitions_order():
    runs = plan_partition_runs(KEYS, {"b007", "gone", "b002"}, max_per_run=100, max_bridge=0)
    assert [r.wanted for r in runs] == [("b002",), ("b007",)]
    assert plan_partition_runs(KEYS, [], 10, 3) == []


@pytest.mark.parametrize("seed", range(20))
def test_every_wanted_partition_is_in_exactly_one_run(seed):
    rng = random.Random(seed)
    ordered = rng.sample(KEYS, len(KEYS))  # dynamic partitions: insertion order, not sorted
    wanted = set(rng.sample(KEYS, rng.randint(1, len(KEYS))))
    per_run, bridge = rng.randint(1, 12), rng.randint(0, 6)
    runs = plan_partition_runs(ordered, wanted, per_run, bridge)
    covered = _covered(runs)
    assert len(covered) == len(set(covered))  # no partition twice
    assert sorted(k for r in runs for k in r.wanted) == sorted(wanted)
    for r in runs:
        i, j = ordered.index(r.first), ordered.index(r.last)
        assert r.batches == tuple(ordered[i : j + 1])  # exactly what a range run covers
        assert len(r.batches) <= per_run and r.first in wanted and r.last in wanted
        assert len(r.bridged) <= bridge * max(0, len(r.wanted) - 1)
    assert plan_partition_runs(ordered, wanted, per_run, bridge) == runs  # deterministic
    assert len({r.digest() for r in runs}) == len(runs)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        plan_partition_runs(KEYS, KEYS, max_per_run=0)
    with pytest.raises(ValueError):
        plan_partition_runs(KEYS, KEYS, max_bridge=-1)
