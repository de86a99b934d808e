"""The dedup stage's checks over stored rows, and its review contact sheet."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
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


def test_contact_sheet_reads_only_the_dc_scans_of_progressive_jpegs(monkeypatch):
    # A 1/8-scale tile of a progressive JPEG needs only its DC scans: the sheet is the
    # same, pixel for pixel, as from the whole stream, and the cut stream is what is decoded.
    from prx_assets.core.dedup import phash
    from prx_assets.demo.jpegs import bundled_photos, jpeg_bytes

    big = bundled_photos()[0].resize((1400, 1000))
    data = jpeg_bytes(big, progressive=True)
    groups = [[G.Tile(data, ("1400x1000", "b"), True), G.Tile(data, ("1400x1000", "c"), False)]]
    decoded: list[int] = []
    real_decode = G.decode_rgb
    monkeypatch.setattr(
        G, "decode_rgb", lambda d, **kw: decoded.append(len(d)) or real_decode(d, **kw)
    )
    cut = G.contact_sheet(groups, thumb=112)
    assert decoded and max(decoded) < len(data) // 2  # the AC scans were left out
    monkeypatch.setattr(G, "progressive_dc_scans", lambda d, t=phash.FAST_DRAFT_TARGET: None)
    decoded.clear()
    whole = G.contact_sheet(groups, thumb=112)
    assert decoded == [len(data), len(data)]
    assert np.array_equal(
        np.asarray(Image.open(io.BytesIO(cut)).convert("RGB")),
        np.asarray(Image.open(io.BytesIO(whole)).convert("RGB")),
    )


def test_contact_sheet_draws_previews_without_decoding_the_originals(monkeypatch):
    # A tile with ingest's preview is drawn from it; the original is decoded only for a
    # tile without one (a lab ingested before the column), or one larger than the preview.
    from prx_assets.demo.jpegs import bundled_photos, jpeg_bytes

    big = jpeg_bytes(bundled_photos()[0].resize((1400, 1000)), progressive=False)
    preview = G.preview_of_decoded(Image.open(io.BytesIO(big)).convert("RGB"))
    assert len(preview) < len(big) // 10
    decoded: list[int] = []
    real_decode = G.decode_rgb
    monkeypatch.setattr(
        G, "decode_rgb", lambda d, **kw: decoded.append(len(d)) or real_decode(d, **kw)
    )
    groups = [
        [G.Tile(big, ("1400x1000", "b"), True, preview), G.Tile(big, ("1400x1000", "c"), False)]
    ]
    G.contact_sheet(groups, thumb=G.PREVIEW_PX)
    assert decoded == [len(preview), len(big)]
    decoded.clear()
    G.contact_sheet(groups, thumb=2 * G.PREVIEW_PX)  # the preview would be upscaled
    assert decoded == [len(big), len(big)]


def test_gallery_groups_read_previews_and_originals_only_where_missing(tmp_path: Path):
    from prx_assets.core.lab import Lab
    from prx_assets.core.tables import IMAGES

    lab = Lab(tmp_path / "lab")
    photo = (PHOTOS / "coffee.png").read_bytes()
    preview = G.preview_of_decoded(Image.open(io.BytesIO(photo)).convert("RGB"))
    base = {f.name: None for f in IMAGES.schema} | {"width": 600, "height": 400}
    rows = [
        base | {"batch": "b", "key": "k1", "image": photo, "preview": preview},
        base | {"batch": "b", "key": "k2", "image": photo + b"x", "preview": None},
    ]
    lab.replace_partition(IMAGES, "b", pa.Table.from_pylist(rows, schema=IMAGES.schema))
    decisions = pa.Table.from_pylist(
        [
            {"cluster_id": "c", "batch": "b", "key": "k1", "is_keeper": True},
            {"cluster_id": "c", "batch": "b", "key": "k2", "is_keeper": False},
        ]
    )
    (tiles,) = G.gallery_groups(lab, "b", decisions)
    assert [(t.keeper, t.preview, t.data) for t in tiles] == [
        (True, preview, None),  # the preview alone: no original read
        (False, None, photo + b"x"),
    ]
