"""Which assigned image goes into which bucket directory, with which caption.

Every assigned image is planned, captioned or not: one without a usable caption goes into
its shard with an empty caption, and its first skip-lists exclude it (``no_caption``), so it
is accounted for everywhere skips are reported and a caption arriving later needs only a
rerun, never a lost image.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

#: The ``captions`` columns a plan needs (what ``mds_shards`` reads of that table).
CAPTION_COLUMNS = (
    "key",
    "caption",
    "is_fallback",
    "backend",
    "model_id",
    "prompt_version",
    "backend_fingerprint",
)
CAPTION_MISSING = "no caption row"
CAPTION_EMPTY = "empty caption"


@dataclass(frozen=True)
class CaptionInfo:
    """The caption a shard sample carries, and where it came from (model or alt-text fallback)."""

    caption: str
    is_fallback: bool
    backend: str
    model_id: str
    prompt_version: str
    fingerprint: str
    usable: bool = True  # False: written with caption "" and skipped as ``no_caption``


NO_USABLE_CAPTION = CaptionInfo(
    caption="", is_fallback=False, backend="", model_id="", prompt_version="", fingerprint="",
    usable=False,
)  # fmt: skip


@dataclass(frozen=True)
class ShardPlan:
    """Per bucket, the assignment rows to write (sorted by key), and each key's caption.

    Every assigned image is written. ``uncaptioned`` (key -> why) are the images without a
    usable caption: they go into the shards with an empty caption and their skip-lists
    exclude them (reason ``no_caption``), so they are accounted for in ``shard_samples``
    and the audit, and a caption arriving later only needs a rerun, never a lost image.
    """

    buckets: dict[tuple[int, str], list[dict[str, Any]]]
    captions: dict[str, CaptionInfo]
    uncaptioned: dict[str, str]

    @property
    def planned(self) -> int:
        return sum(len(rows) for rows in self.buckets.values())


def _caption_info(row: Mapping[str, Any]) -> CaptionInfo:
    return CaptionInfo(
        caption=row["caption"],
        is_fallback=bool(row.get("is_fallback")),
        backend=row.get("backend") or "",
        model_id=row.get("model_id") or "",
        prompt_version=row.get("prompt_version") or "",
        fingerprint=row.get("backend_fingerprint") or "",
    )


def plan_shards(assignments: pa.Table, captions: pa.Table) -> ShardPlan:
    """Join assignments with captions; an image without a usable caption is still planned.

    A caption is usable when it has a non-blank text. Why write the others at all: leaving
    them out silently made a batch of uncaptioned photos "materialise" with 0 samples and
    no trace but a count; written and skipped as ``no_caption`` they are visible in every
    place that reports skips (sidecars, ``skip_audit``, metadata).
    """
    by_key: dict[str, Mapping[str, Any]] = {}
    if captions.num_rows:
        for row in captions.to_pylist():
            if row["key"] in by_key:
                raise ValueError(f"two caption rows for image {row['key']!r}")
            by_key[row["key"]] = row
    buckets: dict[tuple[int, str], list[dict[str, Any]]] = {}
    infos: dict[str, CaptionInfo] = {}
    uncaptioned: dict[str, str] = {}
    for row in sorted(assignments.to_pylist(), key=lambda r: r["key"]):
        cap = by_key.get(row["key"])
        if cap is None:
            uncaptioned[row["key"]] = CAPTION_MISSING
            infos[row["key"]] = NO_USABLE_CAPTION
        elif not (cap["caption"] or "").strip():
            uncaptioned[row["key"]] = CAPTION_EMPTY
            info = _caption_info(cap)
            infos[row["key"]] = CaptionInfo(**{**info.__dict__, "caption": "", "usable": False})
        else:
            infos[row["key"]] = _caption_info(cap)
        buckets.setdefault((int(row["tier"]), row["shape"]), []).append(row)
    return ShardPlan(buckets=buckets, captions=infos, uncaptioned=uncaptioned)
