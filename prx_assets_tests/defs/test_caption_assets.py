"""The caption stage on real demo batches: rows, provenance, indexes, checks and failures."""

import json

import lance
import numpy as np
import pytest
from dagster import AssetCheckSeverity, AssetKey, EnvVar, materialize

from prx_assets.core.captions.models import MiniLMEmbedder, caption_word_count
from prx_assets.core.captions.tables import (
    VECTOR_INDEX_MIN_ROWS,
    embedding_rows,
    ensure_embedding_index,
)
from prx_assets.core.lab import Lab
from prx_assets.core.tables import CAPTION_CLASSES, CAPTION_EMBEDDINGS, CAPTIONS, IMAGES, RESOLUTION
from prx_assets.defs.captions.assets import build_caption_assets
from prx_assets.defs.captions.resources import (
    ALT_TEXT_NOTE,
    EMBEDDING_NOTE,
    CaptionerResource,
    ClassifierResource,
    EmbedderResource,
)
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets_tests.core.models import conftest as model_fixtures

KEY = "public-skimage.000"  # 22 files, some under the size cutoff
SMALL = "public-sklearn.001"  # 8 files
SECRET = "sk-test-not-a-real-key-7f3a"

chat_server = model_fixtures.chat_server  # the scripted OpenAI-compatible server fixture
chat_fleet = model_fixtures.chat_fleet  # several such servers that can die


def resources(lab_resource, captioner=None, classifier=None, embedder=None) -> dict:
    return {
        "lab": lab_resource,
        "captioner": captioner or CaptionerResource(),
        "classifier": classifier or ClassifierResource(device="cpu"),
        "embedder": embedder or EmbedderResource(device="cpu"),
    }


def run(instance, res: dict, key: str, selection=None, raise_on_error: bool = True):
    assets = [
        raw_images,
        resolution_profile,
        *build_caption_assets(res["captioner"], res["classifier"], res["embedder"]),
    ]
    return materialize(
        assets,
        partition_key=key,
        instance=instance,
        resources=res,
        selection=selection,
        raise_on_error=raise_on_error,
    )


def _metadata(result, node: str) -> dict:
    return {k: v.value for k, v in result.asset_materializations_for_node(node)[0].metadata.items()}


def _check(result, name: str):
    [evaluation] = [e for e in result.get_asset_check_evaluations() if e.check_name == name]
    return evaluation


def test_caption_stage_on_one_batch(instance, lab_resource):
    instance.add_dynamic_partitions(BATCHES.name, [KEY])
    res = resources(lab_resource)
    result = run(instance, res, KEY)
    assert result.success
    store = lab_resource.lab()
    where = f"batch = '{KEY}'"

    # captions: exactly the eligible images, each one its normalised alt text, flagged.
    profile = store.read(RESOLUTION.name, ["key", "eligible"], where).to_pylist()
    eligible = {r["key"] for r in profile if r["eligible"]}
    ineligible = {r["key"] for r in profile if not r["eligible"]}
    assert ineligible, "the demo batch plants images under the size cutoff"
    alt = {
        r["key"]: r["alt_text"]
        for r in store.read(IMAGES.name, ["key", "alt_text"], where).to_pylist()
    }
    caps = {r["key"]: r for r in store.read(CAPTIONS.name, filter=where).to_pylist()}
    assert set(caps) == eligible and len(caps) >= 5
    fp = res["captioner"].identity().fingerprint()
    for key, row in caps.items():
        assert row["caption"] == " ".join((alt[key] or "").split())
        assert row["is_fallback"] is True and row["backend"] == "alt_text"
        assert row["model_id"] == "alt-text-fallback"
        assert row["fallback_reason"] == ("source_alt_text" if row["caption"] else "no_alt_text")
        assert row["backend_fingerprint"] == fp
        assert json.loads(row["params"]) == {"normalise_whitespace": True}
        assert row["word_count"] == caption_word_count(row["caption"])
        assert row["length_ok"] == (100 <= row["word_count"] <= 200)
        assert row["created_at"] is not None and row["created_at"].tzinfo is not None

    md = _metadata(result, "captions")
    assert md["caption_source"] == ALT_TEXT_NOTE
    assert md["fallback_captions"] == len(caps) and md["vlm_captions"] == 0
    outside = sum(not (100 <= r["word_count"] <= 200) for r in caps.values())
    assert md["outside_100_200_words"] == outside == len(caps)  # alt texts are short
    assert md["empty_captions"] == sum(not r["caption"] for r in caps.values())
    assert md["fingerprint"] == fp and md["backend"] == "alt_text"
    assert md["fts_index"] == "created"
    assets = build_caption_assets(res["captioner"], res["classifier"], res["embedder"])
    by_key = {a.key: a for a in assets}
    assert ALT_TEXT_NOTE in by_key[AssetKey("captions")].descriptions_by_key[AssetKey("captions")]
    assert by_key[AssetKey("captions")].code_versions_by_key[AssetKey("captions")].endswith(fp)

    # The window is the VLM prompt's: on alt-text fallbacks the check says it does not
    # apply (a permanent warning would say nothing), still with the counts.
    check = _check(result, "captions_length_window")
    assert check.passed is True and check.severity == AssetCheckSeverity.WARN
    assert check.description.startswith("not applicable: fallback captions")
    assert check.partition == KEY and check.metadata["applies"].value is False
    assert check.metadata["outside_window"].value == outside
    assert ALT_TEXT_NOTE in check.metadata["note"].value

    # Full-text index: an INVERTED index on caption, and a query finds the right caption.
    ds = store.dataset(CAPTIONS.name)
    assert any(ix["fields"] == ["caption"] and ix["type"] == "Inverted" for ix in ds.list_indices())
    target = next(r for r in caps.values() if r["caption"])
    word = max(
        (w.strip(".,").lower() for w in target["caption"].split() if w.strip(".,").isalpha()),
        key=len,
    )
    hits = ds.to_table(full_text_query=word, columns=["key", "caption"]).to_pylist()
    assert target["key"] in {h["key"] for h in hits}
    assert all(word in h["caption"].lower() for h in hits)

    # caption_classes: three probabilities and their argmax per caption, with provenance.
    classes = {r["key"]: r for r in store.read(CAPTION_CLASSES.name, filter=where).to_pylist()}
    assert set(classes) == set(caps)
    clf_fp = res["classifier"].identity().fingerprint()
    for key, row in classes.items():
        p = [row["p_visual"], row["p_text"], row["p_nsfw"]]
        if not caps[key]["caption"]:
            assert row["label"] is None and p == [None, None, None]
            continue
        assert abs(sum(p) - 1) < 1e-4 and min(p) >= 0
        assert row["label"] == ("visual", "text", "nsfw")[int(np.argmax(p))]
        assert row["backend"] == "embedding" and row["backend_fingerprint"] == clf_fp
        assert row["caption_fingerprint"] == fp
    cmd = _metadata(result, "caption_classes")
    assert cmd["classifier_source"] == EMBEDDING_NOTE
    labels = [r["label"] for r in classes.values() if r["label"]]
    assert cmd["n_visual"] == labels.count("visual") and cmd["classified"] == len(labels)
    assert labels.count("visual") >= len(labels) - 1  # photos described as photos
    assert _check(result, "caption_classes_in_sync").passed

    # caption_embeddings: MiniLM vectors of the stored captions.
    emb = {r["key"]: r for r in store.read(CAPTION_EMBEDDINGS.name, filter=where).to_pylist()}
    assert set(emb) == {k for k, r in caps.items() if r["caption"]}
    direct = MiniLMEmbedder(device="cpu").embed([caps[target["key"]]["caption"]])[0]
    stored = np.asarray(emb[target["key"]]["vector"], dtype=np.float32)
    assert np.allclose(stored, direct, atol=1e-5)
    assert emb[target["key"]]["caption_fingerprint"] == fp
    emd = _metadata(result, "caption_embeddings")
    assert emd["vector_index"].startswith("below_threshold")
    assert emd["vector_index_min_rows"] == VECTOR_INDEX_MIN_ROWS
    assert _check(result, "caption_embeddings_in_sync").passed


def test_failing_backend_fails_the_partition_and_keeps_previous_rows(
    instance,
    lab_resource,
    chat_server,
):
    other = "public-skimage.003"
    instance.add_dynamic_partitions(BATCHES.name, [SMALL, other])
    good = resources(lab_resource)
    upstream = ["raw_images", "resolution_profile"]
    assert run(instance, good, SMALL, selection=[*upstream, "captions"]).success
    assert run(instance, good, other, selection=upstream).success
    store = lab_resource.lab()
    before = store.read(CAPTIONS.name, filter=f"batch = '{SMALL}'").to_pylist()
    assert before

    chat_server.default = lambda body: {"status": 500, "json": {"error": "overloaded"}}
    broken = CaptionerResource(
        backend="openai",
        base_url=chat_server.base_url,
        api_key=SECRET,
        max_attempts=2,
        backoff_base_s=0.0,
    )
    bad = resources(lab_resource, captioner=broken)
    for key in (SMALL, other):
        result = run(instance, bad, key, selection=["captions"], raise_on_error=False)
        assert not result.success
        [failure] = result.get_step_failure_events()
        message = failure.step_failure_data.error.message
        assert "No rows were written" in message and "HTTP 500" in message
        assert SECRET not in message
    # Previous rows are exactly as they were; the fresh partition has none.
    assert store.read(CAPTIONS.name, filter=f"batch = '{SMALL}'").to_pylist() == before
    assert store.dataset(CAPTIONS.name).count_rows(f"batch = '{other}'") == 0
    assert chat_server.requests, "the backend was really called"
    auth = {r["headers"].get("Authorization") for r in chat_server.requests}
    assert auth == {f"Bearer {SECRET}"}


def test_openai_captions_keep_the_key_out_of_metadata_and_rows(
    instance,
    lab_resource,
    chat_server,
    monkeypatch,
):
    monkeypatch.setenv("PRX_TEST_CAPTION_KEY", SECRET)
    captioner = CaptionerResource(
        backend="openai",
        model="test/vlm",
        base_url=chat_server.base_url,
        api_key=EnvVar("PRX_TEST_CAPTION_KEY"),
        max_attempts=1,
    )
    instance.add_dynamic_partitions(BATCHES.name, [SMALL])
    result = run(instance, resources(lab_resource, captioner=captioner), SMALL)
    assert result.success
    md = _metadata(result, "captions")
    assert md["backend"] == "openai" and md["model_id"] == "test/vlm"
    assert md["fallback_captions"] == 0 and "caption_source" not in md
    assert md["endpoint"] == chat_server.base_url
    dumped = json.dumps({k: str(v) for k, v in md.items()})
    rows = lab_resource.lab().read(CAPTIONS.name, filter=f"batch = '{SMALL}'").to_pylist()
    assert SECRET not in dumped and SECRET not in json.dumps(rows, default=str)
    assert {r["is_fallback"] for r in rows} == {False}
    assert {r["model_id"] for r in rows} == {"test/vlm"}
    assert all(r["caption"].startswith("a caption for image ") for r in rows)
    # The server saw one request per eligible image, each with the image and the key.
    assert len(chat_server.requests) == len(rows)
    assert {r["headers"]["Authorization"] for r in chat_server.requests} == {f"Bearer {SECRET}"}


def test_a_fleet_captions_and_classifies_with_per_endpoint_counts_in_metadata(
    instance, lab_resource, chat_fleet, monkeypatch
):
    """Captions over two servers and classes over two others, one of which is dead: every
    row is made, each asset's metadata counts requests and errors per server, the key
    appears nowhere and the URLs only inside code spans."""
    cap_a, cap_b, cls_a, cls_dead = chat_fleet(4)
    cls_dead.kill()
    for s in (cls_a, cls_dead):
        s.state.default = lambda body: model_fixtures.chat_reply("visual")
    monkeypatch.setenv("PRX_TEST_FLEET_KEY", SECRET)
    captioner = CaptionerResource(
        backend="openai",
        model="test/vlm",
        base_urls=[cap_a.state.base_url, cap_b.state.base_url],
        api_key=EnvVar("PRX_TEST_FLEET_KEY"),
        max_concurrency=2,
    )
    classifier = ClassifierResource(
        backend="openai",
        model="test/lm",
        mode="choice",
        base_url=f"{cls_a.state.base_url},{cls_dead.state.base_url}",
        api_key=EnvVar("PRX_TEST_FLEET_KEY"),
        backoff_base_s=0.0,
        circuit_failures=1,
    )
    instance.add_dynamic_partitions(BATCHES.name, [SMALL])
    res = resources(lab_resource, captioner=captioner, classifier=classifier)
    result = run(
        instance,
        res,
        SMALL,
        selection=["raw_images", "resolution_profile", "captions", "caption_classes"],
    )
    assert result.success
    rows = lab_resource.lab().read(CAPTIONS.name, filter=f"batch = '{SMALL}'").to_pylist()
    classes = lab_resource.lab().read(CAPTION_CLASSES.name, filter=f"batch = '{SMALL}'").to_pylist()
    assert rows and {r["label"] for r in classes} == {"visual"} and len(classes) == len(rows)

    md = _metadata(result, "captions")
    assert md["endpoints"] == 2 and "endpoint" not in md  # no single server to name
    assert md["requests"] == len(rows) and md["request_errors"] == 0
    per = {c["url"]: c for c in md["endpoint_counts"]}
    assert {u: c["ok"] for u, c in per.items()} == {
        s.state.base_url: len(s.state.requests) for s in (cap_a, cap_b)
    }
    assert all(c["ok"] >= 1 for c in per.values())  # both servers served
    table = md["endpoint_requests"]
    for s in (cap_a, cap_b):
        assert f"| `{s.state.base_url}` | {len(s.state.requests)} |" in table

    cmd = _metadata(result, "caption_classes")
    assert cmd["endpoints"] == 2
    alive, dead = cmd["endpoint_counts"]
    assert alive["url"] == cls_a.state.base_url and alive["ok"] == len(rows)
    assert dead["ok"] == 0 and dead["connection_errors"] >= 1 and dead["state"] == "open"
    assert cmd["request_errors"] == dead["errors"] >= 1
    for value in (md, cmd):
        assert SECRET not in json.dumps({k: str(v) for k, v in value.items()})


def test_a_fleet_from_the_environment_keeps_the_single_server_identity(monkeypatch):
    from prx_assets.definitions import backends_from_env

    fleet = "http://vllm-0.vllm:8000/v1,http://vllm-1.vllm:8000/v1 http://vllm-2.vllm:8000/v1"
    monkeypatch.setenv("PRX_CAPTIONER", "openai")
    monkeypatch.setenv("PRX_CAPTION_MODEL", "org/vlm")
    monkeypatch.setenv("PRX_CLASSIFIER", "openai")
    monkeypatch.setenv("PRX_CLASSIFIER_BASE_URL", fleet)
    monkeypatch.setenv("PRX_CAPTION_BASE_URL", fleet)
    captioner, classifier = backends_from_env()
    with captioner.build() as cap, classifier.build() as clf:
        assert len(cap.base_urls) == 3 and cap.base_urls == clf.base_urls
    monkeypatch.setenv("PRX_CAPTION_BASE_URL", "http://vllm-1.vllm:8000/v1")
    single, _ = backends_from_env()
    assert single.identity() == captioner.identity()
    with pytest.raises(ValueError, match="not both"):
        CaptionerResource(
            backend="openai", base_url="http://a:1/v1", base_urls=["http://b:1/v1"]
        ).build()


def test_endpoint_urls_in_metadata_are_code_spans_and_bounded():
    from prx_assets.core.captions.models.fleet import EndpointCounts
    from prx_assets.core.markdown import bounded, md_code
    from prx_assets.defs.metadata import MAX_URL_CHARS, endpoint_metadata

    url = "http://h:1/v1/`![x](/graphql?query=mutation)`|<b>" + "a" * 500
    zeros = dict.fromkeys(
        ["requests", "ok", "errors", "connection_errors", "timeouts", "http_5xx", "http_429"], 0
    )
    counts = EndpointCounts(
        url=url, **zeros, client_errors=0, malformed=0, circuit_opens=0, probes=0, state="closed"
    )
    md = endpoint_metadata([counts])
    table = md["endpoint_requests"].value
    cell = md_code(bounded(url, MAX_URL_CHARS), cell=True)
    assert f"| {cell} |" in table and len(table) < 1000
    assert "![x](/graphql" not in table.replace(cell, "")
    assert md["endpoint_counts"].value[0]["url"] == bounded(url, MAX_URL_CHARS)
    assert endpoint_metadata([]) == {}


def test_identity_ignores_deployment_and_secrets(monkeypatch):
    monkeypatch.setenv("PRX_TEST_MODEL", "org/vlm-a")
    base = CaptionerResource(backend="openai", model=EnvVar("PRX_TEST_MODEL"))
    moved = CaptionerResource(
        backend="openai",
        model="org/vlm-a",
        base_url="http://10.0.0.7:9000/v1",
        api_key=EnvVar("UNSET_PRX_TEST_KEY"),
        max_concurrency=2,
        timeout_s=5,
    )
    assert base.identity() == moved.identity()  # the EnvVar model is read, the key is not
    hotter = CaptionerResource(backend="openai", model="org/vlm-a", temperature=0.7)
    assert hotter.identity().fingerprint() != base.identity().fingerprint()
    assert (
        ClassifierResource(temperature=0.1).identity().fingerprint()
        != ClassifierResource().identity().fingerprint()
    )
    with pytest.raises(Exception, match="alt_text"):
        CaptionerResource(backend="gpt")


def test_vector_index_waits_for_enough_rows(tmp_path):
    lab = Lab(tmp_path / "lab")
    identity = EmbedderResource().identity()
    rng = np.random.default_rng(0)

    def add(batch: str, n: int) -> None:
        v = rng.standard_normal((n, 384)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        keys = [f"{batch}-{i}" for i in range(n)]
        from datetime import UTC, datetime

        table = embedding_rows(batch, keys, ["c"] * n, v, identity, datetime.now(UTC))
        lab.replace_partition(CAPTION_EMBEDDINGS, batch, table)

    uri = lab.uri(CAPTION_EMBEDDINGS.name)
    add("a", 200)
    assert ensure_embedding_index(lab, min_rows=300) == "below_threshold (200 < 300)"
    add("b", 200)
    assert ensure_embedding_index(lab, min_rows=300) == "created"
    add("c", 50)
    assert ensure_embedding_index(lab, min_rows=300) == "optimized"
    ds = lance.dataset(uri)
    # optimize adds a delta segment for the new fragment: the whole table is indexed
    segments = [ix for ix in ds.list_indices() if ix["fields"] == ["vector"]]
    assert {(ix["name"], ix["type"]) for ix in segments} == {("vector_idx", "IVF_HNSW_SQ")}
    assert ds.stats.index_stats("vector_idx")["num_unindexed_rows"] == 0
    q = np.asarray(ds.to_table(columns=["vector"], filter="key = 'c-7'")["vector"][0].as_py())
    nearest = ds.to_table(nearest={"column": "vector", "q": q, "k": 1}, columns=["key"])
    assert nearest["key"].to_pylist() == ["c-7"]
    with pytest.raises(ValueError, match="index_type"):
        ensure_embedding_index(lab, index_type="FLAT")


def test_caption_stage_loads_into_definitions(tmp_path):
    """The wiring the lead adds to build_defs: assets, checks, the swap sensor, resources."""
    from dagster import Definitions

    from prx_assets.defs.captions.reconcile import build_model_swap_sensor
    from prx_assets.defs.resources import LabResource

    cap, clf, emb = CaptionerResource(), ClassifierResource(), EmbedderResource()
    defs = Definitions(
        assets=[raw_images, resolution_profile, *build_caption_assets(cap, clf, emb)],
        sensors=[build_model_swap_sensor()],
        resources={
            "lab": LabResource(data_root=str(tmp_path)),
            "captioner": cap,
            "classifier": clf,
            "embedder": emb,
        },
    )
    Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    assert graph.get(AssetKey("captions")).parent_keys == {
        AssetKey("raw_images"),
        AssetKey("resolution_profile"),
    }
    for name in ("caption_classes", "caption_embeddings"):
        assert graph.get(AssetKey(name)).parent_keys == {AssetKey("captions")}
        assert graph.get(AssetKey(name)).group_name == "captions"
    assert {k.name for k in graph.asset_check_keys} == {
        "captions_length_window",
        "caption_classes_in_sync",
        "caption_embeddings_in_sync",
    }
    pools = {a.key.to_user_string(): a.op.pool for a in build_caption_assets(cap, clf, emb)}
    # The defaults: alt text runs no model (no pool); the MiniLM fallback is in process.
    assert pools == {"captions": None, "caption_classes": "gpu", "caption_embeddings": None}


@pytest.mark.parametrize(
    ("captioner", "classifier", "expected"),
    [
        ("transformers", "transformers", ("gpu", "gpu")),
        ("openai", "openai", (None, None)),
        ("openai", "transformers", (None, "gpu")),
        ("transformers", "embedding", ("gpu", "gpu")),
    ],
)
def test_only_in_process_models_take_the_gpu_pool(captioner, classifier, expected):
    """A fleet-backed step makes HTTP calls: it must not queue behind the one-slot ``gpu``
    pool, so several batches caption at once; an in-process model stays in the pool."""
    cap = CaptionerResource(backend=captioner, base_url="http://fleet-a:8000/v1")
    clf = ClassifierResource(backend=classifier, base_url="http://fleet-b:8000/v1")
    assets = {a.key.to_user_string(): a for a in build_caption_assets(cap, clf, EmbedderResource())}
    assert (assets["captions"].op.pool, assets["caption_classes"].op.pool) == expected


def test_the_length_window_fails_vlm_captions_outside_it():
    from prx_assets.core.captions.tables import CaptionStats
    from prx_assets.defs.captions.checks import length_window_result

    stats = CaptionStats(captions=4, empty=0, fallback=0, too_short=1, too_long=0)
    check = length_window_result(stats, is_fallback=False)
    assert check.passed is False and check.metadata["applies"].value is True
    assert check.description == "1 of 4 captions outside 100-200 words"
    assert length_window_result(stats, is_fallback=True).passed is True


def test_fleet_settings_reach_the_client_policy_with_each_resources_defaults():
    """The resources' fleet fields are passed by name to the client's policy: a configured
    value arrives, each resource keeps its own default, and a bad value is refused."""
    from prx_assets.core.captions.models import BackendConfigError
    from prx_assets.defs.captions.resources import CaptionerResource, ClassifierResource

    url = "http://127.0.0.1:9/v1"
    captioner = CaptionerResource(backend="openai", base_url=url, max_concurrency=3).build()
    assert captioner._client.policy.max_concurrency == 3
    assert captioner._client.policy.timeout_s == 120.0
    classifier = ClassifierResource(backend="openai", base_url=url, max_fleet_down_s=7.0).build()
    assert classifier._client.policy.max_concurrency == 16
    assert classifier._client.policy.max_fleet_down_s == 7.0
    with pytest.raises(BackendConfigError, match="max_attempts"):
        CaptionerResource(backend="openai", base_url=url, max_attempts=0).build()
