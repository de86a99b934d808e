"""Small PNG figures for asset metadata, drawn with Pillow.

Why not matplotlib: these charts are drawn once per partition, and a matplotlib figure cost
50-120 ms of CPU plus tens of thousands of short-lived objects in reference cycles, which
set off the cyclic collector's full passes over a Dagster process's ~700k objects (~0.4 s
each): together most of ``resolution_profile``'s and ``bucket_assignments``' time on a
96-image partition (``benchmarks/bench_pipeline.py``). The charts need bars, points, a
dashed line and a few labels; Pillow draws them in a few milliseconds.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

_BACKGROUND = (255, 255, 255)
_INK = (40, 40, 40)
_GRID = (225, 225, 225)
_BLUE, _GREEN, _PURPLE, _RED = (64, 99, 216), (56, 152, 38), (149, 88, 178), (203, 60, 51)
_TICKS = 5  # about this many labelled ticks per axis
_LABEL_CHARS = 40  # a bar label (data: reasons, shapes) is shown at most this long


@lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def _ticks(lo: float, hi: float, n: int = _TICKS) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering ``lo``..``hi``."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(1, n)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.2g}"


class _Panel:
    """One plot area: data ranges mapped onto a pixel box, with axes, ticks and labels."""

    def __init__(
        self,
        draw: ImageDraw.ImageDraw,
        box: tuple[int, int, int, int],
        x_range: tuple[float, float],
        y_range: tuple[float, float],
    ) -> None:
        self.draw = draw
        self.x0, self.y0, self.x1, self.y1 = box
        self.xr = x_range if x_range[1] > x_range[0] else (x_range[0] - 0.5, x_range[0] + 0.5)
        self.yr = y_range if y_range[1] > y_range[0] else (y_range[0] - 0.5, y_range[0] + 0.5)

    def px(self, x: float) -> float:
        lo, hi = self.xr
        return self.x0 + (x - lo) / (hi - lo) * (self.x1 - self.x0)

    def py(self, y: float) -> float:
        lo, hi = self.yr
        return self.y1 - (y - lo) / (hi - lo) * (self.y1 - self.y0)

    def axes(self, xlabel: str = "", ylabel: str = "", x_ticks: bool = True) -> None:
        d, font = self.draw, _font(10)
        for t in _ticks(*self.yr):
            y = self.py(t)
            d.line((self.x0, y, self.x1, y), fill=_GRID)
            d.text((self.x0 - 4, y), _label(t), fill=_INK, font=font, anchor="rm")
        if x_ticks:
            for t in _ticks(*self.xr):
                x = self.px(t)
                d.line((x, self.y1, x, self.y1 + 3), fill=_INK)
                d.text((x, self.y1 + 5), _label(t), fill=_INK, font=font, anchor="mt")
        d.line((self.x0, self.y0, self.x0, self.y1), fill=_INK)
        d.line((self.x0, self.y1, self.x1, self.y1), fill=_INK)
        if xlabel:
            mid = (self.x0 + self.x1) / 2
            d.text((mid, self.y1 + 20), xlabel, fill=_INK, font=_font(11), anchor="mt")
        if ylabel:
            d.text((self.x0, self.y0 - 4), ylabel, fill=_INK, font=_font(11), anchor="ld")

    def bars(self, lefts: Sequence[float], width: float, heights: Sequence[float], colour) -> None:
        base = self.py(max(0.0, self.yr[0]))
        for left, h in zip(lefts, heights, strict=True):
            if h <= 0:
                continue
            box = (self.px(left), self.py(h), self.px(left + width) - 1, base)
            self.draw.rectangle(box, fill=colour)

    def dashed_vline(self, x: float, colour) -> None:
        px = self.px(x)
        if not self.x0 <= px <= self.x1:
            return
        for y in range(self.y0, self.y1, 8):
            self.draw.line((px, y, px, min(y + 4, self.y1)), fill=colour, width=2)

    def points(self, xs: np.ndarray, ys: np.ndarray, colour) -> None:
        for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
            cx, cy = self.px(x), self.py(y)
            self.draw.ellipse((cx - 2, cy - 2, cx + 2, cy + 2), fill=colour)


def _histogram(
    draw: ImageDraw.ImageDraw,
    box: tuple[int, int, int, int],
    values: np.ndarray,
    colour,
    xlabel: str,
    ylabel: str = "",
) -> _Panel:
    if values.size:
        counts, edges = np.histogram(values, bins=30)
    else:
        counts, edges = np.zeros(0), np.array([0.0, 1.0])
    top = float(counts.max()) if counts.size else 1.0
    panel = _Panel(draw, box, (float(edges[0]), float(edges[-1])), (0.0, max(1.0, top) * 1.05))
    panel.axes(xlabel, ylabel)
    panel.bars(edges[: counts.size].tolist(), float(edges[1] - edges[0]), counts.tolist(), colour)
    return panel


def resolution_histogram(
    widths: np.ndarray, heights: np.ndarray, min_side: int, title: str
) -> bytes:
    """Short side and aspect histograms plus a width/height scatter, as one PNG."""
    widths = np.asarray(widths, dtype=np.float64)
    heights = np.asarray(heights, dtype=np.float64)
    img = Image.new("RGB", (960, 256), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    draw.text((480, 6), title, fill=_INK, font=_font(12), anchor="mt")
    short = np.minimum(widths, heights)
    left = _histogram(draw, (50, 36, 300, 206), short, _BLUE, "short side (px)", "images")
    left.dashed_vline(float(min_side), _RED)
    draw.text((300, 38), f"cutoff {min_side}px", fill=_RED, font=_font(10), anchor="ra")
    aspect = np.where(heights > 0, widths / np.maximum(heights, 1), 1.0)
    middle = _histogram(
        draw,
        (360, 36, 610, 206),
        np.log2(np.clip(aspect, 1 / 8, 8)),
        _GREEN,
        "log2(aspect w/h); buckets cover -1..1",
    )
    for edge in (-1.0, 1.0):
        middle.dashed_vline(edge, _RED)
    if widths.size:
        xr = (float(widths.min()) * 0.95, float(widths.max()) * 1.05)
        yr = (float(heights.min()) * 0.95, float(heights.max()) * 1.05)
    else:
        xr = yr = (0.0, 1.0)
    right = _Panel(draw, (690, 36, 940, 206), xr, yr)
    right.axes("width (px)", "height (px)")
    right.points(widths, heights, _PURPLE)
    return _png(img)


def bar_chart(labels: list[str], values: list[float], title: str, xlabel: str = "") -> bytes:
    """One bar per label (labels slanted under the bars), as a PNG."""
    labels = [s if len(s) <= _LABEL_CHARS else s[: _LABEL_CHARS - 1] + "…" for s in labels]
    n = len(labels)
    width = max(320, 40 * n + 160)
    label_font = _font(10)
    slant = max((label_font.getlength(s) for s in labels), default=0.0) * 0.71 + 12
    height = int(200 + slant + (18 if xlabel else 0))
    img = Image.new("RGB", (width, height), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    draw.text((width / 2, 6), title, fill=_INK, font=_font(12), anchor="mt")
    top = max([*values, 1.0]) * 1.05
    box = (60, 30, width - 20, 180)
    panel = _Panel(draw, box, (-0.5, n - 0.5 if n else 0.5), (0.0, top))
    panel.axes(x_ticks=False)
    panel.bars([i - 0.4 for i in range(n)], 0.8, values, _BLUE)
    for i, text in enumerate(labels):
        _slanted(img, text, (round(panel.px(i)), box[3] + 4), label_font)
    if xlabel:
        draw.text((width / 2, height - 4), xlabel, fill=_INK, font=_font(11), anchor="md")
    return _png(img)


def _slanted(img: Image.Image, text: str, top_right: tuple[int, int], font) -> None:
    """``text`` at 45 degrees, ending at ``top_right`` (matplotlib's rotation=45, ha=right)."""
    w = max(1, math.ceil(font.getlength(text)))
    mask = Image.new("L", (w + 2, 14), 0)
    ImageDraw.Draw(mask).text((1, 0), text, fill=255, font=font)
    mask = mask.rotate(45, expand=True, resample=Image.Resampling.BILINEAR)
    x, y = top_right
    img.paste(_INK, (x - mask.width, y), mask)


def heat_map(
    rows: Sequence[str],
    columns: Sequence[str],
    values: Sequence[Sequence[float]],
    title: str,
    xlabel: str = "",
) -> bytes:
    """A grid of cells shaded by value (log scale: bucket counts span orders of magnitude),
    each with its value written in it, as a PNG; a zero cell is left white."""
    rows = [s if len(s) <= _LABEL_CHARS else s[: _LABEL_CHARS - 1] + "…" for s in rows]
    columns = [s if len(s) <= _LABEL_CHARS else s[: _LABEL_CHARS - 1] + "…" for s in columns]
    if len(values) != len(rows) or any(len(v) != len(columns) for v in values):
        raise ValueError("values must have one row per row label and one cell per column")
    cell_w, cell_h, left, top = 46, 26, 70, 34
    width = left + cell_w * len(columns) + 16
    height = top + cell_h * len(rows) + 24 + (18 if xlabel else 0)
    img = Image.new("RGB", (max(width, 240), height), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    draw.text((img.width / 2, 6), title, fill=_INK, font=_font(12), anchor="mt")
    peak = max((v for row in values for v in row), default=0.0)
    scale = math.log1p(peak) or 1.0
    font = _font(10)
    for r, label in enumerate(rows):
        y = top + r * cell_h
        draw.text((left - 6, y + cell_h / 2), label, fill=_INK, font=font, anchor="rm")
        for c, value in enumerate(values[r]):
            x = left + c * cell_w
            share = math.log1p(max(0.0, value)) / scale
            fill = (
                tuple(round(255 - share * (255 - b)) for b in _BLUE) if value > 0 else _BACKGROUND
            )
            draw.rectangle((x, y, x + cell_w - 1, y + cell_h - 1), fill=fill, outline=_GRID)
            if value > 0:
                ink = _BACKGROUND if share > 0.6 else _INK
                text = _label(value)
                draw.text((x + cell_w / 2, y + cell_h / 2), text, fill=ink, font=font, anchor="mm")
    bottom = top + cell_h * len(rows)
    for c, label in enumerate(columns):
        x = left + c * cell_w + cell_w / 2
        draw.text((x, bottom + 4), label, fill=_INK, font=font, anchor="mt")
    if xlabel:
        draw.text((img.width / 2, height - 4), xlabel, fill=_INK, font=_font(11), anchor="md")
    return _png(img)
