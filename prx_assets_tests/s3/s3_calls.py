"""Count what an ``S3Store`` asks the server: for tests of request budgets."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def requests_of(store: Any) -> Iterator[list[tuple[str, str]]]:
    """Every S3 call ``store``'s client makes inside the block: (operation, key or prefix)."""
    calls: list[tuple[str, str]] = []

    def record(params, model, **_):  # noqa: ANN001, ANN003, ANN202
        calls.append((model.name, params.get("Key", params.get("Prefix", ""))))

    events = store.client.meta.events
    events.register("before-parameter-build.s3", record)
    try:
        yield calls
    finally:
        events.unregister("before-parameter-build.s3", record)
