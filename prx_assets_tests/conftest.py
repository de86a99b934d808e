"""Shared fixtures: a small demo landing zone, a lab resource and a real Dagster instance."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")

PHOTOS = Path(__file__).resolve().parents[1] / "prx_assets" / "demo" / "photos"

# Streaming never removes its file locks; stale ones slow every later dataset construction
# (see prx_assets.loader.locks). Removed when the session starts and after each test.


# The longest modules first (measured with --durations): `make test` runs the suite on two
# processes a module at a time (`--dist loadscope`), and a long module started last leaves
# the other process idle at the end. No test depends on this order.
LONGEST_MODULES = (
    "s3/test_kill_s3.py",
    "s3/test_demo_on_s3.py",
    "test_kill.py",
    "test_end_to_end.py",
    "ops/test_dagster_ui.py",
    "ops/test_run_monitoring.py",
    "test_automation.py",
    "test_snapshots.py",
    "defs/test_audit.py",
    "test_ray_executor.py",
    "s3/test_ray_on_s3.py",
    "test_ray_actor_node_lost.py",
    "test_small_copy_opt_out.py",
    "test_cli.py",
    "browser/test_queries.py",
    "browser/test_browser_ui.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    here = Path(__file__).resolve().parent

    def first(item: pytest.Item) -> int:
        try:
            name = Path(str(item.path)).resolve().relative_to(here).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(name, len(rank))

    items.sort(key=first)  # stable: the rest keep their order


def pytest_configure(config: pytest.Config) -> None:
    from prx_assets.loader.locks import remove_dead_streaming_locks

    remove_dead_streaming_locks()


@pytest.fixture(autouse=True)
def _release_streaming_shared_memory(_no_descriptor_leak: None):
    """Every test's streaming readers give their shared memory back when the test ends.

    Streaming holds each segment (and its file descriptor) until the process exits; over the
    whole suite in one process that exhausts the descriptor limit.
    """
    from prx_assets.loader.locks import remove_dead_streaming_locks
    from prx_assets_tests.streaming_memory import streaming_memory_released

    with streaming_memory_released():
        yield
    remove_dead_streaming_locks()


#: Descriptors the test process may hold between tests (~25 at steady state). A leak fails
#: the test that crosses it, by name, long before the OS limit (1024 on many machines)
#: takes down pytest itself.
MAX_OPEN_DESCRIPTORS = 400


@pytest.fixture(autouse=True)
def _no_descriptor_leak():
    """Fail the test after which this process holds more than MAX_OPEN_DESCRIPTORS.

    Checked after streaming's shared memory is released (that fixture depends on this one,
    so it is torn down first).
    """
    yield
    fd_dir = Path("/proc/self/fd")
    if fd_dir.is_dir():
        held = len(os.listdir(fd_dir))
        assert held <= MAX_OPEN_DESCRIPTORS, (
            f"{held} open file descriptors after this test (limit {MAX_OPEN_DESCRIPTORS}): "
            "a leak (streaming shared memory, Lance datasets, sockets or files left open)"
        )


@pytest.fixture(scope="session")
def demo_source(tmp_path_factory) -> tuple[Path, object]:
    """The small demo landing zone, built once; copy it before changing it."""
    from prx_assets.demo.build import build_demo_landing

    root = tmp_path_factory.mktemp("demo-source")
    manifest = build_demo_landing(root / "landing", size="small")
    return root / "landing", manifest


@pytest.fixture
def data_root(tmp_path: Path, demo_source) -> Path:
    """A fresh data root holding a copy of the small demo landing zone."""
    landing, _ = demo_source
    shutil.copytree(landing, tmp_path / "data" / "landing", symlinks=True)
    return tmp_path / "data"


@pytest.fixture
def demo_manifest(demo_source):
    return demo_source[1]


@pytest.fixture
def lab_resource(data_root: Path):
    from prx_assets.defs.resources import LabResource

    return LabResource(data_root=str(data_root))


@pytest.fixture
def instance():
    from dagster import instance_for_test

    with instance_for_test() as inst:
        yield inst
