"""Profile one batch: read its recorded sizes, decide eligibility and tier, write, check.

Why a runner: the stage is read -> decide -> write -> verify through ``Lab``, and the asset
(``defs/resolution/assets.py``) only turns the typed outcome into metadata. The decisions
themselves are ``profile.py``'s pure functions; this module owns the order of the steps and
the refusal when their input is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prx_assets.core.lab import Lab
from prx_assets.core.plots import resolution_histogram
from prx_assets.core.resolution.profile import MIN_SIDE, ProfileSummary, profile_images, summarise
from prx_assets.core.tables import IMAGES, RESOLUTION

# Sizes were recorded at ingest (after EXIF orientation): the image bytes are never read.
SIZE_COLUMNS = ("key", "batch", "width", "height")


@dataclass(frozen=True)
class ResolutionOutcome:
    """What one run of the stage decided and wrote for one batch."""

    batch: str
    summary: ProfileSummary
    histogram_png: bytes  # short side, aspect and width/height scatter
    rows_written: int
    rows_replaced: int  # the batch's rows before this run (a rerun replaces them all)
    version: int  # the ``resolution`` table's version after the one commit


class MissingImagesError(RuntimeError):
    """The batch has no ``images`` table to profile: raw_images has not run anywhere."""


def profile_batch(lab: Lab, batch: str, min_side: int = MIN_SIDE) -> ResolutionOutcome:
    """Replace ``batch``'s ``resolution`` rows with a profile of its ``images`` rows.

    Refuses (``MissingImagesError``) when there is no ``images`` table, rather than writing
    an empty profile that would read as "no eligible image". A batch whose files were all
    rejected has an ``images`` table without its rows: its profile is empty, correctly.
    After the commit, every image read must have been written (else ``RuntimeError``).
    """
    if not lab.exists(IMAGES.name):
        raise MissingImagesError(f"no images table in the lab: materialise raw_images for {batch}")
    images = lab.read_batch(IMAGES.name, batch, columns=list(SIZE_COLUMNS))
    profile = profile_images(images, min_side)
    written = lab.replace_partition(RESOLUTION, batch, profile)
    if written["rows_written"] != images.num_rows:
        raise RuntimeError(
            f"{batch}: profiled {images.num_rows} images but wrote {written['rows_written']} "
            "resolution rows"
        )
    summary = summarise(profile)
    widths = profile.column("width").to_numpy().astype(np.int64)
    heights = profile.column("height").to_numpy().astype(np.int64)
    png = resolution_histogram(widths, heights, min_side, f"{batch}: {summary.images} images")
    return ResolutionOutcome(
        batch=batch,
        summary=summary,
        histogram_png=png,
        rows_written=written["rows_written"],
        rows_replaced=written["rows_replaced"],
        version=written["version"],
    )
