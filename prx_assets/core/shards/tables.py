"""The shard stage's lab tables, and the row-level logic that fills and reads them.

- ``bucket_assignments``: where each eligible image goes (tier, shape) and the exact crop
  and scale, computed from the ``resolution`` table's width/height alone, so the plan can be
  inspected (and the bucket fill judged) before a single pixel is resized.
- ``shard_samples``: where each written sample lives in the MDS tree (directory, shard,
  index in shard, index in directory), so skip-lists and the per-image audit find a sample
  without opening shards; ``dir_digest`` pins the exact directory content it refers to.

Which image goes into which directory with which caption is ``plan.py``; rendering the
samples is ``render.py``; the run that ties them together is ``runner.py``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from prx_assets.core.lab import TableSpec
from prx_assets.core.shards.buckets import (
    MIN_SIDE,
    Assignment,
    BucketShape,
    BucketTable,
    assign_bucket,
    bucket_table,
    bucket_table_json,
)
from prx_assets.core.shards.mds import Placement

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
    # tier/shape: a bucket's totals over every batch are read per run (mds_shards' hazards).
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("tier", "BITMAP"), ("shape", "BITMAP")),
)


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
    """How one batch fell into buckets: assigned, outside the aspect range, upscaled, fill per shape."""

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


def placement_rows(
    placements: Sequence[Placement],
    batch: str,
    digests: Mapping[str, str],
    jpeg: Mapping[str, tuple[str, int]],
    fingerprints: Mapping[str, str | None],
) -> pa.Table:
    """``shard_samples`` rows; ``digests`` maps a placement's ``relative_dir`` to its digest,
    ``jpeg`` a key to the sha256 and size of the bytes stored for it (``RenderLog.jpeg``),
    ``fingerprints`` a key to its caption's fingerprint (None: written without a usable
    caption, ``ShardPlan.fingerprints``)."""
    cols: dict[str, list[Any]] = {f.name: [] for f in SHARD_SAMPLES.schema}
    for p in sorted(placements, key=lambda p: p.key):
        if p.batch != batch:
            raise ValueError(f"placement of {p.key!r} is for batch {p.batch!r}, not {batch!r}")
        sha, size = jpeg[p.key]
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
            "caption_fingerprint": fingerprints[p.key],
        }
        for name, value in values.items():
            cols[name].append(value)
    return pa.table(cols, schema=SHARD_SAMPLES.schema)


@dataclass(frozen=True)
class BucketTotals:
    """Samples, shards and partition directories one bucket holds."""

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


def written_without_caption(row: Mapping[str, Any]) -> bool:
    """Whether a ``shard_samples`` row is a sample written with no usable caption."""
    return row["caption_fingerprint"] is None
