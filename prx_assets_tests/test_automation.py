"""Automation end to end: each kind of change reruns exactly the asset partitions it should.

One pipeline is built on the small demo and settled once per module; each test starts from
its own copy of that settled state (data root, registered partitions, sensor cursors, a fresh
Dagster instance), makes one change, and then every sensor of the project ticks (as the
daemon would, cursors kept), the runs they request are executed, and ticks repeat until
nothing more is requested. The set of asset partitions materialised by those runs must equal
the expected set: nothing more, nothing less. No test sees another's changes, in any order.
"""

import hashlib
import multiprocessing
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from dagster import DagsterEventType, DagsterInstance, instance_for_test
from markdown_it import MarkdownIt
from PIL import Image

from prx_assets.core.skiplists.intake import list_partition_key
from prx_assets.core.skiplists.optouts import make_list_id
from prx_assets.definitions import build_defs
from prx_assets.defs.captions.resources import CaptionerResource, ClassifierResource
from prx_assets.defs.dedup.config import DedupConfigResource
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.run_requests import evaluate_sensor, execute_run_request
from prx_assets.defs.skiplists.config import SkipPolicyResource
from prx_assets.demo.jpegs import encoded
from prx_assets_tests.core.models import conftest as model_fixtures

chat_server = model_fixtures.chat_server  # scripted OpenAI-compatible server on 127.0.0.1

ALL_ASSETS = {
    "raw_images",
    "resolution_profile",
    "captions",
    "caption_classes",
    "caption_embeddings",
    "image_hashes",
    "phash_clusters",
    "bucket_assignments",
    "mds_shards",
    "skip_lists",
}


class Platform:
    """A data root, an instance and the sensors' cursors, driven like the daemon drives them."""

    def __init__(self, data_root: str, instance: DagsterInstance) -> None:
        self.data_root = data_root
        self.instance = instance
        self.cursors: dict[str, str | None] = {}
        self.config: dict = {}

    def defs(self):
        return build_defs(self.data_root, **self.config)

    def settle(self, max_rounds: int = 4) -> set[tuple[str, str]]:
        """Tick every sensor and run what they ask until quiet; what got materialised."""
        defs = self.defs()
        done: set[tuple[str, str]] = set()
        for _ in range(max_rounds):
            requested = False
            for sensor in defs.sensors:
                requests, cursor = evaluate_sensor(
                    defs, self.instance, sensor.name, self.cursors.get(sensor.name)
                )
                self.cursors[sensor.name] = cursor
                for request in requests:
                    requested = True
                    before = {r.dagster_run.run_id for r in self.instance.get_run_records()}
                    ok = execute_run_request(defs, self.instance, request, "batch_pipeline")
                    assert ok, f"{sensor.name} requested a run that failed: {request}"
                    done |= self._materialised_by_runs_after(before)
            if not requested:
                return done
        raise AssertionError("sensors kept requesting runs: automation does not settle")

    def _materialised_by_runs_after(self, before: set[str]) -> set[tuple[str, str]]:
        out = set()
        for record in self.instance.get_run_records():
            if record.dagster_run.run_id in before:
                continue
            for event in self.instance.all_logs(
                record.dagster_run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION
            ):
                mat = event.dagster_event.event_specific_data.materialization
                out.add((mat.asset_key.to_user_string(), mat.partition))
        return out


def _photo_like(seed: int, size=(900, 640)) -> bytes:
    """A textured, non-flat image unlike any demo photo (so it duplicates nothing)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : size[1], 0 : size[0]]
    base = np.stack(
        [
            128 + 100 * np.sin(x / (17 + seed) + seed),
            128 + 100 * np.cos(y / (23 + seed)),
            128 + 60 * np.sin((x + y) / (31 + seed)),
        ],
        axis=-1,
    )
    arr = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    return encoded(Image.fromarray(arr), "JPEG", quality=92)


@dataclass(frozen=True)
class Settled:
    """The demo after automation settled: what a test's platform starts from."""

    data_root: Path
    partitions: tuple[str, ...]
    cursors: dict[str, str | None]


@pytest.fixture(scope="module")
def settled(tmp_path_factory, demo_source) -> Settled:
    landing, _ = demo_source
    root = tmp_path_factory.mktemp("automation") / "data"
    shutil.copytree(landing, root / "landing", symlinks=True)
    with instance_for_test() as instance:
        p = Platform(str(root), instance)
        first = p.settle()
        batches = set(instance.get_dynamic_partitions(BATCHES.name))
        assert len(batches) == 4
        # New data flowed through every stage for every batch without a human.
        assert {(a, b) for a in ALL_ASSETS for b in batches} <= first
        assert p.settle() == set()  # and then nothing moves
        return Settled(root, tuple(sorted(batches)), dict(p.cursors))


@pytest.fixture
def platform(settled: Settled, tmp_path):
    """A private copy of the settled platform: changes made by one test stay in it."""
    root = tmp_path / "data"
    shutil.copytree(settled.data_root, root, symlinks=True)
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, list(settled.partitions))
        p = Platform(str(root), instance)
        p.cursors = dict(settled.cursors)
        yield p


def test_a_copy_of_the_settled_platform_is_settled(platform):
    assert platform.settle() == set()


def _list_partition(name: str, content: bytes) -> str:
    return list_partition_key(make_list_id(name, hashlib.sha256(content).hexdigest()))


@pytest.fixture(scope="module")
def training_process():
    """A process of its own for the training loop: streaming keeps each StreamingDataset's
    shared memory (one fd per segment) open until its process exits (an atexit cleanup),
    so loops run in the test process would pile up thousands of fds over the suite."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _training_loop(shards_root: str, lab_root: str) -> dict:
    from prx_assets.core.lab import Lab
    from prx_assets.demo.train_loop import run_training_loop

    return run_training_loop(shards_root, Lab(lab_root), batch_size=2)


def _train(pool: ProcessPoolExecutor, platform: Platform) -> dict:
    """The demo's training loop over the platform's shards (the real loader)."""
    lab = platform.defs().resources["lab"]
    return pool.submit(_training_loop, lab.shards_root, lab.lab_root).result(timeout=600)


def _everywhere(platform: Platform, assets: set[str]) -> set[tuple[str, str]]:
    batches = platform.instance.get_dynamic_partitions(BATCHES.name)
    return {(a, b) for a in assets for b in batches}


def test_new_batch_without_duplicates_runs_every_stage_for_it_only(platform):
    folder = platform.data_root + "/landing/public-skimage/.010.partial"
    import os

    os.makedirs(folder)
    for i in range(2):
        with open(f"{folder}/fresh-{i}.jpg", "wb") as f:
            f.write(_photo_like(i))
        with open(f"{folder}/fresh-{i}.txt", "w") as f:
            f.write("An abstract pattern of coloured waves with fine noise.")
    open(f"{folder}/_SUCCESS", "w").close()
    os.rename(folder, platform.data_root + "/landing/public-skimage/010")
    assert platform.settle() == {(a, "public-skimage.010") for a in ALL_ASSETS}


def test_captioner_swap_reruns_captions_and_everything_downstream_only(platform, chat_server):
    platform.config["captioner"] = CaptionerResource(
        backend="openai", model="test/vlm", base_url=chat_server.base_url, max_attempts=2
    )
    expected = _everywhere(
        platform,
        {"captions", "caption_classes", "caption_embeddings", "mds_shards", "skip_lists"},
    )
    assert platform.settle() == expected


def test_classifier_swap_reruns_classes_and_skip_lists_only(platform):
    platform.config["classifier"] = ClassifierResource(backend="embedding", temperature=0.2)
    assert platform.settle() == _everywhere(platform, {"caption_classes", "skip_lists"})


def test_class_policy_change_reruns_skip_lists_only(platform):
    platform.config["skip_policy"] = SkipPolicyResource(excluded_classes=["nsfw"])
    assert platform.settle() == _everywhere(platform, {"skip_lists"})


def test_dedup_radius_change_reruns_clusters_and_skip_lists_only(platform):
    platform.config["dedup"] = DedupConfigResource(radius=2)
    assert platform.settle() == _everywhere(platform, {"phash_clusters", "skip_lists"})


def test_new_opt_out_list_reruns_only_the_affected_skip_lists(platform, training_process):
    import os

    lab = platform.defs().resources["lab"].lab()
    rows = lab.read("shard_samples", ["key", "batch"], "batch = 'public-sklearn.001'")
    keys = rows.column("key").to_pylist()[:2]
    assert keys
    os.makedirs(platform.data_root + "/optouts", exist_ok=True)
    content = ("\n".join(keys) + "\n").encode()
    with open(platform.data_root + "/optouts/request-1.txt", "wb") as f:
        f.write(content)
    # The list's intake (its own partition), then skip_lists where it applies: nothing else.
    assert platform.settle() == {
        ("opt_out_lists", _list_partition("request-1.txt", content)),
        ("skip_lists", "public-sklearn.001"),
    }
    audit = lab.read("skip_audit", ["key", "reasons"], "batch = 'public-sklearn.001'")
    reasons = dict(
        zip(audit.column("key").to_pylist(), audit.column("reasons").to_pylist(), strict=True)
    )
    assert all("opt_out" in reasons[k] for k in keys)

    # The training loader never yields the opted-out images (nor anything else skipped).
    loop = _train(training_process, platform)
    excluded = set(lab.read("skip_audit", ["key"], "excluded = true").column("key").to_pylist())
    assert set(keys) <= excluded
    assert loop["skipped_sample_yielded"] == []
    assert loop["samples"] > 0 and loop["excluded_keys"] == len(excluded)


# --------------------------------------------------------------------------- copies across batches


def _lab(platform: Platform):
    return platform.defs().resources["lab"].lab()


def _cross_batch_clusters(lab) -> dict[str, list[dict]]:
    """Clusters with sharded members in at least two batches, none opted out."""
    decided = lab.read(
        "phash_clusters",
        ["batch", "key", "cluster_id", "low_information"],
        "low_information = false",
    ).to_pylist()
    sharded = {
        (b, k)
        for b, k in zip(
            *(lab.read("shard_samples", ["batch", "key"]).column(c).to_pylist() for c in ("batch", "key")),
            strict=True,
        )
    }  # fmt: skip
    audit = {(r["batch"], r["key"]): r for r in lab.read("skip_audit").to_pylist()}
    groups: dict[str, list[dict]] = {}
    for r in decided:
        if (r["batch"], r["key"]) in sharded:
            groups.setdefault(r["cluster_id"], []).append(r)
    return {
        cid: rows
        for cid, rows in sorted(groups.items())
        if len({r["batch"] for r in rows}) >= 2
        and not any("opt_out" in audit[(r["batch"], r["key"])]["reasons"] for r in rows)
    }


def _ranked(lab, rows: list[dict]) -> list[tuple[str, str]]:
    """The cluster's members in keeper order (most pixels, larger file, key, batch)."""
    from prx_assets.core.dedup.decisions import keeper_order

    hashes = {
        (r["batch"], r["key"]): r
        for r in lab.read("image_hashes", ["batch", "key", "pixels", "file_size"]).to_pylist()
    }
    refs = [(r["batch"], r["key"]) for r in rows]
    return sorted(
        refs,
        key=lambda ref: keeper_order(
            hashes[ref]["pixels"], hashes[ref]["file_size"], ref[1], ref[0]
        ),
    )


def _audit_of(lab, refs) -> dict[tuple[str, str], dict]:
    rows = {(r["batch"], r["key"]): r for r in lab.read("skip_audit").to_pylist()}
    return {ref: rows[ref] for ref in refs}


def test_a_reclassified_keeper_reruns_exactly_the_batches_whose_training_copy_changes(platform):
    from dagster import AssetKey, RunRequest

    from prx_assets.core.tables import CAPTION_CLASSES

    lab = _lab(platform)
    clusters = _cross_batch_clusters(lab)
    assert clusters, "the demo plants copies of batch-000 photos in batch 003"
    rows = max(clusters.values(), key=len)
    ranked = _ranked(lab, rows)
    keeper, heir = ranked[0], ranked[1]
    before = _audit_of(lab, ranked)
    assert before[keeper]["reasons"] == [] and all(
        before[r]["reasons"] == ["duplicate"] and before[r]["duplicate_of"] == keeper[1]
        for r in ranked[1:]
    )
    # caption_classes(keeper's batch) reran and now labels the keeper "nsfw"; its skip_lists
    # reruns (as the lineage would have it). Nothing else was touched.
    classes = lab.read_batch(CAPTION_CLASSES.name, keeper[0]).to_pylist()
    for r in classes:
        if r["key"] == keeper[1]:
            r["label"] = "nsfw"  # excluded by every policy this module sets
    lab.replace_partition(
        CAPTION_CLASSES, keeper[0], pa.Table.from_pylist(classes, schema=CAPTION_CLASSES.schema)
    )
    request = RunRequest(partition_key=keeper[0], asset_selection=[AssetKey("skip_lists")])
    assert execute_run_request(platform.defs(), platform.instance, request, None)

    # Every other batch holding a copy reruns skip_lists, and nothing else runs.
    others = {b for b, _ in ranked[1:]} - {keeper[0]}
    assert others
    assert platform.settle() == {("skip_lists", b) for b in others}
    after = _audit_of(lab, ranked)
    assert after[keeper]["reasons"] == ["class_nsfw", "duplicate"]
    assert after[heir]["reasons"] == [] and not after[heir]["excluded"]
    for ref in ranked:
        if ref != heir:
            assert (after[ref]["duplicate_of"], after[ref]["duplicate_of_batch"]) == heir[::-1]
    assert lab.read("skip_dirty").num_rows == 0
    assert platform.settle() == set()


def test_an_opt_out_of_a_smaller_copy_reruns_every_batch_holding_a_copy(platform, training_process):
    import os

    lab = _lab(platform)
    clusters = _cross_batch_clusters(lab)
    assert clusters
    rows = max(clusters.values(), key=len)
    ranked = _ranked(lab, rows)
    smallest = ranked[-1]
    os.makedirs(platform.data_root + "/optouts", exist_ok=True)
    content = (smallest[1] + "\n").encode()
    with open(platform.data_root + "/optouts/smaller-copy.txt", "wb") as f:
        f.write(content)
    assert platform.settle() == {("skip_lists", b) for b, _ in ranked} | {
        ("opt_out_lists", _list_partition("smaller-copy.txt", content))
    }
    for ref, row in _audit_of(lab, ranked).items():
        assert row["excluded"] and "opt_out" in row["reasons"], ref
        assert row["opt_out_via"] == [smallest[1]] and row["duplicate_of"] is None
        assert row["opt_out_list_ids"] and row["opt_out_list_ids"][0].startswith(
            "smaller-copy.txt@"
        )

    loop = _train(training_process, platform)
    assert loop["skipped_sample_yielded"] == [] and loop["samples"] > 0


# --------------------------------------------------------------------------- opt-out signals

SIGNAL_BATCH = "signals.000"
SIGNAL_ROWS = {  # file -> the headers captured when it was downloaded (CSV manifest columns)
    "robots.jpg": {"X-Robots-Tag": "noindex, otherbot: NoAI"},
    "tdm.jpg": {"tdm-reservation": "1", "tdm-policy": "https://rights.example/policy.json"},
    "aipref.jpg": {"Content-Usage": "search=y, train-ai=n"},
    "broken.jpg": {"Content-Usage": "Train-AI=n <b>![x](/graphql?query=mutation)</b>"},
    "free.jpg": {"X-Robots-Tag": "noindex", "tdm-reservation": "0"},
}


def _loader_keys(shards_root: str, batch: str) -> list[str]:
    """Every key the project's loader (real MDS, StreamingDataset) yields for ``batch``."""
    import tempfile

    from prx_assets.loader import ShapeBatchedLoader, discover_streams

    with tempfile.TemporaryDirectory() as tmp:
        buckets = discover_streams(shards_root, batches=[batch], cache_dir=f"{tmp}/cache")
        loader = ShapeBatchedLoader(
            buckets,
            batch_size=1,
            collate_fn=lambda samples: [s["key"] for s in samples],
            num_canonical_nodes=1,
        )
        return [k for keys in loader for k in keys]


def _signal_batch(platform: Platform) -> dict[str, str]:
    """A CSV manifest batch of fresh images carrying opt-out headers; file -> content key."""
    import csv
    import os

    source = Path(platform.data_root) / "landing" / "signals"
    source.mkdir(parents=True)
    columns = ["path", "alt_text", "X-Robots-Tag", "tdm-reservation", "tdm-policy"]
    columns.append("Content-Usage")
    keys = {}
    for i, name in enumerate(SIGNAL_ROWS):
        data = _photo_like(40 + i)
        (source / name).write_bytes(data)
        keys[name] = hashlib.sha256(data).hexdigest()
    with open(source / ".000.csv.tmp", "w", newline="") as fh:
        writer = csv.DictWriter(fh, columns, restval="")
        writer.writeheader()
        for name, headers in SIGNAL_ROWS.items():
            alt = "An abstract pattern of coloured waves with fine noise."
            writer.writerow({"path": name, "alt_text": alt, **headers})
    os.rename(source / ".000.csv.tmp", source / "000.csv")
    return keys


def _decisions(lab) -> dict[tuple[str, str], tuple[bool, tuple[str, ...]]]:
    rows = lab.read("skip_audit", ["batch", "key", "excluded", "reasons"]).to_pylist()
    return {(r["batch"], r["key"]): (r["excluded"], tuple(r["reasons"])) for r in rows}


def test_opt_out_signals_are_honoured_and_a_source_policy_switch_reruns_skip_lists_only(
    platform, training_process
):
    import json

    from prx_assets.core.audit import audit_image

    keys = _signal_batch(platform)
    assert platform.settle() == {(a, SIGNAL_BATCH) for a in ALL_ASSETS}
    lab = _lab(platform)
    shards_root = platform.defs().resources["lab"].shards_root
    audit = lab.read("skip_audit", ["key", "reasons", "reserved_signals"], "batch = 'signals.000'")
    by_key = {r["key"]: r for r in audit.to_pylist()}
    reserved = {n for n in SIGNAL_ROWS if "reserved" in by_key[keys[n]]["reasons"]}
    assert reserved == {"robots.jpg", "tdm.jpg", "aipref.jpg", "broken.jpg"}
    assert by_key[keys["free.jpg"]]["reasons"] == []
    assert by_key[keys["robots.jpg"]]["reserved_signals"] == [
        f"{keys['robots.jpg']}: x-robots-tag: otherbot: noai"
    ]
    # The loader (real MDS + StreamingDataset) never yields a reserved image.
    yielded = training_process.submit(_loader_keys, shards_root, SIGNAL_BATCH).result(600)
    assert sorted(yielded) == [keys["free.jpg"]]
    # The audit names the signal; the hostile header is shown as text, never markup.
    trail = audit_image(lab, keys["broken.jpg"], shards_root=shards_root)
    assert trail.verdict.startswith("not in training since") and "content-usage" in trail.verdict
    md = trail.to_markdown()
    assert "Train-AI=n" in md and "![x](/graphql?query=mutation)" in md  # shown whole ...
    tokens = [
        t for block in MarkdownIt("commonmark").parse(md) for t in [block, *(block.children or [])]
    ]
    markup = {"link_open", "image", "html_inline", "html_block", "autolink"}
    assert [t.type for t in tokens if t.type in markup] == []  # ... and never as markup

    # Switch one source's policy: only TDMRep honoured, malformed signals ignored.
    before = _decisions(lab)
    policy = {"sources": {"signals": {"honour": ["tdm-reservation"], "malformed": "ignore"}}}
    Path(platform.data_root, "usage_policy.json").write_text(json.dumps(policy))
    assert platform.settle() == _everywhere(platform, {"skip_lists"})  # never ingest or shards
    after = _decisions(lab)
    changed = {ref for ref in before if before[ref] != after[ref]}
    now_kept = {("signals.000", keys[n]) for n in ("robots.jpg", "aipref.jpg", "broken.jpg")}
    assert changed == now_kept
    assert all(after[ref] == (False, ()) for ref in now_kept)
    assert after[("signals.000", keys["tdm.jpg"])] == (True, ("reserved",))
    yielded = training_process.submit(_loader_keys, shards_root, SIGNAL_BATCH).result(600)
    assert sorted(yielded) == sorted(keys[n] for n in SIGNAL_ROWS if n != "tdm.jpg")
    assert platform.settle() == set()  # and then nothing moves
