"""Polling for a condition that real processes bring about (runs ending, workers holding)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.25) -> T:
    """``predicate()``'s first truthy value, asked every ``poll`` seconds; AssertionError
    naming ``what`` once ``timeout`` seconds have passed without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
