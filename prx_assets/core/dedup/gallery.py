"""A contact sheet of a few duplicate clusters touching a batch, keeper framed green.

For the reviewer of ``phash_clusters``: the sheet travels as one small PNG in the run's
metadata (quantised to 256 colours), so the UI shows which copy was kept without opening
the lab. :func:`gallery_groups` picks the clusters (cross-batch ones first) and reads
their previews; :func:`contact_sheet` draws them.

Why previews: a tile drawn from the original costs a full entropy decode of a multi-megapixel
JPEG, and a sheet's 16 such tiles had become the largest cost of ``phash_clusters``
(``bench_pipeline``'s per-stage seconds).
Ingest already holds a 1/8-scale decode of every image (its validation), so it stores a
``PREVIEW_PX`` JPEG of it (``images.preview``, a few KB); an image without one (a lab
ingested before the column) is drawn from its original bytes as before.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from PIL import Image, ImageDraw, ImageOps

from prx_assets.core.dedup.corpus import Reader, as_view, lookup_by_keys
from prx_assets.core.dedup.phash import progressive_dc_scans
from prx_assets.core.ingest.decode import decode_rgb
from prx_assets.core.tables import IMAGES


@dataclass(frozen=True)
class Tile:
    """One image of a contact-sheet row: its bytes, caption lines, and whether it is kept."""

    data: bytes | None  # encoded image; None (and no preview) draws a placeholder
    lines: tuple[str, ...]  # up to two caption lines; the first gets KEEP / dup in front
    keeper: bool
    preview: bytes | None = None  # ingest's PREVIEW_PX JPEG, used when the tile fits it


PREVIEW_PX = 112  # the sheet's tile size
PREVIEW_QUALITY = 85


def preview_size(size: tuple[int, int], box: int = PREVIEW_PX) -> tuple[int, int]:
    """The size ``ImageOps.contain(img, (box, box))`` gives an image of ``size``, but never
    0 px on a side (contain gives a 1000x1 image 112x0, which no JPEG can hold)."""
    w, h = size
    if w == h:
        return box, box
    if w > h:
        return box, max(1, round(h / w * box))
    return max(1, round(w / h * box)), box


# Box-reduce by an integer factor first while the image stays at least this many times the
# preview (Pillow's ``reducing_gap``): a full-size PNG or WebP decode then costs ~2.5 ms
# instead of ~9.5 ms for a 3.5 MP photo, and a JPEG's 1/8-scale decode is not reduced at all.
PREVIEW_REDUCING_GAP = 2.0


def preview_of_decoded(img: Image.Image) -> bytes:
    """The stored preview: ``img`` (an RGB decode: ingest's 1/8-scale one for a JPEG, the full
    decode for other formats) fitted in ``PREVIEW_PX`` square (``ImageOps.contain``'s size),
    JPEG. Bilinear, as the sheet draws its tiles, after a box reduction of a large image
    (``PREVIEW_REDUCING_GAP``)."""
    small = img.resize(
        preview_size(img.size),
        Image.Resampling.BILINEAR,
        reducing_gap=PREVIEW_REDUCING_GAP,
    )
    buf = io.BytesIO()
    small.save(buf, "JPEG", quality=PREVIEW_QUALITY)
    return buf.getvalue()


_KEEPER_RGB = (20, 150, 60)
_DUP_RGB = (200, 40, 40)


def contact_sheet(groups: Sequence[Sequence[Tile]], thumb: int = 112, title: str = "") -> bytes:
    """One row per cluster, thumbnails side by side, keeper framed green, copies red (PNG)."""
    if not groups or not any(groups):
        raise ValueError("contact_sheet needs at least one non-empty group")
    if thumb < 32:
        raise ValueError(f"thumb must be >= 32 px, got {thumb}")
    pad, text_h, frame = 6, 26, 4
    cell_w, cell_h = thumb + 2 * frame, thumb + 2 * frame + text_h
    cols = max(len(g) for g in groups)
    head = 18 if title else 0
    sheet = Image.new(
        "RGB",
        (pad + cols * (cell_w + pad), head + pad + len(groups) * (cell_h + pad)),
        (250, 250, 250),
    )
    draw = ImageDraw.Draw(sheet)
    if title:
        draw.text((pad, 3), title, fill=(0, 0, 0))
    for row, group in enumerate(groups):
        for col, tile in enumerate(group):
            x = pad + col * (cell_w + pad)
            y = head + pad + row * (cell_h + pad)
            colour = _KEEPER_RGB if tile.keeper else _DUP_RGB
            draw.rectangle((x, y, x + cell_w - 1, y + thumb + 2 * frame - 1), fill=colour)
            if tile.preview is not None and thumb <= PREVIEW_PX:
                img = decode_rgb(tile.preview)
                img = ImageOps.contain(img, (thumb, thumb), Image.Resampling.BILINEAR)
            elif tile.data is not None:
                # A progressive JPEG decoded at 1/8 needs only its DC scans (exact, and
                # ~10x cheaper: the AC scans are most of a progressive decode).
                data = progressive_dc_scans(tile.data, thumb) or tile.data
                img = decode_rgb(data, draft_size=(thumb, thumb))
                img = ImageOps.contain(img, (thumb, thumb), Image.Resampling.BILINEAR)
            else:
                img = Image.new("RGB", (thumb, thumb), (200, 200, 200))
            ox = x + frame + (thumb - img.width) // 2
            oy = y + frame + (thumb - img.height) // 2
            sheet.paste(img, (ox, oy))
            status = "KEEP" if tile.keeper else "dup"
            lines = [f"{status}: {line}" if i == 0 else line for i, line in enumerate(tile.lines)]
            draw.multiline_text(
                (x + 1, y + thumb + 2 * frame + 1),
                "\n".join(_fit(line, cell_w) for line in lines[:2]),
                fill=colour,
                spacing=1,
            )
    buf = io.BytesIO()
    # 256 colours are plenty for a review sheet and keep the UI's event metadata small; the
    # octree quantiser takes ~2 ms where the default median cut took ~80-170 ms per sheet.
    # zlib's default level, not optimize=True: that tries every setting, several times the
    # time for a barely smaller file.
    sheet.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(buf, "PNG", compress_level=6)
    return buf.getvalue()


def _fit(line: str, width_px: int, char_px: int = 6) -> str:
    """Shorten from the left (batch names differ at the end: ``source.chunk``)."""
    room = max(4, width_px // char_px)
    return line if len(line) <= room else "…" + line[-(room - 1) :]


def gallery_groups(
    reader: Reader, batch: str, decisions: pa.Table, max_clusters: int = 4, max_members: int = 5
) -> list[list[Tile]]:
    """Tiles for a few duplicate clusters touching ``batch`` (cross-batch ones first)."""
    rows = decisions.to_pylist()
    by_cluster: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_cluster.setdefault(r["cluster_id"], []).append(r)
    touching = [
        c for c, ms in by_cluster.items() if len(ms) > 1 and any(m["batch"] == batch for m in ms)
    ]
    touching.sort(key=lambda c: (-len({m["batch"] for m in by_cluster[c]}), -len(by_cluster[c]), c))
    chosen = touching[:max_clusters]
    members = {
        c: sorted(
            by_cluster[c],
            key=lambda m: (not m["is_keeper"], m["batch"] != batch, m["batch"], m["key"]),
        )[:max_members]
        for c in chosen
    }
    pairs = [(m["batch"], m["key"]) for c in chosen for m in members[c]]
    view = as_view(reader)
    columns = ["batch", "key", "width", "height"]
    stored = view.schema(IMAGES.name)
    if stored is not None and "preview" in stored.names:  # older labs: originals only
        columns.append("preview")
    rows = lookup_by_keys(view, IMAGES.name, IMAGES.schema, pairs, columns).to_pylist()
    found = {(r["batch"], r["key"]): r for r in rows}
    # Originals only for the images without a preview.
    bare = [p for p in pairs if p in found and found[p].get("preview") is None]
    originals = (
        {
            (r["batch"], r["key"]): r["image"]
            for r in lookup_by_keys(
                view, IMAGES.name, IMAGES.schema, bare, ["batch", "key", "image"]
            ).to_pylist()
        }
        if bare
        else {}
    )
    groups = []
    for c in chosen:
        tiles = []
        for m in members[c]:
            pair = (m["batch"], m["key"])
            img = found.get(pair)
            size = f"{img['width']}x{img['height']}" if img else "?"
            tiles.append(
                Tile(
                    originals.get(pair),
                    (size, m["batch"]),
                    m["is_keeper"],
                    preview=img.get("preview") if img else None,
                )
            )
        groups.append(tiles)
    return groups
