"""The dedup stage's checks over stored rows, and its review contact sheet."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pytest
from PIL import Image

from prx_assets.core.dedup import checks as K
from prx_assets.core.dedup import gallery as G

PHOTOS = Path(__file__).parents[2] / "prx_assets" / "demo" / "photos"


def test_check_keepers_reports_each_violation():
    members = pa.Table.from_pylist(
        [
            {
                "cluster_id": "c1",
                "batch": "b",
                "key": "k1",
                "is_keeper": True,
                "low_information": False,
            },
            {
                "cluster_id": "c1",
                "batch": "b",
                "key": "k2",
                "is_keeper": False,
                "low_information": False,
            },
            {
                "cluster_id": "c2",
                "batch": "b",
                "key": "k3",
                "is_keeper": False,
                "low_information": False,
            },
            {
                "cluster_id": "c3",
                "batch": "b",
                "key": "k4",
                "is_keeper": True,
                "low_information": False,
            },
            {
                "cluster_id": "c3",
                "batch": "d",
                "key": "k5",
                "is_keeper": True,
                "low_information": False,
            },
            {
                "cluster_id": "f",
                "batch": "b",
                "key": "f",
                "is_keeper": True,
                "low_information": True,
            },
            {
                "cluster_id": "f",
                "batch": "d",
                "key": "f",
                "is_keeper": True,
                "low_information": True,
            },
            {
                "cluster_id": "k1",
                "batch": "b",
                "key": "g",
                "is_keeper": False,
                "low_information": True,
            },
        ]
    )
    pixels = {("b", "k1"): 10, ("b", "k2"): 20}
    res = K.check_keepers(members, pixels)
    assert res.no_keeper == ["c2"] and res.several_keepers == ["c3"]
    assert res.keeper_not_largest == ["c1"] and res.low_information_not_own_keeper == ["b:g"]
    assert not res.one_keeper and not res.keeper_largest and res.clusters == 3
    assert K.check_keepers(members.slice(5, 2), {}).one_keeper  # same flat bytes in 2 batches


def test_contact_sheet_draws_one_row_per_cluster():
    data = (PHOTOS / "coffee.png").read_bytes()
    groups = [
        [G.Tile(data, ("600x400", "public-skimage.000"), True), G.Tile(None, ("?", "b"), False)],
        [G.Tile(data, ("600x400", "b"), True)],
    ]
    png = G.contact_sheet(groups, thumb=64, title="t")
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.width > 2 * 64 and img.height > 2 * 64
    # The keeper's frame is green, the copy's red.
    rgb = img.convert("RGB")
    assert rgb.getpixel((8, 18 + 6 + 1)) == G._KEEPER_RGB
    assert rgb.getpixel((6 + 64 + 8 + 6 + 2, 18 + 6 + 1)) == G._DUP_RGB
    with pytest.raises(ValueError, match="at least one non-empty group"):
        G.contact_sheet([])
