"""The shard stage's lab tables, and the row-level logic that fills and reads them.

- ``bucket_assignments``: where each eligible image goes (tier, shape) and the exact crop
  and scale, computed from the ``resolution`` table's width/height alone, so the plan can be
  inspected (and the bucket fill judged) before a single pixel is resized.
- ``shard_samples``: where each written sample lives in the MDS tree (directory, shard,
  index in shard, index in directory), so skip-lists and the per-image audit find a sample
  without opening shards; ``dir_digest`` pins the exact directory content it refers to.

Rendering streams the batch's image bytes from Lance one chunk of keys at a time, in key
order per bucket, so memory holds one chunk of source bytes plus the shard being filled.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import lance
import pyarrow as pa

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS
from prx_assets.core.lab import TableSpec, in_list, sql_literal
from prx_assets.core.shards.buckets import (
    MIN_SIDE,
    Assignment,
    BucketShape,
    BucketTable,
    assign_bucket,
    bucket_table,
    bucket_table_json,
)
from prx_assets.core.shards.mds import MDSSample, Placement
from prx_assets.core.shards.resize import RESAMPLE, RESAMPLE_CHOICES, render_jpeg

BUCKET_ASSIGNMENTS = TableSpec(
    name="bucket_assignments",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("source_width", pa.int32()),  # oriented source size
            pa.field("source_height", pa.int32()),
            pa.field("tier", pa.int32()),
            pa.field("shape", pa.string()),  # "<H>x<W>", the bucket directory name
            pa.field("height", pa.int32()),
            pa.field("width", pa.int32()),
            pa.field("scale", pa.float64()),  # Lanczos factor; > 1 only when upscaled
            pa.field("resize_width", pa.int32()),  # whole image resized to this ...
            pa.field("resize_height", pa.int32()),
            pa.field("crop_left", pa.int32()),  # ... then cropped to this box (resized px)
            pa.field("crop_top", pa.int32()),
            pa.field("crop_right", pa.int32()),
            pa.field("crop_bottom", pa.int32()),
            pa.field("crop_fraction", pa.float64()),  # share of the resized area cut away
            pa.field("outside_aspect_range", pa.bool_()),
            pa.field("upscaled", pa.bool_()),
            pa.field("bucket_table_sha256", pa.string()),  # of bucket_table_json()
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("tier", "BITMAP"), ("shape", "BITMAP")),
)

SHARD_SAMPLES = TableSpec(
    name="shard_samples",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("tier", pa.int32()),
            pa.field("shape", pa.string()),
            pa.field("relative_dir", pa.string()),  # "mds/<tier>/<H>x<W>/<batch>" under root
            pa.field("shard", pa.string()),  # raw basename, e.g. "shard.00000.mds"
            pa.field("index_in_shard", pa.int32()),  # what a skip-list sidecar names
            pa.field("sample_index", pa.int32()),  # within the directory (StreamingDataset)
            pa.field("dir_digest", pa.string()),  # mds.partition_digest at write time
            pa.field("jpeg_sha256", pa.string()),  # of the stored image bytes
            pa.field("jpeg_bytes", pa.int64()),
            # Captioner that wrote the caption; null: written with an empty caption because
            # it had no usable one (excluded by its skip-lists, reason ``no_caption``).
            pa.field("caption_fingerprint", pa.string()),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP")),
)

# MDS columns beyond mds.BASE_COLUMNS: caption provenance, and the upscale flag so a
# trainer can keep native pixels only without a lab lookup. Flags are ints (MDS has no bool).
MDS_EXTRA_COLUMNS: dict[str, str] = {
    "caption_backend": "str",
    "caption_model": "str",
    "caption_prompt_version": "str",
    "caption_fingerprint": "str",
    "is_fallback_caption": "int",
    "upscaled": "int",
}
CAPTION_COLUMNS = (
    "key",
    "caption",
    "is_fallback",
    "backend",
    "model_id",
    "prompt_version",
    "backend_fingerprint",
)
NO_CAPTION = "no_caption"  # the skip-list reason code for a sample without a usable caption
CAPTION_MISSING = "no caption row"
CAPTION_EMPTY = "empty caption"


def bucket_table_sha256(table: BucketTable | None = None) -> str:
    """Identifies the shape table an assignment was made with (what the trainer must load)."""
    return hashlib.sha256(bucket_table_json(table).encode()).hexdigest()


def assignment_rows(
    resolution: pa.Table, table: BucketTable | None = None, min_side: int = MIN_SIDE
) -> pa.Table:
    """``bucket_assignments`` rows for eligible ``resolution`` rows (key, batch, width, height).

    Every row passed in must be assignable: the caller filters on ``eligible``, and an
    eligible image that the bucket rule puts under the cutoff means the two stages disagree
    on the cutoff, which is an error, not something to drop silently.
    """
    table = bucket_table() if table is None else table
    sha = bucket_table_sha256(table)
    cols: dict[str, list[Any]] = {f.name: [] for f in BUCKET_ASSIGNMENTS.schema}
    keys = resolution.column("key").to_pylist()
    batches = resolution.column("batch").to_pylist()
    widths = resolution.column("width").to_pylist()
    heights = resolution.column("height").to_pylist()
    for key, batch, w, h in zip(keys, batches, widths, heights, strict=True):
        if w is None or h is None:
            raise ValueError(f"image {key!r} of batch {batch!r} has no recorded size")
        a = assign_bucket(int(w), int(h), table=table, min_side=min_side)
        if a is None:
            raise ValueError(
                f"image {key!r} ({w}x{h}) is marked eligible but is under the bucket cutoff "
                f"of {min_side} px: resolution_profile and the bucket rule disagree"
            )
        left, top, right, bottom = a.crop_box
        values = {
            "key": key,
            "batch": batch,
            "source_width": w,
            "source_height": h,
            "tier": a.tier,
            "shape": a.shape.name,
            "height": a.shape.height,
            "width": a.shape.width,
            "scale": a.scale,
            "resize_width": a.resize_size[0],
            "resize_height": a.resize_size[1],
            "crop_left": left,
            "crop_top": top,
            "crop_right": right,
            "crop_bottom": bottom,
            "crop_fraction": a.crop_fraction,
            "outside_aspect_range": a.outside_aspect_range,
            "upscaled": a.upscaled,
            "bucket_table_sha256": sha,
        }
        for name, value in values.items():
            cols[name].append(value)
    return pa.table(cols, schema=BUCKET_ASSIGNMENTS.schema)


def assignment_from_row(row: Mapping[str, Any]) -> Assignment:
    """The ``Assignment`` a ``bucket_assignments`` row records (exactly, no recomputation)."""
    shape = BucketShape(int(row["tier"]), int(row["height"]), int(row["width"]))
    if shape.name != row["shape"]:
        raise ValueError(
            f"row for {row['key']!r}: shape {row['shape']!r} disagrees with "
            f"height x width {shape.name}"
        )
    box = tuple(int(row[c]) for c in ("crop_left", "crop_top", "crop_right", "crop_bottom"))
    if (box[2] - box[0], box[3] - box[1]) != (shape.width, shape.height):
        raise ValueError(f"row for {row['key']!r}: crop box {box} is not {shape.name}")
    return Assignment(
        source_size=(int(row["source_width"]), int(row["source_height"])),
        shape=shape,
        scale=float(row["scale"]),
        resize_size=(int(row["resize_width"]), int(row["resize_height"])),
        crop_box=box,  # type: ignore[arg-type]
        outside_aspect_range=bool(row["outside_aspect_range"]),
        upscaled=bool(row["upscaled"]),
    )


@dataclass(frozen=True)
class AssignmentSummary:
    assigned: int
    outside_aspect_range: int
    upscaled: int
    fill: dict[int, dict[str, int]]  # tier -> shape name -> images, every shape listed
    mean_crop_fraction: float


def summarise_assignments(
    assignments: pa.Table, table: BucketTable | None = None
) -> AssignmentSummary:
    """Bucket fill per tier x shape (zeros included, in aspect order) and the hazard counts."""
    table = bucket_table() if table is None else table
    fill = {tier: {s.name: 0 for s in shapes} for tier, shapes in table.items()}
    tiers = assignments.column("tier").to_pylist()
    shapes = assignments.column("shape").to_pylist()
    for tier, shape in zip(tiers, shapes, strict=True):
        if tier not in fill or shape not in fill[tier]:
            raise ValueError(f"assignment to {tier}/{shape} is not in the bucket table")
        fill[tier][shape] += 1
    crops = assignments.column("crop_fraction").to_pylist()
    return AssignmentSummary(
        assigned=assignments.num_rows,
        outside_aspect_range=sum(assignments.column("outside_aspect_range").to_pylist()),
        upscaled=sum(assignments.column("upscaled").to_pylist()),
        fill=fill,
        mean_crop_fraction=(sum(crops) / len(crops)) if crops else 0.0,
    )


@dataclass(frozen=True)
class CaptionInfo:
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


def written_without_caption(row: Mapping[str, Any]) -> bool:
    """Whether a ``shard_samples`` row is a sample written with no usable caption."""
    return row["caption_fingerprint"] is None


class RenderFailures(RuntimeError):
    """More images failed to render than a run tolerates."""


@dataclass
class RenderLog:
    """What rendering learned per key: the stored JPEG's digest/size, or why it failed."""

    jpeg: dict[str, tuple[str, int]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


class BucketRenderer:
    """Streams a batch's image bytes from Lance and renders bucket samples from them.

    ``images`` is one pinned dataset version, so every chunk reads the same snapshot
    (None when there is nothing to render: the table is then never opened).
    Chunks of ``chunk_size`` keys are read with a ``batch AND key IN (...)`` filter (the key
    BTREE and batch BITMAP indexes serve it) and rendered on ``threads`` threads (Pillow
    releases the GIL in decode, resample and encode); results keep key order, so the output
    is the same whatever the thread count. An image that fails to render is logged in
    ``log.failures`` and not written; more than ``max_failures`` failures raise
    ``RenderFailures`` (a systematic fault, which must not silently empty the shards: the
    bucket being written keeps its previous version).
    """

    def __init__(
        self,
        images: lance.LanceDataset | None,
        batch: str,
        captions: Mapping[str, CaptionInfo],
        chunk_size: int = 32,
        threads: int = 1,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        resample: str = RESAMPLE,
        max_failures: int = 20,
    ) -> None:
        if chunk_size < 1 or threads < 1:
            raise ValueError(f"chunk_size and threads must be >= 1, got {chunk_size}, {threads}")
        if resample not in RESAMPLE_CHOICES:
            raise ValueError(f"resample must be one of {RESAMPLE_CHOICES}, got {resample!r}")
        self.images = images
        self.batch = batch
        self.captions = captions
        self.chunk_size = chunk_size
        self.threads = threads
        self.max_pixels = max_pixels
        self.resample = resample
        self.max_failures = max_failures
        self.log = RenderLog()

    def _read(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        if self.images is None:
            raise ValueError("BucketRenderer was given no images dataset to read from")
        rows = self.images.to_table(
            columns=["key", "image", "source", "license"],
            filter=f"batch = {sql_literal(self.batch)} AND {in_list('key', keys)}",
        ).to_pylist()
        return {r["key"]: r for r in rows}

    def _render(self, item: tuple[dict[str, Any], dict[str, Any] | None]) -> bytes | str:
        row, image = item
        if image is None or not image["image"]:
            return "image_missing: no bytes for this key in the images table"
        try:
            return render_jpeg(
                image["image"], assignment_from_row(row), self.max_pixels, self.resample
            )
        except Exception as exc:  # noqa: BLE001 - one bad image must not sink the batch
            return f"{type(exc).__name__}: {exc}"

    def samples(self, rows: Sequence[Mapping[str, Any]]) -> Iterator[MDSSample]:
        """Samples for one bucket's assignment rows (sorted by key), rendered lazily."""
        rows = list(rows)
        with ThreadPoolExecutor(self.threads) as pool:
            for start in range(0, len(rows), self.chunk_size):
                chunk = rows[start : start + self.chunk_size]
                images = self._read([r["key"] for r in chunk])
                items = [(dict(r), images.get(r["key"])) for r in chunk]
                results = (
                    pool.map(self._render, items) if self.threads > 1 else map(self._render, items)
                )
                for (row, image), out in zip(items, results, strict=True):
                    if isinstance(out, str):
                        self.log.failures[row["key"]] = out
                        if len(self.log.failures) > self.max_failures:
                            first = next(iter(self.log.failures.items()))
                            raise RenderFailures(
                                f"{len(self.log.failures)} images of batch {self.batch!r} "
                                f"failed to render (limit {self.max_failures}); first: "
                                f"{first[0]}: {first[1]}"
                            )
                        continue
                    yield self._sample(row, image, out)
                del images, items

    def _sample(self, row: dict[str, Any], image: dict[str, Any] | None, jpeg: bytes) -> MDSSample:
        assert image is not None
        cap = self.captions[row["key"]]
        self.log.jpeg[row["key"]] = (hashlib.sha256(jpeg).hexdigest(), len(jpeg))
        return MDSSample(
            key=row["key"],
            image=jpeg,
            caption=cap.caption,
            orig_width=int(row["source_width"]),
            orig_height=int(row["source_height"]),
            tier=int(row["tier"]),
            shape=row["shape"],
            source=image.get("source") or "",
            license=image.get("license") or "",
            extra={
                "caption_backend": cap.backend,
                "caption_model": cap.model_id,
                "caption_prompt_version": cap.prompt_version,
                "caption_fingerprint": cap.fingerprint,
                "is_fallback_caption": int(cap.is_fallback),
                "upscaled": int(bool(row["upscaled"])),
            },
        )


def placement_rows(
    placements: Sequence[Placement],
    batch: str,
    digests: Mapping[str, str],
    log: RenderLog,
    captions: Mapping[str, CaptionInfo],
) -> pa.Table:
    """``shard_samples`` rows; ``digests`` maps a placement's ``relative_dir`` to its digest."""
    cols: dict[str, list[Any]] = {f.name: [] for f in SHARD_SAMPLES.schema}
    for p in sorted(placements, key=lambda p: p.key):
        if p.batch != batch:
            raise ValueError(f"placement of {p.key!r} is for batch {p.batch!r}, not {batch!r}")
        sha, size = log.jpeg[p.key]
        values = {
            "key": p.key,
            "batch": p.batch,
            "tier": p.tier,
            "shape": p.shape,
            "relative_dir": p.relative_dir,
            "shard": p.shard,
            "index_in_shard": p.index_in_shard,
            "sample_index": p.sample_index,
            "dir_digest": digests[p.relative_dir],
            "jpeg_sha256": sha,
            "jpeg_bytes": size,
            "caption_fingerprint": captions[p.key].fingerprint if captions[p.key].usable else None,
        }
        for name, value in values.items():
            cols[name].append(value)
    return pa.table(cols, schema=SHARD_SAMPLES.schema)


@dataclass(frozen=True)
class BucketTotals:
    samples: int
    shards: int
    partitions: int


def bucket_totals(shard_samples: pa.Table) -> dict[tuple[int, str], BucketTotals]:
    """Samples, shards and partition directories per bucket (tier, shape), in table order.

    Reads the ``tier, shape, relative_dir, shard`` columns; over every batch this is what
    a trainer's stream for one bucket sees.
    """
    if shard_samples.num_rows == 0:
        return {}
    samples: dict[tuple[int, str], int] = {}
    shards: dict[tuple[int, str], set[tuple[str, str]]] = {}
    for tier, shape, rel, shard in zip(
        *(shard_samples.column(c).to_pylist() for c in ("tier", "shape", "relative_dir", "shard")),
        strict=True,
    ):
        b = (int(tier), shape)
        samples[b] = samples.get(b, 0) + 1
        shards.setdefault(b, set()).add((rel, shard))
    order = sorted(samples, key=lambda b: (b[0], _aspect_key(b[1])))
    return {
        b: BucketTotals(samples[b], len(shards[b]), len({rel for rel, _ in shards[b]}))
        for b in order
    }


def _aspect_key(shape: str) -> float:
    h, w = (int(x) for x in shape.split("x"))
    return math.log(w / h)
