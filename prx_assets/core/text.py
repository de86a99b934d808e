r"""Bounded, printable text from untrusted input: quotes in reasons and logs, file names as keys.

Why one module: every rejection reason, log line and stored path that carries part of an
input (a file name, an opt-out entry, a decoder message) must be bounded in size and hold
only printable, valid UTF-8, whatever the input held. A 200 MB line without a newline must
not become a 200 MB reason, and a file name that is not UTF-8 must not fail an Arrow write.

File names (``printable_name``): a name is the bytes a filesystem or a tar header holds. It
is written as text by this rule, which is lossless (``name_bytes`` inverts it):

- bytes that are not valid UTF-8 become ``%XX`` (upper-case hex), one per byte;
- ``%`` itself becomes ``%25``;
- control characters (Unicode category Cc: C0, DEL, C1), format characters (Cf: bidi
  overrides, zero-width characters, soft hyphen, BOM) and line/paragraph separators
  (Zl, Zp) become the ``%XX`` of their UTF-8 bytes;
- every other character (letters of any script, spaces, punctuation, ``/``) stays as it is.

So ``café.jpg`` stays ``café.jpg``, the Latin-1 bytes ``caf\xe9.jpg`` become ``caf%E9.jpg``,
``100%.jpg`` becomes ``100%25.jpg`` and a newline becomes ``%0A``.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import unquote_to_bytes

DEFAULT_QUOTE_CHARS = 200  # characters of an offending value quoted in a reason
MAX_DETAIL_CHARS = 2000  # hard cap on one stored reason/detail or log message
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def more_characters(n: int) -> str:
    """The marker for ``n`` characters left out, e.g. ``…(+209,715,160 more characters)``."""
    return f"…(+{n:,} more characters)"


def quote_bounded(value: str, limit: int = DEFAULT_QUOTE_CHARS, *, total: int | None = None) -> str:
    """``repr`` of at most ``limit`` characters of ``value``, then how many were left out.

    ``repr`` escapes newlines, control and format characters and lone surrogates, so the
    quote is one printable line of valid UTF-8. ``total``: the full length in characters
    when ``value`` is only the start of a longer entry (a stream that was cut short).
    """
    full = max(len(value), total or 0)
    shown = value[: max(0, limit)]
    rest = full - len(shown)
    return repr(shown) + (more_characters(rest) if rest > 0 else "")


def bound_text(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters (counting the rest), without lone surrogates.

    The last line of defence for a whole message (a reason, a detail, a log line) whose
    parts were already quoted; it keeps a message that quotes many entries bounded too.
    """
    text = clean_text(text)
    if len(text) <= limit:
        return text
    return text[:limit] + more_characters(len(text) - limit)


def clean_text(text: str) -> str:
    """``text`` with lone surrogates (undecodable bytes, broken JSON escapes) as U+FFFD.

    For metadata values (alt text, URL, licence): Arrow and Lance refuse strings that are
    not valid UTF-8, and one such value must not fail a whole batch.
    """
    if text.isascii():
        return text
    return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


def printable_name(name: bytes | str) -> str:
    """A file name as lossless printable UTF-8 (the rule in the module docstring).

    ``name``: the raw bytes, or a ``str`` as the OS and ``tarfile`` give it, i.e. decoded as
    UTF-8 with ``surrogateescape`` (undecodable bytes held as U+DC80..U+DCFF).
    """
    raw = name.encode("utf-8", "surrogateescape") if isinstance(name, str) else bytes(name)
    text = raw.decode("utf-8", "surrogateescape")
    if text.isascii() and text.isprintable() and "%" not in text:
        return text
    out: list[str] = []
    for ch in text:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, held by surrogateescape
            out.append(f"%{code - 0xDC00:02X}")
        elif ch == "%" or unicodedata.category(ch) in _ESCAPED_CATEGORIES:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass")))
        else:
            out.append(ch)
    return "".join(out)


def name_bytes(printable: str) -> bytes:
    """The raw bytes a ``printable_name`` stands for (its exact inverse)."""
    return unquote_to_bytes(printable)


@dataclass(frozen=True)
class Line:
    """One line of a stream read with a length cap (its end-of-line bytes removed).

    ``data`` holds at most the cap; when ``truncated`` the rest of the line was skipped
    without being kept, and ``total_chars`` says how long the whole line was.
    """

    number: int
    data: bytes
    truncated: bool = False
    total_chars: int | None = None


_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
_DRAIN_CHUNK = 1 << 20


def _chars(data: bytes) -> int:
    """Characters in UTF-8 ``data`` (bytes that start a character), without decoding."""
    return len(data.translate(None, _CONTINUATION_BYTES))


def read_lines(stream: BinaryIO, max_line_bytes: int) -> Iterator[Line]:
    """The lines of a binary stream, never holding more than ``max_line_bytes`` of one.

    A line longer than the cap (a 200 MB file with no newline) is read on in 1 MiB steps
    and only counted, so memory stays bounded whatever the input.
    """
    number = 0
    while True:
        data = stream.readline(max_line_bytes + 1)
        if not data:
            return
        number += 1
        if data.endswith(b"\n") or len(data) <= max_line_bytes:
            yield Line(number, data.rstrip(b"\r\n"))
            continue
        total = _chars(data)
        while True:
            more = stream.readline(_DRAIN_CHUNK)
            if not more:
                break
            total += _chars(more.rstrip(b"\r\n"))
            if more.endswith(b"\n"):
                break
        yield Line(number, data[:max_line_bytes], True, total)
