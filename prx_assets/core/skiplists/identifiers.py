"""What an opt-out entry can name, in canonical form (the value ``opt_outs.identifier`` stores).

Identifier kinds (a bare identifier's kind is detected in this order):

- content key: the sha256 of the original file bytes, 64 hex digits (any case).
- URL: ``http://`` or ``https://`` with a host; matched exactly (after trimming whitespace)
  against the URL recorded at ingest.
- source id: ``source:id``: the image's source (``images.source``, e.g. ``internal-studio``)
  and that source's own id (``images.source_id``), split at the first ``:``. In CSV/parquet a
  ``source`` column may give the source separately (then the id may contain ``:``).

Every error message quotes at most 200 characters of the entry (``text.quote_bounded``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from prx_assets.core.text import quote_bounded

KIND_KEY = "key"
KIND_URL = "url"
KIND_SOURCE_ID = "source_id"
KINDS: tuple[str, ...] = (KIND_KEY, KIND_URL, KIND_SOURCE_ID)

_KEY_RE = re.compile(r"^[0-9a-fA-F]{64}$")
_SPACE_RE = re.compile(r"\s")  # what str.isspace() calls whitespace, for str patterns


@dataclass(frozen=True, order=True)
class OptOutIdentifier:
    """One identifier in canonical form. ``value`` is what ``opt_outs.identifier`` stores:
    the lower-case key, the trimmed URL, or ``"<source>:<id>"``."""

    kind: str
    value: str
    source: str | None = None  # source-id kind only
    source_id: str | None = None


def content_key(text: str) -> OptOutIdentifier:
    if not _KEY_RE.match(text):
        raise ValueError(f"{quote_bounded(text)} is not a content key (64 hex digits of sha256)")
    return OptOutIdentifier(KIND_KEY, text.lower())


def url_identifier(text: str) -> OptOutIdentifier:
    if _SPACE_RE.search(text):  # (a regex: a per-character loop was a third of a URL's parse)
        raise ValueError(f"{quote_bounded(text)} is not a URL (contains whitespace)")
    try:
        parts = urlsplit(text)
    except ValueError as exc:
        raise ValueError(f"{quote_bounded(text)} is not a valid URL ({exc})") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{quote_bounded(text)} is not an http(s) URL with a host")
    return OptOutIdentifier(KIND_URL, text)


def source_identifier(source: str | None, sid: str) -> OptOutIdentifier:
    """``source:id`` (``source`` None) or a separate source; the id keeps any later ``:``."""
    if source is None:
        if ":" not in sid:
            raise ValueError(
                f"{quote_bounded(sid)} is a source id without its source: write 'source:id'"
            )
        source, sid = sid.split(":", 1)
    source, sid = source.strip(), sid.strip()
    if not source or any(c.isspace() for c in source) or "/" in source:
        raise ValueError(
            f"source {quote_bounded(source)} must be a non-empty name without spaces or '/'"
        )
    if not sid:
        raise ValueError(f"source id for source {quote_bounded(source)} is empty")
    if sid.startswith("//"):
        raise ValueError(
            f"{quote_bounded(f'{source}:{sid}')} looks like a URL; only http(s) URLs are accepted"
        )
    return OptOutIdentifier(KIND_SOURCE_ID, f"{source}:{sid}", source, sid)


def parse_identifier(text: str) -> OptOutIdentifier:
    """Detect a bare identifier's kind: content key, http(s) URL, or ``source:id``."""
    text = text.strip()
    if not text:
        raise ValueError("empty identifier")
    if _KEY_RE.match(text):
        return content_key(text)
    scheme = text.split(":", 1)[0].lower()
    if scheme in ("http", "https"):
        return url_identifier(text)
    if ":" in text:
        return source_identifier(None, text)
    raise ValueError(
        f"{quote_bounded(text)} is not a content key (64 hex), an http(s) URL or a 'source:id' pair"
    )


def identifier_of_kind(kind: str, text: str, source: str | None) -> OptOutIdentifier:
    """A cell of a column of ``kind`` (``"identifier"``: detect the kind, as for a bare line)."""
    if kind == "identifier":
        return parse_identifier(text)
    if kind == KIND_KEY:
        return content_key(text)
    if kind == KIND_URL:
        return url_identifier(text)
    return source_identifier(source, text)
