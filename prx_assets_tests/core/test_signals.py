"""Opt-out signals at ingest: each header's grammar with real-world variants, capture from
CSV, parquet, folder and WebDataset sidecars (bounded, sanitised), the per-source policy, and
the skip policy's ``reserved`` reason (cluster-wide, fingerprinted)."""

import csv
import decimal
import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_assets.core.ingest.signals import (
    CONTENT_USAGE_CATEGORIES,
    CONTENT_USAGE_VOCABULARY,
    MAX_SIGNAL_CHARS,
    SFParseError,
    SourceRule,
    UsagePolicy,
    UsagePolicyError,
    capture_signals,
    load_signals,
    parse_content_usage,
    parse_sf_dictionary,
    parse_tdm_reservation,
    parse_x_robots_tag,
    reservations,
)
from prx_assets.core.ingest.sources import BatchRef, iter_candidates
from prx_assets.core.markdown import md_code
from prx_assets.core.skiplists.policy import (
    R_DUPLICATE,
    R_RESERVED,
    Copy,
    SkipPolicy,
    resolve_cluster,
)
from prx_assets.demo.jpegs import solid_jpeg

ALL = frozenset({"x-robots-tag", "tdm-reservation", "content-usage"})


@pytest.mark.parametrize(
    ("value", "agents", "reserved"),
    [
        ("noai", None, True),
        ("NoAI", None, True),
        ("  noimageai  ", None, True),
        ("noindex, NOAI, nofollow", None, True),
        ("noindex,nofollow", None, False),
        ("noindex", None, False),
        ("none", None, False),
        ("otherbot: noai", None, True),  # scoped to a bot: honoured for every bot by default
        ("otherbot: noai", frozenset({"prxbot"}), False),  # ... not when we say who we are
        ("PRXBot: noimageai", frozenset({"prxbot"}), True),
        ("googlebot: noindex, otherbot: noai, nofollow", frozenset({"googlebot"}), False),
        ("otherbot: noindex, googlebot: noai", frozenset({"googlebot"}), True),
        ("otherbot: noindex, noai", frozenset({"googlebot"}), False),  # noai still otherbot's
        ("max-snippet: 20, noai", frozenset({"googlebot"}), True),  # a value, not a scope
        ("unavailable_after: Wed, 21 Oct 2015 07:28:00 GMT, noai", frozenset(), True),
        ("unavailable_after: Wed, 21 Oct 2015 07:28:00 GMT", None, False),
        ("noaix, xnoai, no ai", None, False),  # not the directive
        ("", None, False),
    ],
)
def test_x_robots_tag_grammar(value, agents, reserved):
    verdict, _ = parse_x_robots_tag(value, agents)
    assert verdict.reserved is reserved
    assert not verdict.malformed


def test_x_robots_tag_names_the_scope_that_reserved():
    verdict, pairs = parse_x_robots_tag("googlebot: noindex, OtherBot: NoAI")
    assert verdict.detail == "otherbot: noai"
    assert pairs == [("googlebot", "noindex"), ("otherbot", "noai")]


@pytest.mark.parametrize(
    ("value", "reserved", "malformed"),
    [
        ("1", True, False),
        (" 1\t", True, False),
        ("0", False, False),
        ("0, 0", False, False),
        ("0, 1", True, False),  # repeated header lines: any reservation reserves
        ("yes", True, True),
        ("true", True, True),
        ("2", True, True),
        ("", True, True),
        ("1; policy", True, True),
    ],
)
def test_tdm_reservation_grammar(value, reserved, malformed):
    verdict = parse_tdm_reservation(value)
    assert (verdict.reserved, verdict.malformed) == (reserved, malformed)


VOCAB = f" ({CONTENT_USAGE_VOCABULARY})"


@pytest.mark.parametrize(
    ("value", "reserved", "malformed", "detail"),
    [
        ("train-ai=n", True, False, "train-ai=n"),
        ("train-ai=y", False, False, "train-ai=y"),
        ("train-ai=n, search=y", True, False, "train-ai=n"),
        ("search=y,train-ai=n", True, False, "train-ai=n"),  # no space after the comma
        ("search=n", False, False, ""),  # search does not cover training a generator
        ("train-ai=y, search=n", False, False, "train-ai=y"),
        ("search=n, foo-bar=n", False, False, ""),  # unknown keys ignored
        ("train-ai=n;exp=1, x=(a b);q=0.5", True, False, "train-ai=n"),  # params, inner list
        ("train-ai=y;allow=n", False, False, "train-ai=y"),  # parameters carry no meaning
        ("", False, False, ""),
        ("Train-AI=n", True, True, None),  # keys are lower case: the field is invalid
        ('train-ai="n"', True, True, None),  # a string is not the token n
        ("train-ai", True, True, None),  # a bare key is ?1, not y/n
        ("train-ai=no", True, True, None),
        ("train-ai=(n)", True, True, None),  # an inner list is not the token n
        ("train-ai=n,", True, True, None),  # trailing comma
        ("train-ai=n search=y", True, True, None),
        ("train-ai==n", True, True, None),
        ('train-ai=y, x="unterminated', True, True, None),  # the whole field is invalid
        # Labels of earlier aipref revisions that covered this training still reserve.
        ("train-genai=n", True, False, "train-genai=n"),
        ("bots=n", True, False, "bots=n"),
        ("ai-use=n, ai-output=n, inference=n", False, False, ""),  # use at inference
        ("train-genai=y", False, False, "train-genai=y"),
        # Fail closed where labels conflict: any covering n reserves, whatever the order.
        ("train-ai=y, train-genai=n", True, False, "train-genai=n over train-ai=y"),
        ("bots=n, train-ai=y", True, False, "bots=n over train-ai=y"),
        ("train-ai=y, train-ai=n", True, False, "train-ai=n over train-ai=y"),
        ("train-ai=n, bots=?1", True, False, "train-ai=n"),  # n beats a malformed sibling
        ("train-ai=y, bots=?1", True, True, None),
    ],
)
def test_content_usage_grammar(value, reserved, malformed, detail):
    verdict = parse_content_usage(value)
    assert (verdict.reserved, verdict.malformed) == (reserved, malformed)
    if detail is None:
        assert verdict.detail.startswith("malformed (")
    else:
        assert verdict.detail == (detail + VOCAB if detail else "")
    if verdict.detail:  # which vocabulary revision decided is named, for skip_audit
        assert verdict.detail.endswith(VOCAB)


def test_content_usage_follows_the_current_aipref_vocabulary():
    """Finding 1 of issue 30: the code followed older drafts (train-genai > train-ai > bots,
    the most specific deciding), so ``train-ai=n, train-genai=y`` trained. The current draft
    (vocab-07) has no hierarchy; train-ai covers training a generative model."""
    assert CONTENT_USAGE_VOCABULARY == "draft-ietf-aipref-vocab-07"
    assert CONTENT_USAGE_CATEGORIES["train-ai"].covers_training
    assert not CONTENT_USAGE_CATEGORIES["search"].covers_training
    verdict = parse_content_usage("train-ai=n, train-genai=y")
    assert (verdict.reserved, verdict.malformed) == (True, False)
    assert verdict.detail == "train-ai=n over train-genai=y" + VOCAB
    stored = capture_signals({"content-usage": "train-ai=n, train-genai=y"})
    assert reservations(stored, SourceRule()) == (
        "content-usage: train-ai=n over train-genai=y" + VOCAB,
    )
    # skip_audit.reserved_signals names the revision it was read under.
    out = resolve_cluster([_copy("web.000", "k", 1, stored)], SkipPolicy())[("web.000", "k")]
    assert R_RESERVED in out.reasons
    assert out.reserved_signals == ("k: content-usage: train-ai=n over train-genai=y" + VOCAB,)


def test_content_usage_vocabulary_is_in_the_skip_policy_fingerprint():
    interpretation = UsagePolicy().as_dict()["interpretation"]
    assert interpretation["content_usage_vocabulary"] == CONTENT_USAGE_VOCABULARY
    assert "train-ai" in interpretation["content_usage_covering"]
    assert "search" not in interpretation["content_usage_covering"]


def test_conflicting_duplicate_content_usage_fields_reserve():
    """Finding 2: two Content-Usage field lines (or a column and a header-map key) are one
    Dictionary; RFC 9651 keeps a repeated key's last value, so ``n`` then ``y`` trained."""
    for fields in (
        {"Content-Usage": ["train-ai=n", "train-ai=y"]},
        {"content_usage": "train-ai=n", "headers": {"Content-Usage": "train-ai=y"}},
    ):
        stored = capture_signals(fields)
        assert load_signals(stored)[0]["content-usage"] == "train-ai=n, train-ai=y"
        got = reservations(stored, SourceRule(malformed="ignore"))
        assert got == ("content-usage: train-ai=n over train-ai=y" + VOCAB,)


@pytest.mark.parametrize(
    ("fields", "expect"),
    [
        # Bytes that are not UTF-8 (a parquet binary column, a raw header capture).
        ({"x-robots-tag": b"\xff\xfenoai"}, "x-robots-tag: malformed (bytes that are not UTF-8)"),
        ({"content-usage": b"train-ai=\xff"}, "content-usage: malformed (bytes that are not"),
        # ... or the same, decoded with replacement characters before it reached us.
        ({"x-robots-tag": "\ufffd\ufffdnoai"}, "x-robots-tag: malformed (U+FFFD is not ASCII"),
        # A nested JSON value where header text belongs.
        ({"headers": {"X-Robots-Tag": {"value": "noai"}}}, "x-robots-tag: malformed (a JSON"),
        ({"headers": {"content-usage": ["train-ai=n", ["x"]]}}, "content-usage: malformed (a"),
        ({"x-robots-tag": True}, "x-robots-tag: malformed (a bool"),
        # Left after normalisation: a Cyrillic homoglyph, robots text that is JSON or markup.
        ({"x-robots-tag": "n\u043eai"}, "x-robots-tag: malformed (U+043E is not ASCII"),
        ({"x-robots-tag": '{"v": "noai"}'}, "x-robots-tag: malformed ('{' is not in the robots"),
        ({"x-robots-tag": "noindex; noai"}, "x-robots-tag: malformed (';' is not in the robots"),
    ],
)
def test_header_values_that_do_not_parse_are_malformed_not_absent(fields, expect):
    """Finding 2: these were neither honoured nor flagged malformed (so they trained)."""
    stored = capture_signals(fields)
    got = reservations(stored, SourceRule())
    assert len(got) == 1 and got[0].startswith(expect), got
    assert reservations(stored, SourceRule(malformed="ignore")) == ()  # the source's say


@pytest.mark.parametrize(
    ("fields", "expect"),
    [
        ({"x-robots-tag": "no\u200bai"}, "x-robots-tag: noai"),  # zero-width space
        ({"x-robots-tag": "\ufeffnoimageai"}, "x-robots-tag: noimageai"),  # a BOM
        ({"x-robots-tag": "\uff4e\uff4f\uff41\uff49"}, "x-robots-tag: noai"),  # full-width
        ({"x-robots-tag": "otherbot\uff1a noai"}, "x-robots-tag: otherbot: noai"),
        ({"tdm-reservation": "\uff11"}, "tdm-reservation: 1"),
        ({"content-usage": "train\u2011ai=n"}, None),  # a non-breaking hyphen stays non-ASCII
        ({"content-usage": "\uff54rain-ai=\u200bn"}, "content-usage: train-ai=n" + VOCAB),
    ],
)
def test_invisible_and_full_width_characters_do_not_hide_a_reservation(fields, expect):
    """Finding 2: NFKC and format characters are normalised away before matching, and the
    audit says it was normalised; what NFKC leaves non-ASCII is malformed."""
    got = reservations(capture_signals(fields), SourceRule())
    if expect is None:
        assert len(got) == 1 and "malformed (" in got[0]
    else:
        assert got == (expect + " (after NFKC normalisation)",)


SFV_CASES = Path(__file__).parent / "sfv_cases"
# http-sfv 0.9.9 (2024) accepts two things the current suite (2026) rejects ("1.", "=" in
# a byte sequence); parse_sf_dictionary refuses them itself (_SFV_GAPS), so none is left.
SFV_KNOWN_GAPS: set[tuple[str, str]] = set()


def _sfv_json(parsed):
    return json.loads(
        json.dumps([[k, v[-1].to_json()] for k, v in parsed.items()]),
        parse_float=decimal.Decimal,
    )


def _sfv_agrees(case) -> bool:
    """Whether parse_sf_dictionary agrees with one conformance case. Item cases are read as
    a member's value (``k=<item>``); an item that fails only because it holds a comma is a
    two-member Dictionary then, so those must_fail cases say nothing about us."""
    raw = ", ".join(case["raw"])
    if case["header_type"] == "item":
        if case.get("must_fail") and "," in raw:
            return True
        raw = "k=" + (raw if case.get("must_fail") else raw.strip(" "))
        expected = [["k", case.get("expected")]]
    else:
        expected = case.get("expected")
    try:
        parsed = parse_sf_dictionary(raw)
    except SFParseError:  # "can_fail": the suite lets a parser refuse it (we then reserve)
        return bool(case.get("must_fail") or case.get("can_fail"))
    return not case.get("must_fail") and _sfv_json(parsed) == expected


def test_sf_dictionary_parsing_agrees_with_the_conformance_cases():
    """Finding 3: the parser is http-sfv's, checked against httpwg/structured-field-tests
    (sfv_cases/README.md): a must_fail case is malformed, any other gives the expected
    members."""
    files = sorted(SFV_CASES.glob("*.json"))
    assert len(files) == 11
    checked = 0
    disagree = set()
    for path in files:
        for case in json.loads(path.read_text(), parse_float=decimal.Decimal):
            if case["header_type"] == "list":
                continue
            checked += 1
            if not _sfv_agrees(case):
                disagree.add((path.name, case["name"]))
    assert checked > 900
    assert disagree == SFV_KNOWN_GAPS
    # A repeated key keeps every value, in order (the last is RFC 9651's).
    for gap in ("train-ai=y, x=1.", "train-ai=y, x=:a=GVsbG8=:", "train-ai=y;q=:=aGk=:"):
        assert parse_content_usage(gap).malformed  # http-sfv alone reads train-ai=y
    members = parse_sf_dictionary("a=1, b, a=?0;p")
    assert [m.value for m in members["a"]] == [1, False] and members["b"][0].value is True
    assert dict(members["a"][1].params) == {"p": True}


# --------------------------------------------------------------------------- capture


def test_capture_combines_repeated_and_mapped_headers_case_insensitively():
    stored = capture_signals(
        {
            "X-Robots-Tag": ["noindex", "otherbot: noai"],
            "headers": json.dumps({"TDM-Reservation": "1", "tdm-policy": "https://p.example/p"}),
            "url": "https://x.example/a.jpg",
        }
    )
    headers, defects = load_signals(stored)
    assert headers == {
        "x-robots-tag": "noindex, otherbot: noai",
        "tdm-reservation": "1",
        "tdm-policy": "https://p.example/p",
    }
    assert defects == {}
    assert capture_signals({"url": "u", "alt_text": "a"}) is None


def test_hostile_values_are_bounded_made_visible_and_fail_closed():
    huge = "noindex, " * 2000 + "noai"  # the reservation sits past the bound
    injected = "noindex\r\nSet-Cookie: x=1\x00<script>"
    stored = capture_signals({"x_robots_tag": huge, "content_usage": injected})
    headers, defects = load_signals(stored)
    assert len(headers["x-robots-tag"]) < MAX_SIGNAL_CHARS + 40
    assert "cut at" in defects["x-robots-tag"]
    assert "\r" not in headers["content-usage"] and "\x00" not in headers["content-usage"]
    assert "\\x0d" in headers["content-usage"] and "control" in defects["content-usage"]
    rule = SourceRule()
    assert any(r.startswith("x-robots-tag: malformed") for r in reservations(stored, rule))
    assert reservations(stored, SourceRule(malformed="ignore")) == ()  # noai was cut away
    # Shown in Markdown only as a code span, one line, bounded.
    shown = md_code(headers["content-usage"])
    assert "\n" not in shown and "<script>" in shown and shown.startswith("`")


def test_an_unreadable_header_map_reserves_unless_malformed_is_ignored():
    stored = capture_signals({"headers": "{not json"})
    assert reservations(stored, SourceRule()) == (
        "headers: malformed (header map is not valid JSON)",
    )
    assert reservations(stored, SourceRule(malformed="ignore")) == ()
    assert reservations(stored, SourceRule(honour=frozenset())) == ()


def test_a_stored_value_that_is_not_ours_fails_closed():
    assert reservations('{"oops": 1}', SourceRule())  # every signal malformed -> reserved


def _signals_by_path(ref: BatchRef) -> dict[str, str | None]:
    return {c.path: c.usage_signals for c in iter_candidates(ref) if c.data is not None}


ROWS = [
    ("a.jpg", {"x_robots_tag": "noai"}),
    ("b.jpg", {"tdm-reservation": "1", "tdm-policy": "https://p.example/policy.json"}),
    ("c.jpg", {"Content-Usage": "train-ai=n"}),
    ("d.jpg", {}),
]


def _reserved(signals: dict[str, str | None]) -> dict[str, tuple[str, ...]]:
    return {p: reservations(s, SourceRule()) for p, s in signals.items()}


def _expect(got: dict[str, tuple[str, ...]], prefix: str = "") -> None:
    assert got[f"{prefix}a.jpg"] == ("x-robots-tag: noai",)
    assert got[f"{prefix}b.jpg"] == (
        "tdm-reservation: 1 (tdm-policy 'https://p.example/policy.json')",
    )
    assert got[f"{prefix}c.jpg"] == ("content-usage: train-ai=n" + VOCAB,)
    assert got[f"{prefix}d.jpg"] == ()


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_signals_are_read_from_manifest_columns(tmp_path, fmt):
    src = tmp_path / "web"
    src.mkdir()
    columns = ["path", "alt_text", "X-Robots-Tag", "tdm-reservation", "tdm-policy"]
    columns.append("Content-Usage")
    rows = []
    for i, (name, sig) in enumerate(ROWS):
        (src / name).write_bytes(solid_jpeg((64, 64), (i, 40, 80)))
        rows.append(
            {c: sig.get(c, sig.get(c.lower().replace("-", "_"))) for c in columns[2:]}
            | {"path": name, "alt_text": "x"}
        )
    path = src / f"000.{fmt}"
    if fmt == "csv":
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, columns)
            w.writeheader()
            w.writerows({k: v or "" for k, v in r.items()} for r in rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    got = _signals_by_path(BatchRef("web.000", "web", "000", path, "manifest"))
    _expect(_reserved({k: v for k, v in got.items()}))
    assert got["d.jpg"] is None  # parquet nulls and CSV's empty cells are no header
    headers, _ = load_signals(got["b.jpg"])
    assert headers["tdm-policy"] == "https://p.example/policy.json"


def test_a_manifest_headers_column_holds_a_json_header_map(tmp_path):
    src = tmp_path / "web"
    src.mkdir()
    (src / "a.jpg").write_bytes(solid_jpeg((64, 64), (1, 40, 80)))
    table = pa.table({"path": ["a.jpg"], "headers": [json.dumps({"x-robots-tag": "noimageai"})]})
    pq.write_table(table, src / "000.parquet")
    got = _signals_by_path(BatchRef("web.000", "web", "000", src / "000.parquet", "manifest"))
    assert _reserved(got) == {"a.jpg": ("x-robots-tag: noimageai",)}


def test_signals_are_read_from_folder_sidecars(tmp_path):
    folder = tmp_path / "web" / "000"
    folder.mkdir(parents=True)
    for i, (name, sig) in enumerate(ROWS):
        stem = name.removesuffix(".jpg")
        (folder / name).write_bytes(solid_jpeg((64, 64), (i, 40, 80)))
        (folder / f"{stem}.json").write_text(json.dumps({"url": f"https://x/{name}", **sig}))
    (folder / "_SUCCESS").write_text("")
    _expect(_reserved(_signals_by_path(BatchRef("web.000", "web", "000", folder, "folder"))))


def test_signals_are_read_from_webdataset_json_sidecars(tmp_path):
    path = tmp_path / "web" / "000.tar"
    path.parent.mkdir()
    with tarfile.open(path, "w") as tar:
        for i, (name, sig) in enumerate(ROWS):
            stem = f"shard/{name.removesuffix('.jpg')}"
            meta = {"url": f"https://x/{name}", "headers": sig} if i % 2 else sig
            for member, data in (
                (f"{stem}.jpg", solid_jpeg((64, 64), (i, 40, 80))),
                (f"{stem}.json", json.dumps(meta)),
            ):
                raw = data if isinstance(data, bytes) else data.encode()
                info = tarfile.TarInfo(member)
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    got = _signals_by_path(BatchRef("web.000", "web", "000", path, "archive"))
    _expect(_reserved(got), prefix="shard/")


# --------------------------------------------------------------------------- policy


def test_policy_file_parsing_inherits_and_refuses_mistakes():
    policy = UsagePolicy.from_json(
        json.dumps(
            {
                "default": {"user_agents": ["PRXBot"]},
                "sources": {"laion": {"honour": ["tdm-reservation"], "malformed": "ignore"}},
            }
        )
    )
    laion = policy.rule_for_batch("laion.00001")
    assert laion.honour == {"tdm-reservation"} and laion.malformed == "ignore"
    assert laion.user_agents == {"prxbot"}  # inherited from the default
    assert policy.rule_for_batch("other.000").honour == ALL
    for bad in (
        {"sources": {"x": {"honour": ["x-robots"]}}},  # unknown signal
        {"sources": {"x": {"malformed": "allow"}}},
        {"default": {"honor": [], "honour": []}},
        {"sourcse": {}},  # a typo is an error, not the default
        {"sources": {"a.b": {}, "a-b": {}}},  # one partition prefix twice
        [],
    ):
        with pytest.raises(UsagePolicyError):
            UsagePolicy.from_mapping(bad)
    with pytest.raises(UsagePolicyError):
        UsagePolicy.from_json("{")


def _copy(batch: str, key: str, rank: int, signals: str | None = None) -> Copy:
    return Copy(
        batch=batch,
        key=key,
        cluster_id="c1",
        rank=(-rank, -rank, key, batch),
        label="visual",
        caption_usable=True,
        usage_signals=signals,
    )


def test_a_reserved_copy_excludes_every_copy_of_the_work_under_its_sources_rule():
    noai = capture_signals({"x-robots-tag": "noai"})
    copies = [_copy("web.000", "big", 10), _copy("laion.000", "small", 1, noai)]
    out = resolve_cluster(copies, SkipPolicy())
    for ref in (("web.000", "big"), ("laion.000", "small")):
        assert R_RESERVED in out[ref].reasons and R_DUPLICATE not in out[ref].reasons
        assert out[ref].reserved_via == ("small",)
        assert out[ref].reserved_signals == ("small: x-robots-tag: noai",)
    # laion does not honour X-Robots-Tag: the larger copy trains, the smaller is a duplicate.
    relaxed = SkipPolicy(
        usage=UsagePolicy(sources=(("laion", SourceRule(honour={"tdm-reservation"})),))
    )
    out = resolve_cluster(copies, relaxed)
    assert out[("web.000", "big")].reasons == ()
    assert out[("laion.000", "small")].reasons == (R_DUPLICATE,)
    assert relaxed.fingerprint() != SkipPolicy().fingerprint()
    assert relaxed.as_dict()["usage_signals"]["sources"]["laion"]["honour"] == ["tdm-reservation"]


def test_images_from_before_signal_capture_are_pending_not_unsignalled(tmp_path):
    import lance

    from prx_assets.core.ingest.runner import BatchIngest
    from prx_assets.core.ingest.signals import UNCAPTURED
    from prx_assets.core.ingest.tables import ensure_usage_signals_column
    from prx_assets.core.lab import Lab
    from prx_assets.core.skiplists.policy import R_PENDING, WAITS_FOR_SIGNALS
    from prx_assets.core.tables import IMAGES

    lab = Lab(tmp_path / "lab")
    old = pa.schema([f for f in IMAGES.schema if f.name != "usage_signals"])
    row = {"key": "k" * 64, "batch": "old.000", "path": "a.jpg", "image": b"x"}
    lance.write_dataset(pa.Table.from_pylist([row], schema=old), lab.uri(IMAGES.name))
    assert ensure_usage_signals_column(lab) is True
    assert ensure_usage_signals_column(lab) is False
    # A batch ingested now, next to the legacy row, records what its sidecars said.
    folder = tmp_path / "landing" / "web" / "000"
    folder.mkdir(parents=True)
    (folder / "a.jpg").write_bytes(solid_jpeg((64, 64), (3, 40, 80)))
    (folder / "a.json").write_text(json.dumps({"x-robots-tag": "noai"}))
    run = BatchIngest(BatchRef("web.000", "web", "000", folder, "folder"))
    lab.replace_partition(IMAGES, "web.000", run.image_batches())
    got = dict(
        zip(
            *(lab.read(IMAGES.name, ["batch", "usage_signals"]).column(c).to_pylist() for c in
              ("batch", "usage_signals")),
            strict=True,
        )
    )  # fmt: skip
    assert got["old.000"] == UNCAPTURED
    assert load_signals(got["web.000"])[0] == {"x-robots-tag": "noai"}
    # Unknown is never "no signal": pending until re-ingested, unless nothing is honoured.
    legacy = Copy("old.000", "k", None, None, "visual", True, usage_signals=UNCAPTURED)
    out = resolve_cluster([legacy], SkipPolicy())[legacy.ref]
    assert R_PENDING in out.reasons and WAITS_FOR_SIGNALS in out.pending_on
    honours_nothing = SkipPolicy(usage=UsagePolicy(default=SourceRule(honour=frozenset())))
    out = resolve_cluster([legacy], honours_nothing)[legacy.ref]
    assert WAITS_FOR_SIGNALS not in out.pending_on
