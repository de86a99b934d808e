"""The caption stage's runners on a real demo batch in a real lab, without Dagster.

Backends are the real ones: the alt-text fallback, the bundled MiniLM embedder and the
embedding classifier on CPU, and an OpenAI-compatible HTTP server scripted to fail.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.core.captions.models import (
    AltTextCaptioner,
    BackendError,
    BackendIdentity,
    CaptionInput,
    CaptionResult,
    EmbeddingClassifier,
    MiniLMEmbedder,
    OpenAICaptioner,
    OpenAIClassifier,
)
from prx_assets.core.captions.runner import (
    BatchCaptions,
    BatchClasses,
    BatchEmbeddings,
    CaptionStageError,
)
from prx_assets.core.captions.tables import caption_rows
from prx_assets.core.captions.verify import classes_sync, embeddings_sync
from prx_assets.core.lab import Lab, in_list
from prx_assets.core.tables import CAPTION_CLASSES, CAPTION_EMBEDDINGS, CAPTIONS, IMAGES
from prx_assets_tests.core.models import conftest as model_fixtures
from prx_assets_tests.core.stage_inputs import DEMO_BATCH, RecordingLab, ingest_demo_batch

KEY = DEMO_BATCH
chat_server = model_fixtures.chat_server  # the scripted OpenAI-compatible server fixture
chat_fleet = model_fixtures.chat_fleet  # several such servers that can die


@pytest.fixture
def lab_with_batch(data_root: Path) -> tuple[RecordingLab, list[str]]:
    lab = RecordingLab(data_root / "lab")
    return lab, ingest_demo_batch(lab, data_root / "landing")


def _alt_captions(lab: Lab, **kw) -> BatchCaptions:
    return BatchCaptions(lab, KEY, AltTextCaptioner, backend="alt_text", pixels=False, **kw)


def _rows(lab: Lab, table: str) -> dict[str, dict]:
    return {r["key"]: r for r in lab.read_batch(table, KEY).to_pylist()}


def test_caption_runner_captions_every_eligible_image_and_indexes_the_text(lab_with_batch):
    lab, eligible = lab_with_batch
    progress: list[str] = []
    lab.reads.clear()
    out = _alt_captions(lab, chunk_size=4, log=progress.append).run()
    caps = _rows(lab, CAPTIONS.name)
    assert sorted(caps) == eligible and out.eligible == len(eligible)
    alt = {r["key"]: r["alt_text"] for r in lab.read_batch(IMAGES.name, KEY).to_pylist()}
    fingerprint = AltTextCaptioner().identity.fingerprint()
    for key, row in caps.items():
        assert row["caption"] == " ".join((alt[key] or "").split())
        assert row["is_fallback"] and row["backend"] == "alt_text"
        assert row["backend_fingerprint"] == fingerprint
    assert out.identity.fingerprint() == fingerprint and out.endpoint is None
    assert out.stats.captions == len(eligible) == out.stats.fallback
    assert out.stats.empty == sum(not r["caption"] for r in caps.values())
    n = len(eligible)
    assert progress[-1].startswith(f"{KEY}: captioned {n}/{n} (") and "done in" in progress[-1]
    assert len(progress) == 1  # a short step: the last line only (one every 10 s otherwise)
    # The fallback reads alt text only: image bytes are never read.
    image_reads = [cols for table, cols, _, _ in lab.reads if table == IMAGES.name]
    assert image_reads and all("image" not in cols for cols in image_reads)
    assert out.fts_index == "created"
    word = next(w for r in caps.values() for w in r["caption"].split() if len(w) > 5)
    hits = lab.view().read(CAPTIONS.name, ["key", "caption"], full_text_query=word).to_pylist()
    assert hits and all(word.lower() in h["caption"].lower() for h in hits)
    again = _alt_captions(lab).run()  # a rerun: same captions, the index folds the new rows
    assert again.fts_index == "optimized" and again.version > out.version
    assert {k: r["caption"] for k, r in _rows(lab, CAPTIONS.name).items()} == {
        k: r["caption"] for k, r in caps.items()
    }


def test_class_and_embedding_runners_cover_every_caption_and_verify_it(lab_with_batch):
    lab, eligible = lab_with_batch
    _alt_captions(lab).run()
    rows = lab.read_batch(CAPTIONS.name, KEY).to_pylist()
    rows[0]["caption"] = ""  # an image without alt text: nothing to classify or embed
    lab.replace_partition(CAPTIONS, KEY, pa.Table.from_pylist(rows, schema=CAPTIONS.schema))
    caps = _rows(lab, CAPTIONS.name)
    with_text = {k for k, r in caps.items() if r["caption"].strip()}
    assert len(with_text) == len(caps) - 1
    embedder = MiniLMEmbedder(device="cpu")

    classes = BatchClasses(
        lab, KEY, lambda: EmbeddingClassifier(embedder), backend="embedding", chunk_size=3
    ).run()
    rows = _rows(lab, CAPTION_CLASSES.name)
    assert sorted(rows) == eligible and classes.captions == len(eligible)
    assert classes.classified == len(with_text)
    assert classes.label_counts == {
        label: Counter(r["label"] for r in rows.values())[label] for label in classes.label_counts
    }
    assert {k for k, r in rows.items() if r["label"] is None} == set(caps) - with_text
    assert classes.caption_fingerprints == [caps[eligible[0]]["backend_fingerprint"]]
    assert classes.sync.in_sync and classes.sync.counts["unclassified"] == len(caps) - len(
        with_text
    )

    emb = BatchEmbeddings(lab, KEY, lambda: embedder, chunk_size=2, index_min_rows=256).run()
    vectors = _rows(lab, CAPTION_EMBEDDINGS.name)
    assert set(vectors) == with_text and emb.embeddings == len(with_text)
    assert emb.skipped_empty == len(caps) - len(with_text) and emb.dim == 384
    assert emb.vector_index == f"below_threshold ({len(with_text)} < 256)"
    assert emb.table_rows == len(with_text) and emb.sync.in_sync

    # What the runners verify can fail: captions re-made by another captioner leave the
    # stored classes and embeddings out of sync until they are re-made too.
    other = BackendIdentity.create(kind="test", model_id="other", prompt_version="v2")
    results = [CaptionResult(k, f"another {k[:6]}", "test", "other", "v2") for k in sorted(caps)]
    created = datetime(2024, 1, 1, tzinfo=UTC)
    lab.replace_partition(CAPTIONS, KEY, caption_rows(KEY, results, other, "test", created))
    current = lab.read_batch(CAPTIONS.name, KEY)
    stale = classes_sync(current, lab.read_batch(CAPTION_CLASSES.name, KEY))
    assert stale.problems == {"fingerprint_mismatch": len(caps)}
    stale = embeddings_sync(current, lab.read_batch(CAPTION_EMBEDDINGS.name, KEY))
    assert stale.problems == {
        "missing": len(caps) - len(with_text),
        "fingerprint_mismatch": len(with_text),
    }


def test_a_failing_backend_writes_nothing_and_keeps_the_previous_rows(lab_with_batch, chat_server):
    lab, _ = lab_with_batch
    _alt_captions(lab).run()
    before = lab.read_batch(CAPTIONS.name, KEY)
    version = lab.version(CAPTIONS.name)
    chat_server.default = lambda body: {"status": 500, "json": {"error": "overloaded"}}
    built: list[OpenAICaptioner] = []

    def build() -> OpenAICaptioner:
        built.append(
            OpenAICaptioner(
                "test-vlm", base_url=chat_server.base_url, max_attempts=2, backoff_base_s=0.0
            )
        )
        return built[-1]

    run = BatchCaptions(lab, KEY, build, backend="openai", chunk_size=64)
    with pytest.raises(CaptionStageError, match="No rows were written") as caught:
        run.run()
    assert "HTTP 500" in str(caught.value)
    assert isinstance(caught.value.__cause__, BackendError)
    assert caught.value.details == {
        "backend": "openai",
        "fingerprint": built[0].identity.fingerprint(),
        "endpoints": "1",
        "endpoints_out_of_service": "1",  # every answer a 500: its circuit opened
    }
    assert chat_server.requests  # the server really was asked
    assert lab.read_batch(CAPTIONS.name, KEY).equals(before)
    assert lab.version(CAPTIONS.name) == version


def test_a_dead_fleet_fails_the_batch_and_writes_nothing(lab_with_batch, chat_fleet):
    """Two servers, one dead from the start and one that dies after three answers: the
    batch fails with the fleet's state, and the partition keeps its previous rows."""
    lab, _ = lab_with_batch
    _alt_captions(lab).run()
    before = lab.read_batch(CAPTIONS.name, KEY)
    version = lab.version(CAPTIONS.name)
    dead, dying = chat_fleet(2)
    dead.kill()

    def reply(body: dict) -> dict:
        if len(dying.state.requests) == 4:
            dying.kill()
        return model_fixtures.chat_reply("a caption")

    dying.state.default = reply
    urls = [dead.state.base_url, dying.state.base_url]
    run = BatchCaptions(
        lab,
        KEY,
        lambda: OpenAICaptioner(
            "test-vlm",
            base_url=urls,
            max_attempts=100,
            backoff_base_s=0.0,
            max_concurrency=1,
            circuit_failures=1,
            circuit_cooldown_s=0.05,
            max_fleet_down_s=0.5,
        ),
        backend="openai",
        chunk_size=64,
    )
    with pytest.raises(CaptionStageError, match="No rows were written") as caught:
        run.run()
    assert "FleetDownError" in str(caught.value)
    assert "all 2 endpoint(s) out of service" in str(caught.value)
    assert caught.value.details["endpoints"] == "2"
    assert caught.value.details["endpoints_out_of_service"] == "2"
    assert len(dying.state.requests) >= 4  # it did answer before it died
    assert lab.read_batch(CAPTIONS.name, KEY).equals(before)
    assert lab.version(CAPTIONS.name) == version


def test_missing_inputs_are_refused_before_a_backend_is_built(tmp_path, lab_with_batch):
    built: list[str] = []

    def build():
        built.append("built")
        return AltTextCaptioner()

    empty = Lab(tmp_path / "empty-lab")
    with pytest.raises(CaptionStageError, match="no resolution table yet"):
        BatchCaptions(empty, KEY, build, backend="alt_text").run()
    with pytest.raises(CaptionStageError, match="no captions table yet"):
        BatchClasses(empty, KEY, build, backend="embedding").run()  # type: ignore[arg-type]
    with pytest.raises(CaptionStageError, match="no captions table yet"):
        BatchEmbeddings(empty, KEY, build).run()  # type: ignore[arg-type]
    assert built == []

    lab, eligible = lab_with_batch
    lab.delete(IMAGES.name, in_list("key", [eligible[-1]]))
    with pytest.raises(CaptionStageError, match=r"1 eligible image\(s\) .* not in `images`"):
        BatchCaptions(lab, KEY, build, backend="alt_text").run()
    assert not lab.exists(CAPTIONS.name)


def test_results_out_of_order_are_refused(lab_with_batch):
    lab, _ = lab_with_batch

    class Reversed(AltTextCaptioner):
        def caption(self, images):
            return list(reversed(super().caption(images)))

    with pytest.raises(CaptionStageError, match="out of order"):
        BatchCaptions(lab, KEY, Reversed, backend="alt_text", pixels=False).run()
    assert not lab.exists(CAPTIONS.name)


def _held_head_fleet(chat_fleet, reply_text, *, others: int):
    """One server that holds its first request until ``others`` more have arrived (bounded:
    a runner with a chunk barrier never sends them, and the hold gives up after 2 s)."""
    (server,) = chat_fleet(1)
    arrived = threading.Event()
    seen = {"n": 0, "held_saw_others": None}
    lock = threading.Lock()

    def reply(body: dict) -> dict:
        with lock:
            seen["n"] += 1
            first = seen["n"] == 1
            if seen["n"] == 1 + others:
                arrived.set()
        if first:
            seen["held_saw_others"] = arrived.wait(2.0)
        return model_fixtures.chat_reply(reply_text(body))

    server.state.default = reply
    return server, seen


def test_captions_stream_across_chunks_without_a_barrier(lab_with_batch, chat_fleet):
    """chunk_size 2: while the first request is held, images of later chunks are read,
    prepared and sent; every eligible image still gets exactly its own caption, in order."""
    lab, eligible = lab_with_batch
    assert len(eligible) >= 6
    digest = model_fixtures.data_url_digest
    server, seen = _held_head_fleet(
        chat_fleet, lambda body: f"a caption for image {digest(body)}", others=4
    )
    built: list[OpenAICaptioner] = []

    def build() -> OpenAICaptioner:
        built.append(OpenAICaptioner("test-vlm", base_url=server.state.base_url, max_concurrency=8))
        return built[-1]

    out = BatchCaptions(lab, KEY, build, backend="openai", chunk_size=2).run()
    assert seen["held_saw_others"] is True  # 4 more requests arrived while the head was held
    caps = _rows(lab, CAPTIONS.name)
    assert sorted(caps) == eligible and out.stats.captions == len(eligible)
    images = {r["key"]: r["image"] for r in lab.read_batch(IMAGES.name, KEY).to_pylist()}
    for key in eligible:  # each row holds the caption of its own image
        url = built[0].image_url(CaptionInput(key, image=images[key]))
        body = {"messages": [{"content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        assert caps[key]["caption"] == f"a caption for image {digest(body)}"
    assert len(server.state.requests) == len(eligible)


def test_caption_classes_stream_across_chunks_without_a_barrier(lab_with_batch, chat_fleet):
    lab, _ = lab_with_batch
    _alt_captions(lab).run()
    n = sum(bool((r["caption"] or "").strip()) for r in _rows(lab, CAPTIONS.name).values())
    assert n >= 6
    server, seen = _held_head_fleet(chat_fleet, lambda body: "visual", others=4)

    def build() -> OpenAIClassifier:
        return OpenAIClassifier("test-lm", base_url=server.state.base_url, mode="choice")

    out = BatchClasses(lab, KEY, build, backend="openai", chunk_size=2).run()
    assert seen["held_saw_others"] is True
    assert out.classified == n and out.label_counts["visual"] == n and out.sync.in_sync
    assert len(server.state.requests) == n


def test_a_server_killed_mid_batch_loses_and_duplicates_no_caption(lab_with_batch, chat_fleet):
    """Two servers; one dies (socket closed, requests in flight unanswered) on its third
    request. Its work is retried on the other: one row per image, each its own caption."""
    lab, eligible = lab_with_batch
    digest = model_fixtures.data_url_digest
    a, b = chat_fleet(2)

    def answer(body: dict) -> dict:
        return model_fixtures.chat_reply(f"a caption for image {digest(body)}")

    def dying(body: dict) -> dict:
        if len(b.state.requests) == 3:
            b.kill()
        return answer(body)

    a.state.default, b.state.default = answer, dying
    built: list[OpenAICaptioner] = []

    def build() -> OpenAICaptioner:
        urls = [a.state.base_url, b.state.base_url]
        built.append(
            OpenAICaptioner(
                "test-vlm", base_url=urls, max_concurrency=2, backoff_base_s=0.01, timeout_s=5.0
            )
        )
        return built[-1]

    BatchCaptions(lab, KEY, build, backend="openai", chunk_size=3).run()
    caps = lab.read_batch(CAPTIONS.name, KEY).to_pylist()
    assert sorted(r["key"] for r in caps) == eligible  # none lost, none twice
    images = {r["key"]: r["image"] for r in lab.read_batch(IMAGES.name, KEY).to_pylist()}
    for row in caps:
        url = built[0].image_url(CaptionInput(row["key"], image=images[row["key"]]))
        body = {"messages": [{"content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        assert row["caption"] == f"a caption for image {digest(body)}"
    counts = built[0].endpoint_counts()
    assert counts[1].errors >= 1  # the dead server's requests failed and were moved
    assert counts[0].ok + counts[1].ok == len(eligible)


def test_images_prepared_on_the_worker_pool_get_their_own_captions(lab_with_batch, chat_fleet):
    """``prepare_pool``: decode, resize and encode run in worker processes (Ray tasks on a
    cluster), the step only streams requests; same captions, one per image. A bad image
    prepared there fails the batch and nothing is written."""
    from prx_assets.core.workers import make_pool

    lab, eligible = lab_with_batch
    digest = model_fixtures.data_url_digest
    (server,) = chat_fleet(1)
    server.state.default = lambda body: model_fixtures.chat_reply(
        f"a caption for image {digest(body)}"
    )
    built: list[OpenAICaptioner] = []

    def build() -> OpenAICaptioner:
        built.append(OpenAICaptioner("test-vlm", base_url=server.state.base_url))
        return built[-1]

    def pool():
        return make_pool("process", 2)

    BatchCaptions(lab, KEY, build, backend="openai", chunk_size=4, prepare_pool=pool).run()
    caps = _rows(lab, CAPTIONS.name)
    assert sorted(caps) == eligible
    images = {r["key"]: r["image"] for r in lab.read_batch(IMAGES.name, KEY).to_pylist()}
    for key in eligible:
        url = built[0].image_url(CaptionInput(key, image=images[key]))
        body = {"messages": [{"content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        assert caps[key]["caption"] == f"a caption for image {digest(body)}"

    before, version = lab.read_batch(CAPTIONS.name, KEY), lab.version(CAPTIONS.name)
    table = lab.read_batch(IMAGES.name, KEY)
    blobs = [
        b"\xff\xd8 not a jpeg" if k == eligible[2] else b
        for k, b in zip(table["key"].to_pylist(), table["image"].to_pylist(), strict=True)
    ]
    column = table.schema.get_field_index("image")
    table = table.set_column(column, "image", pa.array(blobs, table.schema.field("image").type))
    lab.replace_partition(IMAGES, KEY, table)
    with pytest.raises(CaptionStageError, match="preparation failed"):
        BatchCaptions(lab, KEY, build, backend="openai", chunk_size=4, prepare_pool=pool).run()
    assert lab.read_batch(CAPTIONS.name, KEY).equals(before)
    assert lab.version(CAPTIONS.name) == version
