"""What a lab table is (its spec) and the SQL literals every filter is built from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa


def sql_literal(value: str) -> str:
    """Quote a string for a Lance SQL filter; batch keys are restricted, but be strict anyway."""
    return "'" + value.replace("'", "''") + "'"


def in_list(column: str, values: Iterable[str]) -> str:
    vals = sorted(set(values))
    if not vals:
        return "false"
    return f"{column} IN ({', '.join(sql_literal(v) for v in vals)})"


@dataclass(frozen=True)
class TableSpec:
    """A lab table: its schema, the columns that identify a row, and its scalar indexes.

    ``blobs`` names binary columns whose bytes live in the lab's content-addressed blob
    store instead of Lance data files (the table stores each value's sha256), so that
    compaction, index refreshes and column additions never copy them. Readers still see
    the bytes: every ``Lab``/``LabView`` read resolves the references.
    """

    name: str
    schema: pa.Schema
    identity: tuple[str, ...]
    indexes: tuple[tuple[str, str], ...] = ()  # (column, index type)
    blobs: tuple[str, ...] = ()
