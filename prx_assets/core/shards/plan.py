"""Which assigned image goes into which bucket directory, with which caption.

Every assigned image is planned, captioned or not: one without a usable caption goes into
its shard with an empty caption, and its first skip-lists exclude it (``no_caption``), so it
is accounted for everywhere skips are reported and a caption arriving later needs only a
rerun, never a lost image.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
    captions: dict[str, CaptionInfo] | None  # None: a plan by reference (``plan_by_reference``)
    uncaptioned: dict[str, str]
    #: key -> the fingerprint of the caption its sample carries (None: no usable caption),
    #: what ``shard_samples.caption_fingerprint`` records.
    fingerprints: dict[str, str | None] = field(default_factory=dict)

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


def planned_caption(row: Mapping[str, Any] | None, usable: bool) -> CaptionInfo:
    """The caption a sample carries, given its ``captions`` row (None: none) and whether
    the plan found it usable; a row whose text disagrees with that verdict is an error
    (the plan and this read come from the same table version, so they must agree)."""
    if row is None:
        if usable:
            raise ValueError("planned with a usable caption, but it has no caption row")
        return NO_USABLE_CAPTION
    info = _caption_info(row)
    if bool((row["caption"] or "").strip()) != usable:
        raise ValueError(
            "its caption's text disagrees with the plan ("
            + ("blank, planned as usable)" if usable else "not blank, planned as unusable)")
        )
    return info if usable else CaptionInfo(**{**info.__dict__, "caption": "", "usable": False})


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
        usable = cap is not None and bool((cap["caption"] or "").strip())
        if not usable:
            uncaptioned[row["key"]] = CAPTION_MISSING if cap is None else CAPTION_EMPTY
        infos[row["key"]] = planned_caption(cap, usable)
        buckets.setdefault((int(row["tier"]), row["shape"]), []).append(row)
    return ShardPlan(
        buckets=buckets,
        captions=infos,
        uncaptioned=uncaptioned,
        fingerprints={k: i.fingerprint if i.usable else None for k, i in infos.items()},
    )


def plan_by_reference(
    assignments: pa.Table,
    captions: pa.Table,
    texts: Callable[[Sequence[str]], Mapping[str, str | None]],
) -> ShardPlan:
    """The plan ``plan_shards`` makes, without reading every caption's text.

    ``assignments``: ``key, tier, shape`` of the batch's rows; ``captions``: ``key,
    backend_fingerprint, word_count`` of its caption rows; ``texts(keys)``: the caption
    text of those keys, asked only for rows whose ``word_count`` is 0 or null (a caption
    with a word is not blank; one without may still be, e.g. "..."). Why: at 10^9 images
    every byte a step reads per image caps the cluster (``benchmarks/bench_scaleout.py``);
    a caption is ~1 KB and an assignment row ~20 fields, which the workers read for their
    own samples (``pieces.read_piece_samples``), checking each text against this plan.
    """
    fingerprints: dict[str, str | None] = {}
    unsure: list[str] = []
    if captions.num_rows:
        for key, fp, words in zip(
            *(captions.column(c).to_pylist() for c in ("key", "backend_fingerprint", "word_count")),
            strict=True,
        ):
            if key in fingerprints:
                raise ValueError(f"two caption rows for image {key!r}")
            fingerprints[key] = fp or ""
            if not words:
                unsure.append(key)
    got = texts(unsure) if unsure else {}
    if set(got) != set(unsure):
        raise ValueError("the caption rows read for their text are not the rows planned")
    blank = {k for k, text in got.items() if not (text or "").strip()}
    buckets: dict[tuple[int, str], list[dict[str, Any]]] = {}
    uncaptioned: dict[str, str] = {}
    planned: dict[str, str | None] = {}
    rows = zip(*(assignments.column(c).to_pylist() for c in ("key", "tier", "shape")), strict=True)
    for key, tier, shape in sorted(rows) if assignments.num_rows else ():
        if key not in fingerprints:
            uncaptioned[key] = CAPTION_MISSING
        elif key in blank:
            uncaptioned[key] = CAPTION_EMPTY
        planned[key] = None if key in uncaptioned else fingerprints[key]
        buckets.setdefault((int(tier), shape), []).append(
            {"key": key, "tier": tier, "shape": shape}
        )
    return ShardPlan(buckets=buckets, captions=None, uncaptioned=uncaptioned, fingerprints=planned)
