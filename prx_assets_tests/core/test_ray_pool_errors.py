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


def test_a_dead_cluster_under_an_ingest_write_is_that_error_not_lances(monkeypatch, tmp_path):
    """The ingest's pool is made inside the stream Lance writes from, and Lance reports an
    exception raised there as ``OSError: LanceError(Arrow): C Data interface error``: the
    lab re-raises the original, so a dead ``RAY_ADDRESS`` reads as what it is."""
    from prx_assets.core.ingest.runner import BatchIngest
    from prx_assets.core.ingest.sources import resolve_batch
    from prx_assets.core.lab import Lab
    from prx_assets.core.ray_pool import RayUnavailable
    from prx_assets.core.tables import IMAGES
    from prx_assets.demo.jpegs import solid_jpeg

    batch = tmp_path / "landing" / "s" / "000"
    batch.mkdir(parents=True)
    (batch / "a.jpg").write_bytes(solid_jpeg((64, 48), (1, 2, 3)))
    (batch / "_SUCCESS").write_text("")
    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    lab = Lab(tmp_path / "lab")
    run = BatchIngest(
        resolve_batch(tmp_path / "landing", "s.000"),
        executor="ray",
        blob_sink=lab.local_blobs(IMAGES, "image"),
    )
    with pytest.raises(
        RayUnavailable, match=f"no Ray cluster answers at RAY_ADDRESS=127.0.0.1:{port}"
    ):
        lab.replace_partition(IMAGES, "s.000", run.image_batches(), stored_blobs=run.stored_blobs)


def test_a_step_with_no_items_joins_no_cluster(monkeypatch):
    """A pool made for a step with nothing to do costs a TCP connect, not a Ray job: the
    cluster is joined at the first item; the listener here is no Ray cluster at all."""
    import ray

    from prx_assets.core import ray_pool

    ray_pool.disconnect()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{listener.getsockname()[1]}")
        pool = make_pool("ray")
        assert list(pool.map_ordered(abs, [])) == []
        pool.close()
    assert not ray.is_initialized()
