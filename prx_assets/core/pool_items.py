"""What one item of a worker pool comes back as when it fails: below the pools.

``workers`` (local processes) and ``ray_pool`` (Ray actors) both wrap a stage's function in
:func:`call_guarded`, so one bad item is that item's :class:`ItemFailed`, never the
partition's end, the same inline, in a process and on a Ray node. A module of its own so
that the Ray pool does not import the local pool's module (which imports it lazily).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

ERROR_CHARS = 500  # an ItemFailed message quotes at most this much of the exception


@dataclass(frozen=True)
class ItemFailed:
    """``fn`` raised on one item, or its worker died: recorded as that item's failure."""

    error: str


def _failure(exc: BaseException) -> ItemFailed:
    message = f"{type(exc).__name__}: {exc}"
    if len(message) > ERROR_CHARS:
        message = f"{message[:ERROR_CHARS]}... ({len(message) - ERROR_CHARS} more characters)"
    return ItemFailed(message)


def call_guarded(fn: Callable[[T], R], item: T) -> R | ItemFailed:
    """``fn(item)``, or its exception as :class:`ItemFailed` (the same inline and in a worker)."""
    try:
        return fn(item)
    except Exception as exc:  # noqa: BLE001 - one bad item must not sink the partition
        return _failure(exc)
