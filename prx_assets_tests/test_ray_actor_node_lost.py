"""``PRX_EXECUTOR=ray``'s worker actors when a whole node is lost mid-step.

An actor is pinned to its node, so Ray cannot restart it when its node is gone: the items
it held are sent to another node's actor, and the map still yields every result in input
order. A cluster of its own (a head and one worker node, one CPU each on 127.0.0.1): the
worker node is killed, every process of it at once, while its actor runs an item.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from prx_assets.core.ray_local import LocalRayCluster
from prx_assets_tests.ray_pipeline import late_square

REPO = Path(__file__).resolve().parents[1]
CALL = "PrxWorker.run"  # what Ray titles an actor process while it runs an item


@pytest.fixture
def cluster(tmp_path):
    cluster = LocalRayCluster(tmp_path / "ray", env={"PYTHONPATH": str(REPO)}, dashboard=False)
    cluster.start()
    try:
        yield cluster
    finally:
        if "prx_assets.core.ray_pool" in sys.modules:
            sys.modules["prx_assets.core.ray_pool"].disconnect()
        cluster.stop()
        assert cluster.pids() == [], "processes of the test's Ray cluster outlived it"


def test_items_of_a_lost_nodes_actor_go_to_another_node_in_order(cluster, monkeypatch):
    from prx_assets.core.ray_pool import RayPool, actor_stats

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    pool = RayPool()
    assert pool.workers == 2
    items = list(range(40))  # ~0.1 s each: the map outlives the kill by far
    got: list = []
    failure: list[BaseException] = []

    def step() -> None:
        try:
            got.extend(pool.map_ordered(late_square, items))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            failure.append(exc)

    runner = threading.Thread(target=step)
    runner.start()
    killed: list[int] = []
    deadline = time.monotonic() + 120
    while not killed and runner.is_alive() and time.monotonic() < deadline:
        if any(cluster.node_of(pid) == 1 for pid in cluster.busy_workers(CALL)):
            killed = cluster.kill_node(1)
        else:
            time.sleep(0.005)
    runner.join(timeout=300)
    assert not runner.is_alive()
    assert killed, "the worker node's actor was never seen running an item"
    assert not failure, failure
    assert got == [late_square(i) for i in items]  # every item, once, in input order
    survivors = actor_stats()
    assert len(survivors) == 1  # the head's actor; the lost node's cannot come back
    assert survivors[0]["pid"] not in killed and survivors[0]["calls"] > len(items) // 2
