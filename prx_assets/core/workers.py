"""Worker pools for the per-image work of a partition: every core the process is given.

Why one small interface: ingest validation, pHash thumbnails and shard rendering are pure
functions of one image's bytes, so a stage maps them over its images, in order, on as many
cores as it has, and gets the same output whatever the worker count. The stage keeps the
I/O (Lance reads and writes, MDS writing) and everything order-dependent in its own process.

Contract (every backend, ``prx_assets.core.ray_pool.RayPool`` included):

- ``map_ordered(fn, items, window=None)`` yields one result per item, in input order;
  ``fn`` is a picklable module-level function. ``items`` is consumed lazily and at most
  ``window`` items (default ``2 * workers``) are in flight, so memory stays bounded by the
  window, not by the partition.
- An exception raised by ``fn`` on an item comes back in that item's place as
  :class:`ItemFailed` (``"<Type>: <message>"``), exactly as inline, so a stage records it as
  that image's failure. A worker process that dies on an item (a segfault in a decoder, the
  OOM killer) is replaced; the items that were in flight are retried one at a time, and one
  that kills a worker again comes back as ``ItemFailed("worker_died: ...")``. No item is
  lost and no bad image takes down the partition.
- ``close()`` releases the workers; a pool is also a context manager.

``make_pool(kind, workers)``: ``kind`` None reads ``PRX_EXECUTOR`` (default ``process``).
``process``: a ``ProcessPoolExecutor`` on a forkserver (workers fork from a small server
process that has imported the task modules once and done nothing else, never from the
Dagster/Lance process with its open datasets and busy threads); ``inline``: the calling
process (what ``workers == 1`` always uses: no pickling, no extra process); ``ray``: the Ray
backend, imported only when asked for. The Dagster executor kinds ``multiprocess``, ``k8s``
and ``ray_runs`` that the same variable selects (``defs/executors.py``) mean ``process``
here: a step's process, pod or Ray-job run maps its images over its own cores. ``workers`` None = the CPUs this process
may use (``available_cpus``: its ``os.sched_getaffinity`` mask, so a ``taskset``/cpuset-pinned
process uses its share, capped by its cgroup CPU quota, so a Kubernetes pod with a CPU limit
of 2 gets 2 workers, not one per core of its node).
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Protocol, TypeVar

from prx_assets.core.pool_items import ItemFailed, call_guarded

T = TypeVar("T")
R = TypeVar("R")

EXECUTOR_ENV = "PRX_EXECUTOR"
POOL_KINDS = ("process", "inline", "ray")
# The Dagster executor kinds of the same variable (defs/executors.py): per-image work in
# one step's process (or pod) runs on a process pool.
_DAGSTER_KINDS = {"multiprocess": "process", "k8s": "process", "ray_runs": "process"}
SHARED_FS_ENV = "PRX_SHARED_FILESYSTEM"
# Imported once in the forkserver, so every forked worker starts with them loaded: the
# stages' task modules (their imports, Lance's included, cost ~1 s per fresh process).
_PRELOAD = [
    "prx_assets.core.forkserver_init",  # first: quiets Lance's fork warning there only
    "numpy",
    "PIL.Image",
    "simplejpeg",
    "prx_assets.core.shards._planes",  # the shard stage's JPEG planes (libjpeg-turbo)
    "prx_assets.core.ingest.runner",
    "prx_assets.core.dedup.phash",
    "prx_assets.core.shards.render",
]


def shared_filesystem() -> bool:
    """Whether every worker node sees this machine's lab, landing zone and shard tree at
    the same paths (``PRX_SHARED_FILESYSTEM=1``: an NFS/Lustre mount on every Ray node, or a
    one-machine cluster). Then Ray workers read and write them like local workers. A wrong
    setting fails the step (each worker first checks a path the step just made: the
    shard staging directory, ingest's probe file), never a silent loss."""
    return os.environ.get(SHARED_FS_ENV, "") == "1"


class WorkerPool(Protocol):
    """Maps a function over items on ``workers`` cores, results in input order.

    ``same_machine``: the items run on this machine, so a task may name a local file (a
    blob of a local lab) instead of carrying its bytes."""

    workers: int
    same_machine: bool

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R | ItemFailed]: ...

    def close(self) -> None: ...


CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _up_from(base: Path, relative: str | None) -> list[Path]:
    """``base/relative`` and each of its parents up to ``base`` itself (a quota set on an
    enclosing cgroup, e.g. a Kubernetes pod's, bounds every cgroup inside it)."""
    dirs = [base]
    if relative:
        here = base
        for part in (p for p in relative.split("/") if p and p not in (".", "..")):
            here = here / part
            dirs.append(here)
    return dirs


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """The CPUs this process's cgroup quota allows (``1.5`` = 150 ms per 100 ms period), or
    None when no quota applies (or none can be read).

    Why: a Kubernetes pod's CPU limit is a CFS quota, not an affinity mask; its process
    sees every core of the node in ``sched_getaffinity``, and a pool of that many workers
    would be throttled into time slices. cgroup v2 reads ``cpu.max`` (``max 100000``: no
    quota; ``200000 100000``: 2 CPUs), v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    (quota -1: none), in the process's own cgroup and every enclosing one under ``root``
    (the smallest wins). ``root`` and ``self_cgroup`` are parameters for tests.
    """
    v2_path: str | None = None
    v1_path: str | None = None
    for line in (_read(self_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    limits: list[float] = []
    for d in _up_from(root, v2_path):
        fields = (_read(d / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0] != "max":
            try:
                quota, period = int(fields[0]), int(fields[1])
            except ValueError:
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    for base in (root / "cpu", root / "cpu,cpuacct", root):
        for d in _up_from(base, v1_path):
            try:
                quota = int(_read(d / "cpu.cfs_quota_us") or "-1")
                period = int(_read(d / "cpu.cfs_period_us") or "0")
            except ValueError:
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits) if limits else None


def available_cpus(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota
    rounded up (``cgroup_cpu_limit``), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root, self_cgroup)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def _window(window: int | None, workers: int) -> int:
    w = 2 * workers if window is None else window
    if w < 1:
        raise ValueError(f"window must be >= 1, got {w}")
    return w


class InlinePool:
    """The calling process itself: what one worker means (nothing pickled, nothing spawned)."""

    same_machine = True

    def __init__(self) -> None:
        self.workers = 1

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R | ItemFailed]:
        _window(window, 1)
        for item in items:
            yield call_guarded(fn, item)

    def close(self) -> None:
        pass

    def __enter__(self) -> InlinePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


WATCH_SECONDS = 0.5  # how often a worker checks that the process it serves is alive


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, killed but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


# A worker's heap keeps what it freed, up to this much, instead of handing it back to the
# kernel after every image (see ``_keep_freed_memory``).
WORKER_HEAP_KEEP_BYTES = 256 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _keep_freed_memory(limit: int = WORKER_HEAP_KEEP_BYTES) -> bool:
    """Let glibc's malloc keep freed memory for reuse (allocations up to ``limit`` from the
    heap, and up to ``limit`` of free heap kept): True when set.

    Why: a worker's per-image buffers (source bytes, decoded planes, the JPEG) are a few MB
    each. A fresh process's malloc maps such buffers from the kernel and hands them back on
    free, so every image faulted its buffers' pages in again, zeroed
    (``prx_assets_tests/core/test_workers.py::test_workers_keep_freed_memory_for_the_next_item``
    shows it in a plain process). A long-lived process reaches a steady heap by itself; a
    worker is told. glibc only (elsewhere a no-op); memory held is bounded by ``limit`` per
    worker beyond its peak in use.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(_M_MMAP_THRESHOLD, min(limit, 32 * 1024 * 1024))  # glibc's maximum
    return bool(ok and mallopt(_M_TRIM_THRESHOLD, limit))


def _serve(owner: int) -> None:
    """Worker initializer: keep freed memory for the next image (``_keep_freed_memory``),
    and exit as soon as the process that owns the pool is gone.

    Why the watchdog: a killed run (kill -9, the OOM killer) cannot shut its pool down, and
    idle workers would otherwise wait on their queue forever, holding the forkserver and
    their memory.
    """
    _keep_freed_memory()

    def watch() -> None:
        while _running(owner):
            time.sleep(WATCH_SECONDS)
        os._exit(0)

    if os.path.exists(f"/proc/{owner}/stat"):  # Linux; elsewhere, no watchdog
        threading.Thread(target=watch, name="prx-pool-owner-watch", daemon=True).start()


def _context() -> multiprocessing.context.BaseContext:
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:  # pragma: no cover - not Linux
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class ProcessPool:
    """``workers`` processes (forkserver), a bounded in-flight window, results in order."""

    same_machine = True

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                self.workers, mp_context=_context(), initializer=_serve, initargs=(os.getpid(),)
            )
        return self._executor

    def _restart(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._executor = None

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R | ItemFailed]:
        limit = _window(window, self.workers)
        pending: deque[tuple[T, Future | None]] = deque()
        source = iter(items)
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < limit:
                    try:
                        item = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    pending.append((item, self._submit(fn, item)))
                if not pending:
                    return
                item, future = pending[0]
                try:
                    if future is None:
                        raise BrokenProcessPool("the pool broke before this item was submitted")
                    result = future.result()
                except BrokenProcessPool:
                    # A worker died (signal, OOM): which item killed it is unknown. Rerun
                    # every in-flight item alone in a fresh pool; the one that kills a
                    # worker again is that item's failure. Order is kept.
                    retried = [self._alone(fn, it) for it, _ in pending]
                    pending.clear()
                    yield from retried
                    continue
                pending.popleft()
                yield result
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()

    def _submit(self, fn: Callable[[T], R], item: T) -> Future | None:
        try:
            return self._pool().submit(call_guarded, fn, item)
        except BrokenProcessPool:  # a worker died since the last submit: retried on read
            return None

    def _alone(self, fn: Callable[[T], R], item: T) -> R | ItemFailed:
        self._restart()
        try:
            return self._pool().submit(call_guarded, fn, item).result()
        except BrokenProcessPool as exc:
            self._restart()
            return ItemFailed(f"worker_died: the worker process exited on this item ({exc})")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_pool(kind: str | None = None, workers: int | None = None) -> WorkerPool:
    """A pool of ``kind`` (None: ``$PRX_EXECUTOR``, default ``process``) with ``workers``.

    ``workers`` None: the CPUs available to this process (for ``ray``: the cluster's CPUs).
    One local worker is always inline
    (the same results, without a process in between), and so is any pool asked for inside
    a daemonic process, which may not start children; an unknown kind is an error.
    """
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    chosen = kind if kind is not None else os.environ.get(EXECUTOR_ENV, "process")
    chosen = _DAGSTER_KINDS.get(chosen, chosen)
    if chosen not in POOL_KINDS:
        raise ValueError(f"worker pool kind must be one of {POOL_KINDS}, got {chosen!r}")
    if chosen == "ray":
        from prx_assets.core.ray_pool import RayPool  # imported only when asked for

        return RayPool(workers=workers)  # None: the cluster's CPUs, not this machine's
    n = available_cpus() if workers is None else workers
    if chosen == "inline" or n == 1 or multiprocessing.current_process().daemon:
        # A daemonic process (a multiprocessing.Pool worker) may not have children.
        return InlinePool()
    return ProcessPool(n)


def task_map(kind: str | None = None, workers: int | None = None) -> Callable[..., list]:
    """``map_ordered`` as one call that opens a pool of ``kind`` and ``workers``, maps, and
    closes it (``core/lab/maintenance.TaskMap``): for work that is due only now and then, such
    as the write path's compactions, so that no pool is started when nothing is due."""

    def run(fn: Callable[[T], R], items: list[T]) -> list[R | ItemFailed]:
        pool = make_pool(kind, workers)
        try:
            return list(pool.map_ordered(fn, items))
        finally:
            pool.close()

    return run
