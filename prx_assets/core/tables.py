"""Schemas of the lab's tables, in one place so every stage and the audit agree."""

from __future__ import annotations

import pyarrow as pa

from prx_assets.core.lab import TableSpec

IMAGES = TableSpec(
    name="images",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),  # sha256 of the original bytes
            pa.field("batch", pa.string(), nullable=False),
            pa.field("source", pa.string()),
            pa.field("license", pa.string()),
            pa.field("alt_text", pa.string()),
            pa.field("url", pa.string()),
            pa.field("source_id", pa.string()),
            pa.field("path", pa.string()),  # path inside the batch (folder/archive/manifest)
            pa.field("format", pa.string()),
            pa.field("width", pa.int32()),  # after EXIF orientation
            pa.field("height", pa.int32()),
            pa.field("mode", pa.string()),  # original Pillow mode
            pa.field("conversion", pa.string()),  # how it becomes RGB (decode policy)
            pa.field("orientation", pa.int8()),
            pa.field("n_frames", pa.int32()),  # >1: animated, first frame used
            pa.field("file_size", pa.int64()),
            pa.field("image", pa.large_binary()),  # the original bytes
        ]
    ),
    identity=("batch", "key"),
    # url / source_id: opt-out lists name images by them; the audit looks them up (and path).
    indexes=(
        ("key", "BTREE"),
        ("batch", "BITMAP"),
        ("url", "BTREE"),
        ("source_id", "BTREE"),
        ("path", "BTREE"),
    ),
)

REJECTS = TableSpec(
    name="rejects",
    schema=pa.schema(
        [
            pa.field("batch", pa.string(), nullable=False),
            pa.field("path", pa.string(), nullable=False),
            pa.field("reason", pa.string(), nullable=False),  # stable code
            pa.field("detail", pa.string()),  # human-readable specifics
            pa.field("source", pa.string()),
            pa.field("key", pa.string()),  # sha256 when bytes were readable
            pa.field("file_size", pa.int64()),
        ]
    ),
    identity=("batch", "path"),
    indexes=(("batch", "BITMAP"), ("path", "BTREE"), ("key", "BTREE")),  # audit look-ups
)

RESOLUTION = TableSpec(
    name="resolution",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("width", pa.int32()),
            pa.field("height", pa.int32()),
            pa.field("megapixels", pa.float64()),
            pa.field("aspect", pa.float64()),  # width / height
            pa.field("eligible", pa.bool_()),
            pa.field("ineligible_reason", pa.string()),
            # assign_bucket's tier: the highest filled without upscaling, else 512 (upscaled)
            pa.field("max_tier", pa.int32()),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP")),
)

CAPTIONS = TableSpec(
    name="captions",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("caption", pa.string()),
            pa.field("word_count", pa.int32()),
            pa.field("length_ok", pa.bool_()),  # inside the prompt's 100-200 word window
            pa.field("is_fallback", pa.bool_()),  # True: alt text, not a VLM caption
            pa.field("fallback_reason", pa.string()),
            # Provenance: which backend wrote it, with what prompt and parameters.
            pa.field("backend", pa.string()),  # openai | transformers | alt_text
            pa.field("model_id", pa.string()),
            pa.field("prompt_version", pa.string()),
            pa.field("prompt_hash", pa.string()),
            pa.field("params", pa.string()),  # canonical JSON
            pa.field("backend_fingerprint", pa.string()),
            pa.field("created_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("backend_fingerprint", "BITMAP")),
)

CAPTION_CLASSES = TableSpec(
    name="caption_classes",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("label", pa.string()),  # visual | text | nsfw (argmax)
            pa.field("p_visual", pa.float32()),
            pa.field("p_text", pa.float32()),
            pa.field("p_nsfw", pa.float32()),
            pa.field("backend", pa.string()),
            pa.field("model_id", pa.string()),
            pa.field("prompt_version", pa.string()),
            pa.field("backend_fingerprint", pa.string()),
            pa.field("caption_fingerprint", pa.string()),  # the captioner it classified
            pa.field("created_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP"), ("label", "BITMAP")),
)

ALL_TABLES: tuple[TableSpec, ...] = (IMAGES, REJECTS, RESOLUTION, CAPTIONS, CAPTION_CLASSES)
