"""Worker pools without a cluster: the local pools keep input order in a bounded window, and
``PRX_EXECUTOR=ray`` without a reachable cluster is a clear error at once (never a hang, never
a silent fallback to local work)."""

from __future__ import annotations

import socket

import pytest

from prx_assets.core.workers import InlinePool, ProcessPool, make_pool
from prx_assets_tests.ray_pipeline import late_square, refuse_seven


def _counted(n: int, pulled: list[int]):
    for i in range(n):
        pulled.append(i)
        yield i


def test_the_default_and_dagster_executor_values_keep_the_work_in_process(monkeypatch):
    monkeypatch.delenv("PRX_EXECUTOR", raising=False)
    assert isinstance(make_pool(), InlinePool)
    for kind in ("multiprocess", "k8s"):
        monkeypatch.setenv("PRX_EXECUTOR", kind)
        assert isinstance(make_pool(), InlinePool)
    with pytest.raises(ValueError, match="PRX_EXECUTOR"):
        make_pool("spark")


def test_the_process_pool_yields_input_order_within_its_window():
    pool = ProcessPool(2)
    try:
        pulled: list[int] = []
        out = []
        for value in pool.map_ordered(late_square, _counted(12, pulled), window=3):
            out.append(value)
            assert len(pulled) - len(out) <= 3
        assert out == [i * i for i in range(12)]
        with pytest.raises(ValueError, match="seven is refused"):
            list(pool.map_ordered(refuse_seven, range(10)))
    finally:
        pool.close()


def test_ray_without_an_address_is_a_clear_error(monkeypatch):
    from prx_assets.core.ray_pool import RayUnavailable

    monkeypatch.setenv("PRX_EXECUTOR", "ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RayUnavailable, match="needs RAY_ADDRESS"):
        make_pool()


def test_ray_at_an_address_nobody_answers_is_refused_before_joining(monkeypatch):
    from prx_assets.core.ray_pool import RayUnavailable

    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(RayUnavailable, match="no Ray cluster answers"):
        make_pool("ray")
    import ray

    assert not ray.is_initialized()


def test_the_definitions_refuse_ray_without_an_address(monkeypatch):
    from prx_assets.definitions import build_defs

    monkeypatch.setenv("PRX_EXECUTOR", "ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="RAY_ADDRESS"):
        build_defs("data")
