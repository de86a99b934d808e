"""The landing sensor's memory: the exact set of partition keys it ever registered, compactly.

Why a set at all: a key the sensor registered once is never requested or re-created again,
even after its partition was deleted by hand, so Dagster's own partition list cannot stand
in for it. Why compact: a Dagster cursor is stored and shipped on every tick, and the plain
JSON list grew with every batch (170 KB at 10,000 keys).

Encoding (exact, no false positives or negatives): keys are split into a stem and a trailing
run of digits (``laion.000123`` -> ``laion.``, ``000123``); keys of one stem and digit width
whose numbers are consecutive become one ``[first, last]`` range, every other key is kept
verbatim. The JSON of that is zlib-compressed and base64-encoded behind ``v2:``. A landing
zone of numbered chunks therefore costs a few bytes per source however many batches it has;
arbitrary names cost their compressed size. The version 1 cursor (a JSON list of keys) is
still read, so upgrading loses nothing.
"""

from __future__ import annotations

import base64
import bisect
import json
import re
import zlib
from collections.abc import Iterable

_PREFIX = "v2:"
_NUMBERED = re.compile(r"^(?P<stem>.*?)(?P<digits>[0-9]+)$")
# Longer digit runs are kept verbatim (their ranges would gain nothing and ints stay small).
_MAX_DIGITS = 18
_MAX_KEYS = 10_000_000  # a damaged range must not expand into all of memory


class CursorError(ValueError):
    """A cursor this code did not write: refusing it beats forgetting what was registered."""


def encode_keys(keys: Iterable[str]) -> str:
    """The compact cursor text for exactly ``keys``."""
    numbered: dict[tuple[str, int], list[int]] = {}
    verbatim: list[str] = []
    for key in sorted(set(keys)):
        m = _NUMBERED.match(key)
        if m is None or len(m.group("digits")) > _MAX_DIGITS:
            verbatim.append(key)
            continue
        digits = m.group("digits")
        numbered.setdefault((m.group("stem"), len(digits)), []).append(int(digits))
    runs = []
    for (stem, width), numbers in sorted(numbered.items()):
        ranges: list[list[int]] = []
        for n in sorted(numbers):
            if ranges and ranges[-1][1] == n - 1:
                ranges[-1][1] = n
            else:
                ranges.append([n, n])
        runs.append([stem, width, ranges])
    body = json.dumps({"runs": runs, "keys": verbatim}, separators=(",", ":"))
    return _PREFIX + base64.b64encode(zlib.compress(body.encode(), 6)).decode("ascii")


def decode_keys(cursor: str | None) -> set[str]:
    """The keys a cursor holds: ``encode_keys``' text, a version 1 JSON list, or none."""
    if not cursor:
        return set()
    if not cursor.startswith(_PREFIX):
        try:
            legacy = json.loads(cursor)
        except json.JSONDecodeError as exc:
            raise CursorError(f"landing cursor is neither v2 nor a JSON list: {exc}") from None
        if not isinstance(legacy, list) or not all(isinstance(k, str) for k in legacy):
            raise CursorError("landing cursor (v1) is not a list of keys")
        return set(legacy)
    try:
        body = json.loads(zlib.decompress(base64.b64decode(cursor[len(_PREFIX) :], validate=True)))
        keys = set(body["keys"])
        for stem, width, ranges in body["runs"]:
            for first, last in ranges:
                if not 0 <= int(last) - int(first) < _MAX_KEYS - len(keys):
                    raise ValueError(f"range {first}..{last} of {stem!r} is out of bounds")
                keys.update(f"{stem}{n:0{int(width)}d}" for n in range(int(first), int(last) + 1))
    except (ValueError, KeyError, TypeError, zlib.error) as exc:
        raise CursorError(f"landing cursor (v2) is damaged: {exc}") from None
    return keys


# The landing sensor's whole cursor (v3): the registered keys as above, plus what the last
# scan of a local landing zone saw (``core/ingest/watch.py``: per source, the mtime of a
# settled listing and its incomplete folders), so an idle tick lists nothing.
_V3 = "v3:"
MAX_CURSOR_CHARS = 64 * 1024 * 1024  # a damaged cursor must not be parsed without bound


def encode_cursor(keys_text: str, watch: dict) -> str:
    """The v3 cursor for ``keys_text`` (``encode_keys``' output) and a watch state's JSON."""
    body = json.dumps({"keys": keys_text, "watch": watch}, separators=(",", ":"), sort_keys=True)
    return _V3 + body


def split_cursor(cursor: str | None) -> tuple[str, dict | None]:
    """(the registered keys' text for ``decode_keys``, the watch state's JSON or None).

    A v1 or v2 cursor is all keys and no watch state (the next scan lists everything once).
    The keys are not decoded here: an idle tick never needs them.
    """
    if not cursor or not cursor.startswith(_V3):
        return cursor or "", None
    if len(cursor) > MAX_CURSOR_CHARS:
        raise CursorError(f"landing cursor (v3) is over {MAX_CURSOR_CHARS:,} characters")
    try:
        data = json.loads(cursor[len(_V3) :])
    except (ValueError, RecursionError) as exc:
        raise CursorError(f"landing cursor (v3) is damaged: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys"), str):
        raise CursorError("landing cursor (v3) has no keys")
    watch = data.get("watch")
    if not isinstance(watch, dict):
        raise CursorError("landing cursor (v3) has no watch state")
    return data["keys"], watch


class RegisteredKeys:
    """``encode_keys``' set, queried and grown without expanding its ranges.

    Why: ``decode_keys`` builds every key as a string; at 100,000 registered batches that
    is ~1 s per tick that lands anything, and the re-encode as much again. Here a numbered
    key is looked up by bisecting its stem's sorted ranges, and adding a key extends or
    inserts one range, so a tick costs O(ranges) JSON work, not O(keys) string building.
    """

    def __init__(self) -> None:
        self._verbatim: set[str] = set()
        self._runs: dict[tuple[str, int], list[list[int]]] = {}

    @classmethod
    def from_text(cls, text: str | None) -> RegisteredKeys:
        out = cls()
        if not text:
            return out
        if not text.startswith(_PREFIX):  # v1: a JSON list of keys
            out.add(decode_keys(text))
            return out
        try:
            body = json.loads(
                zlib.decompress(base64.b64decode(text[len(_PREFIX) :], validate=True))
            )
            verbatim = body["keys"]
            if not isinstance(verbatim, list) or not all(isinstance(k, str) for k in verbatim):
                raise TypeError("keys is not a list of strings")
            out._verbatim = set(verbatim)
            for stem, width, ranges in body["runs"]:
                if not isinstance(stem, str) or type(width) is not int:
                    raise TypeError("a run's stem or width has the wrong type")
                clean = []
                for first, last in ranges:
                    if type(first) is not int or type(last) is not int or not 0 <= first <= last:
                        raise ValueError(f"range {first!r}..{last!r} of {stem!r} is malformed")
                    clean.append([first, last])
                clean.sort()
                out._runs[(stem, width)] = clean
        except (ValueError, KeyError, TypeError, zlib.error) as exc:
            raise CursorError(f"landing cursor (v2) is damaged: {exc}") from None
        return out

    @staticmethod
    def _split(key: str) -> tuple[tuple[str, int], int] | None:
        m = _NUMBERED.match(key)
        if m is None or len(m.group("digits")) > _MAX_DIGITS:
            return None
        digits = m.group("digits")
        return (m.group("stem"), len(digits)), int(digits)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        if key in self._verbatim:
            return True
        split = self._split(key)
        if split is None:
            return False
        ranges = self._runs.get(split[0])
        if not ranges:
            return False
        i = bisect.bisect_right(ranges, [split[1], _BIG]) - 1
        return i >= 0 and ranges[i][0] <= split[1] <= ranges[i][1]

    def add(self, keys: Iterable[str]) -> None:
        for key in keys:
            if key in self:
                continue
            split = self._split(key)
            if split is None:
                self._verbatim.add(key)
                continue
            (stem_width, n) = split
            ranges = self._runs.setdefault(stem_width, [])
            i = bisect.bisect_right(ranges, [n, _BIG])
            ranges.insert(i, [n, n])
            # merge with the neighbours it now touches
            if i + 1 < len(ranges) and ranges[i + 1][0] == n + 1:
                ranges[i][1] = ranges.pop(i + 1)[1]
            if i > 0 and ranges[i - 1][1] == n - 1:
                ranges[i - 1][1] = ranges.pop(i)[1]

    def __len__(self) -> int:
        return len(self._verbatim) + sum(b - a + 1 for r in self._runs.values() for a, b in r)

    def to_text(self) -> str:
        """The same text ``encode_keys`` makes for this set."""
        runs = [[stem, width, ranges] for (stem, width), ranges in sorted(self._runs.items())]
        body = json.dumps({"runs": runs, "keys": sorted(self._verbatim)}, separators=(",", ":"))
        return _PREFIX + base64.b64encode(zlib.compress(body.encode(), 6)).decode("ascii")


_BIG = 1 << 62
