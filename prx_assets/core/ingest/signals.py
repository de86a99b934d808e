"""Machine-readable opt-out signals: HTTP response headers captured at download time.

Pure functions, no I/O. Ingest records the raw headers a manifest row or a sidecar carries
(:func:`capture_signals`: bounded, sanitised, canonical JSON in ``images.usage_signals``); the
skip policy interprets them (:func:`reservations`) under the per-source :class:`UsagePolicy`.
Why split: the interpretation (grammar, which signals a source honours) can change without
re-reading a landing file; switching a source's policy reruns ``skip_lists`` only.

The signals and their grammar:

- ``X-Robots-Tag`` (Google/Bing robots directives, also the ``noai``/``noimageai`` de-facto
  extension img2dataset honours): comma-separated directives, case-insensitive; an item
  ``<agent>: <directive>`` scopes it, and the directives after it, to that user agent until
  the next scope. Directives that carry a value (``max-snippet: 20``, ``unavailable_after:
  <date>``) are no scopes. ``noai`` or ``noimageai`` reserve the image when unscoped, or
  scoped to an agent the source honours (:attr:`SourceRule.user_agents`; ``None``: every
  agent, because who downloaded a file is not recorded and a reservation addressed to any
  crawler is a reservation of the work).
- TDMRep ``tdm-reservation`` (W3C TDMRep): ``1`` = text-and-data-mining rights reserved,
  ``0`` = not reserved; anything else is malformed. ``tdm-policy`` (a URL to the licence
  offer) is recorded and shown, not fetched: an offer is not a licence, so ``1`` with a
  policy is still reserved.
- IETF aipref ``Content-Usage``: an RFC 9651 structured-field Dictionary of usage
  categories to ``y``/``n``. Unknown keys are ignored; the most specific category that
  covers training a generative image model decides (``train-genai``, else ``train-ai``,
  else ``bots``, i.e. automated processing); ``n`` reserves. A header that does not parse
  as a Dictionary, or a known key whose value is not the token ``y``/``n``, is malformed.

Fail closed: a malformed signal (unparseable, holding control characters, or cut at the
size bound so its end is unknown) reserves the image, unless the source's rule says
``malformed: "ignore"``; the audit names it as malformed either way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

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
# aipref categories covering generative image-model training, most specific first.
CONTENT_USAGE_CATEGORIES: tuple[str, ...] = ("train-genai", "train-ai", "bots")
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


def _as_text(value: Any) -> str:
    """A header value as text: repeated header lines (a list) combined with ``, ``
    (RFC 9110 5.3); anything else JSON, so a wrong type reads as malformed, not absent."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, list | tuple) and all(isinstance(v, str | bytes) for v in value):
        return ", ".join(_as_text(v) for v in value)
    return json.dumps(value, sort_keys=True, default=str)


def capture_signals(fields: Mapping[str, Any]) -> str | None:
    r"""The usage signals of one sample as canonical JSON, or None when it carries none.

    ``fields``: a manifest row or sidecar object (keys as given). Header columns/keys
    (:func:`header_name`) and header maps (:data:`HEADER_MAP_FIELDS`, a JSON object or its
    text) are both read; a header given twice is combined; an empty value is no header (a
    CSV cell cannot be null). The stored form is
    ``{"headers": {name: value}, "defects": {name: why}}``: each value bounded to
    :data:`MAX_SIGNAL_CHARS` (the rest counted) with control characters as ``\\xNN``; a cut
    or a control character is a *defect*, which makes the signal malformed.
    """
    found: dict[str, list[str]] = {}
    defects: dict[str, str] = {}
    for key, value in fields.items():
        if value is None or not isinstance(key, str):
            continue
        if key.strip().lower() in HEADER_MAP_FIELDS:
            _read_header_map(value, found, defects)
            continue
        name = header_name(key)
        text = _as_text(value) if name is not None else ""
        if text.strip(" \t"):  # an empty cell (CSV has no null) is no header
            found.setdefault(name, []).append(text)
    if not found and not defects:
        return None
    headers: dict[str, str] = {}
    for name in CAPTURED_HEADERS:
        if name not in found:
            continue
        text, defect = sanitise_header(", ".join(found[name]))
        headers[name] = text
        if defect:
            defects[name] = defect
    record = {"headers": headers, "defects": dict(sorted(defects.items()))}
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _read_header_map(value: Any, found: dict[str, list[str]], defects: dict[str, str]) -> None:
    if isinstance(value, str | bytes | bytearray):
        text = _as_text(value)
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
        name = header_name(str(key))
        text = _as_text(item) if name is not None and item is not None else ""
        if text.strip(" \t"):
            found.setdefault(name, []).append(text)


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
    """The verdict of an aipref ``Content-Usage`` Dictionary (module docstring)."""
    try:
        members = parse_sf_dictionary(value)
    except SFParseError as exc:
        return Verdict(CONTENT_USAGE, True, True, f"malformed ({exc})")
    for category in CONTENT_USAGE_CATEGORIES:
        if category not in members:
            continue
        item = members[category]
        if not isinstance(item, Token) or item not in ("y", "n"):
            return Verdict(
                CONTENT_USAGE, True, True, f"malformed ({category} is {item!r}, not y or n)"
            )
        if item == "n":
            return Verdict(CONTENT_USAGE, True, detail=f"{category}=n")
        return Verdict(CONTENT_USAGE, False, detail=f"{category}=y")
    return Verdict(CONTENT_USAGE, False)


# --------------------------------------------------------------------------- RFC 9651


class SFParseError(ValueError):
    """A structured field that does not parse (RFC 9651: the whole field is invalid)."""


class Token(str):
    """An sf-token (distinct from an sf-string, which aipref does not accept for y/n)."""

    __slots__ = ()


_KEY_FIRST = set("abcdefghijklmnopqrstuvwxyz*")
_KEY_CHARS = _KEY_FIRST | set("0123456789_-.")
_TCHAR = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_TOKEN_CHARS = _TCHAR | set(":/")
_B64 = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


class _SF:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def fail(self, what: str) -> SFParseError:
        return SFParseError(f"{what} at character {self.i}")

    def skip(self, chars: str) -> None:
        while self.peek() and self.peek() in chars:
            self.i += 1

    def key(self) -> str:
        if self.peek() not in _KEY_FIRST or not self.peek():
            raise self.fail("expected a lower-case key")
        start = self.i
        while self.peek() and self.peek() in _KEY_CHARS:
            self.i += 1
        return self.s[start : self.i]

    def bare_item(self) -> Any:
        c = self.peek()
        if c == "-" or c.isdigit():
            return self.number()
        if c == '"':
            return self.string()
        if c == ":":
            return self.byte_sequence()
        if c == "?":
            self.i += 1
            if self.peek() not in ("0", "1") or not self.peek():
                raise self.fail("expected ?0 or ?1")
            self.i += 1
            return self.s[self.i - 1] == "1"
        if c == "@":
            self.i += 1
            return ("date", self.number())
        if c == "%":
            self.i += 1
            return ("display", self.string())
        if c and (c.isalpha() and c.isascii() or c == "*"):
            start = self.i
            while self.peek() and self.peek() in _TOKEN_CHARS:
                self.i += 1
            return Token(self.s[start : self.i])
        raise self.fail("expected an item")

    def number(self) -> int | float:
        m = re.compile(r"-?\d{1,15}(\.\d{1,3})?").match(self.s, self.i)
        if m is None or (m.group(1) and len(m.group().lstrip("-").split(".")[0]) > 12):
            raise self.fail("bad number")
        self.i = m.end()
        return float(m.group()) if m.group(1) else int(m.group())

    def string(self) -> str:
        self.i += 1
        out = []
        while True:
            c = self.peek()
            if not c:
                raise self.fail("unterminated string")
            self.i += 1
            if c == "\\":
                nxt = self.peek()
                if nxt not in ('"', "\\") or not nxt:
                    raise self.fail("bad escape")
                out.append(nxt)
                self.i += 1
            elif c == '"':
                return "".join(out)
            elif not (" " <= c <= "~"):
                raise self.fail("non-ASCII or control character in a string")
            else:
                out.append(c)

    def byte_sequence(self) -> tuple[str, str]:
        end = self.s.find(":", self.i + 1)
        if end < 0 or not set(self.s[self.i + 1 : end]) <= _B64:
            raise self.fail("bad byte sequence")
        raw = self.s[self.i + 1 : end]
        self.i = end + 1
        return ("bytes", raw)

    def parameters(self) -> None:
        while self.peek() == ";":
            self.i += 1
            self.skip(" ")
            self.key()
            if self.peek() == "=":
                self.i += 1
                self.bare_item()

    def member(self) -> Any:
        if self.peek() == "(":
            self.i += 1
            items = []
            while True:
                self.skip(" ")
                if self.peek() == ")":
                    self.i += 1
                    self.parameters()
                    return tuple(items)
                items.append(self.bare_item())
                self.parameters()
                if self.peek() not in (" ", ")"):
                    raise self.fail("bad inner list")
        item = self.bare_item()
        self.parameters()
        return item


def parse_sf_dictionary(text: str) -> dict[str, Any]:
    """An RFC 9651 Dictionary: key -> bare item (a Token for tokens; True for a bare key;
    a tuple for an inner list). Parameters are validated and dropped; a duplicated key keeps
    its last value. Raises :class:`SFParseError` for anything the RFC rejects."""
    p = _SF(text.strip(" "))
    out: dict[str, Any] = {}
    if not p.s:
        return out
    while True:
        key = p.key()
        if p.peek() == "=":
            p.i += 1
            out[key] = p.member()
        else:
            p.parameters()
            out[key] = True
        p.skip(" \t")
        if not p.peek():
            return out
        if p.peek() != ",":
            raise p.fail("expected ','")
        p.i += 1
        p.skip(" \t")
        if not p.peek():
            raise p.fail("trailing ','")


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
        }


def verdicts(stored: str | None, rule: SourceRule) -> list[Verdict]:
    """Every verdict of the signals a sample carries, honoured or not (for the audit)."""
    headers, defects = load_signals(stored)
    out: list[Verdict] = []
    for name in SIGNALS:
        if name in defects:
            out.append(Verdict(name, True, True, f"malformed ({defects[name]})"))
        elif name in headers:
            value = headers[name]
            if name == X_ROBOTS_TAG:
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
