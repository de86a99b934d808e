"""Bounded quotes and the printable file-name rule."""

import io
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from prx_assets.core.text import (
    Line,
    bound_text,
    clean_text,
    name_bytes,
    printable_name,
    quote_bounded,
    read_lines,
)
from prx_assets_tests.bounds import MIB, peak_rss_growth


def test_short_values_are_quoted_like_repr():
    assert quote_bounded("not-an-identifier") == "'not-an-identifier'"
    assert quote_bounded("a\nb\x1b[31m") == repr("a\nb\x1b[31m")


def test_long_values_quote_a_prefix_and_count_the_rest():
    q = quote_bounded("x" * 209_715_360)
    assert q == repr("x" * 200) + "…(+209,715,160 more characters)"
    assert quote_bounded("abcdef", 2) == "'ab'…(+4 more characters)"
    # Only the start of an entry was read: the count comes from its true length.
    assert quote_bounded("abc", 2, total=1_000) == "'ab'…(+998 more characters)"


def test_quotes_are_one_printable_line_of_valid_utf8_whatever_the_input():
    hostile = "\udce9\u202egpj.exe\n\r\x00" * 1_000
    q = quote_bounded(hostile)
    q.encode("utf-8")  # no lone surrogate survives
    assert q.isprintable() and len(q) < 2 * 200 * 6


def test_bound_text_caps_whole_messages():
    assert bound_text("ok") == "ok"
    long = bound_text("y" * 5_000, 100)
    assert long == "y" * 100 + "…(+4,900 more characters)"
    assert bound_text("caf\udce9") == "caf\ufffd"


def test_clean_text_replaces_lone_surrogates_only():
    assert clean_text("café 😀 \udce9") == "café 😀 \ufffd"


def test_printable_name_rule_examples():
    assert printable_name("café.jpg") == "café.jpg"
    assert printable_name(b"caf\xe9.jpg") == "caf%E9.jpg"
    assert printable_name("caf\udce9.jpg") == "caf%E9.jpg"  # surrogateescape'd str
    assert printable_name("100%.jpg") == "100%25.jpg"
    assert printable_name("new\nline\x7f.jpg") == "new%0Aline%7F.jpg"
    assert printable_name("rtl\u202egpj.exe") == "rtl%E2%80%AEgpj.exe"
    assert printable_name("zero\u200bwidth") == "zero%E2%80%8Bwidth"
    assert printable_name("a dir/日本 写真.png") == "a dir/日本 写真.png"


@given(st.binary(max_size=64))
def test_printable_name_is_lossless_and_printable(raw):
    text = printable_name(raw)
    text.encode("utf-8")
    assert not {unicodedata.category(c) for c in text} & {"Cc", "Cf", "Zl", "Zp", "Cs"}
    assert name_bytes(text) == raw
    assert printable_name(raw.decode("utf-8", "surrogateescape")) == text


def test_read_lines_caps_each_line_and_counts_what_it_skipped():
    long = "é" * 5_000  # 10,000 bytes, 5,000 characters
    stream = io.BytesIO(f"short\r\n{long}\nafter\nlast-without-newline".encode())
    lines = list(read_lines(stream, max_line_bytes=100))
    assert [line.number for line in lines] == [1, 2, 3, 4]
    assert lines[0] == Line(1, b"short")
    assert lines[1].truncated and lines[1].total_chars == 5_000 and len(lines[1].data) == 100
    assert lines[2] == Line(3, b"after") and lines[3] == Line(4, b"last-without-newline")


def test_read_lines_holds_at_most_the_cap_of_a_huge_line():
    class Zeros(io.RawIOBase):
        """200 MiB of one line, generated: nothing but the reader holds it."""

        def __init__(self) -> None:
            self.left = 200 * 1024 * 1024

        def readable(self) -> bool:
            return True

        def readinto(self, buf) -> int:
            n = min(len(buf), self.left)
            buf[:n] = b"a" * n
            self.left -= n
            return n

    ((line,), growth) = peak_rss_growth(lambda: list(read_lines(io.BufferedReader(Zeros()), 1_000)))
    assert growth < 32 * MIB
    assert line.truncated and line.total_chars == 200 * 1024 * 1024 and line.data == b"a" * 1_000
