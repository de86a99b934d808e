"""Helpers that turn core results into Dagster metadata the UI renders."""

import base64
from collections.abc import Mapping

from dagster import MetadataValue


def png_markdown(png: bytes, alt: str) -> MetadataValue:
    """A PNG embedded as a data URI in markdown: the Dagster UI shows it inline."""
    b64 = base64.b64encode(png).decode("ascii")
    return MetadataValue.md(f"![{alt}](data:image/png;base64,{b64})")


def counts_table(counts: Mapping[str, int], key: str = "value", sort: bool = True) -> MetadataValue:
    """A two-column markdown table; ``sort=False`` keeps the mapping's order (e.g. tiers)."""
    items = sorted(counts.items()) if sort else list(counts.items())
    rows = "\n".join(f"| {k} | {v} |" for k, v in items)
    return MetadataValue.md(f"| {key} | count |\n|---|---|\n{rows}")
