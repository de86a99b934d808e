"""The opt-out sensor with a real instance and Lance lab: once per list, affected partitions
only, malformed lists rejected without blocking the next, replays idempotent."""

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

from prx_assets.core.tables import IMAGES, OPT_OUT_LISTS, OPT_OUTS, SHARD_SAMPLES
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.assets import build_skiplist_assets
from prx_assets.defs.skiplists.config import OptOutResource, SkipPolicyResource
from prx_assets.defs.skiplists.sensors import build_opt_out_sensor, opt_out_sensor
from prx_assets_tests.bounds import MIB, peak_rss_growth, sparse_file

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
        resources = {"lab": self.lab, "optouts": optouts or OptOutResource()}
        with build_sensor_context(
            instance=self.instance, cursor=cursor, resources=resources
        ) as ctx:
            result = (sensor or opt_out_sensor)(ctx)
        assert isinstance(result, SensorResult)
        return result

    def lists(self) -> dict[str, dict]:
        return {r["list_id"]: r for r in self.store.read(OPT_OUT_LISTS.name).to_pylist()}

    def opt_outs(self) -> list[dict]:
        return self.store.read(OPT_OUTS.name).to_pylist()

    def first(self, batch: str, **where) -> dict:
        return next(r for r in self.images[batch] if all(r[k] == v for k, v in where.items()))


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
    for r in result.run_requests:
        assert r.asset_selection == [AssetKey("skip_lists")]
        assert r.tags["prx/trigger"] == "opt_out"
    return [(r.partition_key, r.run_key) for r in result.run_requests]


def test_each_list_once_affected_partitions_only_and_bad_lists_do_not_block(world):
    w = world
    public_key = w.first(PUBLIC, url=None)["key"]
    if public_key == w.unsharded:
        public_key = next(r["key"] for r in w.images[PUBLIC] if r["key"] != w.unsharded)
    # Files that must never be read: hidden, private, in-flight, other extensions.
    for name in (".hidden.txt", "_staging.csv", "next.txt.tmp", "big.csv.partial", "x.json"):
        w.drop(name, public_key + "\n")

    first = w.drop("2024-05-01-legal.txt", f"# takedown 123\n{public_key}\n")
    r1 = w.tick(None)
    (lid1,) = w.lists()
    assert lid1.startswith("2024-05-01-legal.txt@")
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
    r3 = w.tick(r2.cursor)
    lists = w.lists()
    (bad,) = [lid for lid in lists if lid.startswith("2024-05-02-broken.csv@")]
    (good,) = [lid for lid in lists if lid.startswith("2024-05-03-studio.parquet@")]
    assert lists[bad]["status"] == "rejected"
    assert lists[bad]["reason"].startswith("bad_identifier: ")
    assert "line 2, column 'key'" in lists[bad]["reason"]
    assert not [r for r in w.opt_outs() if r["list_id"] == bad]
    assert lists[good]["status"] == "accepted" and lists[good]["rows"] == 2
    assert _requests(r3) == [(STUDIO, f"opt_out:{good}:{STUDIO}")]
    good_rows = {r["identifier"]: r for r in w.opt_outs() if r["list_id"] == good}
    assert good_rows[f"{studio['source']}:{studio['source_id']}"]["matched_key"] == studio["key"]
    assert good_rows["https://nobody.example/x.jpg"]["matched_key"] is None

    # Nothing is picked up twice, and the ignored files never were.
    r4 = w.tick(r3.cursor)
    assert not r4.run_requests
    assert set(w.lists()) == {lid1, bad, good}


def test_matches_without_shards_or_partition_request_nothing(world):
    w = world
    w.drop("a.txt", w.unsharded + "\n")  # the image exists but was never written to a shard
    r1 = w.tick(None)
    assert not r1.run_requests
    (lid,) = w.lists()
    assert (
        w.lists()[lid]["matched_images"] == 1
        and "no sharded partition" in r1.skip_reason.skip_message
    )

    w.instance.delete_dynamic_partition(BATCHES.name, STUDIO)
    studio_key = w.images[STUDIO][0]["key"]
    w.drop("b.txt", studio_key + "\n")
    r2 = w.tick(r1.cursor)
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
    r = w.tick(None)
    lists = sorted(w.lists())
    one = next(x for x in lists if x.startswith("one.txt@"))
    two = next(x for x in lists if x.startswith("two.csv@"))
    # One run per partition, naming exactly the lists that affect it.
    assert sorted(_requests(r)) == [
        (STUDIO, f"opt_out:{two}:{STUDIO}"),
        (PUBLIC, f"opt_out:{one}+{two}:{PUBLIC}"),
    ]
    n_shared = sum(x["url"] == shared for x in w.images[PUBLIC])
    assert w.lists()[one]["matched_images"] == n_shared


def test_replays_are_idempotent_and_edits_are_new_lists(world):
    w = world
    key = w.images[STUDIO][0]["key"]
    path = w.drop("legal.txt", key + "\n")
    r1 = w.tick(None)
    before_lists, before_rows = w.lists(), w.opt_outs()

    # The cursor is lost (sensor reset): the same list is reprocessed with the same id,
    # the tables end up identical (arrival time kept) and the run key is the same one,
    # which Dagster does not launch twice.
    again = w.tick(None)
    assert w.lists() == before_lists and w.opt_outs() == before_rows
    assert _requests(again) == _requests(r1)

    # Editing a processed file makes a new list; the old one's opt-outs stay.
    with open(path, "a") as fh:
        fh.write(w.images[STUDIO][1]["key"] + "\n")
    os.utime(path, ns=(1, 1))  # a different mtime: the name is re-hashed
    r3 = w.tick(r1.cursor)
    assert len(w.lists()) == 2
    new_id = next(lid for lid in w.lists() if lid not in before_lists)
    assert _requests(r3) == [(STUDIO, f"opt_out:{new_id}:{STUDIO}")]
    assert len(w.opt_outs()) == 3


def test_lists_beyond_the_per_tick_limit_wait_their_turn(world):
    w = world
    w.drop("a.txt", w.images[PUBLIC][1]["key"] + "\n")
    w.drop("b.txt", w.images[STUDIO][0]["key"] + "\n")
    limited = OptOutResource(max_lists_per_tick=1)
    r1 = w.tick(None, limited)
    assert [p for p, _ in _requests(r1)] == [PUBLIC]
    r2 = w.tick(r1.cursor, limited)
    assert [p for p, _ in _requests(r2)] == [STUDIO]
    assert not w.tick(r2.cursor, limited).run_requests


def test_configurable_directory_interval_and_definitions(world, tmp_path):
    w = world
    elsewhere = tmp_path / "legal-drop"
    elsewhere.mkdir()
    (elsewhere / "x.txt").write_text(w.images[STUDIO][0]["key"] + "\n")
    fast = build_opt_out_sensor(name="fast_opt_out_sensor", minimum_interval_seconds=5)
    assert fast.minimum_interval_seconds == 5 and opt_out_sensor.minimum_interval_seconds == 60
    r = w.tick(None, OptOutResource(landing_dir=str(elsewhere)), sensor=fast)
    assert [p for p, _ in _requests(r)] == [STUDIO]

    defs = Definitions(
        assets=build_skiplist_assets(),
        sensors=[opt_out_sensor],
        resources={
            "lab": LabResource(data_root=str(tmp_path / "d")),
            "skip_policy": SkipPolicyResource(),
            "optouts": OptOutResource(),
        },
    )
    Definitions.validate_loadable(defs)
    assert defs.resolve_sensor_def("opt_out_sensor").minimum_interval_seconds == 60


# --------------------------------------------------------------------------- issue 10: bounds


def test_a_huge_list_is_rejected_in_a_bounded_tick_and_the_next_list_still_applies(world):
    w = world
    sparse_file(Path(w.dir) / "a-huge.txt", 200 * MIB, prefix=b"https://example.org/")
    key = w.images[STUDIO][0]["key"]
    w.drop("b-good.txt", key + "\n")
    result, growth = peak_rss_growth(lambda: w.tick(None))
    assert growth < 100 * MIB, f"the tick's peak RSS grew by {growth / MIB:.0f} MiB"
    lists = w.lists()
    (huge,) = [lid for lid in lists if lid.startswith("a-huge.txt@")]
    (good,) = [lid for lid in lists if lid.startswith("b-good.txt@")]
    assert lists[huge]["status"] == "rejected"
    assert lists[huge]["reason"].startswith("too_large: ") and len(lists[huge]["reason"]) < 500
    assert lists[good]["status"] == "accepted"
    assert _requests(result) == [(STUDIO, f"opt_out:{good}:{STUDIO}")]


def test_a_line_over_the_cap_is_rejected_with_a_bounded_reason_and_log(world, capfd):
    w = world
    sparse_file(Path(w.dir) / "one-line.txt", 200 * MIB, prefix=b"https://example.org/")
    generous = OptOutResource(max_list_bytes=300 * MIB)
    _, growth = peak_rss_growth(lambda: w.tick(None, generous))
    assert growth < 100 * MIB, f"the tick's peak RSS grew by {growth / MIB:.0f} MiB"
    (row,) = w.lists().values()
    assert row["status"] == "rejected" and row["reason"].startswith("entry_too_long: ")
    assert "more characters" in row["reason"] and len(row["reason"]) < 2_000
    logged = [line for line in capfd.readouterr().err.splitlines() if "one-line.txt" in line]
    assert logged and all("rejected: entry_too_long" in line for line in logged)
    assert max(len(line) for line in logged) < 3_000


def test_list_files_whose_names_are_not_utf8_are_recorded(world):
    w = world
    key = w.images[STUDIO][0]["key"]
    raw = os.path.join(os.fsencode(w.dir), b"legal-caf\xe9\x1b.txt")
    with open(raw, "wb") as fh:
        fh.write(key.encode() + b"\n")
    result = w.tick(None)
    (lid,) = w.lists()
    assert lid.startswith("legal-caf%E9%1B.txt@")
    assert w.lists()[lid]["path"].endswith("/legal-caf%E9%1B.txt")
    assert _requests(result) == [(STUDIO, f"opt_out:{lid}:{STUDIO}")]
