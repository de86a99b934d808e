"""A spawn-context process pool for tests that race real processes against each other."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.pool import Pool


@contextlib.contextmanager
def spawn_pool(processes: int) -> Iterator[Pool]:
    """A spawned ``Pool`` (Lance is not fork-safe) closed and joined on the way out.

    Why not ``with ctx.Pool(...)``: its exit *terminates* the workers (SIGTERM). A worker
    killed while it holds the task queue's lock leaves that lock taken, and terminate's
    join then waits forever for a sibling blocked on it (a 12-minute hang in this suite).
    ``close()`` lets each worker take its sentinel and exit by itself; a failing test still
    terminates the pool.
    """
    pool = mp.get_context("spawn").Pool(processes)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()
