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
    return _PREFIX + base64.b64encode(zlib.compress(body.encode(), 9)).decode("ascii")


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
