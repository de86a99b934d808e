r"""Machine-readable opt-out signals: HTTP response headers captured at download time.

Pure functions, no I/O. Ingest records the raw headers a manifest row or a sidecar carries
(:func:`capture_signals`: bounded, sanitised, canonical JSON in ``images.usage_signals``); the
skip policy interprets them (:func:`reservations`) under the per-source :class:`UsagePolicy`.
Why split: the interpretation (grammar, which signals a source honours) can change without
re-reading a landing file; switching a source's policy reruns ``skip_lists`` only.

Every value is normalised before it is read (:func:`normalise_value`: Unicode NFKC, format
characters such as U+200B removed), so ``no\u200bai`` and full-width ``ｎｏａｉ`` read as
``noai``; what is still not ASCII after that (a homoglyph, an undecodable byte) is malformed.

The signals and their grammar:

- ``X-Robots-Tag`` (Google/Bing robots directives, also the ``noai``/``noimageai`` de-facto
  extension img2dataset honours): comma-separated directives, case-insensitive; an item
  ``<agent>: <directive>`` scopes it, and the directives after it, to that user agent until
  the next scope. Directives that carry a value (``max-snippet: 20``, ``unavailable_after:
  <date>``) are no scopes. ``noai`` or ``noimageai`` reserve the image when unscoped, or
  scoped to an agent the source honours (:attr:`SourceRule.user_agents`; ``None``: every
  agent, because who downloaded a file is not recorded and a reservation addressed to any
  crawler is a reservation of the work). A value with a character outside the robots
  grammar (JSON, markup, ``;``, ``=``) is malformed.
- TDMRep ``tdm-reservation`` (W3C TDMRep): ``1`` = text-and-data-mining rights reserved,
  ``0`` = not reserved; anything else is malformed. ``tdm-policy`` (a URL to the licence
  offer) is recorded and shown, not fetched: an offer is not a licence, so ``1`` with a
  policy is still reserved.
- IETF aipref ``Content-Usage`` (draft-ietf-aipref-attach-05 section 4): an RFC 9651
  structured-field Dictionary of usage-category labels to the tokens ``y``/``n``, parsed by
  ``http-sfv`` (:func:`parse_sf_dictionary`). Labels follow :data:`CONTENT_USAGE_VOCABULARY`
  (:data:`CONTENT_USAGE_CATEGORIES`: which labels cover the training this platform does).
  The draft has no hierarchy any more, so there is no "most specific wins": every label
  that covers our training is read, every value of a repeated one (RFC 9651 keeps only the
  last), and any ``n`` among them reserves (the draft's own rule for combining statements:
  disallow wins). A field that does not parse, or a covering label whose value is not the
  token ``y``/``n``, is malformed; the draft calls both "unknown", we fail closed. Labels
  that do not cover our training (``search``) and unknown labels are ignored.

Fail closed: a malformed signal (unparseable, holding control characters or bytes that are
not UTF-8, a nested JSON value instead of header text, or cut at the size bound so its end
is unknown) reserves the image, unless the source's rule says ``malformed: "ignore"``; the
audit names it as malformed either way.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Any

import http_sfv

from prx_assets.core.text import clean_text, more_characters, quote_bounded

# Canonical (lower-case) header names, in display order.
X_ROBOTS_TAG = "x-robots-tag"
TDM_RESERVATION = "tdm-reservation"
TDM_POLICY = "tdm-policy"
CONTENT_USAGE = "content-usage"
CAPTURED_HEADERS: tuple[str, ...] = (X_ROBOTS_TAG, TDM_RESERVATION, TDM_POLICY, CONTENT_USAGE)
# The signals that can reserve an image (tdm-policy only accompanies tdm-reservation).
SIGNALS: tuple[str, ...] = (X_ROBOTS_TAG, TDM_RESERVATION, CONTENT_USAGE)
# Manifest columns / sidecar keys that hold a whole header map (a JSON object).
HEADER_MAP_FIELDS: tuple[str, ...] = ("headers", "http_headers", "response_headers")

MAX_SIGNAL_CHARS = 2048  # one header's value, after combining repeated lines
MAX_HEADER_MAP_CHARS = 64 * 1024  # a headers column/sidecar object, before it is parsed
AI_DIRECTIVES = frozenset({"noai", "noimageai"})
# Robots directives that take a value after a colon: ``name: value`` is not a scope.
VALUED_ROBOTS_DIRECTIVES = frozenset(
    {"max-snippet", "max-image-preview", "max-video-preview", "unavailable_after"}
)
# Every character a robots directive list uses (names, agents, numbers, RFC 850 and
# ISO 8601 dates); anything else is not the robots grammar.
_ROBOTS_CHARS = re.compile(r"[A-Za-z0-9 \t_.\-/:+*,()]*")


@dataclass(frozen=True)
class UsageCategory:
    """One aipref usage-category label: whether it covers the training this platform does
    (training a model that generates images), and the draft revision that defines it."""

    covers_training: bool
    defined_in: str
    why: str


# The aipref vocabulary revision this module follows: the working group's editor's copy
# (github ietf-wg-aipref/drafts, tag draft-ietf-aipref-vocab-07, commit 7ca0afc, 2026-08-19).
CONTENT_USAGE_VOCABULARY = "draft-ietf-aipref-vocab-07"
# Label -> category. The current draft defines train-ai and search only (no hierarchy: the
# "more general category applies" rule was removed in -07). Labels of earlier revisions are
# kept: servers configured against them still send them, and the current draft's "ignore
# unknown labels" would turn such an ``n`` into a yes; where the earlier definition covered
# this training, its ``n`` reserves (fail closed); its ``y`` allows only where no covering
# label says ``n``.
CONTENT_USAGE_CATEGORIES: Mapping[str, UsageCategory] = MappingProxyType(
    {
        "train-ai": UsageCategory(
            True,
            "draft-ietf-aipref-vocab-07 section 3.1 (and -02 to -06)",
            "AI Model Training: modifying the learned parameters of a model that generates "
            "synthetic content",
        ),
        "search": UsageCategory(
            False,
            "draft-ietf-aipref-vocab-07 section 3.2",
            "Search: covers training only of models used exclusively by a search application",
        ),
        "train-genai": UsageCategory(
            True, "draft-ietf-aipref-vocab-02, -03", "Generative AI Training"
        ),
        "bots": UsageCategory(
            True, "draft-ietf-aipref-vocab-03, -04", "Automated Processing: every other category"
        ),
        "all": UsageCategory(
            True, "draft-ietf-aipref-vocab-02", "Automated Processing: every other category"
        ),
        "tdm": UsageCategory(
            True, "draft-ietf-aipref-vocab-01", "Text and Data Mining: every other category"
        ),
        "ai": UsageCategory(True, "draft-ietf-aipref-vocab-01", "AI Training"),
        "genai": UsageCategory(True, "draft-ietf-aipref-vocab-01", "Generative AI Training"),
        "ai-use": UsageCategory(
            False, "draft-ietf-aipref-vocab-02", "AI Use: an asset as input at inference"
        ),
        "ai-output": UsageCategory(
            False, "draft-ietf-aipref-vocab-04", "AI Output: an asset used to generate outputs"
        ),
        "inference": UsageCategory(
            False, "draft-ietf-aipref-vocab-01", "AI Inference: an asset as input at inference"
        ),
    }
)
COVERING_LABELS: tuple[str, ...] = tuple(
    k for k, c in CONTENT_USAGE_CATEGORIES.items() if c.covers_training
)
# Bumped when the reading of stored signals changes, so the skip policy's fingerprint does.
INTERPRETATION_VERSION = 2  # 2: aipref vocab-07, NFKC normalisation, http-sfv
MALFORMED_RESERVES = "reserved"
MALFORMED_IGNORED = "ignore"
_CTL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_AGENT = re.compile(r"^[a-z0-9][a-z0-9_.\-/ ]*$")


class UsagePolicyError(ValueError):
    """A usage-signal policy that cannot be applied (bad file, unknown key or signal)."""


# --------------------------------------------------------------------------- capture (ingest)


def header_name(field_name: str) -> str | None:
    """The canonical header a manifest column or sidecar key names, or None.

    Case-insensitive; ``_`` and ``-`` are the same (``X_Robots_Tag`` = ``x-robots-tag``)."""
    name = field_name.strip().lower().replace("_", "-")
    return name if name in CAPTURED_HEADERS else None


def _as_text(value: Any) -> tuple[str, str | None]:
    r"""(a header value as text, defect or None).

    Repeated header lines (a list) are combined with ``, `` (RFC 9110 5.3); an integer (a
    parquet column of ``tdm-reservation``) is its digits. Bytes that are not UTF-8 are kept
    visible as ``\\xNN`` and any other type (a nested JSON object or list, a bool, a float)
    as JSON, each with a defect: such a value is malformed, never absent, and never read as
    the text it happens to contain."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8"), None
        except UnicodeDecodeError:
            return bytes(value).decode("utf-8", "backslashreplace"), "bytes that are not UTF-8"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), None
    if isinstance(value, list | tuple) and all(
        isinstance(v, str | bytes | bytearray) for v in value
    ):
        parts = [_as_text(v) for v in value]
        defect = next((d for _, d in parts if d), None)
        return ", ".join(text for text, _ in parts), defect
    kind = "JSON object" if isinstance(value, Mapping) else type(value).__name__
    return json.dumps(value, sort_keys=True, default=str), f"a {kind}, not header text"


def capture_signals(fields: Mapping[str, Any]) -> str | None:
    r"""The usage signals of one sample as canonical JSON, or None when it carries none.

    ``fields``: a manifest row or sidecar object (keys as given). Header columns/keys
    (:func:`header_name`) and header maps (:data:`HEADER_MAP_FIELDS`, a JSON object or its
    text) are both read; a header given twice is combined; an empty value is no header (a
    CSV cell cannot be null). The stored form is
    ``{"headers": {name: value}, "defects": {name: why}}``: each value bounded to
    :data:`MAX_SIGNAL_CHARS` (the rest counted) with control characters as ``\\xNN``; a cut,
    a control character, bytes that are not UTF-8 or a value that is not header text (a
    nested JSON object) is a *defect*, which makes the signal malformed.
    """
    found: dict[str, list[str]] = {}
    defects: dict[str, str] = {}
    for key, value in fields.items():
        if value is None or not isinstance(key, str):
            continue
        if key.strip().lower() in HEADER_MAP_FIELDS:
            _read_header_map(value, found, defects)
            continue
        _found(header_name(key), value, found, defects)
    if not found and not defects:
        return None
    headers: dict[str, str] = {}
    for name in CAPTURED_HEADERS:
        if name not in found:
            continue
        text, defect = sanitise_header(", ".join(found[name]))
        headers[name] = text
        if defect:
            defects.setdefault(name, defect)
    record = {"headers": headers, "defects": dict(sorted(defects.items()))}
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _found(
    name: str | None, value: Any, found: dict[str, list[str]], defects: dict[str, str]
) -> None:
    """Record one captured header value (and its defect); empty text is no header."""
    if name is None or value is None:
        return
    text, defect = _as_text(value)
    if defect:
        defects.setdefault(name, defect)
    if text.strip(" \t") or defect:  # an empty cell (CSV has no null) is no header
        found.setdefault(name, []).append(text)


def _read_header_map(value: Any, found: dict[str, list[str]], defects: dict[str, str]) -> None:
    if isinstance(value, str | bytes | bytearray):
        text, defect = _as_text(value)
        if defect:
            defects["headers"] = f"header map holds {defect}"
            return
        if not text.strip():
            return
        if len(text) > MAX_HEADER_MAP_CHARS:
            defects["headers"] = f"header map of {len(text):,} characters, over the bound"
            return
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            defects["headers"] = "header map is not valid JSON"
            return
    if not isinstance(value, Mapping):
        defects["headers"] = f"header map is a {type(value).__name__}, not an object"
        return
    for key, item in value.items():
        _found(header_name(str(key)), item, found, defects)


def sanitise_header(value: str) -> tuple[str, str | None]:
    r"""(stored value, defect or None): bounded, lone surrogates replaced, controls shown.

    Obsolete line folding (CRLF + whitespace) becomes a space, as RFC 9110 allows; any
    other control character is invalid in a field value and is kept visible as ``\\xNN``.
    """
    text = clean_text(re.sub(r"\r?\n[ \t]+", " ", value)).strip(" \t")
    defect = None
    if _CTL.search(text):
        defect = "control characters in the value"
        text = _CTL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    if len(text) > MAX_SIGNAL_CHARS:
        defect = f"value of {len(text):,} characters cut at {MAX_SIGNAL_CHARS:,}"
        text = text[:MAX_SIGNAL_CHARS] + more_characters(len(text) - MAX_SIGNAL_CHARS)
    return text, defect


# The value an ``images`` row written before signal capture gets when the column is added
# (``ingest.tables.ensure_usage_signals_column``): not "no signals" but "not known".
UNCAPTURED = '{"uncaptured":true}'


def load_signals(stored: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """(headers, defects) of an ``images.usage_signals`` value (None: no signals).

    A stored value that is not what :func:`capture_signals` writes reads as one defect of
    every signal, so the policy fails closed on it."""
    if stored is None:
        return {}, {}
    try:
        record = json.loads(stored)
        headers, defects = record["headers"], record["defects"]
        if not (isinstance(headers, dict) and isinstance(defects, dict)):
            raise TypeError("not objects")
        return {str(k): str(v) for k, v in headers.items()}, {
            str(k): str(v) for k, v in defects.items()
        }
    except (ValueError, KeyError, TypeError, RecursionError):
        return {}, dict.fromkeys(SIGNALS, "stored usage signals are unreadable")


# --------------------------------------------------------------------------- verdicts


def _strip_format(text: str) -> str:
    return "".join(c for c in text if unicodedata.category(c) != "Cf")


def normalise_value(value: str) -> str:
    """A header value as it is matched: NFKC (full-width ``ｎｏａｉ`` -> ``noai``), without
    format characters (Unicode Cf: zero-width space and joiners, BOM, bidi controls).

    Why: a signal is what a server meant, and these are invisible or look identical to a
    reader; matching the raw bytes lets them hide a reservation. What is still not ASCII
    afterwards is no signal grammar (:func:`_not_ascii`)."""
    if value.isascii():
        return value
    return _strip_format(unicodedata.normalize("NFKC", _strip_format(value)))


def _not_ascii(text: str) -> str | None:
    """Why a normalised value is malformed (its first non-ASCII character), or None."""
    for c in text:
        if not c.isascii():
            return f"U+{ord(c):04X} is not ASCII after NFKC normalisation"
    return None


@dataclass(frozen=True)
class Verdict:
    """What one signal says: ``reserved`` (True/False) or ``malformed``, and why."""

    signal: str
    reserved: bool
    malformed: bool = False
    detail: str = ""

    def describe(self) -> str:
        """Short, for ``skip_audit.reserved_signals``: ``<signal>: <detail>``."""
        return f"{self.signal}: {self.detail}" if self.detail else self.signal


def _robots_items(value: str) -> list[str]:
    """Comma-separated items, a comma inside an ``unavailable_after`` date rejoined."""
    parts = value.split(",")
    items: list[str] = []
    for part in parts:
        if (
            items
            and re.match(r"^\s*\d{1,2}\s+[A-Za-z]{3}\s+\d{4}", part)
            and ("unavailable_after" in items[-1].lower())
        ):
            items[-1] += "," + part  # "unavailable_after: Wed, 21 Oct 2015 07:28:00 GMT"
            continue
        items.append(part)
    return items


def parse_x_robots_tag(
    value: str, user_agents: frozenset[str] | None = None
) -> tuple[Verdict, list[tuple[str | None, str]]]:
    """The verdict of an ``X-Robots-Tag`` value and its (scope, directive) pairs.

    ``user_agents``: the lower-case agent tokens whose scoped directives apply (None: all).
    """
    pairs: list[tuple[str | None, str]] = []
    scope: str | None = None
    for raw in _robots_items(value):
        item = raw.strip().lower()
        if not item:
            continue
        if ":" in item:
            head, _, rest = item.partition(":")
            head = head.strip()
            if head not in VALUED_ROBOTS_DIRECTIVES and _AGENT.match(head):
                scope = head
                item = rest.strip()
                if not item:
                    continue
        pairs.append((scope, re.sub(r"\s+", " ", item)))
    hits = [
        (s, d)
        for s, d in pairs
        if d in AI_DIRECTIVES and (s is None or user_agents is None or s in user_agents)
    ]
    if hits:
        s, d = hits[0]
        return Verdict(X_ROBOTS_TAG, True, detail=f"{s}: {d}" if s else d), pairs
    if not _ROBOTS_CHARS.fullmatch(value):
        bad = next(c for c in value if not _ROBOTS_CHARS.fullmatch(c))
        why = _not_ascii(bad) or f"{bad!r} is not in the robots grammar"
        return Verdict(X_ROBOTS_TAG, True, True, f"malformed ({why})"), pairs
    return Verdict(X_ROBOTS_TAG, False), pairs


def parse_tdm_reservation(value: str) -> Verdict:
    """``1`` reserved, ``0`` not; repeated values combined (any ``1`` reserves); else malformed."""
    values = [v.strip() for v in value.split(",")]
    if not values or any(v not in ("0", "1") for v in values):
        shown = value if len(value) <= 40 else value[:40] + "…"
        return Verdict(TDM_RESERVATION, True, True, f"malformed ({shown!r} is not 0 or 1)")
    if "1" in values:
        return Verdict(TDM_RESERVATION, True, detail="1")
    return Verdict(TDM_RESERVATION, False)


def parse_content_usage(value: str) -> Verdict:
    """The verdict of an aipref ``Content-Usage`` Dictionary (module docstring): any
    covering label saying ``n`` reserves; else a covering label that is not ``y``/``n`` is
    malformed; else a ``y`` allows. The detail names :data:`CONTENT_USAGE_VOCABULARY`."""
    vocab = f"({CONTENT_USAGE_VOCABULARY})"
    try:
        members = parse_sf_dictionary(value)
    except SFParseError as exc:
        return Verdict(CONTENT_USAGE, True, True, f"malformed ({exc}) {vocab}")
    said: dict[str, list[str]] = {"y": [], "n": []}
    bad: list[str] = []
    for label in COVERING_LABELS:
        for member in members.get(label, ()):
            preference = _preference(member)
            if preference is None:
                bad.append(f"{label} is {_shown(member)}, not y or n")
            elif f"{label}={preference}" not in said[preference]:
                said[preference].append(f"{label}={preference}")
    if said["n"]:
        conflict = f" over {', '.join(said['y'])}" if said["y"] else ""
        return Verdict(CONTENT_USAGE, True, detail=f"{', '.join(said['n'])}{conflict} {vocab}")
    if bad:
        more = f"; {len(bad) - 3} more" if len(bad) > 3 else ""  # bounded for skip_audit
        return Verdict(CONTENT_USAGE, True, True, f"malformed ({'; '.join(bad[:3])}{more}) {vocab}")
    if said["y"]:
        return Verdict(CONTENT_USAGE, False, detail=f"{', '.join(said['y'])} {vocab}")
    return Verdict(CONTENT_USAGE, False)


def _preference(member: http_sfv.Item | http_sfv.InnerList) -> str | None:
    """``y``/``n`` for the Token ``y``/``n`` (parameters ignored, as the draft says)."""
    if isinstance(member, http_sfv.Item) and isinstance(member.value, http_sfv.Token):
        return str(member.value) if member.value in ("y", "n") else None
    return None


def _shown(member: http_sfv.Item | http_sfv.InnerList) -> str:
    try:
        text = str(member)
    except ValueError:  # an empty inner list's serialisation is fine; anything else odd
        text = type(member).__name__
    return quote_bounded(text, 40)


# --------------------------------------------------------------------------- RFC 9651


class SFParseError(ValueError):
    """A structured field that does not parse (RFC 9651: the whole field is invalid)."""


class _Members(http_sfv.Dictionary):
    """http-sfv's Dictionary, also keeping every value a repeated key had: RFC 9651 keeps
    only the last, so ``train-ai=n, train-ai=y`` (two conflicting header lines combined)
    would read as a plain ``y``. http-sfv's parser stores each member through
    ``__setitem__`` (http-sfv 0.9.9; the conformance test pins that this still holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.every: dict[str, list[http_sfv.Item | http_sfv.InnerList]] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.every.setdefault(key, []).append(self.data[key])


def parse_sf_dictionary(text: str) -> dict[str, list[http_sfv.Item | http_sfv.InnerList]]:
    """An RFC 9651 Dictionary, parsed by ``http-sfv``: key -> every member given for it, in
    order (the last is RFC 9651's value), keys in first-seen order. Raises
    :class:`SFParseError` for anything the parser rejects, and for non-ASCII text (the
    field is bytes; a header is matched after :func:`normalise_value`)."""
    try:
        data = text.encode("ascii")
    except UnicodeEncodeError as exc:
        raise SFParseError(f"U+{ord(text[exc.start]):04X} is not ASCII") from None
    if not data.lstrip(b" "):
        return {}  # RFC 9651 4.2.2: an empty Dictionary (http-sfv 0.9.9 rejects it)
    members = _Members()
    try:
        members.parse(data)
    except ValueError as exc:
        why = exc.__cause__ if exc.__cause__ is not None else exc
        raise SFParseError((str(why) or type(why).__name__)[:120]) from None  # a key can be long
    if _SFV_GAPS.search(text) and any(
        isinstance(v, Decimal | bytes) for v in _bare_values(members.every)
    ):
        raise SFParseError("a decimal or byte sequence that RFC 9651 rejects")
    return members.every


# Text RFC 9651 rejects that http-sfv 0.9.9 accepts (a decimal with no fractional digit,
# "1."; "=" inside a byte sequence's base64): found by the conformance cases. Refused only
# when the field holds such a value, so a token or string with these characters is not.
_SFV_GAPS = re.compile(r"[0-9]\.(?![0-9])|:[A-Za-z0-9+/]*=+[A-Za-z0-9+/]")


def _bare_values(members: Mapping[str, list[http_sfv.Item | http_sfv.InnerList]]) -> Iterable[Any]:
    """Every bare value of a parsed Dictionary: members, inner-list items, parameters."""
    for every in members.values():
        for member in every:
            items = list(member) if isinstance(member, http_sfv.InnerList) else [member]
            yield from member.params.values()
            for item in items:
                yield item.value
                yield from item.params.values()


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class SourceRule:
    """Which signals one source honours, and what a malformed one means."""

    honour: frozenset[str] = frozenset(SIGNALS)
    malformed: str = MALFORMED_RESERVES  # "reserved" (fail closed) | "ignore"
    user_agents: frozenset[str] | None = None  # scoped X-Robots-Tag agents; None: all

    def __post_init__(self) -> None:
        object.__setattr__(self, "honour", frozenset(self.honour))
        bad = sorted(set(self.honour) - set(SIGNALS))
        if bad:
            raise UsagePolicyError(f"unknown signal(s) {bad}: signals are {list(SIGNALS)}")
        if self.malformed not in (MALFORMED_RESERVES, MALFORMED_IGNORED):
            raise UsagePolicyError(
                f"malformed must be {MALFORMED_RESERVES!r} or {MALFORMED_IGNORED!r}, "
                f"got {self.malformed!r}"
            )
        if self.user_agents is not None:
            agents = frozenset(str(a).strip().lower() for a in self.user_agents)
            if any(not _AGENT.match(a) for a in agents):
                raise UsagePolicyError(f"user_agents must be agent tokens, got {sorted(agents)}")
            object.__setattr__(self, "user_agents", agents)

    def as_dict(self) -> dict[str, Any]:
        return {
            "honour": sorted(self.honour),
            "malformed": self.malformed,
            "user_agents": None if self.user_agents is None else sorted(self.user_agents),
        }


_RULE_KEYS = {"honour", "honor", "malformed", "user_agents"}
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]+")


def _rule(raw: Any, base: SourceRule, where: str) -> SourceRule:
    if not isinstance(raw, Mapping):
        raise UsagePolicyError(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _RULE_KEYS)
    if unknown:
        raise UsagePolicyError(f"{where}: unknown key(s) {unknown}; allowed {sorted(_RULE_KEYS)}")
    if "honour" in raw and "honor" in raw:
        raise UsagePolicyError(f"{where}: give 'honour' or 'honor', not both")
    honour = raw.get("honour", raw.get("honor", base.honour))
    if isinstance(honour, str) or not isinstance(honour, Iterable):
        raise UsagePolicyError(f"{where}.honour must be a list of signals")
    agents = raw.get("user_agents", base.user_agents)
    if agents is not None and (isinstance(agents, str) or not isinstance(agents, Iterable)):
        raise UsagePolicyError(f"{where}.user_agents must be a list or null")
    return SourceRule(
        honour=frozenset(str(h).lower() for h in honour),
        malformed=raw.get("malformed", base.malformed),
        user_agents=None if agents is None else frozenset(agents),
    )


@dataclass(frozen=True)
class UsagePolicy:
    """Per-source rules (keyed by the partition key's source part), and the default."""

    default: SourceRule = field(default_factory=SourceRule)
    sources: tuple[tuple[str, SourceRule], ...] = ()

    @classmethod
    def from_mapping(cls, data: Any) -> UsagePolicy:
        """From the policy file's object: ``{"default": rule, "sources": {name: rule}}``;
        a source's rule inherits what it does not say from the default."""
        if not isinstance(data, Mapping):
            raise UsagePolicyError("the usage policy must be a JSON object")
        unknown = sorted(set(data) - {"default", "sources", "version"})
        if unknown:
            raise UsagePolicyError(f"unknown key(s) {unknown}; allowed default, sources, version")
        if data.get("version", 1) != 1:
            raise UsagePolicyError(f"usage policy version {data.get('version')!r} is not 1")
        default = _rule(data.get("default", {}), SourceRule(), "default")
        raw_sources = data.get("sources", {})
        if not isinstance(raw_sources, Mapping):
            raise UsagePolicyError("sources must be an object of source name -> rule")
        rules: dict[str, SourceRule] = {}
        for name, raw in raw_sources.items():
            key = _KEY_UNSAFE.sub("-", str(name))
            if key in rules:
                raise UsagePolicyError(f"two sources map to partition prefix {key!r}")
            rules[key] = _rule(raw, default, f"sources.{key}")
        return cls(default, tuple(sorted(rules.items())))

    @classmethod
    def from_json(cls, text: str | bytes) -> UsagePolicy:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise UsagePolicyError(f"usage policy is not valid JSON: {exc}") from None
        return cls.from_mapping(data)

    def rule_for_batch(self, batch: str) -> SourceRule:
        """The rule of a partition ``<source>.<chunk>``: its source's, else the default."""
        source = batch.split(".", 1)[0]
        return dict(self.sources).get(source, self.default)

    def as_dict(self) -> dict[str, Any]:
        return {
            "default": self.default.as_dict(),
            "sources": {k: r.as_dict() for k, r in self.sources},
            # How signals are read: part of the skip policy's fingerprint, so a change in
            # the vocabulary or the reading reruns skip_lists (skip_policy_sensor).
            "interpretation": {
                "version": INTERPRETATION_VERSION,
                "content_usage_vocabulary": CONTENT_USAGE_VOCABULARY,
                "content_usage_covering": sorted(COVERING_LABELS),
            },
        }


def verdicts(stored: str | None, rule: SourceRule) -> list[Verdict]:
    """Every verdict of the signals a sample carries, honoured or not (for the audit)."""
    headers, defects = load_signals(stored)
    out: list[Verdict] = []
    for name in SIGNALS:
        if name in defects:
            out.append(Verdict(name, True, True, f"malformed ({defects[name]})"))
        elif name in headers:
            value = normalise_value(headers[name])
            why = _not_ascii(value)
            if why is not None:
                out.append(Verdict(name, True, True, f"malformed ({why})"))
            elif name == X_ROBOTS_TAG:
                out.append(parse_x_robots_tag(value, rule.user_agents)[0])
            elif name == TDM_RESERVATION:
                v = parse_tdm_reservation(value)
                if v.reserved and not v.malformed and headers.get(TDM_POLICY):
                    # Where a licence may be offered: named, never fetched or assumed granted.
                    policy = quote_bounded(headers[TDM_POLICY], 200)
                    v = Verdict(v.signal, True, detail=f"{v.detail} (tdm-policy {policy})")
                out.append(v)
            else:
                out.append(parse_content_usage(value))
            if value != headers[name] and not out[-1].malformed and out[-1].reserved:
                v = out[-1]  # say so: the raw value shown next to it reads differently
                out[-1] = Verdict(v.signal, True, detail=f"{v.detail} (after NFKC normalisation)")
    if "headers" in defects:  # a header map that could not be read may hold any signal
        out.append(Verdict("headers", True, True, f"malformed ({defects['headers']})"))
    return out


def reservations(stored: str | None, rule: SourceRule) -> tuple[str, ...]:
    """The honoured signals that reserve this sample, described; empty: not reserved.

    A malformed signal reserves unless ``rule.malformed == "ignore"``; an unreadable header
    map counts as malformed for every honoured signal (it may have held any of them)."""
    out = []
    for v in verdicts(stored, rule):
        honoured = bool(rule.honour) if v.signal == "headers" else v.signal in rule.honour
        if not honoured or not v.reserved:
            continue
        if v.malformed and rule.malformed == MALFORMED_IGNORED:
            continue
        out.append(v.describe())
    return tuple(out)
