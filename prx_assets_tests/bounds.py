"""Test helpers for bounded behaviour: peak memory, sparse inputs, reads that must not block.

Peak memory of a piece of work is measured from the kernel's own counters (Linux).

Why not wall clock or tracemalloc: the findings were about resident memory (a 1.5 GB file
read whole before being refused), which includes buffers Python's allocator never sees.
The peak-RSS mark of this process is reset (``/proc/self/clear_refs``, "5"), the work runs,
and the new peak (``VmHWM``) is compared with the resident size at the reset.
"""

from __future__ import annotations

import gc
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
MIB = 1024 * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_growth(work: Callable[[], T]) -> tuple[T, int]:
    """Run ``work``; return its result and how far resident memory peaked above the start,
    in bytes. Fails (never skips) where the kernel cannot reset the peak mark."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start = _status_kib("VmRSS")
    result = work()
    peak = _status_kib("VmHWM")
    return result, max(0, peak - start) * 1024


def sparse_file(path: Path, size: int, prefix: bytes = b"") -> Path:
    """A file of ``size`` bytes that takes no disk space beyond ``prefix`` (a hole of zeros)."""
    with open(path, "wb") as fh:
        fh.write(prefix)
        fh.truncate(size)
    return path


@contextmanager
def fail_after(seconds: int) -> Iterator[None]:
    """Turn a read that blocks (a FIFO opened for reading) into a test failure, not a hang."""

    def _fail(*_: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s: the reader waited on something")

    old = signal.signal(signal.SIGALRM, _fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
