"""The dedup stage's configuration: hash mode, radius and low-information threshold.

Its fingerprint (:meth:`DedupConfigResource.fingerprint`) is part of ``phash_clusters``'
code version and is stored on every decision row, so changing the radius or the threshold
reruns ``phash_clusters`` and the skip-lists for every partition (via the dedup sensor) and
nothing upstream; changing the hash mode reruns ``image_hashes`` too.
"""

from dagster import ConfigurableResource
from pydantic import Field

from prx_assets.core.dedup.corpus import DEFAULT_LOOKUP_CHUNK
from prx_assets.core.dedup.decisions import MAX_DEDUP_RADIUS, DedupSettings
from prx_assets.core.dedup.phash import DEFAULT_LOW_INFO_THRESHOLD, PHASH_MODES


class DedupConfigResource(ConfigurableResource):
    """How near-duplicates are found and which copy is kept."""

    radius: int = Field(
        default=0,
        description=(
            f"Hamming radius, 0..{MAX_DEDUP_RADIUS}: 0 merges identical hashes only (an index "
            "lookup); r > 0 merges chains of hashes within r bits (scans the corpus' hashes)."
        ),
    )
    low_info_threshold: float = Field(
        default=DEFAULT_LOW_INFO_THRESHOLD,
        description=(
            "Below this AC energy (RMS grey levels of the 8x8-lowpass thumbnail) an image is "
            "near-flat: flagged low_information, never merged, listed for review, and skipped "
            "in training unless skip_policy.skip_low_information is off."
        ),
    )
    phash_mode: str = Field(default="fast", description=f"One of {list(PHASH_MODES)}.")
    read_chunk: int = Field(
        default=256, description="Images whose bytes are read from Lance and hashed at once."
    )
    lookup_chunk: int = Field(
        default=DEFAULT_LOOKUP_CHUNK, description="Values per IN-list in index look-ups."
    )
    gallery_clusters: int = Field(
        default=4, description="Duplicate clusters drawn in phash_clusters' contact sheet."
    )

    def settings(self) -> DedupSettings:
        """Validated settings; a bad value is a clear error before anything runs."""
        for name in ("read_chunk", "lookup_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        return DedupSettings(
            radius=self.radius,
            low_info_threshold=self.low_info_threshold,
            phash_mode=self.phash_mode,
        )

    def fingerprint(self) -> str:
        return self.settings().fingerprint()
