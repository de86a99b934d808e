"""Versions a holder (a training snapshot) needs kept: ``Lab.pin_versions`` / ``unpin`` /
``pinned_versions``.

A pin is a Lance tag on each pinned version (Lance's cleanup never removes a tagged version
nor any file it references) plus one row per table in the lab table ``version_pins``, the
record of who holds what. Tags are named by a digest of the holder (holders are free text).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pyarrow as pa

from prx_assets.core.lab import maintenance as mx
from prx_assets.core.lab.maintenance import VERSION_PINS
from prx_assets.core.lab.spec import sql_literal

if TYPE_CHECKING:
    import lance


class VersionPins:
    """The pin methods of ``Lab`` (a mixin: they use its reads and writes)."""

    if TYPE_CHECKING:

        def dataset(self, table: str, version: int | None = None) -> lance.LanceDataset: ...
        def _open(self, table: str, version: int | None = None) -> lance.LanceDataset | None: ...
        def exists(self, table: str) -> bool: ...
        def read(self, table: str, columns=None, filter=None, version=None) -> pa.Table: ...
        def replace_rows(self, spec, column: str, value: str, rows: pa.Table) -> int: ...
        def delete(self, table: str, predicate: str, attempts: int = 8) -> int: ...

    def pin_versions(self, holder: str, versions: Mapping[str, int]) -> None:
        """Keep exactly ``versions`` (table -> version) for ``holder`` until ``unpin``.

        Each version gets the holder's Lance tag first (cleanup never removes a tagged
        version nor a file it references), then the pins are recorded in ``version_pins``
        in one commit, replacing the holder's earlier pins (their tags are dropped last). A
        crash in between leaves an extra tag (a version kept longer), never a recorded pin
        without its tag. A version that no longer exists raises.
        """
        if not holder:
            raise ValueError("a pin needs a holder")
        tag = mx.pin_tag(holder)
        for table, version in versions.items():
            mx.set_tag(self.dataset(table), tag, int(version))
        earlier = set(self.pinned_by(holder)) - set(versions)
        now = datetime.now(UTC)
        rows = pa.table(
            {
                "holder": [holder] * len(versions),
                "table": list(versions),
                "version": [int(v) for v in versions.values()],
                "tag": [tag] * len(versions),
                "pinned_at": [now] * len(versions),
            },
            schema=VERSION_PINS.schema,
        )
        self.replace_rows(VERSION_PINS, "holder", holder, rows)
        for table in earlier:
            if (ds := self._open(table)) is not None:
                mx.drop_tag(ds, tag)

    def unpin(self, holder: str) -> None:
        """Release every version ``holder`` pinned (record first, then the tags)."""
        tables = set(self.pinned_by(holder))
        if self.exists(VERSION_PINS.name):
            self.delete(VERSION_PINS.name, f"holder = {sql_literal(holder)}")
        tag = mx.pin_tag(holder)
        for table in tables:
            if (ds := self._open(table)) is not None:
                mx.drop_tag(ds, tag)

    def pinned_by(self, holder: str) -> dict[str, int]:
        """The versions ``holder`` has pinned (table -> version)."""
        rows = self.read(VERSION_PINS.name, ["table", "version"], f"holder = {sql_literal(holder)}")
        if not rows.num_rows:
            return {}
        return dict(
            zip(rows.column("table").to_pylist(), rows.column("version").to_pylist(), strict=True)
        )

    def pinned_versions(self) -> dict[str, set[int]]:
        """Every pinned version, by table (what cleanup keeps for holders)."""
        rows = self.read(VERSION_PINS.name, ["table", "version"])
        out: dict[str, set[int]] = {}
        for table, version in zip(
            rows.column("table").to_pylist() if rows.num_rows else [],
            rows.column("version").to_pylist() if rows.num_rows else [],
            strict=True,
        ):
            out.setdefault(table, set()).add(int(version))
        return out
