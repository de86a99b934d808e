"""Helpers that turn core results into Dagster metadata the UI renders.

Every Markdown value built from data goes through ``core/markdown.py`` (``md_code``,
``md_table``, re-exported here): the Dagster UI renders Markdown with GFM autolinks and
fetches any image it names, so a caption, a file name or a reason must never reach it as
Markdown syntax. Plain values (``MetadataValue.text``, ``str``, JSON) are shown as text.
"""

import base64
import re
from collections.abc import Mapping

from dagster import MetadataValue

from prx_assets.core.markdown import bounded, md_code, md_table

__all__ = ["bounded", "counts_table", "md_code", "md_table", "png_markdown"]

_ALT_UNSAFE = re.compile(r"[^A-Za-z0-9 .,:_-]+")


def png_markdown(png: bytes, alt: str) -> MetadataValue:
    """A PNG embedded as a data URI in markdown: the Dagster UI shows it inline.

    ``alt`` is reduced to letters, digits and `` .,:_-``, so it cannot close the image syntax.
    """
    b64 = base64.b64encode(png).decode("ascii")
    return MetadataValue.md(f"![{_ALT_UNSAFE.sub(' ', alt)}](data:image/png;base64,{b64})")


def counts_table(counts: Mapping[str, int], key: str = "value", sort: bool = True) -> MetadataValue:
    """A two-column markdown table; ``sort=False`` keeps the mapping's order (e.g. tiers).

    Labels are data (reason codes, formats, sources): each is an escaped code span.
    """
    items = sorted(counts.items()) if sort else list(counts.items())
    return MetadataValue.md(md_table([key, "count"], items))
