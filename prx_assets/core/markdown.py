r"""Untrusted text inside Markdown: data is shown, never interpreted.

Why code spans and not backslash escapes: the Dagster UI renders Markdown with remark-gfm,
whose autolink pass runs over *decoded* text, so ``https\://x`` or ``www\.x`` still becomes
a link once the escapes are resolved, and any image or HTML syntax that survives an escaper
is fetched by the browser as soon as the page renders (``![](/graphql?query=mutation...)``
is a stored CSRF against Dagster's GET-accepting GraphQL endpoint). Inside a code span
nothing is parsed: no link, image, HTML, entity, emphasis or autolink. :func:`md_code` is the
one way a value from the data (alt text, captions, file names, URLs, licences, reasons,
opt-out entries, batch and source names) enters Markdown in this project:

- the fence is one backtick longer than the longest backtick run in the value, padded with
  a space where the value starts or ends with a backtick or a space (CommonMark strips one);
- characters that are not printable (line breaks, tabs, controls, bidi overrides, zero-width
  marks) are shown as Python-style escapes (``\n``, ``\x1b``, ``\u202e``), so a value can
  end neither the line, the table row nor the list item it sits in, and cannot reorder or
  hide what is displayed (also in a terminal);
- ``|`` is escaped inside table cells (``cell=True``): GFM splits rows on pipes before it
  parses code spans, and removes the backslash again inside them;
- values are bounded (``limit`` characters, the rest counted), so one hostile row cannot
  bloat a page.

No Dagster import: the audit trail (``core/audit.py``), the CLI and the Dagster metadata
helpers (``defs/metadata.py``) share these functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

MAX_VALUE_CHARS = 2000  # per value; a VLM caption (100-200 words) fits
EMPTY = "*(empty)*"
_BACKTICK_RUN = re.compile(r"`+")


def bounded(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… (+{len(text) - limit} characters)"


def visible(text: str) -> str:
    """Every character that is not printable (space excepted) as its Python escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def md_code(value: object, limit: int = MAX_VALUE_CHARS, cell: bool = False) -> str:
    """``value`` as an inline code span: shown verbatim (bounded, controls visible), never
    parsed as Markdown. ``cell=True`` inside a GFM table. ``None`` and ``""`` read as
    ``*(empty)*`` (a code span cannot be empty)."""
    if value is None or value == "":
        return EMPTY
    text = visible(bounded(str(value), limit))
    longest = max((len(m) for m in _BACKTICK_RUN.findall(text)), default=0)
    fence = "`" * (longest + 1)
    if text.strip(" ") and (text[0] in "` " or text[-1] in "` "):
        text = f" {text} "  # CommonMark strips one space each side (unless all spaces)
    if cell:
        text = text.replace("|", "\\|")
    return f"{fence}{text}{fence}"


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GFM table; every cell goes through :func:`md_code` except ints and floats.

    ``header`` holds code-defined column titles (checked to be plain words), never data.
    """
    for title in header:
        if not re.fullmatch(r"[A-Za-z0-9 _()./%-]+", title):
            raise ValueError(f"column title {title!r} is not a plain title")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row!r} has {len(row)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return md_code(value, cell=True)
    return str(value)
