"""Model swaps: stored fingerprints vs configured backends decide exactly what reruns."""

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from dagster import AssetKey, SensorResult, build_sensor_context, materialize

from prx_assets.core.captions.swaps import (
    ConfiguredFingerprints,
    plan_reruns,
    stale_batches,
    swap_run_key,
)
from prx_assets.core.tables import CAPTION_CLASSES, CAPTION_EMBEDDINGS, CAPTIONS
from prx_assets.defs.captions.assets import build_caption_assets
from prx_assets.defs.captions.reconcile import (
    build_model_swap_sensor,
    configured_fingerprints,
    model_swap_sensor,
    partitions_needing_rerun,
)
from prx_assets.defs.captions.resources import (
    CaptionerResource,
    ClassifierResource,
    EmbedderResource,
)
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets_tests.core.models import conftest as model_fixtures

KEYS = ["public-skimage.003", "public-sklearn.001"]  # the two smallest demo batches
STAGE = ["captions", "caption_classes", "caption_embeddings"]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


chat_server = model_fixtures.chat_server  # the scripted OpenAI-compatible server fixture
chat_fleet = model_fixtures.chat_fleet  # several such servers


# --------------------------------------------------------------------------- pure logic


def _rows(items: list[tuple[str, str | None]]) -> pa.Table:
    return pa.table(
        {
            "batch": [b for b, _ in items],
            "backend_fingerprint": pa.array([f for _, f in items], pa.string()),
            "created_at": pa.array(
                [T0 + timedelta(minutes=i) for i in range(len(items))], pa.timestamp("us", "UTC")
            ),
        }
    )


def test_stale_batches_reports_only_batches_with_other_fingerprints():
    rows = _rows([("a", "new"), ("a", "new"), ("b", "old"), ("b", "new"), ("c", None)])
    stale = stale_batches(rows, {"backend_fingerprint": "new"})
    assert sorted(stale) == ["b", "c"]
    assert stale["b"].rows == 1 and stale["b"].found == ("backend_fingerprint=old",)
    assert stale["b"].newest == (T0 + timedelta(minutes=2)).isoformat()
    assert stale["c"].found == ("backend_fingerprint=<null>",)
    assert stale_batches(_rows([("a", "new")]), {"backend_fingerprint": "new"}) == {}
    with pytest.raises(ValueError, match="lack columns"):
        stale_batches(rows, {"caption_fingerprint": "x"})


def test_plan_reruns_closes_over_downstream_and_keeps_swaps_apart():
    downstream = {
        "captions": ("caption_classes", "caption_embeddings", "mds_shards"),
        "mds_shards": ("skip_lists",),
    }
    plan = plan_reruns({"captions": ["b2", "b1"], "caption_classes": ["b3"]}, downstream)
    assert plan == {
        "captions": ["b1", "b2"],
        "caption_classes": ["b1", "b2", "b3"],
        "caption_embeddings": ["b1", "b2"],
        "mds_shards": ["b1", "b2"],
        "skip_lists": ["b1", "b2"],
    }
    assert plan_reruns({"caption_embeddings": ["b1"]}, downstream) == {"caption_embeddings": ["b1"]}
    assert plan_reruns({"captions": []}, downstream) == {}
    a = swap_run_key("b1", STAGE, ["captions:x@t1"])
    assert a == swap_run_key("b1", STAGE, ["captions:x@t1"])
    assert a != swap_run_key("b1", STAGE, ["captions:x@t2"])  # a later stale write: new key


# --------------------------------------------------------------------------- on the lab


def resources(lab_resource, captioner=None, classifier=None, embedder=None) -> dict:
    return {
        "lab": lab_resource,
        "captioner": captioner or CaptionerResource(),
        "classifier": classifier or ClassifierResource(device="cpu"),
        "embedder": embedder or EmbedderResource(device="cpu"),
    }


def assets_for(res: dict) -> list:
    caption_assets = build_caption_assets(res["captioner"], res["classifier"], res["embedder"])
    return [raw_images, resolution_profile, *caption_assets]


def fingerprints(res: dict) -> ConfiguredFingerprints:
    return configured_fingerprints(res["captioner"], res["classifier"], res["embedder"])


def tick(instance, res: dict, cursor: str | None, sensor=model_swap_sensor) -> SensorResult:
    with build_sensor_context(instance=instance, cursor=cursor, resources=res) as ctx:
        result = sensor(ctx)
    assert isinstance(result, SensorResult)
    return result


def run_requests(instance, res: dict, result: SensorResult) -> None:
    for req in result.run_requests:
        done = materialize(
            assets_for(res),
            selection=req.asset_selection,
            partition_key=req.partition_key,
            instance=instance,
            resources=res,
        )
        assert done.success


def code_versions(res: dict) -> dict[str, str]:
    return {a.key.to_user_string(): a.code_versions_by_key[a.key] for a in assets_for(res)[2:]}


@pytest.fixture(scope="module")
def staged_lab(tmp_path_factory, demo_source) -> Path:
    """Both small demo batches through the whole stage with the offline backends, once."""
    from dagster import instance_for_test

    from prx_assets.defs.resources import LabResource

    root = tmp_path_factory.mktemp("staged") / "data"
    shutil.copytree(demo_source[0], root / "landing", symlinks=True)
    res = resources(LabResource(data_root=str(root)))
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, KEYS)
        for key in KEYS:
            assert materialize(
                assets_for(res), partition_key=key, instance=instance, resources=res
            ).success
    return root / "lab"


@pytest.fixture
def lab_with_stage(instance, lab_resource, staged_lab) -> dict:
    """A private copy of the staged lab, its batches registered; the offline resources."""
    shutil.copytree(staged_lab, lab_resource.lab_root)
    instance.add_dynamic_partitions(BATCHES.name, KEYS)
    res = resources(lab_resource)
    assert partitions_needing_rerun(lab_resource.lab(), fingerprints(res)) == {}
    assert tick(instance, res, None).run_requests == []
    return res


def test_captioner_swap_reruns_captions_and_everything_downstream(
    instance,
    lab_resource,
    lab_with_stage,
    chat_server,
):
    before = lab_with_stage
    after = resources(
        lab_resource,
        captioner=CaptionerResource(
            backend="openai", model="test/vlm", base_url=chat_server.base_url, max_attempts=1
        ),
    )
    lab = lab_resource.lab()
    # The code versions follow the configuration: captions and classes change, not embeddings.
    old, new = code_versions(before), code_versions(after)
    assert new["captions"] != old["captions"] and new["caption_classes"] != old["caption_classes"]
    assert new["caption_embeddings"] == old["caption_embeddings"]
    assert after["captioner"].identity().fingerprint() in new["captions"]

    assert partitions_needing_rerun(lab, fingerprints(after)) == {name: KEYS for name in STAGE}
    # A later stage joins the list and is requested with the rest.
    extended = partitions_needing_rerun(
        lab, fingerprints(after), downstream_of_captions=(*STAGE[1:], "mds_shards")
    )
    assert extended == {**{name: KEYS for name in STAGE}, "mds_shards": KEYS}

    first = tick(instance, after, None)
    assert sorted(r.partition_key for r in first.run_requests) == KEYS
    for req in first.run_requests:
        assert req.asset_selection == [AssetKey(a) for a in STAGE]
        assert req.run_key.startswith(f"model-swap:{req.partition_key}:")
        assert req.tags["prx/trigger"] == "model_swap"
    assert len({r.run_key for r in first.run_requests}) == 2
    # The next tick, before the runs finish, requests nothing again.
    second = tick(instance, after, first.cursor)
    assert second.run_requests == [] and "all requested" in second.skip_reason.skip_message
    # Only registered partitions are requested.
    instance.delete_dynamic_partition(BATCHES.name, KEYS[0])
    only = tick(instance, after, None)
    assert [r.partition_key for r in only.run_requests] == [KEYS[1]]
    instance.add_dynamic_partitions(BATCHES.name, [KEYS[0]])

    run_requests(instance, after, first)
    assert partitions_needing_rerun(lab, fingerprints(after)) == {}
    assert tick(instance, after, second.cursor).run_requests == []
    rows = lab.read(CAPTIONS.name, ["backend", "is_fallback", "model_id"]).to_pylist()
    assert {(r["backend"], r["is_fallback"], r["model_id"]) for r in rows} == {
        ("openai", False, "test/vlm")
    }
    fp = after["captioner"].identity().fingerprint()
    for table in (CAPTION_CLASSES.name, CAPTION_EMBEDDINGS.name):
        assert set(lab.read(table, ["caption_fingerprint"])["caption_fingerprint"].to_pylist()) == {
            fp
        }
    # Swapping back is a swap too: the rows now say "openai".
    assert partitions_needing_rerun(lab, fingerprints(before)) == {name: KEYS for name in STAGE}


def test_resizing_or_reordering_the_fleet_is_no_swap_but_a_new_model_is(
    instance, lab_resource, lab_with_stage, chat_fleet
):
    a, b, c = chat_fleet(3)

    def fleet(urls: list[str], model: str = "test/vlm") -> dict:
        captioner = CaptionerResource(backend="openai", model=model, base_urls=urls)
        return resources(lab_resource, captioner=captioner)

    two = fleet([a.state.base_url, b.state.base_url])
    run_requests(instance, two, tick(instance, two, None))  # the swap from the offline rows
    lab = lab_resource.lab()
    assert partitions_needing_rerun(lab, fingerprints(two)) == {}
    assert {len(s.state.requests) > 0 for s in (a, b)} == {True}

    three = fleet([c.state.base_url, b.state.base_url, a.state.base_url])
    one = fleet([b.state.base_url])
    for moved in (three, one):
        assert code_versions(moved) == code_versions(two)
        assert partitions_needing_rerun(lab, fingerprints(moved)) == {}
        assert tick(instance, moved, None).run_requests == []
    other = fleet([a.state.base_url, b.state.base_url], model="test/other-vlm")
    assert code_versions(other)["captions"] != code_versions(two)["captions"]
    assert partitions_needing_rerun(lab, fingerprints(other)) == {name: KEYS for name in STAGE}


def test_classifier_or_embedder_swap_reruns_only_that_asset(instance, lab_resource, lab_with_stage):
    lab = lab_resource.lab()
    captions_before = lab.read(CAPTIONS.name, ["key", "created_at"]).to_pylist()

    new_classifier = resources(lab_resource, classifier=ClassifierResource(temperature=0.1))
    assert partitions_needing_rerun(lab, fingerprints(new_classifier)) == {"caption_classes": KEYS}
    result = tick(instance, new_classifier, None)
    assert sorted(r.partition_key for r in result.run_requests) == KEYS
    assert {tuple(r.asset_selection) for r in result.run_requests} == {
        (AssetKey("caption_classes"),)
    }
    run_requests(instance, new_classifier, result)
    assert partitions_needing_rerun(lab, fingerprints(new_classifier)) == {}
    assert lab.read(CAPTIONS.name, ["key", "created_at"]).to_pylist() == captions_before

    new_embedder = {
        **new_classifier,
        "embedder": EmbedderResource(device="cpu", model_id="prx/minilm-finetune"),
    }
    assert partitions_needing_rerun(lab, fingerprints(new_embedder)) == {"caption_embeddings": KEYS}
    # A sensor built with later stages downstream of embeddings requests them too.
    sensor = build_model_swap_sensor(downstream_of_embeddings=("caption_classes",))
    result = tick(instance, new_embedder, None, sensor=sensor)
    assert {tuple(r.asset_selection) for r in result.run_requests} == {
        (AssetKey("caption_classes"), AssetKey("caption_embeddings"))
    }
    run_requests(instance, new_embedder, result)
    assert partitions_needing_rerun(lab, fingerprints(new_embedder)) == {}
    model_ids = set(lab.read(CAPTION_EMBEDDINGS.name, ["model_id"])["model_id"].to_pylist())
    assert model_ids == {"prx/minilm-finetune"}
