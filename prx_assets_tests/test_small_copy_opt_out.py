"""An opt-out that names only a copy under the 384 px cutoff, through Dagster end to end.

Two batches of real photos hold the same picture: a large copy that trains, and a small
copy that never can (its batch has no shards). A list naming only the small copy's content
key must keep the large copy out of training, whether the list arrives after both batches
(the opt-out sensor expands the named image's pHash cluster to the large copy's batch) or
before the small copy is ingested (the small copy's batch finds the large copy's recorded
decision contradicted and queues its batch; ``skip_dirty_sensor`` reruns it). Real batch
pipeline runs, real sensor ticks, real skip-list sidecars, and the training loader.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from dagster import AssetKey, instance_for_test
from PIL import Image

from prx_assets.core.tables import IMAGE_HASHES, IMAGES, RESOLUTION, SHARD_SAMPLES, SKIP_AUDIT
from prx_assets.definitions import DOWNSTREAM_OF_DEDUP, build_defs
from prx_assets.defs.dedup.settle import settle_dedup_in_process
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.run_requests import QUIET, evaluate_sensor, execute_run_request
from prx_assets.defs.skiplists.config import OptOutResource, OptOutSource
from prx_assets.demo.jpegs import PHOTO_DIR, jpeg_bytes
from prx_assets_tests.loader_keys import loader_keys

LARGE = "public-optout.000"  # the large copy (and a bystander photo that stays)
SMALL = "public-optout.001"  # only a copy under the size cutoff


def _photo(name: str) -> Image.Image:
    return Image.open(PHOTO_DIR / name).convert("RGB")


def _batch(landing: Path, key: str, images: dict[str, bytes]) -> None:
    source, chunk = key.split(".")
    folder = landing / source / chunk
    folder.mkdir(parents=True)
    for name, data in images.items():
        (folder / name).write_bytes(data)
        (folder / f"{Path(name).stem}.txt").write_text(f"a photograph ({name})")
    (folder / "_SUCCESS").write_text("")


@pytest.fixture
def photos() -> dict[str, bytes]:
    coffee = _photo("coffee.png")  # 600 x 400
    big = coffee.resize((1200, 800), Image.Resampling.LANCZOS)
    small = coffee.resize((360, 240), Image.Resampling.LANCZOS)  # under 384 px
    return {
        "large": jpeg_bytes(big, quality=95),
        "small": jpeg_bytes(small, quality=95),
        "bystander": jpeg_bytes(_photo("chelsea.png").resize((902, 600)), quality=95),
    }


class Platform:
    """One data root, its definitions and a real (temporary sqlite) Dagster instance."""

    def __init__(self, root: Path, instance, optouts: OptOutResource | None = None) -> None:
        self.root = root
        self.defs = build_defs(str(root), optouts=optouts)
        self.instance = instance
        self.lab = self.defs.resources["lab"].lab()
        self.cursors: dict[str, str | None] = {}

    def land(self, key: str, images: dict[str, bytes]) -> None:
        """A batch lands and runs through the whole pipeline, then dedup settles."""
        _batch(self.root / "landing", key, images)
        self.instance.add_dynamic_partitions(BATCHES.name, [key])
        job = self.defs.resolve_job_def("batch_pipeline")
        result = job.execute_in_process(
            partition_key=key, instance=self.instance, run_config=QUIET, raise_on_error=False
        )
        assert result.success, key
        settle_dedup_in_process(self.defs, self.instance, DOWNSTREAM_OF_DEDUP, log=lambda _: None)

    def tick(self, sensor: str) -> list[str]:
        """One tick of ``sensor``, its runs carried out; what they were for."""
        requests, self.cursors[sensor] = evaluate_sensor(
            self.defs, self.instance, sensor, self.cursors.get(sensor)
        )
        for request in requests:
            assert execute_run_request(self.defs, self.instance, request, None), request
        return [
            f"{','.join(k.to_user_string() for k in r.asset_selection or [])}:{r.partition_key}"
            for r in requests
        ]

    def settle(self, sensor: str, ticks: int = 4) -> list[str]:
        """Ticks until ``sensor`` asks for nothing more (bounded): every request made."""
        done: list[str] = []
        for _ in range(ticks):
            asked = self.tick(sensor)
            if not asked:
                return done
            done += asked
        raise AssertionError(f"{sensor} still requesting after {ticks} ticks: {done}")

    def opt_out(self, name: str, lines: list[str]) -> None:
        directory = self.root / "optouts"
        directory.mkdir(exist_ok=True)
        (directory / name).write_text("\n".join(lines) + "\n")

    def key_of(self, batch: str, file_name: str) -> str:
        rows = self.lab.read_batch(IMAGES.name, batch, ["key", "path"]).to_pylist()
        (key,) = [r["key"] for r in rows if r["path"].endswith(file_name)]
        return key

    def audit(self, batch: str) -> dict[str, dict]:
        return {r["key"]: r for r in self.lab.read_batch(SKIP_AUDIT.name, batch).to_pylist()}

    def trained_keys(self) -> list[str]:
        """What the training loader yields from the shard tree (sidecars honoured)."""
        return loader_keys(self.root / "shards")

    def check_preconditions(self, large: str, small: str) -> None:
        """The small copy is ineligible, unsharded, hashed, and in the large one's cluster."""
        eligible = {
            r["key"]: r["eligible"]
            for b in (LARGE, SMALL)
            for r in self.lab.read_batch(RESOLUTION.name, b, ["key", "eligible"]).to_pylist()
        }
        assert eligible[large] is True and eligible[small] is False
        assert self.lab.count(SHARD_SAMPLES.name, f"batch = '{SMALL}'") == 0
        hashes = {
            r["key"]: r["phash"]
            for b in (LARGE, SMALL)
            for r in self.lab.read_batch(IMAGE_HASHES.name, b, ["key", "phash"]).to_pylist()
        }
        assert hashes[small] == hashes[large], "the planted copy is not at Hamming 0"


@pytest.fixture
def platform(tmp_path, monkeypatch):
    monkeypatch.setenv("PRX_DATA_ROOT", str(tmp_path / "data"))
    with instance_for_test() as instance:
        yield Platform(tmp_path / "data", instance)


def test_a_list_naming_only_the_small_copy_keeps_the_large_copy_out(platform, photos):
    p = platform
    p.land(LARGE, {"large.jpg": photos["large"], "bystander.jpg": photos["bystander"]})
    p.land(SMALL, {"small.jpg": photos["small"]})
    large, small = p.key_of(LARGE, "large.jpg"), p.key_of(SMALL, "small.jpg")
    bystander = p.key_of(LARGE, "bystander.jpg")
    assert sorted(p.trained_keys()) == sorted([large, bystander])  # before: both train

    p.opt_out("small-copy.txt", [small])
    runs = p.settle("opt_out_sensor")
    assert any(r.startswith("opt_out_lists:") for r in runs)
    assert f"skip_lists:{LARGE}" in runs  # the cluster reached the large copy's batch

    row = p.audit(LARGE)[large]
    assert row["excluded"] and "opt_out" in row["reasons"], row
    assert row["opt_out_via"] == [small]  # excluded because of the copy the list named
    assert p.audit(LARGE)[bystander]["excluded"] is False
    assert p.trained_keys() == [bystander]
    p.check_preconditions(large, small)  # and it was the case the test is about


def test_a_list_recorded_before_the_small_copy_arrives_reaches_the_large_copy(platform, photos):
    p = platform
    small_key = hashlib.sha256(photos["small"]).hexdigest()  # a content key: its sha256
    p.land(LARGE, {"large.jpg": photos["large"], "bystander.jpg": photos["bystander"]})
    p.opt_out("early.txt", [small_key])
    runs = p.settle("opt_out_sensor")
    assert runs and all(r.startswith("opt_out_lists:") for r in runs)  # names nothing yet
    large = p.key_of(LARGE, "large.jpg")
    assert p.audit(LARGE)[large]["excluded"] is False  # decided "kept", and trains

    # Any rerun the small copy's batch causes is what the daemon's sensors would request;
    # the large copy's batch is requested by skip_dirty_sensor, not by the settle above.
    _batch(p.root / "landing", SMALL, {"small.jpg": photos["small"]})
    p.instance.add_dynamic_partitions(BATCHES.name, [SMALL])
    job = p.defs.resolve_job_def("batch_pipeline")
    assert job.execute_in_process(
        partition_key=SMALL, instance=p.instance, run_config=QUIET, raise_on_error=False
    ).success
    assert p.key_of(SMALL, "small.jpg") == small_key
    p.check_preconditions(large, small_key)
    assert large in p.trained_keys()  # not yet: the large copy's sidecars are stale

    assert p.settle("skip_dirty_sensor") == [f"skip_lists:{LARGE}"]
    row = p.audit(LARGE)[large]
    assert row["excluded"] and "opt_out" in row["reasons"], row
    assert large not in p.trained_keys()


def test_a_registry_withdrawal_lets_the_image_train_again_and_is_recorded(tmp_path, photos):
    # A registry (source "dntr", allowed to withdraw) opts the bystander out in its dump,
    # then withdraws it in a delta: the sensor reruns the batch, the bystander trains again,
    # the trail keeps both rows, and compliance of the dump passes and names the withdrawal.
    from prx_assets.core.snapshots.compliance import compliance_report
    from prx_assets.core.tables import OPT_OUTS

    registry = OptOutSource(pattern="dntr-*", name="dntr", allow_withdrawals=True)
    with instance_for_test() as instance:
        p = Platform(tmp_path / "data", instance, OptOutResource(sources=[registry]))
        p.land(LARGE, {"large.jpg": photos["large"], "bystander.jpg": photos["bystander"]})
        large, bystander = p.key_of(LARGE, "large.jpg"), p.key_of(LARGE, "bystander.jpg")
        p.opt_out("dntr-dump.csv", ["key", bystander])
        assert f"skip_lists:{LARGE}" in p.settle("opt_out_sensor")
        assert p.trained_keys() == [large]
        assert p.audit(LARGE)[bystander]["excluded"] is True

        p.opt_out("dntr-delta-0001.csv", ["key,action", f"{bystander},withdraw"])
        runs = p.settle("opt_out_sensor")
        assert f"skip_lists:{LARGE}" in runs, runs  # the withdrawal reruns its batch
        assert sorted(p.trained_keys()) == sorted([large, bystander])
        assert p.audit(LARGE)[bystander]["excluded"] is False
        trail = p.lab.read(OPT_OUTS.name, ["list_id", "action"], f"matched_key = '{bystander}'")
        assert sorted((r["list_id"].split("@")[0], r["action"]) for r in trail.to_pylist()) == [
            ("dntr-delta-0001.csv", "withdraw"),
            ("dntr-dump.csv", "add"),
        ]
        report = compliance_report(p.lab, p.root / "shards", "dntr-dump.csv")
        assert report.verdict == "PASS" and report.withdrawn == [(LARGE, bystander)]
        assert "withdrawn by its source" in report.reason
        delta = compliance_report(p.lab, p.root / "shards", "dntr-delta-0001.csv")
        assert delta.verdict == "PASS" and delta.withdraws == 1 and delta.images == []
        assert "it withdraws 1 earlier opt-out(s) of its source" in delta.reason


def test_the_planted_copies_are_real_photos_not_blank_images(photos):
    # Guard for the two tests above: the pHash match is between real pictures.
    for name in ("large", "small"):
        img = Image.open(io.BytesIO(photos[name]))
        extrema = img.convert("L").getextrema()
        assert extrema[1] - extrema[0] > 100, name


def test_a_list_reaching_several_batches_is_one_run_and_pending_until_it_ran(platform, photos):
    """The batched fan-out end to end: one list reaching three batches (one of them with
    nothing the list names in between, bridged) becomes one run over their range; the
    compliance report says PENDING until that run ran, PASS after, and the loader no longer
    yields what the list names."""
    from prx_assets.core.snapshots.compliance import compliance_report

    p = platform
    p.land(LARGE, {"large.jpg": photos["large"], "bystander.jpg": photos["bystander"]})
    middle = "public-optout.002"
    last = "public-optout.003"
    p.land(middle, {"astronaut.jpg": jpeg_bytes(_photo("astronaut.png"), quality=95)})
    p.land(last, {"rocket.jpg": jpeg_bytes(_photo("rocket.jpg"), quality=95)})
    large, rocket = p.key_of(LARGE, "large.jpg"), p.key_of(last, "rocket.jpg")
    astronaut = p.key_of(middle, "astronaut.jpg")
    assert {large, rocket, astronaut} <= set(p.trained_keys())

    p.opt_out("two-batches.txt", [large, rocket])
    assert p.tick("opt_out_sensor") == ["opt_out_lists:two-batches.txt@" + _digest(p)]
    requests, p.cursors["opt_out_sensor"] = evaluate_sensor(
        p.defs, p.instance, "opt_out_sensor", p.cursors["opt_out_sensor"]
    )
    (request,) = requests  # one run for every batch the list reaches
    tags = request.tags
    assert request.partition_key is None and tags["prx/partitions"] == "3"
    assert tags["prx/bridged_partitions"] == "1"  # the middle batch: nothing it names
    start, end = (tags[f"dagster/asset_partition_range_{e}"] for e in ("start", "end"))
    assert (start, end) == (LARGE, last)
    list_id = tags["prx/opt_out_lists"]
    shards = p.root / "shards"
    assert compliance_report(p.lab, shards, list_id).verdict == "PENDING"
    assert {large, rocket} <= set(p.trained_keys())

    assert execute_run_request(p.defs, p.instance, request, None)
    assert compliance_report(p.lab, shards, list_id).verdict == "PASS"
    trained = set(p.trained_keys())
    assert large not in trained and rocket not in trained and astronaut in trained
    for batch in (LARGE, middle, last):  # each partition materialised on its own
        records = p.instance.fetch_materializations(AssetKey("skip_lists"), limit=50).records
        assert any(r.partition_key == batch for r in records), batch


def _digest(p) -> str:
    data = (p.root / "optouts" / "two-batches.txt").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]
