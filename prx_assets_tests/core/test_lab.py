"""The lab's contract on real Lance tables: one commit per partition, concurrent writers and
index builders, maintenance and orphan removal, and the read and write API every stage uses."""

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pyarrow as pa

from prx_assets.core.lab import MANUAL, Lab, TableSpec, full_text_query
from prx_assets_tests.spawned import spawn_pool

SPEC = TableSpec(
    name="t",
    schema=pa.schema([("batch", pa.string()), ("key", pa.string()), ("v", pa.int64())]),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"), ("batch", "BITMAP")),
)


def _rows(batch: str, n: int, v: int = 0) -> pa.Table:
    return pa.Table.from_pylist(
        [{"batch": batch, "key": f"{batch}-{i}", "v": v} for i in range(n)], schema=SPEC.schema
    )


def _content(lab: Lab) -> list[dict]:
    return sorted(lab.read("t").to_pylist(), key=lambda r: (r["batch"], r["key"]))


def test_replace_partition_touches_only_its_batch_and_is_idempotent(tmp_path):
    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "a", _rows("a", 5))
    lab.replace_partition(SPEC, "b", _rows("b", 3))
    before = _content(lab)
    stats = lab.replace_partition(SPEC, "a", _rows("a", 5))
    assert stats["rows_written"] == 5 and stats["rows_replaced"] == 5
    assert _content(lab) == before
    lab.replace_partition(SPEC, "a", _rows("a", 2, v=9))
    rows = _content(lab)
    assert [r["key"] for r in rows if r["batch"] == "a"] == ["a-0", "a-1"]
    assert all(r["v"] == 9 for r in rows if r["batch"] == "a")
    assert [r for r in rows if r["batch"] == "b"] == [r for r in before if r["batch"] == "b"]
    lab.replace_partition(SPEC, "a", _rows("a", 0))
    assert {r["batch"] for r in _content(lab)} == {"b"}


def test_rows_of_another_batch_are_refused(tmp_path):
    lab = Lab(tmp_path)
    try:
        lab.replace_partition(SPEC, "a", _rows("b", 2))
    except ValueError as exc:
        assert "other batches" in str(exc)
    else:
        raise AssertionError("rows of batch b were accepted for batch a")
    assert lab.read("t").num_rows == 0


def test_a_replacement_is_one_commit_readers_never_see_a_gap(tmp_path):
    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "a", _rows("a", 4))
    v1 = lab.dataset("t").version
    v2 = lab.replace_partition(SPEC, "a", _rows("a", 4, v=1))["version"]
    assert v2 == v1 + 1  # delete-old and add-new landed together (maintenance commits after)
    assert lab.dataset("t", version=v1).count_rows("batch = 'a'") == 4
    assert lab.dataset("t", version=v2).count_rows("batch = 'a'") == 4


def _write(args):
    root, batch, n = args
    Lab(root).replace_partition(SPEC, batch, _rows(batch, n))
    return batch


def test_concurrent_partitions_lose_no_rows(tmp_path):
    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "seed", _rows("seed", 10))
    jobs = [(str(tmp_path), f"p{i}", 50 + i) for i in range(6)] * 2  # each twice, racing
    with spawn_pool(4) as pool:
        assert sorted(pool.map(_write, jobs)) == sorted(j[1] for j in jobs)
    ds = lab.dataset("t")
    for i in range(6):
        assert ds.count_rows(f"batch = 'p{i}'") == 50 + i
    assert ds.count_rows() == 10 + sum(50 + i for i in range(6))


def test_maintenance_compacts_fragments_and_keeps_indexes(tmp_path):
    lab = Lab(tmp_path, policy=MANUAL)  # no write-path maintenance: maintain does it all
    for i in range(8):
        lab.replace_partition(SPEC, f"b{i}", _rows(f"b{i}", 20))
    assert len(lab.dataset("t").get_fragments()) == 8
    result = lab.maintain(SPEC, target_rows_per_fragment=1_000_000, retention=timedelta(0))
    assert result["fragments_after"] == 1 and result["rows"] == 160
    ds = lab.dataset("t")
    assert {ix["name"] for ix in ds.list_indices()} >= {"key_idx", "batch_idx"}
    plan = ds.scanner(columns=["key"], filter="batch = 'b3'").explain_plan()
    assert "ScalarIndexQuery" in plan
    assert ds.count_rows("batch = 'b3'") == 20


def test_the_lab_works_through_a_uri_as_on_object_storage(tmp_path):
    # Object stores are reached by URI (s3://, gs://); file:// takes the same code path
    # (no local lock, no mkdir) without a network.
    lab = Lab(f"file://{tmp_path}/lab")
    assert lab.uri("t") == f"file://{tmp_path}/lab/t.lance"
    lab.replace_partition(SPEC, "a", _rows("a", 3))
    lab.replace_partition(SPEC, "a", _rows("a", 2, v=5))
    assert _content(lab) == [
        {"batch": "a", "key": "a-0", "v": 5},
        {"batch": "a", "key": "a-1", "v": 5},
    ]
    assert not (tmp_path / "lab" / ".locks").exists()


def _ensure(root: str) -> bool:
    Lab(root).ensure_indexes(SPEC)
    return True


def test_concurrent_index_creation_tolerates_preempted_commits(tmp_path):
    # Writers racing to create the same index: Lance preempts all but one CreateIndex.
    lab = Lab(tmp_path)
    unindexed = TableSpec(SPEC.name, SPEC.schema, SPEC.identity, indexes=())
    for i in range(3):
        lab.replace_partition(unindexed, f"b{i}", _rows(f"b{i}", 30))
    assert lab.dataset("t").list_indices() == []
    with spawn_pool(4) as pool:
        assert pool.map(_ensure, [str(tmp_path)] * 8) == [True] * 8
    names = {ix["name"] for ix in lab.dataset("t").list_indices()}
    assert names == {"key_idx", "batch_idx"}


# A writer that gets as far as Lab.replace_partition's first half (its fragments written),
# then waits before committing: killed there, it leaves files no version references.
WRITER = """
import os, sys, time
import lance, pyarrow as pa
from lance.fragment import write_fragments
uri, batch, written, go = sys.argv[1:5]
schema = pa.schema([("batch", pa.string()), ("key", pa.string()), ("v", pa.int64())])
rows = pa.Table.from_pylist(
    [{"batch": batch, "key": f"{batch}-{i}", "v": 7} for i in range(50)], schema=schema
)
fragments = write_fragments(rows, uri, schema=schema)
open(written, "w").close()
deadline = time.monotonic() + 120  # never outlive a test that failed before saying go
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
ds = lance.dataset(uri)
lance.LanceDataset.commit(uri, lance.LanceOperation.Append(fragments), read_version=ds.version)
"""


def _writer(tmp_path, lab: Lab, batch: str):
    import subprocess
    import sys
    import time

    written, go = tmp_path / f"{batch}.written", tmp_path / f"{batch}.go"
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, lab.uri("t"), batch, str(written), str(go)]
    )
    deadline = time.monotonic() + 60
    while not written.exists():
        assert child.poll() is None, "the writer died before writing its fragments"
        assert time.monotonic() < deadline, "the writer did not write its fragments"
        time.sleep(0.05)
    return child, go


def _data_files(lab: Lab) -> set[str]:
    from pathlib import Path

    return {p.name for p in (Path(lab.uri("t")) / "data").iterdir()}


def _age_everything(lab: Lab, days: float) -> None:
    """As if ``days`` had passed since every file of the table was written."""
    import os
    import time
    from pathlib import Path

    then = time.time() - days * 86400
    for path in Path(lab.uri("t")).rglob("*"):
        if path.is_file():
            os.utime(path, (then, then))


def test_maintenance_removes_files_a_killed_writer_left_and_spares_in_flight_ones(tmp_path):
    import signal

    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "a", _rows("a", 5))
    lab.replace_partition(SPEC, "b", _rows("b", 3))
    before, referenced = _content(lab), _data_files(lab)

    killed, _ = _writer(tmp_path, lab, "killed")
    killed.send_signal(signal.SIGKILL)  # after write_fragments, before any commit
    killed.wait(timeout=30)
    orphans = _data_files(lab) - referenced
    assert orphans, "the killed writer left no data file to clean up"

    # Fresh files may be an in-flight write: kept, whatever their number.
    result = lab.maintain(SPEC)
    assert _data_files(lab) >= orphans and result["orphan_files_kept_recent"] >= len(orphans)

    # Older than the threshold they are garbage: removed; every referenced file stays.
    _age_everything(lab, days=2)
    in_flight, go = _writer(tmp_path, lab, "inflight")  # written now: young
    try:
        young = _data_files(lab) - referenced - orphans
        result = lab.maintain(SPEC)
        left = _data_files(lab)
        assert not (orphans & left), "orphaned data files survived maintenance"
        assert result["orphan_files_removed"] >= len(orphans)
        assert young <= left  # the in-flight writer's fragments were not touched
        assert _content(lab) == before
        lab.dataset("t").validate()

        go.write_text("")  # the in-flight writer commits: its files are all there
        assert in_flight.wait(timeout=60) == 0
    finally:
        if in_flight.poll() is None:
            in_flight.kill()
            in_flight.wait(timeout=30)
    assert lab.dataset("t").count_rows("batch = 'inflight'") == 50
    assert [r for r in _content(lab) if r["batch"] != "inflight"] == before
    lab.dataset("t").validate()


def test_orphans_are_found_through_a_uri_as_on_object_storage(tmp_path):
    from lance.fragment import write_fragments

    lab = Lab(f"file://{tmp_path}/lab")
    lab.replace_partition(SPEC, "a", _rows("a", 4))
    local = Lab(tmp_path / "lab")  # the same table, to list and age its files
    referenced = _data_files(local)
    write_fragments(_rows("x", 3), lab.uri("t"), schema=SPEC.schema)  # never committed
    orphans = _data_files(local) - referenced
    assert orphans
    _age_everything(local, days=2)
    result = lab.maintain(SPEC)
    assert result["orphan_files_removed"] == len(orphans) and result["orphan_files_unmapped"] == 0
    assert _data_files(local) == referenced
    assert _content(lab) == [{"batch": "a", "key": f"a-{i}", "v": 0} for i in range(4)]


def test_a_negative_orphan_age_is_refused(tmp_path):
    import pytest

    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "a", _rows("a", 1))
    with pytest.raises(ValueError, match="min_age"):
        lab.remove_orphaned_files("t", timedelta(days=7), timedelta(hours=-1))


# --------------------------------------------------------------------------- the read API


def test_absent_tables_read_as_empty_and_count_nothing(tmp_path):
    lab = Lab(tmp_path)
    assert lab.read("t").num_rows == 0 and lab.count("t") == 0 and lab.version("t") is None
    view = lab.view()
    assert not view.exists("t") and view.count("t") == 0 and view.schema("t") is None
    assert view.read("t").num_rows == 0 and view.explain("t") is None
    assert view.indexed_columns("t") == {} and view.pin(["t"]) == {}


def test_a_pinned_view_keeps_reading_the_version_it_opened(tmp_path):
    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "a", _rows("a", 3))
    view = lab.view()
    pinned = view.pin(["t", "absent"])
    assert pinned == {"t": lab.version("t")} and view.versions == pinned
    lab.replace_partition(SPEC, "a", _rows("a", 5, v=1))
    lab.replace_partition(SPEC, "b", _rows("b", 2))
    assert view.count("t") == 3 and view.version("t") == pinned["t"]
    assert {r["v"] for r in view.read("t", ["v"]).to_pylist()} == {0}
    assert lab.count("t") == 7 and lab.view().count("t", "batch = 'a'") == 5
    again = lab.view(pinned)  # a new view at the same versions reads the same rows
    assert again.read("t").to_pylist() == view.read("t").to_pylist()


def test_a_view_opens_each_table_once_whatever_it_reads_and_from_how_many_threads(tmp_path):
    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "a", _rows("a", 3))
    opened: list[str] = []
    real_open = lab._open
    lab._open = lambda table, version=None: opened.append(table) or real_open(table, version)
    view = lab.view()
    with ThreadPoolExecutor(8) as pool:
        counts = list(pool.map(lambda _: view.count("t", "batch = 'a'"), range(32)))
    view.read("t", ["key"])
    view.schema("t")
    view.explain("t", ["key"])
    view.count("absent")
    view.read("absent")
    assert counts == [3] * 32 and sorted(opened) == ["absent", "t"]


def test_a_view_passes_scan_options_and_explains_the_same_read(tmp_path):
    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "a", _rows("a", 40))
    lab.replace_partition(SPEC, "b", _rows("b", 10))
    view = lab.view()
    assert view.indexed_columns("t") == {"key": {"BTREE"}, "batch": {"BITMAP"}}
    assert view.read("t", ["key"], "batch = 'a'", limit=4).num_rows == 4
    assert view.count("t", "batch = 'b'") == 10
    assert view.count("t", "batch = 'b'", use_scalar_index=False) == 10
    assert "ScalarIndexQuery" in view.explain("t", ["key"], "key = 'a-3'")
    assert "ScalarIndexQuery" not in view.explain(
        "t", ["key"], "key = 'a-3'", use_scalar_index=False
    )


def test_full_text_queries_are_built_by_the_lab(tmp_path):
    spec = TableSpec(
        "docs",
        pa.schema([("batch", pa.string()), ("key", pa.string()), ("text", pa.string())]),
        ("batch", "key"),
    )
    lab = Lab(tmp_path)
    texts = ["a red brick wall", "a red door", "green grass"]
    rows = [{"batch": "a", "key": f"k{i}", "text": t} for i, t in enumerate(texts)]
    lab.replace_partition(spec, "a", pa.Table.from_pylist(rows, schema=spec.schema))
    assert lab.ensure_text_index("docs", "text", "text_idx") == "created"
    view = lab.view()

    def hits(text: str, all_terms: bool) -> set[str]:
        query = full_text_query(text, "text", all_terms=all_terms)
        return set(view.read("docs", ["key"], full_text_query=query).column("key").to_pylist())

    assert hits("red wall", all_terms=True) == {"k0"}
    assert hits("red wall", all_terms=False) == {"k0", "k1"}
    assert hits("blue", all_terms=False) == set()


# --------------------------------------------------------------------------- other writes


def test_append_and_delete_are_one_commit_each(tmp_path):
    lab = Lab(tmp_path)
    v1 = lab.append(SPEC, _rows("q", 4))
    assert lab.count("t") == 4 and lab.version("t") == v1
    assert lab.append(SPEC, _rows("q", 0)) == v1  # nothing to add: no commit
    v2 = lab.delete("t", "key IN ('q-0', 'q-2')")
    assert v2 == v1 + 1 and sorted(r["key"] for r in _content(lab)) == ["q-1", "q-3"]
    assert lab.delete("absent", "true") == 0


def test_replace_rows_makes_exactly_the_rows_of_one_value(tmp_path):
    lab = Lab(tmp_path)
    lab.replace_rows(SPEC, "batch", "l1", _rows("l1", 3))
    lab.replace_rows(SPEC, "batch", "l2", _rows("l2", 2))
    lab.replace_rows(SPEC, "batch", "l1", _rows("l1", 2, v=7))  # one row gone, two updated
    lab.replace_rows(SPEC, "batch", "l1", _rows("l1", 2, v=7))  # a replay changes nothing
    rows = _content(lab)
    assert [(r["key"], r["v"]) for r in rows if r["batch"] == "l1"] == [("l1-0", 7), ("l1-1", 7)]
    assert len([r for r in rows if r["batch"] == "l2"]) == 2
    try:
        lab.replace_rows(SPEC, "batch", "l1", _rows("l2", 1))
    except ValueError as exc:
        assert "other values" in str(exc)
    else:
        raise AssertionError("rows of l2 were accepted as the rows of l1")


def test_take_matching_reads_the_rows_a_filter_read_does_at_the_pinned_version(tmp_path):
    # Row ids through the indexes, then a take: the same rows as the filtered scan, also
    # after replacements left deleted rows in old fragments, and at the view's version.
    lab = Lab(tmp_path)
    lab.replace_partition(SPEC, "a", _rows("a", 6))
    lab.replace_partition(SPEC, "b", _rows("b", 4))
    lab.replace_partition(SPEC, "a", _rows("a", 5, v=2))  # deletes a's first rows
    view = lab.view()
    where = "batch = 'a' AND key IN ('a-1', 'a-4', 'a-5', 'b-1')"

    def rows(table: pa.Table) -> list[dict]:
        return sorted(table.to_pylist(), key=lambda r: r["key"])

    taken = rows(view.take_matching("t", ["key", "v"], where))
    assert taken == rows(view.read("t", ["key", "v"], where))
    assert taken == [{"key": "a-1", "v": 2}, {"key": "a-4", "v": 2}]  # a-5 was deleted
    lab.replace_partition(SPEC, "a", _rows("a", 6, v=3))
    assert rows(view.take_matching("t", ["key", "v"], where)) == taken  # pinned
    assert view.take_matching("t", ["key"], "batch = 'none'").num_rows == 0
    assert view.take_matching("absent", ["key"], "batch = 'a'").num_rows == 0
