"""The per-image audit trail: everything the lab knows about one image, from every table.

Why generic: each stage owns its table, and the audit must keep working as stages are
added, so it reads every lab table that has a ``key`` column (through the BTREE index
on ``key``), drops binary columns, and records the Lance version it read. A URL or a
source id is first resolved to keys through the ``images`` table.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from prx_assets.core.lab import Lab, sql_literal

# The order a data lead reads a trail in: where it came from, to where it went.
TABLE_ORDER = (
    "images",
    "rejects",
    "resolution",
    "captions",
    "caption_classes",
    "image_hashes",
    "phash_clusters",
    "bucket_assignments",
    "shard_samples",
    "skip_audit",
    "opt_outs",
)
_HIDDEN_COLUMNS = {"image", "vector"}
KEY_COLUMNS = ("key", "matched_key")  # opt_outs names the image it matched


@dataclass
class AuditTrail:
    query: str
    keys: list[str]
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)

    @property
    def found(self) -> bool:
        return any(self.tables.values())

    def to_json(self) -> str:
        return json.dumps(
            {"query": self.query, "keys": self.keys, "versions": self.versions, **self.tables},
            indent=2,
            default=_jsonable,
            sort_keys=False,
        )

    def to_markdown(self) -> str:
        lines = [f"# Audit trail for `{self.query}`", ""]
        if not self.found:
            lines.append("Not found in any lab table.")
            return "\n".join(lines)
        lines.append(f"Keys: {', '.join(f'`{k}`' for k in self.keys)}")
        lines.append("")
        for table, rows in self.tables.items():
            lines.append(f"## {table} (Lance version {self.versions.get(table)})")
            if not rows:
                lines.append("_no rows_")
            for row in rows:
                lines.append("| column | value |")
                lines.append("|---|---|")
                for k, v in row.items():
                    text = _jsonable(v) if not isinstance(v, str) else v
                    text = str(text).replace("|", "\\|").replace("\n", " ")
                    lines.append(f"| {k} | {text} |")
                lines.append("")
        return "\n".join(lines)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dt.datetime | dt.date):
        return v.isoformat()
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    return v


def _table_names(lab: Lab) -> list[str]:
    import os

    if "://" in lab.root:
        candidates = list(TABLE_ORDER)
    else:
        present = {n[: -len(".lance")] for n in os.listdir(lab.root) if n.endswith(".lance")}
        candidates = [t for t in TABLE_ORDER if t in present] + sorted(present - set(TABLE_ORDER))
    return [t for t in candidates if lab.exists(t)]


def resolve_keys(lab: Lab, query: str) -> list[str]:
    """A sha256 key as is; otherwise look the URL / source id up in ``images`` and ``rejects``."""
    q = query.strip()
    if len(q) == 64 and all(c in "0123456789abcdef" for c in q.lower()):
        return [q.lower()]
    keys: set[str] = set()
    if lab.exists("images"):
        flt = f"url = {sql_literal(q)} OR source_id = {sql_literal(q)} OR path = {sql_literal(q)}"
        keys |= set(lab.read("images", ["key"], flt).column("key").to_pylist())
    return sorted(keys)


def audit_image(lab: Lab, query: str) -> AuditTrail:
    keys = resolve_keys(lab, query)
    trail = AuditTrail(query=query, keys=keys)
    if not keys:
        return trail
    for table in _table_names(lab):
        ds = lab.dataset(table)
        names = [n for n in ds.schema.names if n not in _HIDDEN_COLUMNS]
        key_column = next((c for c in KEY_COLUMNS if c in ds.schema.names), None)
        if key_column is None:
            continue
        key_filter = " OR ".join(f"{key_column} = {sql_literal(k)}" for k in keys)
        columns = [
            n
            for n in names
            if not pa.types.is_binary(ds.schema.field(n).type)
            and not pa.types.is_large_binary(ds.schema.field(n).type)
        ]
        rows = ds.to_table(columns=columns, filter=key_filter).to_pylist()
        trail.tables[table] = rows
        trail.versions[table] = ds.version
    return trail
