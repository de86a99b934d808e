"""Shared fixtures: a small demo landing zone, a lab resource and a real Dagster instance."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")

PHOTOS = Path(__file__).resolve().parents[1] / "prx_assets" / "demo" / "photos"

# Streaming creates two file locks per dataset in the temporary directory and never removes
# them; every later dataset stats each earlier prefix's locks to find a free one, so a
# machine that ran the suite a few times builds datasets ever more slowly. Locks of prefixes
# whose shared memory is gone (their datasets are) are removed when the session starts and
# after each test.
_STREAMING_LOCK = re.compile(r"(\d{6})_(?:barrier|cache)_filelock")


def _remove_dead_streaming_locks() -> None:
    shm, tmp = Path("/dev/shm"), tempfile.gettempdir()
    if not shm.is_dir():
        return
    live = {name[:6] for name in os.listdir(shm) if name[:6].isdigit()}
    for name in os.listdir(tmp):
        m = _STREAMING_LOCK.fullmatch(name)
        if m and m.group(1) not in live:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(tmp, name))


def pytest_configure(config: pytest.Config) -> None:
    _remove_dead_streaming_locks()


@pytest.fixture(autouse=True)
def _release_streaming_shared_memory(_no_descriptor_leak: None):
    """Every test's streaming readers give their shared memory back when the test ends.

    Streaming holds each segment (and its file descriptor) until the process exits; over the
    whole suite in one process that exhausts the descriptor limit.
    """
    from prx_assets_tests.core.stage_inputs import streaming_memory_released

    with streaming_memory_released():
        yield
    _remove_dead_streaming_locks()


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
