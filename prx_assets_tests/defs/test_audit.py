"""The audit on a settled demo lab: verdicts agree with what the loader yields, every
identifier form the README lists finds the image (rejected files too), and a duplicate's
verdict says whether its keeper trains."""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path

import pytest

from prx_assets.cli import main as cli_main
from prx_assets.core.audit import (
    EXCLUDED,
    IN_TRAINING,
    NEVER_SHARDED,
    REJECTED,
    audit_image,
    path_conditions,
)
from prx_assets.core.lab import sql_literal
from prx_assets.core.tables import LAB_TABLES
from prx_assets_tests.defs.conftest import (
    HOSTILE_BATCH,
    HOSTILE_ID,
    HOSTILE_IMAGE_NAME,
    HOSTILE_REJECT_NAME,
    HOSTILE_URL,
    World,
)


def _loader_keys(shards_root: Path, cache: Path) -> set[str]:
    """Every key the training loader yields (skip-lists required), one pass, no shuffle."""
    from prx_assets.loader import SkipListDataset, discover_streams

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-bucket and all-skipped-partition notes
        buckets = discover_streams(shards_root, cache_dir=cache)
        ds = SkipListDataset(
            streams=[b.to_stream() for b in buckets],  # skip-lists required (the default)
            batch_size=1,
            num_canonical_nodes=1,
            shuffle=False,
        )
        keys = {s["key"] for s in ds}
    del ds
    gc.collect()
    return keys


def _copy(trail, batch: str, key: str):
    return next(c for c in trail.copies if c.batch == batch and c.key == key)


def _since(when) -> str:
    from datetime import UTC

    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def test_verdicts_agree_with_what_the_loader_yields(audit_world: World, tmp_path):
    lab = audit_world.lab()
    yielded = _loader_keys(audit_world.data_root / "shards", tmp_path / "cache")
    placed = lab.read("shard_samples").to_pylist()
    decided = {(r["batch"], r["key"]): r for r in lab.read("skip_audit").to_pylist()}
    assert yielded and len(yielded) < len(placed)  # some samples are skipped
    statuses = set()
    for row in placed:
        verdict = _copy(
            audit_image(lab, row["key"], shards_root=audit_world.shards_root),
            row["batch"],
            row["key"],
        )
        statuses.add(verdict.status)
        skip = decided[(row["batch"], row["key"])]
        if verdict.status == IN_TRAINING:
            assert row["key"] in yielded, verdict.line
            slot = f"{row['relative_dir']}/{row['shard']} #{row['index_in_shard']}"
            assert verdict.line == f"in training: {slot}"
        else:
            assert verdict.status == EXCLUDED, verdict.line
            assert row["key"] not in yielded, verdict.line
            head = f"not in training since {_since(skip['first_excluded_at'])}: "
            assert verdict.line.startswith(head), verdict.line
            for reason in skip["reasons"]:
                assert reason in verdict.line
    assert statuses == {IN_TRAINING, EXCLUDED}

    # Accepted but never sharded: under the size cutoff.
    small = lab.read("resolution", ["key", "batch", "ineligible_reason"], "eligible = false")
    row = small.to_pylist()[0]
    verdict = _copy(
        audit_image(lab, row["key"], shards_root=audit_world.shards_root), row["batch"], row["key"]
    )
    assert verdict.status == NEVER_SHARDED
    assert verdict.line == f"never sharded: ineligible ({row['ineligible_reason']})"


def test_a_duplicate_says_whether_its_keeper_trains(audit_world: World):
    w = audit_world
    lab = w.lab()
    keeper = audit_image(lab, w.keeper, shards_root=audit_world.shards_root)
    kept = _copy(keeper, w.keeper_batch, w.keeper)
    # The keeper is opted out by key: not in training, since when, and by which list.
    assert kept.status == EXCLUDED
    assert f"opt_out (list {w.list_id}" in kept.line
    assert keeper.verdict.startswith("not in training since ")

    # An opt-out of one copy excludes every copy of the picture: the duplicate is out by
    # the same list, through the keeper (opt_out_via names the copy the list matched).
    dup = _copy(
        audit_image(lab, w.duplicate, shards_root=audit_world.shards_root),
        w.duplicate_batch,
        w.duplicate,
    )
    assert dup.status == EXCLUDED
    assert f"opt_out (list {w.list_id}; opt_out_via {w.keeper}" in dup.line

    # A duplicate whose keeper is kept names the keeper's shard slot.
    clusters = lab.read("phash_clusters", ["key", "batch", "keeper_key"], "is_keeper = false")
    decided = {r["key"]: r for r in lab.read("skip_audit").to_pylist()}
    others = [
        r
        for r in clusters.to_pylist()
        if r["keeper_key"] != w.keeper and r["keeper_key"] in decided and r["key"] in decided
    ]
    assert others, "the demo needs a second duplicate cluster"
    other = others[0]
    keeper_slot = decided[other["keeper_key"]]
    assert not keeper_slot["excluded"]
    line = _copy(
        audit_image(lab, other["key"], shards_root=audit_world.shards_root),
        other["batch"],
        other["key"],
    ).line
    slot = f"{keeper_slot['relative_dir']}/{keeper_slot['shard']} #{keeper_slot['index_in_shard']}"
    assert f"keeper {other['keeper_key']} of {keeper_slot['batch']} in training: {slot}" in line


def test_every_identifier_form_the_readme_lists(audit_world: World):
    w = audit_world
    lab = w.lab()
    hostile = lab.read("images", ["key", "source", "path"], f"batch = '{HOSTILE_BATCH}'")
    (image,) = hostile.to_pylist()
    key = image["key"]
    forms = {
        "content key": key,
        "content key (upper case)": key.upper(),
        "url": HOSTILE_URL,
        "source:id": f"{image['source']}:{HOSTILE_ID}",
        "source id": HOSTILE_ID,
        "landing path": f"hostile/000/{HOSTILE_IMAGE_NAME}.jpg",
        "absolute landing path": str(w.landing / "hostile" / "000" / f"{HOSTILE_IMAGE_NAME}.jpg"),
        "path in batch": f"{HOSTILE_IMAGE_NAME}.jpg",
    }
    for form, query in forms.items():
        trail = audit_image(lab, query, landing=w.landing, shards_root=audit_world.shards_root)
        assert trail.keys == [key], form
        assert trail.copies[0].batch == HOSTILE_BATCH, form

    # Each form is a scalar-index look-up, rejected files' paths included.
    for table, predicate in (
        ("images", path_conditions(forms["landing path"])[-1][1]),
        ("images", f"url = {sql_literal(HOSTILE_URL)}"),
        ("images", f"source_id = {sql_literal(HOSTILE_ID)}"),
        ("rejects", f"path = {sql_literal(HOSTILE_REJECT_NAME)}"),
    ):
        plan = lab.dataset(table).scanner(columns=["key"], filter=predicate).explain_plan()
        assert "ScalarIndexQuery" in plan, (table, predicate, plan)

    # Manifest rows: `source:id` and the landing path relative to the source folder.
    studio = lab.read(
        "images", ["key", "source", "source_id", "path"], "batch = 'internal-studio.002'"
    )
    row = next(r for r in studio.to_pylist() if r["source_id"])
    by_id = audit_image(
        lab, f"{row['source']}:{row['source_id']}", shards_root=audit_world.shards_root
    )
    assert row["key"] in by_id.keys and "source:id" in by_id.matched_by
    by_path = audit_image(
        lab,
        f"internal-studio/{row['path']}",
        landing=w.landing,
        shards_root=audit_world.shards_root,
    )
    assert row["key"] in by_path.keys


@pytest.mark.parametrize(
    ("batch", "entry"),
    [
        (HOSTILE_BATCH, "hostile/000"),  # a folder
        ("public-sklearn.001", "public-sklearn/001.tar"),  # a tar archive
        ("internal-studio.002", "internal-studio"),  # a manifest: paths relative to the source
    ],
)
def test_rejected_files_are_found_by_landing_path(audit_world: World, batch, entry):
    w = audit_world
    lab = w.lab()
    rejects = lab.read("rejects", filter=f"batch = {sql_literal(batch)}").to_pylist()
    assert rejects
    for reject in rejects:
        for query in (f"{entry}/{reject['path']}", str(w.landing / entry / reject["path"])):
            trail = audit_image(lab, query, landing=w.landing, shards_root=audit_world.shards_root)
            assert trail.found, query
            verdict = next(c for c in trail.copies if c.status == REJECTED)
            assert verdict.path == reject["path"] and verdict.batch == batch
            assert verdict.line.startswith(f"rejected at ingest: {reject['reason']}")
            if reject["detail"]:
                assert reject["detail"] in verdict.line
    if batch == HOSTILE_BATCH:
        assert any(r["path"] == HOSTILE_REJECT_NAME for r in rejects)


def test_audit_command_and_job(audit_world: World, capsys):
    from prx_assets.definitions import build_defs

    w = audit_world
    root = str(w.data_root)
    image = w.lab().read("images", ["key", "source"], f"batch = '{HOSTILE_BATCH}'").to_pylist()[0]
    query = f"{image['source']}:{HOSTILE_ID}"
    assert cli_main(["audit", query, "--data-root", root]) == 0
    out = capsys.readouterr().out
    trail = audit_image(w.lab(), query, shards_root=audit_world.shards_root)
    lines = out.splitlines()
    assert lines[0] == trail.verdict  # the verdict first, as plain text (README)
    assert lines[2].startswith("# Audit trail for")
    assert lines[4] == f"**Verdict:** `{trail.verdict}`"

    assert cli_main(["audit", w.duplicate, "--data-root", root, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["verdict"]
        == audit_image(w.lab(), w.duplicate, shards_root=audit_world.shards_root).verdict
    )
    assert data["status"] == EXCLUDED and data["keys"] == [w.duplicate]
    assert {c["batch"] for c in data["copies"]} == {w.duplicate_batch}
    assert data["images"][0]["key"] == w.duplicate and "image" not in data["images"][0]

    relative = f"hostile/000/{HOSTILE_REJECT_NAME}"
    assert cli_main(["audit", relative, "--data-root", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"].startswith("rejected at ingest: ")
    assert cli_main(["audit", "0" * 64, "--data-root", root]) == 1
    assert "not found" in capsys.readouterr().out
    # A data root without a lab is said to be one, not "not found" (exit 2, nothing created).
    missing = w.root / "no-such-root"
    assert cli_main(["audit", "0" * 64, "--data-root", str(missing)]) == 2
    assert f"no lab at {missing / 'lab'}" in capsys.readouterr().err
    assert not missing.exists()
    (missing / "lab").mkdir(parents=True)  # a directory, but no lab table in it
    assert cli_main(["audit", "0" * 64, "--data-root", str(missing)]) == 2
    assert f"no lab at {missing / 'lab'}" in capsys.readouterr().err

    instance = w.instance()
    try:
        job = build_defs(root).resolve_job_def("image_audit")
        result = job.execute_in_process(
            instance=instance,
            run_config={"ops": {"audit_one_image": {"config": {"query": relative}}}},
        )
    finally:
        instance.dispose()
    event = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"][0]
    metadata = event.step_output_data.metadata
    assert metadata["verdict"].value.startswith("rejected at ingest: not_an_image")
    assert metadata["status"].value == REJECTED
    text = metadata["trail"].value
    assert text.splitlines()[2] == f"**Verdict:** `{metadata['verdict'].value}`"


def test_the_trail_reads_every_registered_table_at_the_version_it_reports(audit_world: World):
    lab = audit_world.lab()
    trail = audit_image(lab, audit_world.duplicate, shards_root=audit_world.shards_root)
    view = lab.view()
    with_keys = {
        spec.name
        for spec in LAB_TABLES
        if (schema := view.schema(spec.name)) is not None
        and {"key", "matched_key"} & set(schema.names)
    }
    assert {"images", "phash_clusters", "skip_audit"} <= set(trail.tables) == with_keys
    assert trail.versions == {t: view.version(t) for t in trail.tables}
    pinned = lab.view(trail.versions)  # the same rows, read again at the reported versions
    for table, rows in trail.tables.items():
        column = "key" if "key" in pinned.schema(table).names else "matched_key"
        again = pinned.read(table, filter=f"{column} = {sql_literal(audit_world.duplicate)}")
        assert len(rows) == again.num_rows, table
