"""``PRX_EXECUTOR=ray`` without a reachable cluster is a clear error at once: never a hang,
never a silent fallback to local work."""

from __future__ import annotations

import socket

import pytest

from prx_assets.core.workers import make_pool


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
