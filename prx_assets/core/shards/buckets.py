"""Aspect-ratio buckets: the shape table and the rule that assigns an image to one shape.

Why a derived table: the training side batches by exact (H, W), so both sides must agree
on the same list, and a list typed by hand drifts. The table is computed from a handful
of parameters and exported as JSON (``bucket_table_json``) for the trainer.

Derivation, per tier T (a square budget of T*T pixels, i.e. (T/patch)^2 tokens):

- step = T/16 (64 px at 1024); sides are multiples of it;
- target aspects (W/H) spaced evenly in log space from ``min_aspect`` to ``max_aspect``
  (13 of them: 6 portrait, square, 6 landscape);
- for a landscape target a: the long side is the step multiple nearest sqrt(T*T*a), the
  short side the largest step multiple that keeps H*W within the budget; if that overshoots
  ``max_aspect`` the long side shrinks a step at a time until it does not;
- portrait shapes are the transposes, so the table is symmetric by construction.

At 1024 this gives 1024x1024, 960x1088, 896x1152, 832x1216, 768x1280, 768x1344, 704x1408
(H x W) and their transposes. Every tier is the same table in units of its step, so token
counts are the same fraction of the budget at every tier: between 93.75 % and 100 %
(``TOKEN_TOLERANCE``), never above it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_TIERS: tuple[int, ...] = (512, 1024, 2048, 4096)
DEFAULT_PATCH = 16
DEFAULT_N_SHAPES = 13
DEFAULT_MIN_ASPECT = 0.5
DEFAULT_MAX_ASPECT = 2.0
STEP_DIVISOR = 16  # step = tier / 16
MIN_SIDE = 384  # images with a short side under this are not training data
# Shapes use between (1 - TOKEN_TOLERANCE) and 100 % of the tier's token budget.
TOKEN_TOLERANCE = 0.0625


@dataclass(frozen=True, order=True)
class BucketShape:
    """One bucket: an exact (height, width) inside a tier."""

    tier: int
    height: int
    width: int

    @property
    def aspect(self) -> float:
        """Width / height (> 1 is landscape)."""
        return self.width / self.height

    @property
    def name(self) -> str:
        """``"<H>x<W>"``, the directory name of the bucket."""
        return f"{self.height}x{self.width}"

    def tokens(self, patch: int = DEFAULT_PATCH) -> int:
        """Number of patch tokens the trainer sees for this shape."""
        if self.height % patch or self.width % patch:
            raise ValueError(f"shape {self.name} is not a multiple of patch size {patch}")
        return (self.height // patch) * (self.width // patch)


BucketTable = dict[int, tuple[BucketShape, ...]]


def _landscape_units(budget_units: int, n_side: int, max_aspect: float) -> list[tuple[int, int]]:
    """(h, w) in step units for the square and the landscape targets, nearest-square first."""
    if n_side == 0:
        return []
    shapes = []
    for k in range(n_side + 1):
        # Landscape half of the log-spaced grid: 1 .. max_aspect.
        target = max_aspect ** (k / n_side)
        w = max(1, round(math.sqrt(budget_units * target)))
        h = budget_units // w
        while h > 0 and w / h > max_aspect + 1e-12:
            w -= 1
            h = budget_units // w
        if h <= 0:
            raise ValueError(f"no shape fits aspect {target:.3f} in {budget_units} units")
        shapes.append((h, w))
    return shapes


@lru_cache(maxsize=64)
def _tier_shapes(
    tier: int, patch: int, n_shapes: int, min_aspect: float, max_aspect: float
) -> tuple[BucketShape, ...]:
    if tier <= 0 or tier % STEP_DIVISOR:
        raise ValueError(f"tier {tier} must be a positive multiple of {STEP_DIVISOR}")
    step = tier // STEP_DIVISOR
    if patch <= 0 or step % patch:
        raise ValueError(
            f"patch size {patch} must divide the tier step {step} (tier {tier} / {STEP_DIVISOR})"
        )
    if n_shapes < 1 or n_shapes % 2 == 0:
        raise ValueError(f"n_shapes must be odd (square + symmetric pairs), got {n_shapes}")
    if not (0 < min_aspect <= 1 <= max_aspect) or not math.isclose(
        min_aspect * max_aspect, 1.0, rel_tol=1e-9
    ):
        raise ValueError(
            f"aspect range must be symmetric around 1 (min = 1/max), got {min_aspect}..{max_aspect}"
        )
    budget_units = STEP_DIVISOR * STEP_DIVISOR
    landscape = _landscape_units(budget_units, n_shapes // 2, max_aspect)
    widths = [w for _, w in landscape]
    if len(set(widths)) != len(widths):
        raise ValueError(
            f"{n_shapes} shapes do not fit between aspects {min_aspect} and {max_aspect} "
            f"on a {step}px grid: two targets round to the same shape"
        )
    units = [(w, h) for h, w in reversed(landscape[1:])] + landscape
    return tuple(BucketShape(tier, h * step, w * step) for h, w in units)


def bucket_table(
    tiers: tuple[int, ...] = DEFAULT_TIERS,
    patch: int = DEFAULT_PATCH,
    n_shapes: int = DEFAULT_N_SHAPES,
    min_aspect: float = DEFAULT_MIN_ASPECT,
    max_aspect: float = DEFAULT_MAX_ASPECT,
) -> BucketTable:
    """The shapes of every tier, each ordered by aspect from most portrait to most landscape."""
    return {
        t: _tier_shapes(t, patch, n_shapes, float(min_aspect), float(max_aspect))
        for t in sorted(set(tiers))
    }


def bucket_table_json(table: BucketTable | None = None, patch: int = DEFAULT_PATCH) -> str:
    """The table as stable JSON: what the training side loads to agree on shapes."""
    table = bucket_table(patch=patch) if table is None else table
    obj = {
        "version": 1,
        "patch": patch,
        "tiers": {
            str(tier): [
                {
                    "name": s.name,
                    "height": s.height,
                    "width": s.width,
                    "aspect": round(s.aspect, 6),
                    "tokens": s.tokens(patch),
                }
                for s in shapes
            ]
            for tier, shapes in sorted(table.items())
        },
    }
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True)
class Assignment:
    """Where one image goes and exactly how it is resized there.

    ``resize_size`` is the (width, height) the whole image is Lanczos-resized to so that it
    covers the shape; ``crop_box`` is (left, top, right, bottom) in those resized
    coordinates, centred, and exactly the shape's size.
    """

    source_size: tuple[int, int]  # (width, height) of the oriented source
    shape: BucketShape
    scale: float  # resize factor; > 1 only when ``upscaled``
    resize_size: tuple[int, int]
    crop_box: tuple[int, int, int, int]
    outside_aspect_range: bool  # the image was wider/taller than the extreme shapes
    upscaled: bool

    @property
    def tier(self) -> int:
        return self.shape.tier

    @property
    def hw(self) -> tuple[int, int]:
        return (self.shape.height, self.shape.width)

    @property
    def crop_fraction(self) -> float:
        """Share of the resized image's area that the crop discards."""
        rw, rh = self.resize_size
        return 1.0 - (self.shape.width * self.shape.height) / (rw * rh)


def _nearest_shape(shapes: tuple[BucketShape, ...], width: int, height: int) -> BucketShape:
    log_a = math.log(width / height)
    # Ties (an aspect exactly between two shapes) go to the first: deterministic.
    return min(shapes, key=lambda s: abs(math.log(s.aspect) - log_a))


def _cover(width: int, height: int, shape: BucketShape) -> tuple[float, tuple[int, int]]:
    """Scale and integer resized size that covers ``shape``; the binding side is exact."""
    sx = shape.width / width
    sy = shape.height / height
    if sx >= sy:
        return sx, (shape.width, max(shape.height, round(height * sx)))
    return sy, (max(shape.width, round(width * sy)), shape.height)


def _fills(width: int, height: int, shape: BucketShape) -> bool:
    return shape.width <= width and shape.height <= height


def _check_size(width: int, height: int) -> None:
    if not (isinstance(width, int) and isinstance(height, int)) or width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive integers, got {width!r}x{height!r}")


def _choose_tier(
    width: int, height: int, table: BucketTable, allow_upscale: bool, min_side: int
) -> BucketShape | None:
    _check_size(width, height)
    if not table:
        raise ValueError("empty bucket table")
    if min(width, height) < min_side or width * height < min_side * min_side:
        return None
    candidates = [_nearest_shape(table[t], width, height) for t in sorted(table, reverse=True)]
    if allow_upscale:
        # The tier whose scale is closest to 1 in log space; ties go to the higher tier.
        return min(candidates, key=lambda s: abs(math.log(_cover(width, height, s)[0])))
    for shape in candidates:
        if _fills(width, height, shape):
            return shape
    return candidates[-1]


def assign_bucket(
    width: int,
    height: int,
    table: BucketTable | None = None,
    allow_upscale: bool = False,
    min_side: int = MIN_SIDE,
) -> Assignment | None:
    """Assign an oriented ``width`` x ``height`` image to a tier and shape, or None.

    - None when the image is under the cutoff: short side < ``min_side`` or fewer than
      ``min_side``^2 pixels.
    - The shape within a tier is the one with the nearest aspect in log space; an image
      beyond the table's aspect range lands on the extreme shape and is centre-cropped
      (``outside_aspect_range``, ``crop_box``).
    - Tier, default: the highest tier the image *fills without upscaling*, i.e. whose
      nearest-aspect shape fits inside the image on both sides (cover scale <= 1).
    - Eligible images too small for even the lowest tier (at the defaults, 384..511 px on a
      side) go to the lowest tier, upscaled by at most 512/384 = 1.33 (``upscaled=True``).
      Why: the 384 cutoff exists to admit them, and a mild Lanczos upscale keeps rare
      content in the data; dropping them would make the cutoff meaningless. Consumers that
      want only native pixels filter on ``upscaled``.
    - ``allow_upscale=True``: the tier whose cover scale is closest to 1 in log space, so a
      1000 px square goes to 1024 (x1.024) rather than 512 (x0.512).
    """
    table = bucket_table() if table is None else table
    shape = _choose_tier(width, height, table, allow_upscale, min_side)
    if shape is None:
        return None
    scale, (rw, rh) = _cover(width, height, shape)
    left = (rw - shape.width) // 2
    top = (rh - shape.height) // 2
    extremes = (table[shape.tier][0].aspect, table[shape.tier][-1].aspect)
    aspect = width / height
    return Assignment(
        source_size=(width, height),
        shape=shape,
        scale=scale,
        resize_size=(rw, rh),
        crop_box=(left, top, left + shape.width, top + shape.height),
        outside_aspect_range=aspect < extremes[0] or aspect > extremes[1],
        upscaled=scale > 1.0,
    )


def max_fillable_tier(
    width: int, height: int, table: BucketTable | None = None, min_side: int = MIN_SIDE
) -> int | None:
    """The tier ``assign_bucket`` (default rule) puts this image in; None under the cutoff.

    For images between the cutoff and the lowest tier this is the lowest tier, reached by
    a bounded upscale (see ``assign_bucket``).
    """
    table = bucket_table() if table is None else table
    shape = _choose_tier(width, height, table, False, min_side)
    return None if shape is None else shape.tier
