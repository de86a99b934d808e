"""OpenAICaptioner against a real local HTTP server with scripted replies and faults."""

from __future__ import annotations

import base64
import io
import logging
import re

import pytest
from PIL import Image

from prx_assets.core.captions.models import (
    CAPTION_PROMPT_VERSION,
    CAPTION_SYSTEM_PROMPT,
    BackendConfigError,
    BackendInputError,
    BackendRequestError,
    BackendTimeoutError,
    BackendUnavailableError,
    CaptionInput,
    EmptyContentError,
    MalformedResponseError,
    OpenAICaptioner,
)

from .conftest import ChatServer, chat_reply, data_url_digest

SECRET = "sk-test-5f3a9c0d2b7e41ee"
FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 2.0}


def _inputs(demo_photos: dict[str, bytes], n: int) -> list[CaptionInput]:
    names = sorted(demo_photos)[:n]
    return [CaptionInput(key=name, image=demo_photos[name]) for name in names]


def _captioner(server: ChatServer, **kw: object) -> OpenAICaptioner:
    args = {"base_url": server.base_url, "api_key": SECRET, "max_side": 256, **FAST, **kw}
    return OpenAICaptioner("test-vlm", **args)  # type: ignore[arg-type]


def test_captions_keep_order_bound_concurrency_and_send_small_jpegs(chat_server, demo_photos):
    chat_server.default = lambda body: {
        **chat_reply(f"a caption for image {data_url_digest(body)}"),
        "sleep": 0.1,
    }
    inputs = _inputs(demo_photos, 6)
    with _captioner(chat_server, max_concurrency=3) as cap:
        results = cap.caption(inputs)
        expected_urls = [cap.image_url(item) for item in inputs]

    assert [r.key for r in results] == [i.key for i in inputs]
    for result, url in zip(results, expected_urls, strict=True):
        body = {"messages": [{"content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        assert result.caption == f"a caption for image {data_url_digest(body)}"
        assert (result.kind, result.model_id, result.is_fallback) == (
            "openai_vlm",
            "test-vlm",
            False,
        )
        assert result.prompt_version == CAPTION_PROMPT_VERSION
        assert result.finish_reason == "stop"
    assert 2 <= chat_server.max_in_flight <= 3

    req = chat_server.requests[0]
    assert req["headers"]["Authorization"] == f"Bearer {SECRET}"
    body = req["body"]
    assert body["model"] == "test-vlm" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": CAPTION_SYSTEM_PROMPT}
    url = body["messages"][1]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert sent.format == "JPEG" and max(sent.size) == 256  # demo photos are all > 256 px


def test_transient_faults_are_retried_until_success(chat_server, demo_photos, caplog):
    chat_server.script = [
        {"status": 500, "json": {"error": "boom"}},
        {"status": 429, "json": {"error": "slow down"}, "headers": {"Retry-After": "1"}},
        {"status": 200, "raw": b'{"choices": [{"message": '},  # truncated JSON
        chat_reply("   "),  # empty content
        {"status": 200, "json": {"object": "chat.completion"}},  # no choices
        {**chat_reply("late"), "sleep": 1.6},  # past the client timeout
        chat_reply("<think>let me look</think>\nA red brick\n\nwall  in daylight."),
    ]
    caplog.set_level(logging.WARNING)
    with _captioner(chat_server, max_attempts=7, timeout_s=0.8) as cap:
        [result] = cap.caption(_inputs(demo_photos, 1))

    assert result.caption == "A red brick wall in daylight."
    assert len(chat_server.requests) == 7
    # Retry-After: 1 is honoured: the wait after the 429 is at least 1 s, though the
    # configured backoff (FAST) is at most 0.05 s.
    waits = re.findall(r"attempt (\d)/7 failed \((.*?)\); retrying in ([0-9.]+)s", caplog.text)
    assert [(int(n), float(s)) for n, why, s in waits if "HTTP 429" in why] == [(2, 1.0)]
    assert all(float(s) <= 0.05 for _, why, s in waits if "HTTP 429" not in why)
    assert "timeout" in caplog.text and "malformed JSON" in caplog.text


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ({"status": 503, "json": {"error": "overloaded"}}, BackendUnavailableError),
        ({"status": 200, "raw": b"not json at all"}, MalformedResponseError),
        ({"status": 200, "json": {"choices": []}}, MalformedResponseError),
        (chat_reply(""), EmptyContentError),
        (chat_reply(None), EmptyContentError),
        ({**chat_reply("too late"), "sleep": 1.2}, BackendTimeoutError),
    ],
)
def test_exhausted_retries_raise_a_specific_error(chat_server, demo_photos, reply, error):
    chat_server.default = lambda body: reply
    with _captioner(chat_server, max_attempts=3, timeout_s=0.75) as cap:
        with pytest.raises(error) as info:
            cap.caption(_inputs(demo_photos, 1))
    assert len(chat_server.requests) == 3
    assert info.value.attempts == 3
    assert "failed after 3 attempts" in str(info.value)
    if error is BackendUnavailableError:
        assert info.value.status == 503


def test_client_errors_are_not_retried(chat_server, demo_photos):
    chat_server.default = lambda body: {"status": 400, "json": {"error": "bad model"}}
    with _captioner(chat_server) as cap:
        with pytest.raises(BackendRequestError, match="HTTP 400") as info:
            cap.caption(_inputs(demo_photos, 2))
    assert info.value.status == 400
    assert len(chat_server.requests) <= 2  # one per image at most, no retries


def test_one_failing_image_fails_the_whole_batch(chat_server, demo_photos):
    inputs = _inputs(demo_photos, 5)
    cap = _captioner(chat_server, max_concurrency=2, max_attempts=3)
    poisoned = data_url_digest(
        {
            "messages": [
                {"content": [{"type": "image_url", "image_url": {"url": cap.image_url(inputs[2])}}]}
            ]
        }
    )

    def reply(body: dict) -> dict:
        if data_url_digest(body) == poisoned:
            return {"status": 502, "json": {"error": "bad gateway"}}
        return {**chat_reply("fine"), "sleep": 0.05}

    chat_server.default = reply
    with pytest.raises(BackendUnavailableError) as info:
        cap.caption(inputs)
    cap.close()
    assert inputs[2].key in str(info.value)
    assert info.value.status == 502


def test_bad_images_fail_the_batch_and_are_never_sent(chat_server, demo_photos):
    """Streaming has no prepare-everything barrier, so the good image before a bad one may
    already have been sent; the batch still fails as a whole and the bad one never goes."""
    cap = _captioner(chat_server)
    good = _inputs(demo_photos, 1)[0]
    with pytest.raises(BackendInputError, match="no image"):
        cap.caption([good, CaptionInput(key="missing")])
    with pytest.raises(BackendInputError, match=r"broken\.jpg: image rejected \(not_an_image\)"):
        cap.caption([good, CaptionInput(key="broken.jpg", image=b"\xff\xd8 not really a jpeg")])
    good_url = cap.image_url(good)
    sent = [
        r["body"]["messages"][1]["content"][0]["image_url"]["url"] for r in chat_server.requests
    ]
    assert set(sent) <= {good_url} and len(sent) <= 2  # only the good image, once per call


def test_api_key_never_in_identity_repr_errors_or_logs(chat_server, demo_photos, caplog):
    caplog.set_level(logging.DEBUG)  # include httpx/httpcore debug logs
    chat_server.default = lambda body: {"status": 500, "json": {"error": "nope"}}
    cap = _captioner(chat_server, max_attempts=2)
    with pytest.raises(BackendUnavailableError) as info:
        cap.caption(_inputs(demo_photos, 1))
    assert chat_server.requests[0]["headers"]["Authorization"] == f"Bearer {SECRET}"
    surfaces = [
        repr(cap),
        str(cap),
        repr(cap._client),
        repr(cap.identity),
        cap.identity.canonical_json(),
        repr(vars(cap)),
        str(info.value),
        caplog.text,
    ]
    assert "attempt 1/2 failed" in caplog.text  # our retry log
    assert "HTTP Request: POST" in caplog.text  # httpx's own request log
    for surface in surfaces:
        assert SECRET not in surface


def test_key_and_url_from_environment(chat_server, demo_photos, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("PRX_CAPTION_API_KEY", "env-key-123")
    monkeypatch.setenv("PRX_CAPTION_BASE_URL", chat_server.base_url)
    with OpenAICaptioner("m", max_side=128) as cap:
        cap.caption(_inputs(demo_photos, 1))
    assert chat_server.requests[-1]["headers"]["Authorization"] == "Bearer env-key-123"

    monkeypatch.delenv("PRX_CAPTION_API_KEY")
    with OpenAICaptioner("m", max_side=128) as cap:
        cap.caption(_inputs(demo_photos, 1))
    assert "Authorization" not in chat_server.requests[-1]["headers"]


def test_identity_tracks_output_not_deployment(chat_server):
    base = _captioner(chat_server).identity
    moved = OpenAICaptioner(
        "test-vlm",
        base_url="http://10.0.0.9:9000/v1",
        api_key="other",
        max_side=256,
        max_concurrency=64,
    ).identity
    assert moved == base and moved.fingerprint() == base.fingerprint()
    for change in ({"max_side": 512}, {"max_tokens": 100}, {"temperature": 0.7}):
        assert _captioner(chat_server, **change).identity.fingerprint() != base.fingerprint()
    other_model = OpenAICaptioner("other-vlm", base_url=chat_server.base_url, max_side=256)
    assert other_model.identity.fingerprint() != base.fingerprint()


def test_truncated_caption_keeps_finish_reason(chat_server, demo_photos):
    chat_server.default = lambda body: chat_reply("a long caption cut", finish_reason="length")
    with _captioner(chat_server) as cap:
        [result] = cap.caption(_inputs(demo_photos, 1))
    assert result.finish_reason == "length"


@pytest.mark.parametrize(
    "url",
    ["ftp://host/v1", "http://user:pw@host/v1", "http://host/v1?key=abc", "not a url"],
)
def test_bad_base_urls_are_refused(url):
    with pytest.raises(BackendConfigError):
        OpenAICaptioner("m", base_url=url)


def test_empty_batch_sends_nothing(chat_server):
    assert _captioner(chat_server).caption([]) == []
    assert chat_server.requests == []
