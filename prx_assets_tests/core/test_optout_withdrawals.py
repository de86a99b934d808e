"""Withdrawals in a registry's deltas, on a real lab: which opt-outs stand.

A withdrawal (an ``action`` of ``withdraw`` in a CSV/parquet list) takes back an opt-out of
the same identifier from an earlier list of the same source, only for a source allowed to
withdraw; everything else fails closed (the opt-out stands).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.core.lab import Lab
from prx_assets.core.skiplists.intake import ListIntake
from prx_assets.core.skiplists.matching import opted_out_keys
from prx_assets.core.skiplists.optouts import (
    OptOutListError,
    file_sha256,
    make_list_id,
    parse_list_bytes,
)
from prx_assets.core.snapshots.compliance import _reached
from prx_assets.core.tables import IMAGES, OPT_OUT_LISTS, OPT_OUTS
from prx_assets_tests.core.skip_world import World, key_of

A, B = "src.a", "src.b"
T1, T2, T3 = (datetime(2024, 6, d, tzinfo=UTC) for d in (1, 2, 3))


@pytest.fixture
def world(tmp_path) -> World:
    w = World(Lab(tmp_path / "lab"))
    w.image("photo", A, url="https://example.org/p.jpg")
    w.image("other", B)
    w.commit()
    return w


def _take(world: World, drop: Path, name: str, text: str, at: datetime, **kw):
    path = drop / name
    path.write_text(text)
    list_id = make_list_id(name, file_sha256(path))
    return ListIntake(world.lab, drop, list_id, now=at, **kw).run()


def _opted(world: World) -> dict[str, tuple[str, ...]]:
    images = world.lab.read(IMAGES.name, ["key", "url", "source", "source_id"])
    return opted_out_keys(world.lab, images)


@pytest.fixture
def drop(tmp_path) -> Path:
    d = tmp_path / "optouts"
    d.mkdir()
    return d


REG = {"source": "dntr", "allow_withdrawals": True}


def test_the_action_column_is_parsed_and_checked():
    parsed = parse_list_bytes(
        f"key,action\n{key_of('a')},\n{key_of('b')},Withdraw\n{key_of('c')},add\n".encode(), "d.csv"
    )
    assert [i.value for i in parsed.identifiers] == sorted([key_of("a"), key_of("c")])
    assert [i.value for i in parsed.withdrawals] == [key_of("b")]
    with pytest.raises(OptOutListError, match="action 'maybe' is not one of"):
        parse_list_bytes(f"key,action\n{key_of('a')},maybe\n".encode(), "d.csv")
    both = parse_list_bytes(
        f"key,action\n{key_of('a')},withdraw\n{key_of('a')},add\n".encode(), "d.csv"
    )
    assert both.withdrawals == () and len(both.identifiers) == 1  # in one list, the opt-out wins


def test_a_later_withdrawal_of_the_same_source_takes_the_opt_out_back(world, drop):
    photo = key_of("photo")
    added = _take(world, drop, "dntr-1.csv", f"key\n{photo}\n{key_of('other')}\n", T1, **REG)
    assert _opted(world) == {photo: (added.list_id,), key_of("other"): (added.list_id,)}
    pulled = _take(world, drop, "dntr-2.csv", f"key,action\n{photo},withdraw\n", T2, **REG)
    assert pulled.accepted and pulled.withdrawals == 1 and pulled.batches == (A,)
    assert _opted(world) == {key_of("other"): (added.list_id,)}
    # Recorded, not erased: both rows are there, and compliance of the first list says so.
    actions = world.lab.read(OPT_OUTS.name, ["list_id", "action"], f"matched_key = '{photo}'")
    assert sorted(actions.to_pylist(), key=str) == sorted(
        [
            {"list_id": added.list_id, "action": "add"},
            {"list_id": pulled.list_id, "action": "withdraw"},
        ],
        key=str,
    )
    reached, withdrawn = _reached(world.lab, added.list_id)
    assert set(reached) == {(B, key_of("other"))} and withdrawn == {(A, photo)}
    # The owner opts out again: a later opt-out stands.
    again = _take(world, drop, "dntr-3.csv", f"key\n{photo}\n", T3, **REG)
    assert _opted(world)[photo] == (again.list_id,)


def test_a_withdrawal_reaches_no_other_source_and_no_later_opt_out(world, drop):
    photo = key_of("photo")
    legal = _take(world, drop, "legal.txt", f"{photo}\n", T1)  # the default source
    url = _take(world, drop, "dntr-1.csv", "url\nhttps://example.org/p.jpg\n", T1, **REG)
    later = _take(world, drop, "dntr-3.csv", f"key\n{photo}\n", T3, **REG)
    _take(world, drop, "dntr-2.csv", f"key,action\n{photo},withdraw\n", T2, **REG)
    # The legal desk's opt-out is another source's; the URL opt-out names another identifier
    # (a withdrawal names what it withdraws); the opt-out made after the withdrawal stands.
    assert _opted(world)[photo] == tuple(sorted([legal.list_id, url.list_id, later.list_id]))


def test_a_withdrawal_from_a_source_not_allowed_to_withdraw_is_rejected_whole(world, drop):
    photo = key_of("photo")
    added = _take(world, drop, "dntr-1.csv", f"key\n{photo}\n", T1, source="dntr")
    out = _take(world, drop, "dntr-2.csv", f"key,action\n{photo},withdraw\n", T2, source="dntr")
    assert not out.accepted and out.reason.startswith("withdrawal_not_allowed: ")
    assert _opted(world) == {photo: (added.list_id,)}


def test_a_withdrawal_whose_list_is_not_recorded_accepted_withdraws_nothing(world, drop):
    # Its rows committed but its opt_out_lists row missing (killed between the two commits):
    # not an accepted list, so it withdraws nothing (fail closed).
    photo = key_of("photo")
    added = _take(world, drop, "dntr-1.csv", f"key\n{photo}\n", T1, **REG)
    pulled = _take(world, drop, "dntr-2.csv", f"key,action\n{photo},withdraw\n", T2, **REG)
    world.lab.delete(OPT_OUT_LISTS.name, f"list_id = '{pulled.list_id}'")
    assert _opted(world) == {photo: (added.list_id,)}


def test_rows_from_before_withdrawals_are_opt_outs(world, drop):
    # An opt_outs table without the action column (written before withdrawals) still reads.
    photo = key_of("photo")
    rows = pa.table(
        {
            "list_id": ["old.txt@1"],
            "identifier": [photo],
            "identifier_kind": ["key"],
            "received_at": pa.array([T1], pa.timestamp("us", tz="UTC")),
            "matched_key": [photo],
            "matched_batch": [A],
        }
    )
    import lance

    lance.write_dataset(rows, world.lab.uri(OPT_OUTS.name), mode="overwrite")
    assert _opted(world) == {photo: ("old.txt@1",)}
    pulled = _take(world, drop, "dntr-2.csv", f"key,action\n{photo},withdraw\n", T2, **REG)
    assert pulled.accepted  # the intake added the column; the old row is an opt-out
    assert "action" in world.lab.dataset(OPT_OUTS.name).schema.names
    # Its list has no accepted row here (source and arrival unknown): it stands.
    assert _opted(world) == {photo: ("old.txt@1",)}


def test_in_one_list_an_opt_out_is_never_withdrawn_even_across_its_chunks(world, drop):
    # Chunks of one identifier: the add and the withdrawal land as rows of one list (one
    # arrival time); the opt-out stands.
    photo = key_of("photo")
    text = f"key,action\n{photo},add\n{key_of('other')},add\n{photo},withdraw\n"
    out = _take(world, drop, "dntr-1.csv", text, T1, chunk_entries=1, **REG)
    assert out.accepted and out.withdrawals == 1
    assert _opted(world)[photo] == (out.list_id,)
