"""Worker pools: input order, bounded window, failures in the item's place, dead workers."""

from __future__ import annotations

import os
import threading

import pytest

from prx_assets.core.workers import (
    InlinePool,
    ItemFailed,
    ProcessPool,
    available_cpus,
    cgroup_cpu_limit,
    make_pool,
)
from prx_assets_tests.spawned import spawn_pool


def square_after_delay(x: int) -> int:
    # Later items finish first, so order is the pool's doing, not the scheduler's.
    import time

    time.sleep(0.002 * (8 - x % 8))
    return x * x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError(f"bad item {x}")
    return x


def die_on_five(x: int) -> int:
    if x == 5:
        os._exit(17)  # what a segfaulting decoder looks like to the pool
    return x + 100


def worker_pid(_: int) -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2) as p:
        yield p


def test_results_come_back_in_input_order(pool: ProcessPool) -> None:
    assert list(pool.map_ordered(square_after_delay, range(20))) == [x * x for x in range(20)]
    assert list(pool.map_ordered(square_after_delay, [])) == []


def test_work_runs_in_other_processes(pool: ProcessPool) -> None:
    pids = set(pool.map_ordered(worker_pid, range(8)))
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_exception_is_the_same_failure_as_inline(pool: ProcessPool) -> None:
    pooled = list(pool.map_ordered(fail_on_three, range(6)))
    inline = list(InlinePool().map_ordered(fail_on_three, range(6)))
    assert pooled == inline
    assert pooled[3] == ItemFailed("ValueError: bad item 3")
    assert pooled[:3] == [0, 1, 2] and pooled[4:] == [4, 5]


def test_a_dead_worker_costs_only_its_item(pool: ProcessPool) -> None:
    out = list(pool.map_ordered(die_on_five, range(12), window=4))
    assert len(out) == 12
    assert isinstance(out[5], ItemFailed) and out[5].error.startswith("worker_died")
    assert [o for i, o in enumerate(out) if i != 5] == [x + 100 for x in range(12) if x != 5]
    # The pool keeps working afterwards.
    assert list(pool.map_ordered(square_after_delay, range(4))) == [0, 1, 4, 9]


def test_in_flight_items_never_exceed_the_window(pool: ProcessPool) -> None:
    pulled = 0
    lock = threading.Lock()
    consumed = 0
    high = 0

    def items():
        nonlocal pulled, high
        for i in range(30):
            with lock:
                pulled += 1
                high = max(high, pulled - consumed)
            yield i

    for _ in pool.map_ordered(square_after_delay, items(), window=3):
        consumed += 1
    assert pulled == consumed == 30
    assert high <= 3


def test_make_pool_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_pool("process", 1), InlinePool)  # one worker: no process between
    assert isinstance(make_pool("inline", 4), InlinePool)
    p = make_pool("process", 2)
    assert isinstance(p, ProcessPool) and p.workers == 2
    p.close()
    monkeypatch.setenv("PRX_EXECUTOR", "inline")
    assert isinstance(make_pool(None, 3), InlinePool)
    monkeypatch.setenv("PRX_EXECUTOR", "k8s")  # the Dagster executor kind: a process pool
    assert isinstance(make_pool(None, 2), ProcessPool)
    monkeypatch.setenv("PRX_EXECUTOR", "threads")
    with pytest.raises(ValueError, match="worker pool kind"):
        make_pool(None, 2)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        make_pool("process", 0)
    monkeypatch.delenv("PRX_EXECUTOR")
    assert make_pool().workers == available_cpus() <= len(os.sched_getaffinity(0))


def _fake_cgroup(tmp_path, self_cgroup: str, files: dict[str, str]):
    root = tmp_path / "sys-fs-cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "self-cgroup").write_text(self_cgroup)
    return root, tmp_path / "self-cgroup"


def test_the_pool_sizes_itself_from_the_cgroup_cpu_quota(tmp_path) -> None:
    """A Kubernetes pod sees every core of its node in its affinity mask; its CPU limit is
    a CFS quota. The pool takes the quota, rounded up, when it is the smaller."""
    affinity = len(os.sched_getaffinity(0))
    v2 = _fake_cgroup(tmp_path / "v2", "0::/\n", {"cpu.max": "150000 100000\n"})
    assert cgroup_cpu_limit(*v2) == 1.5
    assert available_cpus(*v2) == min(affinity, 2)
    unlimited = _fake_cgroup(tmp_path / "max", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(*unlimited) is None
    assert available_cpus(*unlimited) == affinity
    # A quota on an enclosing cgroup (the pod's) bounds the container's cgroup inside it.
    nested = _fake_cgroup(
        tmp_path / "nested",
        "0::/kubepods/pod1/ctr\n",
        {"kubepods/pod1/cpu.max": "50000 100000", "kubepods/pod1/ctr/cpu.max": "max 100000"},
    )
    assert cgroup_cpu_limit(*nested) == 0.5
    assert available_cpus(*nested) == 1  # at least one
    v1 = _fake_cgroup(
        tmp_path / "v1",
        "4:cpu,cpuacct:/\n0::/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "300000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
    )
    assert cgroup_cpu_limit(*v1) == 3.0
    assert available_cpus(*v1) == min(affinity, 3)
    v1_none = _fake_cgroup(
        tmp_path / "v1none",
        "4:cpu:/\n",
        {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
    )
    assert cgroup_cpu_limit(*v1_none) is None
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-self") is None


def _pool_kind_in_a_daemon(_: int) -> str:
    return type(make_pool("process", 2)).__name__


def test_a_daemonic_process_gets_an_inline_pool() -> None:
    with spawn_pool(1) as daemons:
        assert daemons.map(_pool_kind_in_a_daemon, [0]) == ["InlinePool"]


KILLED_OWNER = """
import os, signal, sys
from prx_assets.core.workers import ProcessPool
from prx_assets_tests.core.test_workers import worker_pid

pool = ProcessPool(2)
pids = sorted(set(pool.map_ordered(worker_pid, range(6))))
with open(sys.argv[1], "w") as f:
    f.write(" ".join(map(str, pids)))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_exit_when_the_pool_owner_is_killed(tmp_path) -> None:
    import subprocess
    import sys
    import time

    from prx_assets.core.workers import _running

    out = tmp_path / "pids"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_OWNER, str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=120,
    )
    assert child.returncode == -9
    pids = [int(p) for p in out.read_text().split()]
    assert pids
    deadline = time.monotonic() + 20
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)], "workers outlived the killed owner"


BUFFER_BYTES = 8 << 20  # a few MB, as one image's bytes, planes or JPEG are
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def faults_of_fresh_buffers(n: int) -> int:
    """Minor page faults of ``n`` rounds of making three zeroed buffers (an image's bytes,
    planes and output are held together) and dropping them."""
    import resource

    def one_round() -> None:
        held = [bytearray(BUFFER_BYTES) for _ in range(3)]
        del held

    one_round()  # the first round may fault in whatever this process keeps
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        one_round()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_workers_keep_freed_memory_for_the_next_item(pool: ProcessPool) -> None:
    # A fresh process maps every buffer of this size from the kernel and hands it back on
    # free, so each one faults all its pages in again (the control, in a plain spawned
    # process); a pool worker is told to keep freed memory, and the next item reuses it.
    per_buffer = BUFFER_BYTES // PAGE_BYTES
    with spawn_pool(1) as plain:
        assert plain.apply(faults_of_fresh_buffers, (10,)) >= 10 * per_buffer
    assert max(pool.map_ordered(faults_of_fresh_buffers, [10, 10])) < per_buffer
