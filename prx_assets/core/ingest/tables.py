"""The ingest stage's lab tables: every accepted image, every refused file (and, for a refused
byte-identical copy, the names it carried: aliases of the image kept)."""

from __future__ import annotations

import pyarrow as pa

from prx_assets.core.ingest.signals import UNCAPTURED
from prx_assets.core.lab import Lab, TableSpec, sql_literal

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
            pa.field("image", pa.large_binary()),  # the original bytes (in the blob store)
            # HTTP opt-out headers captured at download time, bounded and sanitised
            # (core/ingest/signals.capture_signals; null: none). Interpreted by skip_lists.
            pa.field("usage_signals", pa.string()),
            # The pHash ``fast`` thumbnail (32x32 float32 LE) from the validation decode, and
            # the pHash version it was made for: image_hashes hashes it without decoding
            # again (null, or another version: it decodes the bytes).
            pa.field("phash_thumbnail", pa.binary()),
            pa.field("phash_thumbnail_version", pa.string()),
            # A PREVIEW_PX JPEG of the same decode, for the duplicate gallery
            # (core/dedup/gallery; null: the gallery decodes the original).
            pa.field("preview", pa.binary()),
        ]
    ),
    identity=("batch", "key"),
    # Stored once by sha256 outside Lance data files: maintenance never copies image bytes.
    blobs=("image",),
    # url / source_id: opt-out lists name images by them; the audit looks them up (and path).
    indexes=(
        ("key", "BTREE"),
        ("batch", "BITMAP"),
        ("url", "BTREE"),
        ("source_id", "BTREE"),
        ("path", "BTREE"),
        ("source", "BITMAP"),  # the browser's source filter
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
            # The identifiers the refused file carried (manifest columns, sidecars), so the
            # audit finds a refused file by them too. A ``duplicate_bytes_in_batch`` row is an
            # *alias* of the accepted copy (``batch``, ``key``): the same bytes train under
            # the other name, so opt-out lists naming this URL / ``source:id`` / path match
            # that copy (``ALIAS_REASON``, ``core/skiplists/matching``).
            pa.field("url", pa.string()),
            pa.field("source_id", pa.string()),
            # The refused file's own captured opt-out headers (``signals.capture_signals``):
            # an alias row's signals reserve the copy kept, as the kept file's own would
            # (a mirror's URL may say ``noai`` where the kept one said nothing).
            pa.field("usage_signals", pa.string()),
        ]
    ),
    identity=("batch", "path"),
    indexes=(
        ("batch", "BITMAP"),
        ("path", "BTREE"),
        ("key", "BTREE"),
        ("url", "BTREE"),  # opt-out matching and the audit look aliases up by them
        ("source_id", "BTREE"),
    ),
)

#: The ``rejects`` reason whose row is an alias of an accepted image: a byte-identical copy
#: of a file the batch kept (same ``batch`` and ``key``), refused only as a repeat.
ALIAS_REASON = "duplicate_bytes_in_batch"


def migrate_rejects_table(lab: Lab) -> list[str]:
    """Give a ``rejects`` table written under an older spec the columns this one adds
    (``url``, ``source_id``: null, so its old rows carry no aliases until their batch is
    ingested again). Returns the names added."""
    if not lab.exists(REJECTS.name):
        return []
    have = set(lab.dataset(REJECTS.name).schema.names)
    missing = [f for f in REJECTS.schema if f.name not in have]
    if missing:
        lab.add_columns(REJECTS.name, missing)
    return [f.name for f in missing]


def ensure_usage_signals_column(lab: Lab) -> bool:
    """Give an ``images`` table from before opt-out signal capture its ``usage_signals``
    column, filled with :data:`~prx_assets.core.ingest.signals.UNCAPTURED` (never null: a
    row nobody re-ingested must not read as "no signals"; the skip policy keeps such rows
    ``pending`` until raw_images reruns for their batch). True when the column was added."""
    schema = lab.view().schema(IMAGES.name)
    if schema is None or "usage_signals" in schema.names:
        return False
    lab.dataset(IMAGES.name).add_columns({"usage_signals": sql_literal(UNCAPTURED)})
    return True
