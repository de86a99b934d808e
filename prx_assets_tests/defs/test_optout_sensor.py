"""The opt-out sensor with a real instance and Lance lab: each list taken in once by its own
intake run, then exactly the affected partitions requested; malformed lists rejected without
blocking the next; replays idempotent; the sensor itself never writes a table."""

import io
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import (
    AssetKey,
    Definitions,
    SensorResult,
    build_sensor_context,
    materialize,
)

from prx_assets.core.lab import Lab
from prx_assets.core.skiplists.intake import list_partition_key
from prx_assets.core.tables import IMAGES, LAB_TABLES, OPT_OUT_LISTS, OPT_OUTS, SHARD_SAMPLES
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.assets import build_skiplist_assets
from prx_assets.defs.skiplists.config import OptOutResource, OptOutSource, SkipPolicyResource
from prx_assets.defs.skiplists.intake import OPT_OUT_LISTS as LIST_PARTITIONS
from prx_assets.defs.skiplists.intake import opt_out_lists
from prx_assets.defs.skiplists.sensors import LISTS_TAG, build_opt_out_sensor, opt_out_sensor
from prx_assets_tests.bounds import MIB, peak_rss_growth, sparse_file

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"

PUBLIC = "public-skimage.000"
STUDIO = "internal-studio.002"


class World:
    def __init__(self, instance, lab_resource, images: dict[str, list[dict]], unsharded: str):
        self.instance = instance
        self.lab = lab_resource
        self.store = lab_resource.lab()
        self.images = images
        self.unsharded = unsharded  # an image of PUBLIC with no shard_samples row
        self.dir = os.path.join(lab_resource.data_root, "optouts")
        os.makedirs(self.dir, exist_ok=True)

    def drop(self, name: str, data: bytes | str) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        return path

    def tick(self, cursor: str | None, optouts: OptOutResource | None = None, sensor=None):
        """One tick; its new partitions are added, as the daemon does. Writes no table."""
        resources = {"lab": self.lab, "optouts": optouts or OptOutResource()}
        before = _versions(self.store)
        with build_sensor_context(
            instance=self.instance, cursor=cursor, resources=resources
        ) as ctx:
            result = (sensor or opt_out_sensor)(ctx)
        assert isinstance(result, SensorResult)
        assert _versions(self.store) == before, "a sensor tick wrote to the lab"
        for req in result.dynamic_partitions_requests or []:
            assert req.partitions_def_name == LIST_PARTITIONS.name
            self.instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        return result

    def run(self, result: SensorResult, optouts: OptOutResource | None = None, ok: bool = True):
        """Execute the intake runs a tick requested (real materialisations of opt_out_lists)."""
        results = []
        for request in result.run_requests:
            if request.asset_selection != [AssetKey("opt_out_lists")]:
                continue
            results.append(
                materialize(
                    [opt_out_lists],
                    partition_key=request.partition_key,
                    instance=self.instance,
                    resources={"lab": self.lab, "optouts": optouts or OptOutResource()},
                    tags=dict(request.tags),
                    raise_on_error=False,
                )
            )
            # A rejected list is recorded, and its partition fails (unmistakable in the UI).
            status = self.lists().get(request.tags.get(LISTS_TAG), {}).get("status")
            assert results[-1].success == (ok and status != "rejected"), (request, status)
        return results

    def cycle(self, cursor: str | None, optouts: OptOutResource | None = None):
        """A tick requesting only intakes, those runs, and the next tick: (first, second)."""
        first = self.tick(cursor, optouts)
        assert _intakes(first) and not _requests(first)
        self.run(first, optouts)
        return first, self.tick(first.cursor, optouts)

    def lists(self) -> dict[str, dict]:
        return {r["list_id"]: r for r in self.store.read(OPT_OUT_LISTS.name).to_pylist()}

    def opt_outs(self) -> list[dict]:
        rows = self.store.read(OPT_OUTS.name).to_pylist()
        return sorted(rows, key=lambda r: (r["list_id"], r["identifier"], str(r["matched_key"])))

    def first(self, batch: str, **where) -> dict:
        return next(r for r in self.images[batch] if all(r[k] == v for k, v in where.items()))


def _versions(store: Lab) -> dict[str, int | None]:
    return {spec.name: store.version(spec.name) for spec in LAB_TABLES}


@pytest.fixture
def world(instance, lab_resource) -> World:
    instance.add_dynamic_partitions(BATCHES.name, [PUBLIC, STUDIO])
    for batch in (PUBLIC, STUDIO):
        ok = materialize(
            [raw_images], partition_key=batch, instance=instance, resources={"lab": lab_resource}
        )
        assert ok.success
    store = lab_resource.lab()
    images = {
        b: sorted(
            store.read_batch(
                IMAGES.name, b, ["key", "batch", "url", "source", "source_id"]
            ).to_pylist(),
            key=lambda r: r["key"],
        )
        for b in (PUBLIC, STUDIO)
    }
    unsharded = next(r["key"] for r in images[PUBLIC] if r["url"] is None)
    for batch, rows in images.items():
        located = [
            {
                "key": r["key"],
                "batch": batch,
                "relative_dir": f"mds/512/512x512/{batch}",
                "shard": "shard.00000.mds",
                "index_in_shard": i,
            }
            for i, r in enumerate(x for x in rows if x["key"] != unsharded)
        ]
        store.replace_partition(
            SHARD_SAMPLES, batch, pa.Table.from_pylist(located, schema=SHARD_SAMPLES.schema)
        )
    return World(instance, lab_resource, images, unsharded)


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _requests(result: SensorResult) -> list[tuple[str, str]]:
    """The skip_lists requests of a tick: (partition, run key)."""
    out = []
    for r in result.run_requests:
        if r.asset_selection == [AssetKey("skip_lists")]:
            assert r.job_name == "opt_out_skip_lists" and r.tags["prx/trigger"] == "opt_out"
            out.append((r.partition_key, r.run_key))
        else:
            assert r.asset_selection == [AssetKey("opt_out_lists")], r
    return out


def _intakes(result: SensorResult) -> list[str]:
    """The list ids whose intake a tick requested (checking key, run key and tags)."""
    out = []
    for r in result.run_requests:
        if r.asset_selection != [AssetKey("opt_out_lists")]:
            continue
        list_id = r.tags["prx/opt_out_lists"]
        assert r.job_name == "opt_out_intake" and r.tags["prx/trigger"] == "opt_out"
        assert r.partition_key == list_partition_key(list_id)
        assert r.run_key == f"opt_out_intake:{list_id}"
        out.append(list_id)
    return out


def test_each_list_once_affected_partitions_only_and_bad_lists_do_not_block(world):
    w = world
    public_key = w.first(PUBLIC, url=None)["key"]
    if public_key == w.unsharded:
        public_key = next(r["key"] for r in w.images[PUBLIC] if r["key"] != w.unsharded)
    # Files that must never be read: hidden, private, in-flight, other extensions.
    for name in (".hidden.txt", "_staging.csv", "next.txt.tmp", "big.csv.partial", "x.json"):
        w.drop(name, public_key + "\n")

    first = w.drop("2024-05-01-legal.txt", f"# takedown 123\n{public_key}\n")
    i1 = w.tick(None)
    (lid1,) = _intakes(i1)
    assert lid1.startswith("2024-05-01-legal.txt@")
    assert w.lists() == {} and w.opt_outs() == []  # the sensor requested; it recorded nothing
    assert w.instance.get_dynamic_partitions("opt_out_lists") == [lid1]
    w.run(i1)
    r1 = w.tick(i1.cursor)
    assert not _intakes(r1)
    assert _requests(r1) == [(PUBLIC, f"opt_out:{lid1}:{PUBLIC}")]
    assert r1.run_requests[0].tags["prx/opt_out_lists"] == lid1
    rows = w.opt_outs()
    assert [(r["identifier"], r["identifier_kind"], r["matched_batch"]) for r in rows] == [
        (public_key, "key", PUBLIC)
    ]
    meta = w.lists()[lid1]
    assert meta["status"] == "accepted" and meta["rows"] == 1 and meta["path"] == first
    assert meta["batches"] == [PUBLIC] and meta["matched_images"] == 1

    # Resolution went through scalar indexes on images.key/url/source_id.
    indexed = {ix["fields"][0] for ix in w.store.dataset(IMAGES.name).list_indices()}
    assert {"key", "url", "source_id"} <= indexed

    # Next tick: nothing new, nothing requested.
    r2 = w.tick(r1.cursor)
    assert not r2.run_requests and r2.skip_reason is not None
    assert len(w.lists()) == 1

    # A malformed list and, after it in name order, a good one naming a studio image by
    # source id plus a URL nobody has: the bad one is rejected, the good one applied.
    w.drop("2024-05-02-broken.csv", "key,note\nnot-a-key,oops\n")
    studio = w.first(STUDIO, url=None)
    assert studio["source_id"]
    table = pa.table(
        {
            "source": [studio["source"], None],
            "source_id": [studio["source_id"], None],
            "url": [None, "https://nobody.example/x.jpg"],
        }
    )
    w.drop("2024-05-03-studio.parquet", _parquet(table))
    i3, r3 = w.cycle(r2.cursor)
    bad, good = _intakes(i3)
    assert bad.startswith("2024-05-02-broken.csv@") and good.startswith(
        "2024-05-03-studio.parquet@"
    )
    lists = w.lists()
    assert lists[bad]["status"] == "rejected"
    assert lists[bad]["reason"].startswith("bad_identifier: ")
    assert "line 2, column 'key'" in lists[bad]["reason"]
    assert not [r for r in w.opt_outs() if r["list_id"] == bad]
    assert lists[good]["status"] == "accepted" and lists[good]["rows"] == 2
    assert _requests(r3) == [(STUDIO, f"opt_out:{good}:{STUDIO}")] and not _intakes(r3)
    good_rows = {r["identifier"]: r for r in w.opt_outs() if r["list_id"] == good}
    assert good_rows[f"{studio['source']}:{studio['source_id']}"]["matched_key"] == studio["key"]
    assert good_rows["https://nobody.example/x.jpg"]["matched_key"] is None

    # Nothing is picked up twice, and the ignored files never were.
    r4 = w.tick(r3.cursor)
    assert not r4.run_requests
    assert set(w.lists()) == {lid1, bad, good}
    assert sorted(w.instance.get_dynamic_partitions("opt_out_lists")) == sorted(w.lists())


def test_the_intake_partition_shows_the_outcome_and_a_rejection_fails_it(world):
    w = world
    w.drop("a-good.txt", w.images[STUDIO][0]["key"] + "\n")
    w.drop("b-bad.txt", "not an identifier\n")
    tick = w.tick(None)
    good, bad = _intakes(tick)
    accepted, rejected = w.run(tick)
    md = accepted.asset_materializations_for_node("opt_out_lists")[0].metadata
    assert md["list_id"].value == good and md["status"].value == "accepted"
    assert md["identifiers"].value == 1 and md["matched_images"].value == 1
    assert md["batches"].value == [STUDIO]
    (check,) = accepted.get_asset_check_evaluations()
    assert check.check_name == "opt_out_list_accepted" and check.passed
    # Finding: a rejected list showed as a green "Materialized" partition beside a failed
    # check. It is recorded, and its run fails with the reason: red, not "applied".
    assert not rejected.success
    assert not rejected.asset_materializations_for_node("opt_out_lists")
    (failure,) = rejected.get_step_failure_events()
    data = failure.step_failure_data.user_failure_data
    assert data.description.startswith(f"opt-out list {bad} was REJECTED and none of it")
    assert data.metadata["status"].value == "rejected"
    assert data.metadata["reason"].value == w.lists()[bad]["reason"]
    assert w.lists()[bad]["reason"].startswith("bad_identifier: ")
    assert data.metadata["identifiers"].value == 0


def test_a_source_recording_malformed_entries_applies_the_rest_and_says_so(world):
    # Per source: the registry's dumps record malformed entries; other lists fail closed.
    w = world
    key = w.images[STUDIO][0]["key"]
    w.drop("dntr-dump.txt", f"{key}\nnot an identifier\n")
    w.drop("legal.txt", f"{key}\nnot an identifier\n")
    optouts = OptOutResource(sources=[OptOutSource(pattern="dntr-*", on_malformed="record")])
    tick = w.tick(None, optouts)
    dump, legal = _intakes(tick)
    recorded, rejected = w.run(tick, optouts)
    md = recorded.asset_materializations_for_node("opt_out_lists")[0].metadata
    assert md["status"].value == "accepted" and md["malformed_entries"].value == 1
    assert md["identifiers"].value == 1 and md["matched_images"].value == 1
    assert not rejected.success and w.lists()[legal]["status"] == "rejected"
    problems = w.store.read("opt_out_problems").to_pylist()
    assert [(p["list_id"], p["position"]) for p in problems] == [(dump, "line 2")]
    assert _requests(w.tick(tick.cursor, optouts)) == [(STUDIO, f"opt_out:{dump}:{STUDIO}")]


def test_a_file_changed_before_its_intake_records_nothing_and_its_new_bytes_are_a_new_list(world):
    w = world
    path = w.drop("legal.txt", w.images[STUDIO][0]["key"] + "\n")
    first = w.tick(None)
    (old,) = _intakes(first)
    with open(path, "a") as fh:  # rewritten in place before the intake ran
        fh.write(w.images[STUDIO][1]["key"] + "\n")
    os.utime(path, ns=(1, 1))
    (failed,) = w.run(first, ok=False)
    assert "no longer holds list" in str(
        next(
            e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"
        ).event_specific_data.error
    )
    assert w.lists() == {} and w.opt_outs() == []
    # The sensor still awaits the old list (a rerun of its partition would record it) and
    # takes the new bytes in as a new list; only the recorded one is applied.
    second = w.tick(first.cursor)
    (new,) = _intakes(second)
    assert new != old and not _requests(second)
    w.run(second)
    third = w.tick(second.cursor)
    assert _requests(third) == [(STUDIO, f"opt_out:{new}:{STUDIO}")]
    assert set(w.lists()) == {new}


def test_matches_without_shards_or_partition_request_nothing(world):
    w = world
    w.drop("a.txt", w.unsharded + "\n")  # the image exists but was never written to a shard
    _, r1 = w.cycle(None)
    assert not r1.run_requests
    (lid,) = w.lists()
    assert (
        w.lists()[lid]["matched_images"] == 1
        and "no sharded partition" in r1.skip_reason.skip_message
    )

    w.instance.delete_dynamic_partition(BATCHES.name, STUDIO)
    studio_key = w.images[STUDIO][0]["key"]
    w.drop("b.txt", studio_key + "\n")
    _, r2 = w.cycle(r1.cursor)
    assert not r2.run_requests  # matched and sharded, but no longer a partition


def test_a_shared_url_and_a_key_in_two_lists_of_one_tick(world):
    w = world
    shared = next(
        r["url"]
        for r in w.images[PUBLIC]
        if r["url"] and sum(x["url"] == r["url"] for x in w.images[PUBLIC]) >= 2
    )
    studio_key = w.images[STUDIO][-1]["key"]
    w.drop("one.txt", shared + "\n")
    w.drop("two.csv", f"identifier,requested_by\n{studio_key},legal\n{shared},legal\n")
    i, r = w.cycle(None)
    one, two = _intakes(i)
    assert one.startswith("one.txt@") and two.startswith("two.csv@")
    # Both partitions in one run over their range, naming every list that affects one.
    (request,) = [q for q in r.run_requests if q.asset_selection == [AssetKey("skip_lists")]]
    assert request.partition_key is None and request.tags[LISTS_TAG] == f"{one},{two}"
    assert (request.tags[RANGE_START], request.tags[RANGE_END]) == (PUBLIC, STUDIO)
    assert request.tags["prx/partitions"] == "2" and request.tags["prx/bridged_partitions"] == "0"
    assert request.run_key.startswith(f"opt_out:{one}+{two}:{PUBLIC}..{STUDIO}:")
    # One run per partition, naming exactly the lists that affect it, when runs hold one
    # (a lost cursor: the recorded lists are planned again).
    r2 = w.tick(None, OptOutResource(max_partitions_per_run=1))
    assert sorted(_requests(r2)) == [
        (STUDIO, f"opt_out:{two}:{STUDIO}"),
        (PUBLIC, f"opt_out:{one}+{two}:{PUBLIC}"),
    ]
    n_shared = sum(x["url"] == shared for x in w.images[PUBLIC])
    assert w.lists()[one]["matched_images"] == n_shared


def test_replays_are_idempotent_and_edits_are_new_lists(world):
    w = world
    key = w.images[STUDIO][0]["key"]
    path = w.drop("legal.txt", key + "\n")
    i1, r1 = w.cycle(None)
    before_lists, before_rows = w.lists(), w.opt_outs()

    # The cursor is lost (sensor reset): the list is found again under the same id; it is
    # recorded already, so no intake is requested, and its partition is requested under the
    # same run key, which Dagster does not launch twice.
    again = w.tick(None)
    assert not _intakes(again) and _requests(again) == _requests(r1)
    # A replayed intake run rewrites the same rows (arrival time kept).
    w.run(i1)
    assert w.lists() == before_lists and w.opt_outs() == before_rows

    # Editing a processed file makes a new list; the old one's opt-outs stay.
    with open(path, "a") as fh:
        fh.write(w.images[STUDIO][1]["key"] + "\n")
    os.utime(path, ns=(1, 1))  # a different mtime: the name is re-hashed
    i3, r3 = w.cycle(r1.cursor)
    (new_id,) = _intakes(i3)
    assert new_id not in before_lists and len(w.lists()) == 2
    assert _requests(r3) == [(STUDIO, f"opt_out:{new_id}:{STUDIO}")]
    assert len(w.opt_outs()) == 3


def test_lists_beyond_the_per_tick_limit_wait_their_turn(world):
    w = world
    w.drop("a.txt", w.images[PUBLIC][1]["key"] + "\n")
    w.drop("b.txt", w.images[STUDIO][0]["key"] + "\n")
    limited = OptOutResource(max_lists_per_tick=1)
    t1 = w.tick(None, limited)
    (a,) = _intakes(t1)
    assert a.startswith("a.txt@") and not _requests(t1)
    w.run(t1)
    t2 = w.tick(t1.cursor, limited)
    (b,) = _intakes(t2)
    assert b.startswith("b.txt@") and [p for p, _ in _requests(t2)] == [PUBLIC]
    w.run(t2)
    t3 = w.tick(t2.cursor, limited)
    assert not _intakes(t3) and [p for p, _ in _requests(t3)] == [STUDIO]
    assert not w.tick(t3.cursor, limited).run_requests


def test_a_list_name_with_three_dots_is_a_valid_partition(world):
    w = world
    w.drop("legal...2024.txt", w.images[STUDIO][0]["key"] + "\n")
    i, r = w.cycle(None)
    (lid,) = _intakes(i)
    assert lid.startswith("legal...2024.txt@") and "..." not in list_partition_key(lid)
    assert list(w.lists()) == [lid]
    assert _requests(r) == [(STUDIO, f"opt_out:{lid}:{STUDIO}")]


def test_configurable_directory_interval_and_definitions(world, tmp_path):
    w = world
    elsewhere = tmp_path / "legal-drop"
    elsewhere.mkdir()
    (elsewhere / "x.txt").write_text(w.images[STUDIO][0]["key"] + "\n")
    fast = build_opt_out_sensor(name="fast_opt_out_sensor", minimum_interval_seconds=5)
    assert fast.minimum_interval_seconds == 5 and opt_out_sensor.minimum_interval_seconds == 60
    there = OptOutResource(landing_dir=str(elsewhere))
    first = w.tick(None, there, sensor=fast)
    assert len(_intakes(first)) == 1
    w.run(first, there)
    r = w.tick(first.cursor, there, sensor=fast)
    assert [p for p, _ in _requests(r)] == [STUDIO]

    defs = Definitions(
        assets=[*build_skiplist_assets(), opt_out_lists],
        sensors=[opt_out_sensor],
        resources={
            "lab": LabResource(data_root=str(tmp_path / "d")),
            "skip_policy": SkipPolicyResource(),
            "optouts": OptOutResource(),
        },
    )
    Definitions.validate_loadable(defs)
    assert defs.resolve_sensor_def("opt_out_sensor").minimum_interval_seconds == 60
    assert {j.name for j in defs.resolve_all_job_defs()} >= {"opt_out_intake", "opt_out_skip_lists"}


# --------------------------------------------------------------------------- issue 10: bounds


def test_a_huge_list_is_rejected_in_bounded_memory_and_the_next_list_still_applies(world):
    w = world
    sparse_file(Path(w.dir) / "a-huge.txt", 200 * MIB, prefix=b"https://example.org/")
    key = w.images[STUDIO][0]["key"]
    w.drop("b-good.txt", key + "\n")
    # A source that caps its lists (no cap is the default: lists are streamed).
    capped = OptOutResource(sources=[OptOutSource(pattern="a-huge*", max_list_bytes=64 * MIB)])
    tick, growth = peak_rss_growth(lambda: w.tick(None, capped))  # hashes both as streams
    assert growth < 100 * MIB, f"the tick's peak RSS grew by {growth / MIB:.0f} MiB"
    huge, good = _intakes(tick)
    _, growth = peak_rss_growth(lambda: w.run(tick, capped))
    assert growth < 100 * MIB, f"the intake runs' peak RSS grew by {growth / MIB:.0f} MiB"
    lists = w.lists()
    assert huge.startswith("a-huge.txt@") and good.startswith("b-good.txt@")
    assert lists[huge]["status"] == "rejected"
    assert lists[huge]["reason"].startswith("too_large: ") and len(lists[huge]["reason"]) < 500
    assert lists[good]["status"] == "accepted"
    assert _requests(w.tick(tick.cursor, capped)) == [(STUDIO, f"opt_out:{good}:{STUDIO}")]


def test_a_line_over_the_cap_is_rejected_with_a_bounded_reason_and_log(world, capfd):
    w = world
    sparse_file(Path(w.dir) / "one-line.txt", 200 * MIB, prefix=b"https://example.org/")
    generous = OptOutResource()  # no size limit: streamed, the line limit still holds
    tick = w.tick(None, generous)
    _, growth = peak_rss_growth(lambda: w.run(tick, generous))
    assert growth < 100 * MIB, f"the intake run's peak RSS grew by {growth / MIB:.0f} MiB"
    (row,) = w.lists().values()
    assert row["status"] == "rejected" and row["reason"].startswith("entry_too_long: ")
    assert "more characters" in row["reason"] and len(row["reason"]) < 2_000
    w.tick(tick.cursor, generous)  # the sensor logs the rejection it acts on, too
    err = capfd.readouterr().err.splitlines()
    logged = [line for line in err if "one-line.txt" in line and "rejected" in line]
    assert len(logged) >= 2 and all("rejected: entry_too_long" in line for line in logged)
    assert max(len(line) for line in err if "one-line.txt" in line) < 3_000


def test_list_files_whose_names_are_not_utf8_are_recorded(world):
    w = world
    key = w.images[STUDIO][0]["key"]
    raw = os.path.join(os.fsencode(w.dir), b"legal-caf\xe9\x1b.txt")
    with open(raw, "wb") as fh:
        fh.write(key.encode() + b"\n")
    _, result = w.cycle(None)
    (lid,) = w.lists()
    assert lid.startswith("legal-caf%E9%1B.txt@")
    assert w.lists()[lid]["path"].endswith("/legal-caf%E9%1B.txt")
    assert _requests(result) == [(STUDIO, f"opt_out:{lid}:{STUDIO}")]
