"""The metadata charts are real PNGs whose bars follow the data, drawn without matplotlib."""

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from prx_assets.core.plots import _ticks, bar_chart, heat_map, resolution_histogram

BLUE = (64, 99, 216)


def _open(png: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG"
    return img.convert("RGB")


def _blue_columns(img: Image.Image) -> np.ndarray:
    """For each pixel column, how many pixels of it are bar blue."""
    arr = np.asarray(img).astype(int)
    return (np.abs(arr - BLUE).sum(axis=2) < 30).sum(axis=0)


def test_bar_chart_bars_follow_the_values():
    img = _open(bar_chart(["a", "b", "c"], [0.0, 4.0, 8.0], "t", "bucket"))
    blue = _blue_columns(img)
    # Three equal slots across the plot area (x 60 .. width-20): the first bar is empty,
    # the third about twice the second.
    left, right = 60, img.width - 20
    slot = (right - left) / 3
    heights = [blue[int(left + slot * (i + 0.5))] for i in range(3)]
    assert heights[0] == 0
    assert heights[1] > 0
    assert abs(heights[2] - 2 * heights[1]) <= 2


def test_resolution_histogram_draws_every_panel_and_survives_edge_cases():
    rng = np.random.default_rng(0)
    w, h = rng.integers(200, 3000, 50), rng.integers(200, 3000, 50)
    img = _open(resolution_histogram(w, h, 384, "b: 50 images"))
    assert img.size == (960, 256)
    blue = _blue_columns(img)
    assert blue[50:300].sum() > 0  # the short-side histogram has bars
    assert blue[360:].sum() == 0  # the other panels are drawn in other colours
    for widths, heights in (([], []), ([512], [512])):  # empty batch, one image
        png = resolution_histogram(np.array(widths), np.array(heights), 384, "edge")
        assert _open(png).size == (960, 256)


def test_ticks_are_round_and_cover_the_range():
    ticks = _ticks(0.0, 1234.0)
    assert ticks[0] == 0.0 and ticks[-1] <= 1234.0 and len(ticks) >= 3
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) == 1 and steps.pop() in (100.0, 200.0, 500.0)
    assert _ticks(5.0, 5.0) == [5.0]  # a degenerate range still gets its one value


def test_charts_do_not_import_matplotlib():
    # Per-partition charts were matplotlib figures: 50-120 ms each plus cyclic garbage
    # that triggered full collections of the whole process heap.
    code = (
        "import sys, numpy as np\n"
        "from prx_assets.core.plots import bar_chart, resolution_histogram\n"
        "bar_chart(['a'], [1.0], 't'); resolution_histogram(np.array([9]), np.array([9]), 4, 't')\n"
        "print('matplotlib' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_long_label_is_shortened_not_drawn_whole():
    # Labels are data (a snapshot diff's reasons): a huge one must not make a huge picture.
    img = _open(bar_chart(["x" * 100_000, "b"], [1.0, 2.0], "t"))
    assert img.width < 1000 and img.height < 1000


def _cell_blue(img: Image.Image, row: int, col: int) -> int:
    """How far a heat-map cell's centre is from white towards bar blue (0..255)."""
    r, g, b = img.getpixel((70 + col * 46 + 5, 34 + row * 26 + 5))  # off the written value
    return 255 - r


def test_heat_map_shades_cells_by_value_on_a_log_scale_and_leaves_zeros_white():
    values = [[0.0, 1.0, 10.0], [100.0, 1000.0, 0.0]]
    img = _open(heat_map(["4096", "512"], ["0.50", "1.00", "2.00"], values, "fill", "aspect"))
    shade = [[_cell_blue(img, r, c) for c in range(3)] for r in range(2)]
    assert shade[0][0] == 0 and shade[1][2] == 0  # empty buckets stay white
    assert 0 < shade[0][1] < shade[0][2] < shade[1][0] < shade[1][1]  # more is darker
    # Log scale: 10 and 100 are visibly apart though both are small next to 1000.
    assert shade[1][0] - shade[0][2] > 20
    with pytest.raises(ValueError, match="one row per row label"):
        heat_map(["a"], ["x", "y"], [[1.0]], "bad")
