"""A forkserver whose server has imported what a test's children need.

multiprocessing keeps one forkserver per process and takes its preload list only when it
starts: once the worker pool (``core/workers.py``) has started one, a later
``set_forkserver_preload`` is ignored, and every kill-test child imports the writers,
streaming and torch afresh (seconds per trial: the kill tests took ~210 s each late in the
suite against ~10 s alone). The server is stopped before and after such a module, so it
starts again with the preload of whoever needs it next (the pool sets its own each time).
Its already forked children are independent processes and keep running.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from multiprocessing import forkserver
from multiprocessing.context import BaseContext


def _stop_forkserver() -> None:
    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's, used by its own tests
    if stop is not None:
        stop()


@contextlib.contextmanager
def forkserver_preloading(modules: list[str]) -> Iterator[BaseContext]:
    """The forkserver context, its server (re)started with ``modules`` imported."""
    _stop_forkserver()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(modules)
    try:
        yield ctx
    finally:
        _stop_forkserver()
