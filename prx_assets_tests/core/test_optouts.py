"""Opt-out lists: parsing each format and identifier kind, rejections, Lance resolution."""

import hashlib
import io
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_assets.core.lab import Lab
from prx_assets.core.skiplists.identifiers import (
    KIND_KEY,
    KIND_SOURCE_ID,
    KIND_URL,
    OptOutIdentifier,
    parse_identifier,
)
from prx_assets.core.skiplists.intake import list_row, opt_out_rows
from prx_assets.core.skiplists.matching import (
    match_filter,
    opted_out_keys,
    resolve_identifiers,
    sharded_batches,
)
from prx_assets.core.skiplists.optouts import (
    OptOutListError,
    discover_lists,
    file_sha256,
    is_candidate,
    make_list_id,
    parse_list_bytes,
    parse_list_file,
)
from prx_assets.core.tables import IMAGES, OPT_OUT_LISTS, OPT_OUTS
from prx_assets_tests.bounds import MIB, peak_rss_growth, sparse_file

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"
KEY_A = "a" * 64
KEY_B = "0123456789abcdef" * 4


def _err(data: bytes, name: str) -> OptOutListError:
    with pytest.raises(OptOutListError) as info:
        parse_list_bytes(data, name)
    return info.value


# --------------------------------------------------------------------------- identifiers


def test_identifier_kinds_are_detected_and_canonical():
    assert parse_identifier(KEY_B.upper()) == OptOutIdentifier(KIND_KEY, KEY_B)
    url = "https://example.org/a/b.jpg?x=1#frag"
    assert parse_identifier(f"  {url} ") == OptOutIdentifier(KIND_URL, url)
    assert parse_identifier("HTTP://Example.org/x").kind == KIND_URL  # scheme case-insensitive
    sid = parse_identifier("internal-studio:studio-astronaut-v00")
    assert sid == OptOutIdentifier(
        KIND_SOURCE_ID,
        "internal-studio:studio-astronaut-v00",
        "internal-studio",
        "studio-astronaut-v00",
    )
    # The id keeps any later colon; the source is what precedes the first.
    assert parse_identifier("flickr:123:456").source_id == "123:456"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("a" * 63, "not a content key"),
        ("g" * 64, "not a content key"),
        ("hello world", "not a content key"),
        ("https:nohost", "http(s) URL with a host"),
        ("http://", "http(s) URL with a host"),
        ("https://exa mple.org/x", "whitespace"),
        ("ftp://example.org/file", "looks like a URL"),
        (":abc", "non-empty name"),
        ("source:", "is empty"),
        ("two words:id", "without spaces"),
    ],
)
def test_malformed_identifiers_say_why(text, fragment):
    with pytest.raises(ValueError, match=None) as info:
        parse_identifier(text)
    assert fragment in str(info.value)


# --------------------------------------------------------------------------- formats


def test_txt_comments_blank_lines_bom_crlf_and_duplicates():
    data = (
        "\ufeff# requested 2024-05-01 by legal\r\n"
        f"{KEY_A}\r\n"
        "\r\n"
        "https://example.org/p.jpg#section   # trailing comment after whitespace\r\n"
        "   # indented comment\r\n"
        "internal-studio:studio-1\r\n"
        f"{KEY_A.upper()}\r\n"
    ).encode()
    parsed = parse_list_bytes(data, "legal.txt")
    assert parsed.format == "txt"
    assert parsed.identifiers == (
        OptOutIdentifier(KIND_KEY, KEY_A),
        OptOutIdentifier(KIND_SOURCE_ID, "internal-studio:studio-1", "internal-studio", "studio-1"),
        OptOutIdentifier(KIND_URL, "https://example.org/p.jpg#section"),
    )


def test_txt_malformed_line_rejects_the_whole_list_with_line_numbers():
    data = f"{KEY_A}\nnot-an-identifier\n{KEY_B}\nftp://x/y\n".encode()
    err = _err(data, "bad.txt")
    assert err.code == "bad_identifier"
    assert "2 malformed entries" in err.message
    assert "line 2: 'not-an-identifier'" in err.message and "line 4:" in err.message
    assert err.reason.startswith("bad_identifier: ")


def test_many_malformed_lines_are_summarised():
    err = _err(b"\n".join(b"bad%d" % i for i in range(12)), "many.txt")
    assert "12 malformed entries" in err.message and "(and 7 more)" in err.message


def test_empty_and_comment_only_lists_are_rejected():
    assert _err(b"", "e.txt").code == "empty"
    assert _err(b"# nothing yet\n\n", "c.txt").code == "empty"
    assert _err(b"", "e.csv").code == "empty"
    assert _err(b"key,note\n", "h.csv").code == "empty"


def test_non_utf8_is_rejected():
    err = _err(b"caf\xe9:1\n", "latin1.txt")
    assert err.code == "bad_encoding" and "not UTF-8" in err.message


def test_csv_columns_by_kind_with_extra_columns_ignored():
    data = (
        "Key,URL,source,source_id,requested_by\n"
        f"{KEY_A},,,,alice\n"
        ",https://example.org/1.jpg,,,bob\n"
        ",,internal-studio,studio-7,carol\n"
        ",,,flickr:99,dave\n"  # source:id in the id column when no source is given
        f"{KEY_B},https://example.org/2.jpg,,,erin\n"  # two identifiers in one row
        ",,,,\n"  # blank row: ignored
    ).encode()
    parsed = parse_list_bytes(data, "requests.csv")
    assert parsed.format == "csv"
    assert {(i.kind, i.value) for i in parsed.identifiers} == {
        (KIND_KEY, KEY_A),
        (KIND_KEY, KEY_B),
        (KIND_URL, "https://example.org/1.jpg"),
        (KIND_URL, "https://example.org/2.jpg"),
        (KIND_SOURCE_ID, "internal-studio:studio-7"),
        (KIND_SOURCE_ID, "flickr:99"),
    }


def test_csv_identifier_column_detects_kinds():
    data = f"identifier\n{KEY_A}\nhttps://e.org/x\nsrc:1\n".encode()
    kinds = sorted(i.kind for i in parse_list_bytes(data, "x.csv").identifiers)
    assert kinds == [KIND_KEY, KIND_SOURCE_ID, KIND_URL]


def test_csv_source_column_lets_ids_hold_colons():
    parsed = parse_list_bytes(b"source,source_id\nflickr,a:b:c\n", "c.csv")
    assert parsed.identifiers[0].value == "flickr:a:b:c"
    assert parsed.identifiers[0].source == "flickr"


@pytest.mark.parametrize(
    ("data", "code", "fragment"),
    [
        (b"name,note\nx,y\n", "no_identifier_column", "no identifier column"),
        (b"key\nnot-a-key\n", "bad_identifier", "line 2, column 'key'"),
        (b"url\nexample.org/x\n", "bad_identifier", "http(s) URL"),
        (b"source_id\nstudio-7\n", "bad_identifier", "without its source"),
        (b"key,url\n" + KEY_A.encode() + b"\n", "bad_identifier", "1 fields, the header has 2"),
        (b"key,note\n,only a note\n", "bad_identifier", "line 2: no identifier"),
        (b"key,KEY\n" + KEY_A.encode() + b"," + KEY_B.encode() + b"\n", "bad_header", "same"),
        (b'key\n"' + KEY_A.encode() + b"\n", "unreadable", "not valid CSV"),
    ],
)
def test_malformed_csv_gets_a_specific_error(data, code, fragment):
    err = _err(data, "bad.csv")
    assert err.code == code, err.message
    assert fragment in err.message


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def test_parquet_columns_nulls_and_kinds():
    table = pa.table(
        {
            "key": [KEY_A, None, None],
            "url": [None, "https://example.org/3.jpg", None],
            "source": [None, None, "internal-studio"],
            "source_id": [None, None, "studio-9"],
            "note": ["a", "b", "c"],
        }
    )
    parsed = parse_list_bytes(_parquet(table), "batch.parquet")
    assert parsed.format == "parquet"
    assert {i.value for i in parsed.identifiers} == {
        KEY_A,
        "https://example.org/3.jpg",
        "internal-studio:studio-9",
    }


def test_parquet_rejections():
    assert _err(b"PAR1 this is not parquet", "x.parquet").code == "unreadable"
    typed = _err(_parquet(pa.table({"key": [1, 2]})), "t.parquet")
    assert typed.code == "bad_column_type" and "int64" in typed.message
    bad = _err(_parquet(pa.table({"identifier": ["ok:1", "bogus"]})), "b.parquet")
    assert bad.code == "bad_identifier" and "row 2" in bad.message


def test_unsupported_extension(tmp_path):
    p = tmp_path / "list.json"
    p.write_text("[]")
    with pytest.raises(OptOutListError) as info:
        parse_list_file(p)
    assert info.value.code == "unsupported_format"


def test_candidates_ids_and_discovery(tmp_path):
    names = ["a.txt", "b.CSV", "c.parquet", ".hidden.txt", "_staging.csv", "d.txt.tmp"]
    names += ["e.csv.partial", "notes.md", "f.json"]
    for n in names:
        (tmp_path / n).write_text(KEY_A)
    (tmp_path / "dir.txt").mkdir()
    assert [p.name for p in discover_lists(tmp_path)] == ["a.txt", "b.CSV", "c.parquet"]
    assert discover_lists(tmp_path / "absent") == []
    assert not is_candidate("x.tmp") and is_candidate("X.TXT")
    sha = file_sha256(tmp_path / "a.txt")
    assert sha == hashlib.sha256(KEY_A.encode()).hexdigest()
    assert make_list_id("a.txt", sha) == f"a.txt@{sha[:16]}"
    assert make_list_id("a.txt", sha) != make_list_id("b.txt", sha)


# --------------------------------------------------------------------------- Lance


def _image_rows(batch: str, photos: list[Path], source: str, urls, ids) -> pa.Table:
    rows = []
    for p, url, sid in zip(photos, urls, ids, strict=True):
        data = p.read_bytes()
        rows.append(
            {
                "key": hashlib.sha256(data).hexdigest(),
                "batch": batch,
                "source": source,
                "url": url,
                "source_id": sid,
                "path": p.name,
                "image": data,
            }
        )
    return pa.Table.from_pylist(rows, schema=IMAGES.schema)


@pytest.fixture
def lab(tmp_path) -> Lab:
    photos = sorted(p for p in PHOTOS.iterdir() if p.suffix in (".jpg", ".png"))[:4]
    lab = Lab(tmp_path / "lab")
    shared = "https://example.org/same-photo"
    lab.replace_partition(
        IMAGES,
        "s.000",
        _image_rows("s.000", photos[:3], "public", [shared, "https://e.org/1", None], [None] * 3),
    )
    # Batch s.001 holds photo 0 again (same key) and a studio image named by source id.
    lab.replace_partition(
        IMAGES,
        "s.001",
        _image_rows("s.001", [photos[0], photos[3]], "studio", [None, shared], ["st-0", "st-3"]),
    )
    return lab


def _keys(lab: Lab) -> dict[tuple[str, str], str]:
    rows = lab.read("images", ["batch", "path", "key"]).to_pylist()
    return {(r["batch"], r["path"]): r["key"] for r in rows}


def test_lookup_indexes_are_created_and_serve_every_kind(lab):
    # The images spec now carries the url/source_id indexes itself; this ensures them for
    # labs written before that, and is a no-op once they exist.
    lab.ensure_indexes(IMAGES)
    assert lab.ensure_indexes(IMAGES) == []
    names = {ix["name"] for ix in lab.dataset("images").list_indices()}
    assert {"key_idx", "url_idx", "source_id_idx"} <= names
    ds = lab.dataset("images")
    for kind, value in ((KIND_KEY, KEY_A), (KIND_URL, "https://e.org/1"), (KIND_SOURCE_ID, "x")):
        plan = ds.scanner(
            columns=["batch", "key"], filter=match_filter(kind, [value])
        ).explain_plan()
        column = {KIND_KEY: "key", KIND_URL: "url", KIND_SOURCE_ID: "source_id"}[kind]
        assert "ScalarIndexQuery" in plan and f"{column}_idx" in plan, plan
    assert Lab(lab.root + "-empty").ensure_indexes(IMAGES) == []


def test_resolution_finds_every_image_an_identifier_names(lab):
    lab.ensure_indexes(IMAGES)
    keys = _keys(lab)
    photos = sorted(p for p in PHOTOS.iterdir() if p.suffix in (".jpg", ".png"))[:4]
    k0 = keys[("s.000", photos[0].name)]
    ids = [
        parse_identifier(k0),  # same content in two batches
        parse_identifier("https://example.org/same-photo"),  # one URL, two images
        parse_identifier("studio:st-3"),
        parse_identifier("public:st-3"),  # right id, wrong source: no match
        parse_identifier("https://nowhere.example/none"),
    ]
    got = resolve_identifiers(lab, ids)
    assert got[ids[0]] == [("s.000", k0), ("s.001", k0)]
    assert got[ids[1]] == sorted([("s.000", k0), ("s.001", keys[("s.001", photos[3].name)])])
    assert got[ids[2]] == [("s.001", keys[("s.001", photos[3].name)])]
    assert got[ids[3]] == [] and got[ids[4]] == []
    assert resolve_identifiers(Lab(lab.root + "-none"), ids[:1]) == {ids[0]: []}


def test_recording_is_idempotent_and_matching_works_from_the_partition_side(lab):
    lab.ensure_indexes(IMAGES)
    keys = _keys(lab)
    photos = sorted(p for p in PHOTOS.iterdir() if p.suffix in (".jpg", ".png"))[:4]
    k1 = keys[("s.000", photos[1].name)]
    ids = [parse_identifier("https://e.org/1"), parse_identifier("studio:st-0")]
    ids.append(parse_identifier(KEY_A))  # unmatched: one row with no match
    when = datetime(2024, 5, 1, tzinfo=UTC)
    rows = opt_out_rows("l1@x", resolve_identifiers(lab, ids), when)
    for _ in range(2):  # a replay (tick died before its cursor moved) adds nothing
        lab.replace_rows(OPT_OUTS, "list_id", "l1@x", rows)
    table = lab.read("opt_outs").to_pylist()
    assert len(table) == 3
    assert {(r["identifier"], r["matched_batch"]) for r in table} == {
        ("https://e.org/1", "s.000"),
        ("studio:st-0", "s.001"),
        (KEY_A, None),
    }
    lab.replace_rows(OPT_OUTS, "list_id", "l2@y", opt_out_rows("l2@y", {ids[0]: []}, when))
    assert lab.dataset("opt_outs").count_rows() == 4  # other lists untouched
    with pytest.raises(ValueError, match="other values"):
        lab.replace_rows(OPT_OUTS, "list_id", "l3@z", rows)
    names = {ix["fields"][0] for ix in lab.dataset("opt_outs").list_indices()}
    assert {"identifier", "list_id"} <= names

    # From the partition side: every way a list can name an image of s.000 / s.001.
    s0 = lab.read_batch("images", "s.000", ["key", "url", "source", "source_id"])
    assert opted_out_keys(lab, s0) == {k1: ("l1@x", "l2@y")}
    s1 = lab.read_batch("images", "s.001", ["key", "url", "source", "source_id"])
    assert opted_out_keys(lab, s1) == {keys[("s.001", photos[0].name)]: ("l1@x",)}
    assert opted_out_keys(Lab(lab.root + "-none"), s0) == {}


def test_list_rows_and_sharded_batches(lab):
    err = OptOutListError("empty", "x.txt holds no identifiers")
    when = datetime(2024, 5, 1, tzinfo=UTC)
    rej = list_row("x.txt@1", "/o/x.txt", "1" * 64, when, fmt=None, error=err).to_pylist()[0]
    assert rej["status"] == "rejected" and rej["reason"] == "empty: x.txt holds no identifiers"
    lab.replace_rows(
        OPT_OUT_LISTS, "list_id", "x.txt@1", list_row("x.txt@1", "/o", "1", when, fmt="txt")
    )
    assert lab.read("opt_out_lists").to_pylist()[0]["status"] == "accepted"

    keys = _keys(lab)
    some = sorted(keys.items())
    # Only s.001's first image is in a shard: matching s.000 images does not count.
    from prx_assets.core.tables import SHARD_SAMPLES

    (batch, _), key = next(kv for kv in some if kv[0][0] == "s.001")
    lab.replace_partition(
        SHARD_SAMPLES,
        batch,
        pa.Table.from_pylist([{"key": key, "batch": batch}], schema=SHARD_SAMPLES.schema),
    )
    pairs = [(b, k) for (b, _), k in some]
    assert sharded_batches(lab, pairs) == {"s.001"}
    assert sharded_batches(lab, [("s.000", key)]) == set()  # same key, unsharded batch
    assert sharded_batches(Lab(lab.root + "-none"), pairs) == set()


# --------------------------------------------------------------------------- issue 10: bounds


def test_a_200_mb_list_without_newlines_is_refused_by_size_unread(tmp_path):
    path = sparse_file(tmp_path / "huge.txt", 200 * MIB, prefix=b"https://example.org/")
    err, growth = peak_rss_growth(lambda: _file_err(path))
    assert growth < 32 * MIB, f"peak RSS grew by {growth / MIB:.0f} MiB"
    assert err.code == "too_large"
    assert f"{200 * MIB:,} bytes" in err.reason and len(err.reason) < 500


def test_a_line_over_the_cap_rejects_the_list_without_being_held(tmp_path):
    path = sparse_file(tmp_path / "huge.txt", 200 * MIB, prefix=b"https://example.org/")
    err, growth = peak_rss_growth(lambda: _file_err(path, max_list_bytes=300 * MIB))
    assert growth < 32 * MIB, f"peak RSS grew by {growth / MIB:.0f} MiB"
    assert err.code == "entry_too_long"
    assert "line 1 is 209,715,200 characters" in err.reason
    assert "'https://example.org/" in err.reason  # the start of the entry is quoted
    assert f"…(+{200 * MIB - 200:,} more characters)" in err.reason
    assert len(err.reason) < 2_000


def test_rejection_reasons_quote_at_most_200_characters_of_an_entry():
    entry = "x" * 10_000
    err = _err(f"{KEY_A}\n{entry}\n".encode(), "long.txt")
    assert err.code == "bad_identifier"
    assert repr("x" * 200) + "…(+9,800 more characters)" in err.reason
    assert len(err.reason) < 1_000


def test_many_malformed_entries_keep_the_reason_bounded():
    err = _err(b"\n".join(b"bad-%d-" % i + b"y" * 300 for i in range(50_000)), "many.txt")
    assert "50000 malformed entries" in err.reason and "(and 49995 more)" in err.reason
    assert len(err.reason) < 2_100


def test_csv_lines_and_parquet_cells_over_the_cap_are_entry_too_long():
    csv_err = _err(b"url,note\nhttps://e.org/x," + b"n" * 100_000 + b"\n", "wide.csv")
    assert csv_err.code == "entry_too_long" and "line 2" in csv_err.reason
    assert len(csv_err.reason) < 1_000
    table = pa.table({"url": ["https://e.org/" + "p" * 100_000]})
    pq_err = _err(_parquet(table), "wide.parquet")
    assert pq_err.code == "entry_too_long" and "'url'" in pq_err.reason
    assert len(pq_err.reason) < 1_000


def test_the_caps_are_configurable(tmp_path):
    path = tmp_path / "two.txt"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    assert len(parse_list_file(path).identifiers) == 2
    assert _file_err(path, max_list_bytes=100).code == "too_large"
    assert _file_err(path, max_line_bytes=63).code == "entry_too_long"
    assert len(parse_list_file(path, max_line_bytes=64).identifiers) == 2


def test_a_file_rewritten_after_hashing_is_not_recorded_as_the_hashed_list(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(KEY_A + "\n")
    sha = file_sha256(path)
    assert parse_list_file(path, expected_sha256=sha).identifiers[0].value == KEY_A
    path.write_text(KEY_B + "\n")  # same name, new bytes, after the id was made
    assert _file_err(path, expected_sha256=sha).code == "changed"


def test_list_ids_of_names_that_are_not_utf8_are_printable():
    name = b"caf\xe9\n.txt".decode("utf-8", "surrogateescape")
    assert make_list_id(name, "ab" * 32) == "caf%E9%0A.txt@" + "ab" * 8


def _file_err(path: Path, **limits) -> OptOutListError:
    with pytest.raises(OptOutListError) as info:
        parse_list_file(path, **limits)
    return info.value
