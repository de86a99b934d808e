"""Data never becomes Markdown: the escaping helpers, and every Markdown value the stages
and the audit job publish for a batch whose texts and file names are payloads.

Markdown is parsed with markdown-it-py (CommonMark + GFM tables, in the lock through rich),
the way the Dagster UI's remark parses it; the real UI is exercised by ops/test_csrf.py.
The property checked: a value from the data shows up only inside code spans, whole, and no
link, image (other than the project's own data-URI pictures) or HTML comes out.
"""

from __future__ import annotations

import random

import pytest
from dagster import DagsterEventType
from markdown_it import MarkdownIt

from prx_assets.core.markdown import MAX_VALUE_CHARS, bounded, md_code, md_table, visible
from prx_assets.defs.metadata import counts_table, png_markdown
from prx_assets_tests.defs.conftest import CSRF, HOSTILE_BATCH, PAYLOADS, World

PARSER = MarkdownIt("commonmark").enable("table")
MARKUP = {"link_open", "image", "html_inline", "html_block", "autolink"}
HOSTILE = [
    *PAYLOADS,
    CSRF,
    "`",
    "``",
    "a ``` b",
    "`lead",
    "trail`",
    " spaced ",
    " ",
    "x|y||z\\|",
    "line\nbreak\r\n\n# heading\n---",
    "tab\there\x00nul\x1b[31mred\u202eltr\u200bzw\u2028ls",
    "&lt;script&gt; &#x21;[](/x)",
    "<https://evil.example>",
    "[ref]: /graphql?query=x",
    "\\`escaped\\`",
]


def _inline(markdown: str) -> list:
    out = []
    for token in PARSER.parse(markdown):
        out.append(token)
        out += token.children or []
    return out


def _markup(tokens) -> list[str]:
    found = []
    for t in tokens:
        if t.type == "image" and str(t.attrs.get("src", "")).startswith("data:image/png;base64,"):
            continue  # the project's own pictures (png_markdown)
        if t.type in MARKUP:
            found.append(f"{t.type}: {t.content or t.attrs}")
    return found


def _random_strings(n: int, seed: int = 7) -> list[str]:
    alphabet = "`*_[]()!<>|\\#&;:/.-=~+ \n\tab@w" + "\x00\u202e"
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]


@pytest.mark.parametrize("cell", [False, True])
def test_md_code_shows_any_value_whole_and_as_nothing_but_code(cell):
    for value in HOSTILE + _random_strings(400):
        span = md_code(value, cell=cell)
        doc = f"| v |\n|---|\n| {span} |\n" if cell else f"- value: {span}\n- next"
        tokens = _inline(doc)
        assert _markup(tokens) == [], value
        codes = [t.content for t in tokens if t.type == "code_inline"]
        assert codes == [visible(value)], (value, span)
        if not cell:  # the value could not end its list item
            assert [t.content for t in tokens if t.type == "text"][-1] == "next"


def test_md_code_bounds_and_makes_controls_visible():
    assert md_code("a\nb") == "`a\\nb`"
    assert md_code("\x1b[2J") == "`\\x1b[2J`"
    assert md_code(None) == md_code("") == "*(empty)*"
    long = "x" * (MAX_VALUE_CHARS + 5)
    assert md_code(long) == f"`{'x' * MAX_VALUE_CHARS}… (+5 characters)`"
    assert bounded("abc", 2) == "ab… (+1 characters)" and bounded("ab", 2) == "ab"
    with pytest.raises(ValueError):
        bounded("x", 0)


def test_tables_escape_their_cells_and_refuse_data_as_titles():
    rows = [(value, i) for i, value in enumerate(HOSTILE)]
    tokens = _inline(md_table(["label", "count"], rows))
    assert _markup(tokens) == []
    assert [t.content for t in tokens if t.type == "code_inline"] == [visible(v) for v in HOSTILE]
    assert [t.content for t in tokens if t.type == "tr_open"] == [""] * (len(HOSTILE) + 1)
    with pytest.raises(ValueError, match="not a plain title"):
        md_table([CSRF], [])
    with pytest.raises(ValueError, match="cells"):
        md_table(["a", "b"], [(1,)])

    table = counts_table({v: i for i, v in enumerate(HOSTILE)}, "reason").value
    tokens = _inline(table)
    assert _markup(tokens) == []
    assert sorted(t.content for t in tokens if t.type == "code_inline") == sorted(
        visible(v) for v in HOSTILE
    )


def test_picture_alt_text_cannot_close_the_image():
    md = png_markdown(b"\x89PNG", f"x](javascript:alert(1)) {CSRF} <img src=x>").value
    images = [t for t in _inline(md) if t.type == "image"]
    assert len(images) == 1 and images[0].attrs["src"].startswith("data:image/png;base64,")
    assert _markup(_inline(md)) == []


def _published_markdown(instance) -> list[tuple[str, str]]:
    """(where, markdown) for every Markdown metadata value and check description of every
    run in ``instance``: materialisations, step outputs, asset check evaluations."""
    found = []
    for record in instance.get_run_records():
        run = record.dagster_run
        for entry in instance.all_logs(run.run_id):
            event = entry.dagster_event
            if event is None:
                continue
            data = event.event_specific_data
            if event.event_type == DagsterEventType.ASSET_MATERIALIZATION:
                metadata, description = data.materialization.metadata, None
            elif event.event_type == DagsterEventType.STEP_OUTPUT:
                metadata, description = data.metadata, None
            elif event.event_type == DagsterEventType.ASSET_CHECK_EVALUATION:
                metadata, description = data.metadata, data.description
            else:
                continue
            where = f"{run.job_name}/{event.step_key}/{event.event_type_value}"
            if description:
                found.append((f"{where}: description", description))
            for name, value in metadata.items():
                if type(value).__name__ == "MarkdownMetadataValue":
                    found.append((f"{where}: {name}", value.md_str))
    return found


def test_no_published_markdown_carries_markup_from_data(audit_world: World):
    from prx_assets.definitions import build_defs

    w = audit_world
    key = w.lab().read("images", ["key"], f"batch = '{HOSTILE_BATCH}'").column("key")[0]
    job = build_defs(str(w.data_root)).resolve_job_def("image_audit")
    instance = w.instance()
    try:
        for query in (key.as_py(), f"hostile/000/{PAYLOADS[-1]}"):
            run_config = {"ops": {"audit_one_image": {"config": {"query": query}}}}
            assert job.execute_in_process(instance=instance, run_config=run_config).success
        published = _published_markdown(instance)
    finally:
        instance.dispose()
    stages = {where.split("/")[1] for where, _ in published}
    assert {"raw_images", "mds_shards", "skip_lists", "audit_one_image"} <= stages
    problems = []
    shown = set()
    for where, markdown in published:
        tokens = _inline(markdown)
        problems += [f"{where}: {m}" for m in _markup(tokens)]
        texts = " ".join(t.content for t in tokens if t.type == "text")
        codes = {t.content for t in tokens if t.type == "code_inline"}
        for payload in PAYLOADS:
            assert payload not in texts, where  # data only ever inside code spans
            shown |= {payload} & codes
    assert problems == []
    assert shown == set(PAYLOADS)  # ... where the trail shows each of them whole
