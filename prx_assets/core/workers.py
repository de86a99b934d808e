"""Where a stage's per-image work runs: in this process, in local processes, or on Ray.

A runner hands its per-image function to a ``WorkerPool`` and reads the results back in
input order, so what it writes does not depend on where (or how widely) the work ran: the
shards and rows are byte-identical whatever the pool. ``make_pool`` picks the pool from
``PRX_EXECUTOR`` (the variable that also picks the Dagster executor, see
``defs/executors.py``): ``ray`` submits the work as Ray tasks to the cluster ``RAY_ADDRESS``
names; every other value keeps it on this machine. Ray is imported only on the ``ray``
branch, so the default path never loads it.

Minimal version (issue 14, Ray part); the fuller local implementation arrives with issue 13's
branch and keeps this interface.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")

EXECUTOR_ENV = "PRX_EXECUTOR"
# PRX_EXECUTOR values that keep per-image work in the step's own process (the Dagster
# executor values too: a multiprocess or k8s step does its own work).
LOCAL_KINDS = ("", "inline", "multiprocess", "k8s")


class WorkerPool(Protocol):
    """Runs ``fn`` over items somewhere, yielding results in input order."""

    workers: int

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R]: ...

    def close(self) -> None: ...


class InlinePool:
    """Runs every item in this process, one after the other (the default)."""

    workers = 1

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R]:
        for item in items:
            yield fn(item)

    def close(self) -> None:
        return None


class ProcessPool:
    """Local worker processes; at most ``window`` items in flight (bounded memory)."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self._executor = ProcessPoolExecutor(workers)

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R]:
        limit = window or 2 * self.workers
        pending: deque[Future[R]] = deque()
        try:
            for item in items:
                pending.append(self._executor.submit(fn, item))
                while len(pending) >= limit:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def make_pool(kind: str | None = None, workers: int | None = None) -> WorkerPool:
    """The pool ``kind`` names (``None``: ``$PRX_EXECUTOR``); an unknown kind is an error."""
    kind = os.environ.get(EXECUTOR_ENV, "") if kind is None else kind
    if kind == "ray":
        from prx_assets.core.ray_pool import RayPool

        return RayPool(workers=workers)
    if kind == "process":
        return ProcessPool(workers or os.cpu_count() or 1)
    if kind in LOCAL_KINDS:
        return InlinePool() if not workers or workers <= 1 else ProcessPool(workers)
    raise ValueError(
        f"{EXECUTOR_ENV} must be one of 'multiprocess', 'k8s', 'ray', 'process', 'inline', "
        f"not {kind!r}"
    )
