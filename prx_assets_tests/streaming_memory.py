"""Give back the shared memory streaming holds until exit, and build plain readers: for tests
and benchmarks.

A leaf module (standard library only at import; ``plain_streaming_dataset`` imports
streaming and the loader when called), so that the benchmarks can use it without importing
the test fixtures' stack.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def streaming_memory_released() -> Iterator[None]:
    """Release, on exit, the shared memory streaming readers opened inside the block.

    Streaming keeps each shared-memory segment it opens alive until the process exits (an
    atexit handler per segment, ``streaming.base.shared.memory.SharedMemory.cleanup``), so a
    long test session that builds many readers runs out of file descriptors, and a benchmark
    that builds many datasets measures ever more segments. Those handlers alone are held back
    and run when the block ends (drop every reader inside it); any other atexit registration
    goes through untouched.
    """
    held: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
    real_register = atexit.register

    def register(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        if not str(getattr(f, "__module__", "")).startswith("streaming."):
            return real_register(f, *args, **kwargs)
        held.append((f, args, kwargs))
        return f

    atexit.register = register  # type: ignore[assignment]
    try:
        yield
    finally:
        atexit.register = real_register
        if held:  # nothing opened: no collection (a second or two in a big process)
            gc.collect()
        for f, args, kwargs in reversed(held):
            with contextlib.suppress(Exception):  # best-effort release of shared memory
                f(*args, **kwargs)


def plain_streaming_dataset(attempts: int = 20, **kwargs: Any) -> Any:
    """``streaming.StreamingDataset(**kwargs)``, retried when it loses streaming's prefix race.

    Streaming registers a machine-wide shared-memory prefix as "the first free number", so two
    test workers building plain datasets at the same moment can pick the same one and the
    loser gets ``FileExistsError`` on ``/<prefix>_locals`` (seen in CI at stop 44). The
    project's own loader retries this itself (``SkipListDataset._init_streaming``); tests that
    check what *plain* streaming does with our output retry here, and only on that error.
    """
    import time

    from streaming import StreamingDataset

    from prx_assets.loader.dataset import lost_prefix_race

    for attempt in range(attempts):
        try:
            return StreamingDataset(**kwargs)
        except FileExistsError as exc:
            if attempt + 1 == attempts or not lost_prefix_race(exc):
                raise
            time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")
