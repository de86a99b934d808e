"""Training snapshots on the settled demo: pinning, diffs by reason, compliance, cleanup, retire.

Each test starts from its own copy of the settled demo platform (test_automation's fixtures),
makes snapshots with the real runner, changes the platform the way the daemon would (opt-out
lists through the opt-out sensor, a captioner swap through the model-swap sensor) and checks
the snapshot guarantees on real Lance tables, real MDS directories and the real loader.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from datetime import timedelta
from pathlib import Path

import pytest

from prx_assets.browser.queries import Filters, LabQueries, QueryError
from prx_assets.core.audit import audit_image
from prx_assets.core.lab import Lab
from prx_assets.core.skiplists.sidecars import (
    RETENTION_ENV,
    load_generation,
    sweep,
    update_skiplists,
)
from prx_assets.core.snapshots.compliance import compliance_report
from prx_assets.core.snapshots.diff import diff_snapshots
from prx_assets.core.snapshots.manifest import SnapshotError, read_snapshot
from prx_assets.core.snapshots.members import (
    MEMBER_COLUMNS,
    MEMBERSHIP_TABLES,
    frozen,
    iter_members,
)
from prx_assets.core.snapshots.pins import PINS_DIRNAME, RETAINED_DIRNAME
from prx_assets.core.snapshots.runner import (
    SOURCE_TABLES,
    create_snapshot,
    holder,
    retire_snapshot,
    snapshots_containing,
)
from prx_assets.core.tables import spec
from prx_assets.defs.captions.resources import CaptionerResource
from prx_assets.defs.run_requests import evaluate_sensor, execute_run_request
from prx_assets.defs.skiplists.config import SkipPolicyResource
from prx_assets.loader.discover import discover_streams
from prx_assets.loader.shape_loader import ShapeBatchedLoader
from prx_assets.loader.snapshots import (
    REPRODUCE_UNSAFE,
    SnapshotChanged,
    SnapshotChangedWarning,
)
from prx_assets_tests import test_automation as automation

settled = automation.settled  # the settled demo platform, once per module
platform = automation.platform  # a private copy of it per test
chat_server = automation.chat_server  # scripted OpenAI-compatible server on 127.0.0.1


def _lab(platform) -> Lab:
    return Lab(os.path.join(platform.data_root, "lab"))


def _shards(platform) -> str:
    return os.path.join(platform.data_root, "shards")


def _member_rows(lab: Lab, snapshot_id: str) -> list[dict]:
    """The samples the snapshot holds, derived from its frozen directories."""
    return [r for chunk in iter_members(lab, frozen(lab, snapshot_id)) for r in chunk]


def _members(lab: Lab, snapshot_id: str) -> set[tuple[str, str]]:
    return {(r["batch"], r["key"]) for r in _member_rows(lab, snapshot_id)}


def _opt_out(platform, name: str, keys: list[str]) -> None:
    os.makedirs(platform.data_root + "/optouts", exist_ok=True)
    tmp = Path(platform.data_root) / "optouts" / f".{name}.tmp"
    tmp.write_text("\n".join(keys) + "\n")
    tmp.rename(tmp.with_name(name))


def test_a_snapshot_freezes_exactly_what_the_loader_trains_on(platform):
    lab, root = _lab(platform), _shards(platform)
    out = create_snapshot(lab, root, "run-a")
    m = out.manifest
    live = discover_streams(root)
    assert {b.relpath for b in live} <= {d.partition for d in m.directories}
    assert m.kept_samples == sum(b.counts.kept_samples for b in live) > 0
    # The membership table holds exactly the samples kept by the live skip-lists.
    kept = lab.read("skip_audit", ["batch", "key"], "excluded = false")
    assert _members(lab, "run-a") == set(
        zip(kept.column("batch").to_pylist(), kept.column("key").to_pylist(), strict=True)
    )
    pinned = discover_streams(root, snapshot="run-a")
    assert [(b.relpath, b.counts.kept_samples) for b in pinned] == [
        (b.relpath, b.counts.kept_samples) for b in live
    ]
    # A directory that appears later is read by live discovery, never by the snapshot.
    first = Path(pinned[0].local)
    late = first.with_name("zzz-late.000")
    shutil.copytree(first, late, ignore=shutil.ignore_patterns(PINS_DIRNAME))
    assert late.name in {b.batch for b in discover_streams(root)}
    assert late.name not in {b.batch for b in discover_streams(root, snapshot="run-a")}
    # Immutable: the same name again returns it unchanged.
    again = create_snapshot(lab, root, "run-a")
    assert not again.created and again.manifest.sha256 == m.sha256
    row = lab.read("training_snapshots", None, "snapshot_id = 'run-a'").to_pylist()[0]
    assert row["status"] == "live" and row["manifest_sha256"] == m.sha256
    assert set(lab.pinned_versions()) >= {"skip_audit", "shard_samples"}


def test_a_changed_sidecar_after_pinning_is_refused_and_so_is_resuming(platform, monkeypatch):
    monkeypatch.setenv(RETENTION_ENV, "0")  # the pin, not the retention, keeps the sidecars
    lab, root = _lab(platform), _shards(platform)
    create_snapshot(lab, root, "run-a")
    buckets = discover_streams(root, snapshot="run-a")
    loader = ShapeBatchedLoader(buckets, batch_size=1, shuffle=False)
    state = loader.state_dict()
    assert state["snapshot"] == "run-a"
    assert all(ds.state_dict(0, True)["snapshot"] == "run-a" for ds in loader.datasets.values())

    # A new skip-list generation for one pinned directory (what an opt-out run publishes).
    target = Path(buckets[0].local)
    before = load_generation(target)
    shard = next(iter(before.skiplists))
    kept_index = next(i for i in range(10_000) if i not in set(before.skiplists[shard].indices))
    update_skiplists(target, {shard: {kept_index: ["opt_out"]}})
    # The old generation's sidecars survive the writer's sweeps: the snapshot pins them.
    sweep(target)
    assert all((target / e.sidecar).is_file() for e in before.manifest.entries)

    with pytest.raises(SnapshotChanged, match="new skip-list generation"):
        discover_streams(root, snapshot="run-a")
    # Resuming: the loader is rebuilt from the snapshot first, which is refused; and a
    # checkpoint of another snapshot (or of live data) never resumes here.
    with pytest.raises(SnapshotChanged):
        ShapeBatchedLoader(discover_streams(root, snapshot="run-a"), batch_size=1)
    live_loader = ShapeBatchedLoader(discover_streams(root), batch_size=1, shuffle=False)
    with pytest.raises(SnapshotChanged, match="checkpoint was taken on snapshot 'run-a'"):
        live_loader.load_state_dict(state)

    # Told to, explicitly: the frozen set is read as pinned, with a warning each time.
    with pytest.warns(SnapshotChangedWarning, match="reproduce-UNSAFE"):
        again = discover_streams(root, snapshot="run-a", pinned_changes=REPRODUCE_UNSAFE)
    reproduced = ShapeBatchedLoader(again, batch_size=1, shuffle=False)
    reproduced.load_state_dict(state)
    shape = target.parent.name  # pinned generation: the sample the new one skips is back
    assert reproduced.datasets[shape].num_samples == loader.datasets[shape].num_samples

    # A pinned sidecar edited in place is refused even then.
    victim = target / before.manifest.entries[0].sidecar
    victim.write_bytes(victim.read_bytes().replace(b'"indices":[', b'"indices":[0,', 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SnapshotChangedWarning)
        with pytest.raises(Exception, match="sha256|hash"):
            ShapeBatchedLoader(
                discover_streams(root, snapshot="run-a", pinned_changes=REPRODUCE_UNSAFE),
                batch_size=1,
            )


def test_diff_counts_by_reason_after_an_opt_out_and_a_captioner_swap(platform, chat_server):
    lab, root = _lab(platform), _shards(platform)
    create_snapshot(lab, root, "before")
    a = _members(lab, "before")
    batch = "public-sklearn.001"
    opted = sorted(k for b, k in a if b == batch)[:2]
    assert len(opted) == 2
    _opt_out(platform, "request-1.txt", opted)
    platform.settle()
    platform.config["captioner"] = CaptionerResource(
        backend="openai", model="test/vlm", base_url=chat_server.base_url, max_attempts=2
    )
    platform.settle()
    create_snapshot(lab, root, "after")
    b = _members(lab, "after")

    diff = diff_snapshots(lab, "before", "after")
    assert diff.count("removed") == len(a - b) and diff.count("added") == len(b - a)
    assert sorted(diff.keys("removed", "opt-out")) == opted
    assert diff.count("removed", "opt-out") == 2
    # Every sample in both was recaptioned by the new backend: its shard bytes changed.
    assert diff.count("changed", "captioner or classifier swap") == len(a & b) > 0
    assert diff.count("added", "new batch") == 0
    md = diff.to_markdown()
    assert "| removed | `opt-out` | 2 |" in md or "`removed` | `opt-out` | 2" in md

    # The swap rewrote every directory; the ones "before" pins were kept, not deleted.
    before = read_snapshot(root, "before")
    retained = Path(root) / RETAINED_DIRNAME
    for d in before.directories:
        live_index = Path(root, d.relative_dir, "index.json")
        if not live_index.is_file() or (
            hashlib.sha256(live_index.read_bytes()).hexdigest() != d.index_sha256
        ):
            kept = retained / f"{d.relative_dir}@{d.index_sha256[:16]}"
            assert hashlib.sha256((kept / "index.json").read_bytes()).hexdigest() == (
                d.index_sha256
            )
    assert retained.is_dir()
    with pytest.raises(SnapshotChanged, match="rewritten"):
        discover_streams(root, snapshot="before")

    # Retiring releases the pins and the retained copies; the loader then refuses it.
    out = retire_snapshot(lab, root, "before")
    assert out.pins_removed >= len(before.directories) and out.retained_removed
    assert not any(retained.rglob("index.json"))
    with pytest.raises(SnapshotError, match="retired"):
        discover_streams(root, snapshot="before")
    row = lab.read("training_snapshots", None, "snapshot_id = 'before'").to_pylist()[0]
    assert row["status"] == "retired" and row["retired_at"] is not None
    assert _members(lab, "before") == a  # lineage is kept


def _members_by_batch(lab: Lab, snapshot_id: str) -> dict[str, set[tuple]]:
    out: dict[str, set[tuple]] = {}
    for r in _member_rows(lab, snapshot_id):
        out.setdefault(r["batch"], set()).add(tuple(r[c] for c in MEMBER_COLUMNS))
    return out


def _same_result(x, y) -> bool:
    return (x.a_samples, x.b_samples, x.totals(), [g.__dict__ for g in x.groups]) == (
        y.a_samples,
        y.b_samples,
        y.totals(),
        [g.__dict__ for g in y.groups],
    )


def test_a_diff_reads_only_the_batches_whose_members_changed(platform):
    lab, root = _lab(platform), _shards(platform)
    create_snapshot(lab, root, "s1")
    batch = "public-sklearn.001"
    opted = sorted(k for b, k in _members(lab, "s1") if b == batch)[:2]
    _opt_out(platform, "request-1.txt", opted)
    platform.settle()
    create_snapshot(lab, root, "s2")

    before, after = _members_by_batch(lab, "s1"), _members_by_batch(lab, "s2")
    changed = {b for b in before.keys() | after.keys() if before.get(b) != after.get(b)}
    sharded = {  # batches with a directory in either snapshot (some may keep no sample)
        d.relative_dir.rsplit("/", 1)[-1]
        for sid in ("s1", "s2")
        for d in read_snapshot(root, sid).directories
    }
    assert batch in changed and len(changed) < len(sharded)  # some batches unchanged
    diff = diff_snapshots(lab, "s1", "s2")
    assert diff.batches_compared == len(changed)
    assert diff.batches_unchanged == len(sharded) - len(changed)
    assert sorted(diff.keys("removed", "opt-out")) == opted
    assert diff.a_samples == sum(map(len, before.values()))
    assert diff.b_samples == sum(map(len, after.values()))
    assert "unchanged (same directories and members digests)" in diff.to_markdown()
    # A batch per read gives the same answer as one read of every changed batch.
    assert _same_result(diff_snapshots(lab, "s1", "s2", chunk_samples=1), diff)

    # Membership is derived from the directory rows: a snapshot missing one of them is
    # refused (by the diff, the audit's lineage and compliance), never read as holding less.
    lab.delete("snapshot_directories", f"snapshot_id = 's1' AND batch = '{batch}'")
    with pytest.raises(SnapshotError, match="cannot be established"):
        diff_snapshots(lab, "s1", "s2")
    with pytest.raises(SnapshotError, match="cannot be established"):
        snapshots_containing(lab, opted)


def _duplicate_pair(lab: Lab, members: set[tuple[str, str]]) -> tuple[tuple, tuple]:
    """(copy not in training, its keeper in training) of one pHash cluster."""
    rows = lab.read("phash_clusters", ["batch", "key", "cluster_id", "is_keeper"]).to_pylist()
    by_cluster: dict[str, list[dict]] = {}
    for r in rows:
        by_cluster.setdefault(r["cluster_id"], []).append(r)
    for copies in by_cluster.values():
        trained = [c for c in copies if (c["batch"], c["key"]) in members]
        others = [
            c
            for c in copies
            if (c["batch"], c["key"]) not in members and c["key"] not in {t["key"] for t in trained}
        ]
        if trained and others:
            return (others[0]["batch"], others[0]["key"]), (trained[0]["batch"], trained[0]["key"])
    raise AssertionError("the demo plants duplicates: no cluster with a trained and a skipped copy")


def test_compliance_report_follows_a_list_through_a_duplicate_copy(platform):
    lab, root = _lab(platform), _shards(platform)
    create_snapshot(lab, root, "s1")
    (copy_batch, copy_key), (keeper_batch, keeper_key) = _duplicate_pair(lab, _members(lab, "s1"))
    _opt_out(platform, "takedown.txt", [copy_key])
    # The list is taken in, but its skip_lists runs have not happened yet.
    defs = platform.defs()
    requests, platform.cursors["opt_out_sensor"] = evaluate_sensor(
        defs, platform.instance, "opt_out_sensor", platform.cursors.get("opt_out_sensor")
    )
    intake = [r for r in requests if r.job_name == "opt_out_intake"] or requests[:1]
    for r in intake:
        assert execute_run_request(defs, platform.instance, r, None)
    # Taken in, not applied yet: no snapshot holds it after arrival, yet it is no PASS.
    report = compliance_report(lab, root, "takedown.txt")
    assert report.verdict == "PENDING" and not report.passed
    assert keeper_batch in report.pending_batches
    keeper = {(i.batch, i.key): i for i in report.images}[(keeper_batch, keeper_key)]
    assert keeper.placement and "before the list arrived" in keeper.not_held
    assert report.to_markdown().startswith("**PENDING**: ") and keeper_batch in report.reason
    # A snapshot now still trains on the keeper: the list reaches it only through its copy.
    create_snapshot(lab, root, "s2")
    report = compliance_report(lab, root, "takedown.txt")
    reached = {(i.batch, i.key): i for i in report.images}
    assert reached[(copy_batch, copy_key)].via == "direct"
    keeper = reached[(keeper_batch, keeper_key)]
    assert keeper.via == f"duplicate of {copy_key}"
    assert keeper.contained_in == ["s1", "s2"] and keeper.violations == ["s2"]
    assert report.verdict == "FAIL" and report.to_markdown().startswith("**FAIL**")

    # Lineage: the keeper's audit lists both snapshots with their dates; the browser's
    # snapshot filter finds it in s2 and never finds the skipped copy there.
    trail = audit_image(lab, keeper_key, shards_root=str(root))
    assert [s["snapshot_id"] for s in trail.snapshots if s["batch"] == keeper_batch] == [
        "s1",
        "s2",
    ]
    assert all(s["created_at"] is not None for s in trail.snapshots)
    assert "Training snapshots that contained it" in trail.to_markdown()
    hits = LabQueries(lab).browse(Filters(snapshots=("s2",)), limit=200).hits
    found = {h["key"] for h in hits}
    assert keeper_key in found and copy_key not in found
    assert found == {k for _, k in _members(lab, "s2")}
    with pytest.raises(QueryError):
        Filters(snapshots=("<b>x</b>",))

    platform.settle()  # the list's skip_lists runs
    create_snapshot(lab, root, "s3")
    report = compliance_report(lab, root, "takedown.txt")
    keeper = {(i.batch, i.key): i for i in report.images}[(keeper_batch, keeper_key)]
    assert keeper.first_excluding == "s3" and keeper.violations == ["s2"]
    assert keeper.not_held is None and report.verdict == "FAIL"
    retire_snapshot(lab, root, "s2")  # the remedy: the violating snapshot can't be trained on
    report = compliance_report(lab, root, "takedown.txt")
    assert report.verdict == "PASS" and report.passed and not report.pending_batches

    # Holding is read from the live generation, not from the audit: a generation published
    # by hand that keeps the keeper again (an older one restored) is no PASS.
    rel, shard_index = keeper.placement.rsplit("/", 1)
    shard, index = shard_index.split("#")
    target = Path(root) / rel
    live = load_generation(target).skiplists[shard].as_mapping()
    update_skiplists(target, {shard: {i: r for i, r in live.items() if i != int(index)}})
    report = compliance_report(lab, root, "takedown.txt")
    assert report.verdict == "PENDING" and report.pending_batches == [keeper_batch]
    keeper = {(i.batch, i.key): i for i in report.images}[(keeper_batch, keeper_key)]
    assert f"does not skip {shard} #{index}" in keeper.not_held
    (target / "skiplists.json").unlink()  # unscreened: unreadable, never a pass
    report = compliance_report(lab, root, "takedown.txt")
    keeper = {(i.batch, i.key): i for i in report.images}[(keeper_batch, keeper_key)]
    assert report.verdict == "PENDING" and "unreadable" in keeper.not_held


def test_cleanup_keeps_pinned_lance_versions_until_retired(platform):
    lab, root = _lab(platform), _shards(platform)
    out = create_snapshot(lab, root, "keep")
    version = out.manifest.lab_versions["skip_audit"]
    expected = lab.read("skip_audit", ["key"], version=version).num_rows
    platform.config["skip_policy"] = SkipPolicyResource(excluded_classes=["nsfw"])
    platform.settle()  # new skip_audit versions
    assert lab.version("skip_audit") > version
    lab.maintain(  # everything unpinned but the newest version may go
        spec("skip_audit"),
        retention=timedelta(0),
        orphan_min_age=timedelta(0),
        keep_versions=1,
        version_min_age=timedelta(0),
    )
    assert lab.read("skip_audit", ["key"], version=version).num_rows == expected
    members = _members(lab, "keep")
    assert lab.pinned_by(holder("keep")) == out.manifest.lab_versions
    retire_snapshot(lab, root, "keep")
    # Retired: only the versions its membership and diff reasons are derived from stay
    # pinned (skip_audit among them), so its history still answers after a cleanup.
    assert lab.pinned_by(holder("keep")) == {
        t: v for t, v in out.manifest.lab_versions.items() if t in MEMBERSHIP_TABLES
    }
    assert set(MEMBERSHIP_TABLES) < set(SOURCE_TABLES)
    for table in MEMBERSHIP_TABLES:
        lab.maintain(
            spec(table),
            retention=timedelta(0),
            orphan_min_age=timedelta(0),
            keep_versions=1,
            version_min_age=timedelta(0),
        )
    assert lab.read("skip_audit", ["key"], version=version).num_rows == expected
    assert _members(lab, "keep") == members
    # A version no snapshot pins does go: the one the policy change superseded last.
    released = lab.version("skip_audit") - 1
    assert released != version
    with pytest.raises((OSError, ValueError)):  # the version's manifest is gone
        lab.dataset("skip_audit", version=released)


def _intake_only(platform, rejected: bool = False) -> None:
    """Take new opt-out lists in without running their skip_lists (a sensor tick's first
    half); ``rejected``: the lists are malformed, so their intake runs fail (recorded)."""
    defs = platform.defs()
    requests, platform.cursors["opt_out_sensor"] = evaluate_sensor(
        defs, platform.instance, "opt_out_sensor", platform.cursors.get("opt_out_sensor")
    )
    intake = [r for r in requests if r.job_name == "opt_out_intake"]
    assert intake
    for r in intake:
        assert execute_run_request(defs, platform.instance, r, None) is not rejected


def test_the_asset_its_compliance_check_the_jobs_and_the_cli(platform, capsys):
    from dagster import materialize

    from prx_assets.cli import main
    from prx_assets.defs.resources import LabResource
    from prx_assets.defs.snapshots.assets import opt_out_compliance, training_snapshots

    lab = _lab(platform)
    resources = {"lab": LabResource(data_root=platform.data_root)}

    def snapshot(name: str):
        return materialize(
            [training_snapshots, opt_out_compliance],
            resources=resources,
            run_config={"ops": {"training_snapshots": {"config": {"name": name}}}},
            instance=platform.instance,
            raise_on_error=False,
        )

    first = snapshot("d1")
    assert first.success
    [check] = first.get_asset_check_evaluations()
    assert check.passed  # no list yet
    (_copy_batch, copy_key), (keeper_batch, keeper_key) = _duplicate_pair(lab, _members(lab, "d1"))
    _opt_out(platform, "takedown.txt", [copy_key])
    _intake_only(platform)
    # Taken in, its skip_lists runs not done: PENDING, naming the batch to rerun (exit 3).
    assert main(["compliance", "takedown.txt", "--data-root", platform.data_root]) == 3
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line.startswith("**PENDING**: ") and keeper_batch in first_line
    second = snapshot("d2")
    [check] = second.get_asset_check_evaluations()
    assert not check.passed and check.metadata["violations"].value >= 1
    [mat] = second.get_asset_materialization_events()
    meta = mat.event_specific_data.materialization.metadata
    assert meta["snapshot"].value == "d2" and meta["diff_from"].value == "d1"
    assert "diff_chart" not in meta or meta["diff_chart"].value.startswith("![")

    assert main(["compliance", "takedown.txt", "--data-root", platform.data_root]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and keeper_key in out
    assert main(["snapshot", "list", "--data-root", platform.data_root]) == 0
    assert "d1\tlive" in capsys.readouterr().out
    assert main(["snapshot", "create", "../evil", "--data-root", platform.data_root]) == 2
    capsys.readouterr()

    platform.settle()
    assert main(["snapshot", "create", "d3", "--data-root", platform.data_root]) == 0
    assert "d3: created" in capsys.readouterr().out
    assert main(["snapshot", "diff", "d2", "d3", "--json", "--data-root", platform.data_root]) == 0
    import json

    diff = json.loads(capsys.readouterr().out)
    removed = {t["reason"]: t["samples"] for t in diff["totals"] if t["direction"] == "removed"}
    assert removed.get("opt-out", 0) >= 1  # the keeper left through its copy's opt-out
    job = platform.defs().resolve_job_def("retire_training_snapshot")
    run = job.execute_in_process(
        run_config={"ops": {"retire_one_snapshot": {"config": {"name": "d2"}}}},
        instance=platform.instance,
    )
    assert run.success
    assert existing_status(lab, "d2") == "retired"
    assert main(["compliance", "takedown.txt", "--data-root", platform.data_root]) == 0
    assert capsys.readouterr().out.startswith("**PASS**: ")

    # A rejected list was never applied: NOT APPLIED with intake's reason, and the check fails.
    _opt_out(platform, "bad.csv", ["key", "not-a-key"])
    _intake_only(platform, rejected=True)
    assert main(["compliance", "bad.csv", "--data-root", platform.data_root]) == 4
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line.startswith("**NOT APPLIED**: ") and "bad_identifier" in first_line
    assert main(["compliance", "never-sent.txt", "--data-root", platform.data_root]) == 4
    assert capsys.readouterr().out.startswith("NOT APPLIED: ")
    fourth = snapshot("d4")
    assert fourth.success
    [check] = fourth.get_asset_check_evaluations()
    assert not check.passed and check.metadata["verdicts"].value == {"NOT APPLIED": 1, "PASS": 1}
    assert "bad_identifier" in check.metadata["not_passing"].value

    # A snapshot whose directory rows are not all there: no verdict and no audit answer.
    lab.delete("snapshot_directories", "snapshot_id = 'd2'")
    assert main(["compliance", "takedown.txt", "--data-root", platform.data_root]) == 2
    assert "cannot be established" in capsys.readouterr().err
    assert main(["audit", keeper_key, "--data-root", platform.data_root]) == 2
    assert "cannot be established" in capsys.readouterr().err
    # The browser: a filter on that snapshot has no answer (500 with the reason); one on
    # an intact snapshot still answers.
    from prx_assets.browser.app import BrowserApp

    app = BrowserApp(LabQueries(lab, refresh_s=0))
    broken = app.handle("GET", "/api/search?snapshot=d2", "127.0.0.1")
    assert broken.status == 500 and b"cannot be established" in broken.body
    assert app.handle("GET", "/api/search?snapshot=d3", "127.0.0.1").status == 200


def test_commands_on_a_data_root_without_a_lab_say_so(tmp_path, capsys):
    from prx_assets.browser.queries import LabQueries, NotFound
    from prx_assets.cli import main

    missing = str(tmp_path / "nowhere")
    for argv in (["snapshot", "list"], ["compliance", "x.txt"]):
        assert main([*argv, "--data-root", missing]) == 2
        assert f"no lab at {missing}/lab" in capsys.readouterr().err
    assert not os.path.exists(missing)  # and nothing was created there
    empty = tmp_path / "empty"
    (empty / "lab").mkdir(parents=True)
    assert main(["snapshot", "list", "--data-root", str(empty)]) == 2
    assert "holds no lab table" in capsys.readouterr().err
    with pytest.raises(NotFound, match="no lab at"):
        LabQueries(Lab(str(empty / "lab")), shards_root=str(empty / "shards")).audit("a" * 64)


def existing_status(lab: Lab, snapshot_id: str) -> str:
    rows = lab.read("training_snapshots", ["status"], f"snapshot_id = '{snapshot_id}'")
    return rows.column("status").to_pylist()[0]


def _create_in_child(lab_root: str, shards_root: str, name: str) -> None:
    create_snapshot(Lab(lab_root), shards_root, name)


@pytest.mark.parametrize("crash_at", ["snapshots.pinned:3", "snapshots.file_written:1"])
def test_a_killed_snapshot_is_never_half_made_and_its_rerun_completes_it(platform, crash_at):
    import multiprocessing
    import signal

    lab, root = _lab(platform), _shards(platform)
    ctx = multiprocessing.get_context("spawn")
    os.environ["PRX_CRASH_AT"] = crash_at
    try:
        child = ctx.Process(target=_create_in_child, args=(lab.root, root, "k1"))
        child.start()
        child.join(300)
    finally:
        del os.environ["PRX_CRASH_AT"]
    assert child.exitcode == -signal.SIGKILL
    # Not committed: no row, so nothing lists it, trains on it or counts it in compliance;
    # the loader refuses it too (its manifest, if written, is only staged).
    assert lab.read("training_snapshots", None, "snapshot_id = 'k1'").num_rows == 0
    refusal = "rerun `snapshot create k1`" if "file_written" in crash_at else "no training snap"
    with pytest.raises(SnapshotError, match=refusal):
        discover_streams(root, snapshot="k1")
    out = create_snapshot(lab, root, "k1")
    assert out.created == (crash_at.startswith("snapshots.pinned"))
    reference = create_snapshot(lab, root, "k2").manifest
    assert [d.as_dict() for d in out.manifest.directories] == [
        d.as_dict() for d in reference.directories
    ]
    assert lab.read("training_snapshots", None, "snapshot_id = 'k1'").num_rows == 1
    assert discover_streams(root, snapshot="k1")
