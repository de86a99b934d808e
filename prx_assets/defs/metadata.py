"""Helpers that turn core results into Dagster metadata the UI renders.

Every Markdown value built from data goes through ``core/markdown.py`` (``md_code``,
``md_table``, re-exported here): the Dagster UI renders Markdown with GFM autolinks and
fetches any image it names, so a caption, a file name or a reason must never reach it as
Markdown syntax. Plain values (``MetadataValue.text``, ``str``, JSON) are shown as text.
"""

import base64
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dagster import MetadataValue

from prx_assets.core.captions.models.fleet import EndpointCounts
from prx_assets.core.markdown import bounded, md_code, md_table

__all__ = [
    "bounded",
    "counts_table",
    "endpoint_metadata",
    "md_code",
    "md_table",
    "png_markdown",
]

MAX_URL_CHARS = 200  # an endpoint URL as shown in metadata

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


ENDPOINT_COLUMNS = (
    "endpoint",
    "requests",
    "ok",
    "errors",
    "connection errors",
    "timeouts",
    "5xx",
    "429",
    "4xx",
    "malformed",
    "circuit opens",
    "probes",
    "state",
)


def endpoint_metadata(counts: Sequence[EndpointCounts]) -> dict[str, Any]:
    """Per-server request and error counts of an OpenAI-compatible backend's run.

    URLs are configuration, never credentials (refused at configuration), but still shown
    bounded and inside code spans; ``{}`` for a backend without servers.
    """
    if not counts:
        return {}
    rows = [
        (
            bounded(c.url, MAX_URL_CHARS),
            c.requests,
            c.ok,
            c.errors,
            c.connection_errors,
            c.timeouts,
            c.http_5xx,
            c.http_429,
            c.client_errors,
            c.malformed,
            c.circuit_opens,
            c.probes,
            c.state,
        )
        for c in counts
    ]
    per_endpoint = [{**c.as_dict(), "url": bounded(c.url, MAX_URL_CHARS)} for c in counts]
    return {
        "endpoints": len(counts),
        "requests": sum(c.requests for c in counts),
        "request_errors": sum(c.errors for c in counts),
        "endpoint_requests": MetadataValue.md(md_table(ENDPOINT_COLUMNS, rows)),
        "endpoint_counts": MetadataValue.json(per_endpoint),
    }
