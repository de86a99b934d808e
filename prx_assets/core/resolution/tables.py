"""The resolution stage's lab table: sizes, eligibility and highest tier per image."""

from __future__ import annotations

import pyarrow as pa

from prx_assets.core.lab import TableSpec

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
    indexes=(
        ("key", "BTREE"),
        ("batch", "BITMAP"),
        ("width", "BTREE"),  # width, height, megapixels: the browser's size filters
        ("height", "BTREE"),
        ("megapixels", "BTREE"),
    ),
)
