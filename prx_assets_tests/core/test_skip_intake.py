"""Opt-out intake (core, no Dagster) and the opt-out sensor's decisions, on a real lab.

``ListIntake`` records one list (accepted or rejected, idempotent, nothing for a file that
is gone or changed); ``plan_opt_out_tick`` first asks for the intake of new files, then, once
they are recorded, for ``skip_lists`` of exactly the partitions holding a copy they name.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.core.lab import Lab
from prx_assets.core.skiplists.intake import (
    ListFileChanged,
    ListFileMissing,
    ListIntake,
    find_list_file,
    list_id_of_partition,
    list_partition_key,
)
from prx_assets.core.skiplists.reruns import OptOutCursor, plan_opt_out_tick
from prx_assets.core.tables import IMAGES, OPT_OUT_LISTS, OPT_OUT_PROBLEMS, OPT_OUTS
from prx_assets_tests.core.skip_world import World, key_of
from prx_assets_tests.spawned import spawn_pool

A, B, C = "src.a", "src.b", "src.c"
T1 = datetime(2024, 6, 1, tzinfo=UTC)
T2 = datetime(2024, 6, 2, tzinfo=UTC)


@pytest.fixture
def world(tmp_path) -> World:
    w = World(Lab(tmp_path / "lab"))
    w.image("photo", A, phash=11, url="https://example.org/p.jpg")
    w.image("copy", B, phash=11, pixels=100)  # the same picture in another batch
    w.image("lonely", B)
    w.image("unsharded", C, sharded=False)
    w.commit()
    return w


@pytest.fixture
def drop(tmp_path) -> Path:
    d = tmp_path / "optouts"
    d.mkdir()
    return d


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def _rows(lab: Lab, spec, list_id: str) -> list[dict]:
    """The list's rows of ``spec``, in a fixed order (a replay may store them in another)."""
    rows = lab.read(spec.name, filter=f"list_id = '{list_id}'").to_pylist()
    return sorted(rows, key=lambda r: sorted((k, str(v)) for k, v in r.items()))


def test_an_accepted_list_is_recorded_once_whatever_the_replays(world, drop):
    _write(drop, "legal.txt", "https://example.org/p.jpg\n" + key_of("lonely") + "\n" + "a" * 64)
    (item,) = [find_list_file(drop, lid) for lid in _ids(drop)]
    out = ListIntake(world.lab, drop, item.list_id, now=T1).run()
    assert out.accepted and out.reason is None and out.format == "txt"
    assert out.identifiers == 3 and out.batches == (A, B) and out.matched_images == 2
    lists = _rows(world.lab, OPT_OUT_LISTS, item.list_id)
    assert [(r["status"], r["rows"], r["matched_images"], r["batches"]) for r in lists] == [
        ("accepted", 3, 2, [A, B])
    ]
    opt_outs = _rows(world.lab, OPT_OUTS, item.list_id)
    assert sorted((r["identifier_kind"], r["matched_batch"] or "-") for r in opt_outs) == [
        ("key", "-"),  # names nothing yet: kept, applied when such an image arrives
        ("key", B),
        ("url", A),
    ]
    # A replay (a rerun of the partition, later) rewrites the same rows, arrival kept.
    again = ListIntake(world.lab, drop, item.list_id, now=T2).run()
    assert again.received_at == out.received_at == lists[0]["received_at"]
    assert _rows(world.lab, OPT_OUTS, item.list_id) == opt_outs
    assert _rows(world.lab, OPT_OUT_LISTS, item.list_id) == lists
    # Resolution is served by the images spec's indexes.
    indexed = {ix["fields"][0] for ix in world.lab.dataset(IMAGES.name).list_indices()}
    assert {"key", "url", "source_id"} <= indexed


def test_a_malformed_list_is_recorded_rejected_and_applies_nothing(world, drop):
    _write(drop, "bad.csv", "key\nnot-a-key\n")
    (lid,) = _ids(drop)
    out = ListIntake(world.lab, drop, lid, now=T1).run()
    assert not out.accepted and out.reason.startswith("bad_identifier: ")
    assert out.opt_outs_version is None and out.matched_images == 0 and out.batches == ()
    (row,) = _rows(world.lab, OPT_OUT_LISTS, lid)
    assert row["status"] == "rejected" and row["reason"] == out.reason
    assert _rows(world.lab, OPT_OUTS, lid) == []


def test_over_the_cap_is_rejected_unparsed(world, drop):
    _write(drop, "big.txt", key_of("lonely") + "\n" * 100)
    (lid,) = _ids(drop)
    out = ListIntake(world.lab, drop, lid, max_list_bytes=50, now=T1).run()
    assert out.reason.startswith("too_large: ") and _rows(world.lab, OPT_OUTS, lid) == []


def _matched(lab: Lab, list_id: str) -> list[tuple[str, str, str | None]]:
    rows = lab.read(OPT_OUTS.name, filter=f"list_id = '{list_id}'").to_pylist()
    return sorted({(r["identifier"], r["matched_batch"] or "-", r["matched_key"]) for r in rows})


def test_a_list_streamed_in_chunks_records_what_a_whole_read_does(world, drop, tmp_path):
    # Chunks of 2 identifiers against one chunk for the whole list, on two copies of one
    # lab: the same matches and counts; a repeat in another chunk is one more row (readers
    # take the rows as a set), a repeat within a chunk is not.
    lines = [
        key_of("lonely"),
        "https://example.org/p.jpg",
        "b" * 64,
        key_of("copy"),
        key_of("lonely"),  # a repeat, in another chunk of 2
    ]
    _write(drop, "registry.txt", "\n".join(lines) + "\n")
    (lid,) = _ids(drop)
    whole_lab = _copy_world(world, tmp_path / "whole")
    streamed = ListIntake(world.lab, drop, lid, chunk_entries=2, now=T1).run()
    whole = ListIntake(whole_lab, drop, lid, chunk_entries=100, now=T1).run()
    for out in (streamed, whole):
        assert out.accepted and out.matched_images == 3 and out.batches == (A, B)
    assert (streamed.identifiers, whole.identifiers) == (5, 4)
    assert world.lab.count(OPT_OUTS.name, f"list_id = '{lid}'") == 5
    assert _matched(world.lab, lid) == _matched(whole_lab, lid)
    assert len(_matched(whole_lab, lid)) == 4


def _copy_world(world: World, root: Path) -> Lab:
    shutil.copytree(world.lab.root, root)
    return Lab(root)


def test_a_source_that_records_malformed_entries_applies_the_rest(world, drop):
    _write(drop, "dump.txt", f"{key_of('lonely')}\nnot an identifier\n\n{key_of('photo')}\n")
    (lid,) = _ids(drop)
    strict = ListIntake(world.lab, drop, lid, now=T1).run()
    assert not strict.accepted and "line 2" in strict.reason
    assert _rows(world.lab, OPT_OUTS, lid) == []  # fail closed: nothing of it applies
    out = ListIntake(world.lab, drop, lid, on_malformed="record", now=T1).run()
    assert out.accepted and out.malformed == 1 and out.identifiers == 2
    assert {k for _, _, k in _matched(world.lab, lid)} == {key_of("lonely"), key_of("photo")}
    (problem,) = _rows(world.lab, OPT_OUT_PROBLEMS, lid)
    assert problem["position"] == "line 2" and "not an identifier" in problem["problem"]
    (row,) = _rows(world.lab, OPT_OUT_LISTS, lid)
    assert (row["status"], row["malformed"], row["rows"]) == ("accepted", 1, 2)


def test_a_structural_problem_rejects_under_either_policy(world, drop):
    (drop / "dump.txt").write_bytes(key_of("lonely").encode() + b"\n\xff\xfe\n")
    (lid,) = _ids(drop)
    for policy in ("reject", "record"):
        out = ListIntake(world.lab, drop, lid, on_malformed=policy, chunk_entries=1).run()
        assert not out.accepted and out.reason.startswith("bad_encoding: ")
        assert _rows(world.lab, OPT_OUTS, lid) == []  # the first chunk's rows never committed


def test_a_vanished_or_rewritten_file_records_nothing(world, drop):
    path = _write(drop, "legal.txt", key_of("lonely") + "\n")
    (lid,) = _ids(drop)
    path.write_text(key_of("photo") + "\n")
    with pytest.raises(ListFileChanged, match="no longer holds list"):
        ListIntake(world.lab, drop, lid).run()
    path.unlink()
    with pytest.raises(ListFileMissing):
        ListIntake(world.lab, drop, lid).run()
    assert not world.lab.exists(OPT_OUT_LISTS.name) and not world.lab.exists(OPT_OUTS.name)


def test_a_list_id_never_becomes_a_path(world, drop, tmp_path):
    outside = _write(tmp_path, "secret.txt", key_of("lonely") + "\n")
    (lid,) = _ids(tmp_path)  # a real id, of a file outside the opt-out directory
    for forged in (lid, f"../{lid}", f"{outside}@{lid.rsplit('@', 1)[1]}"):
        with pytest.raises(ListFileMissing):
            find_list_file(drop, forged)


def test_partition_keys_round_trip_and_avoid_what_dagster_refuses():
    for lid in ("a.txt@0123", "legal...2024.txt@ab", "x....y.csv@1", "caf%E9.txt@2"):
        key = list_partition_key(lid)
        assert "..." not in key and list_id_of_partition(key) == lid


def _ids(directory: Path) -> list[str]:
    cursor = OptOutCursor()
    lab = Lab(directory / ".no-lab")  # nothing recorded: every file is new
    return [f.list_id for f in plan_opt_out_tick(lab, directory, cursor, 100, set()).intake]


def test_the_tick_plan_asks_for_intake_then_exactly_the_partitions_reached(world, drop):
    registered = {A, B, C}
    _write(drop, "one.txt", key_of("photo") + "\n")
    cursor = OptOutCursor()
    first = plan_opt_out_tick(world.lab, drop, cursor, 8, registered)
    (item,) = first.intake
    assert first.skip_lists == {} and first.awaiting == [item.list_id]
    assert not world.lab.exists(OPT_OUT_LISTS.name)  # deciding wrote nothing

    # Not recorded yet (intake not run): asked for nothing more, the list stays awaited.
    waiting = plan_opt_out_tick(world.lab, drop, cursor, 8, registered)
    assert waiting.intake == [] and waiting.skip_lists == {} and waiting.awaiting == [item.list_id]

    ListIntake(world.lab, drop, item.list_id).run()
    second = plan_opt_out_tick(world.lab, drop, cursor, 8, registered)
    # photo's copy in B (its pHash cluster) is reached too; C holds nothing of it.
    assert second.intake == [] and second.skip_lists == {A: [item.list_id], B: [item.list_id]}
    assert [r.list_id for r in second.recorded] == [item.list_id] and second.awaiting == []
    assert plan_opt_out_tick(world.lab, drop, cursor, 8, registered).skip_lists == {}

    # A lost cursor: nothing is taken in again; the same partitions are requested again.
    lost = plan_opt_out_tick(world.lab, drop, OptOutCursor(), 8, registered)
    assert lost.intake == [] and lost.skip_lists == second.skip_lists

    # A list naming an unsharded image, and one of a batch that is no longer a partition.
    _write(drop, "two.txt", key_of("unsharded") + "\n")
    _write(drop, "three.txt", key_of("lonely") + "\n")
    new = plan_opt_out_tick(world.lab, drop, cursor, 8, {A, C})
    for f in new.intake:
        ListIntake(world.lab, drop, f.list_id).run()
    applied = plan_opt_out_tick(world.lab, drop, cursor, 8, {A, C})
    assert applied.skip_lists == {} and applied.waiting == [B, C]
    assert len(applied.recorded) == 2


def test_the_reach_is_the_intakes_and_a_list_recorded_without_one_is_reached_by_the_tick(
    world, drop
):
    # The intake run records which batches hold a copy (through the pHash cluster) and which
    # of them have one in a shard; the sensor's tick only reads that. A list recorded before
    # intakes did (null reach) is reached by the tick itself, with the same answer.
    _write(drop, "one.txt", key_of("photo") + "\n" + key_of("unsharded") + "\n")
    (lid,) = _ids(drop)
    out = ListIntake(world.lab, drop, lid, now=T1).run()
    (row,) = _rows(world.lab, OPT_OUT_LISTS, lid)
    assert (row["reach_batches"], row["reach_sharded"]) == ([A, B, C], [A, B])
    assert out.reach_sharded == (A, B)
    computed = plan_opt_out_tick(world.lab, drop, OptOutCursor(), 8, {A, B, C})
    assert computed.skip_lists == {A: [lid], B: [lid]} and computed.waiting == [C]
    # The tick reads the recorded reach, not the lab (a planted narrower reach is followed).
    narrow = {**row, "reach_batches": [A], "reach_sharded": [A]}
    world.lab.replace_rows(OPT_OUT_LISTS, "list_id", lid, pa.Table.from_pylist([narrow]))
    assert plan_opt_out_tick(world.lab, drop, OptOutCursor(), 8, {A, B, C}).skip_lists == {A: [lid]}
    legacy = {**row, "reach_batches": None, "reach_sharded": None}
    world.lab.replace_rows(OPT_OUT_LISTS, "list_id", lid, pa.Table.from_pylist([legacy]))
    recomputed = plan_opt_out_tick(world.lab, drop, OptOutCursor(), 8, {A, B, C})
    assert (recomputed.skip_lists, recomputed.waiting) == (computed.skip_lists, computed.waiting)


def test_the_cursor_of_the_sensor_before_intake_runs_still_loads(world, drop):
    _write(drop, "old.txt", key_of("photo") + "\n")
    (lid,) = _ids(drop)
    old = json.dumps({"processed": [lid], "seen": {}})  # written before intake was a run
    cursor = OptOutCursor.load(old)
    assert cursor.applied == {lid} and cursor.awaiting == set()
    tick = plan_opt_out_tick(world.lab, drop, cursor, 8, {A, B})
    assert tick.intake == [] and tick.skip_lists == {}  # processed then: not again
    assert OptOutCursor.load(cursor.dump()) == cursor
    shutil.rmtree(drop)
    assert plan_opt_out_tick(world.lab, drop, cursor, 8, {A, B}).intake == []


def _take_in(args: tuple[str, str, str]) -> str:
    """One intake in its own process (spawned: Lance is not fork-safe)."""
    lab_root, directory, list_id = args
    return ListIntake(Lab(lab_root), directory, list_id).run().status


def test_concurrent_intakes_of_different_lists_all_record(world, drop):
    # The daemon may run several intake runs at once (one per list): each commit to
    # opt_outs / opt_out_lists must survive the others (merge_insert retries contention).
    names = ["photo", "copy", "lonely", "unsharded"]
    for n in names:
        _write(drop, f"{n}.txt", key_of(n) + "\n")
    ids = _ids(drop)
    with spawn_pool(len(ids)) as pool:
        statuses = pool.map(_take_in, [(world.lab.root, str(drop), i) for i in ids])
    assert statuses == ["accepted"] * len(ids)
    assert sorted(world.lab.read(OPT_OUT_LISTS.name, ["list_id"]).column(0).to_pylist()) == ids
    matched = world.lab.read(OPT_OUTS.name, ["list_id", "matched_key"]).to_pylist()
    assert sorted((r["list_id"], r["matched_key"]) for r in matched) == sorted(
        zip(ids, [key_of(n) for n in sorted(names)], strict=True)
    )
