"""OpenAIClassifier: first-token logprobs, and the constrained-choice fallback."""

from __future__ import annotations

import math

import pytest

from prx_assets.core.captions.models import (
    LABELS,
    BackendRequestError,
    MalformedResponseError,
    OpenAIClassifier,
)
from prx_assets.core.captions.models.classifiers import first_token_label_logprobs

from .conftest import ChatServer, chat_reply

SECRET = "sk-classify-0b1c2d3e"


def logprob_reply(top: list[tuple[str, float]]) -> dict:
    token, logprob = top[0]
    entries = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]
    logprobs = {"content": [{"token": token, "logprob": logprob, "top_logprobs": entries}]}
    return chat_reply(token, finish_reason="length", logprobs=logprobs)


def _clf(server: ChatServer, **kw: object) -> OpenAIClassifier:
    args = {"base_url": server.base_url, "api_key": SECRET, "backoff_base_s": 0.01, **kw}
    return OpenAIClassifier("test-lm", **args)  # type: ignore[arg-type]


def test_logprobs_become_label_probabilities(chat_server):
    chat_server.default = lambda body: logprob_reply(
        [("text", math.log(0.6)), ("visual", math.log(0.3)), ("ns", math.log(0.05)), ("The", -5.0)]
    )
    clf = _clf(chat_server)
    [r] = clf.classify(["A screenshot of a document."])
    assert r.method == "logprob_first_token" and r.label == "text"
    assert (r.visual, r.text, r.nsfw) == pytest.approx((0.3 / 0.95, 0.6 / 0.95, 0.05 / 0.95))

    body = chat_server.requests[0]["body"]
    assert body["logprobs"] is True and body["top_logprobs"] == 10 and body["max_tokens"] == 1
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "A screenshot of a document." in body["messages"][0]["content"]
    assert chat_server.requests[0]["headers"]["Authorization"] == f"Bearer {SECRET}"
    assert SECRET not in repr(clf) and SECRET not in clf.identity.canonical_json()


def test_surface_forms_are_merged_and_missing_labels_get_an_upper_bound():
    lps = first_token_label_logprobs(
        [
            {"token": "visual", "logprob": math.log(0.5)},
            {"token": " Visual", "logprob": math.log(0.2)},
            {"token": "te", "logprob": math.log(0.1)},
            {"token": "\n", "logprob": math.log(0.1)},
        ]
    )
    assert lps is not None
    assert lps[0] == pytest.approx(math.log(0.7))
    assert lps[1] == pytest.approx(math.log(0.1))
    # nsfw is absent: bounded by the lowest listed log-prob and the unlisted mass (0.1)
    assert lps[2] == pytest.approx(math.log(0.1))
    assert first_token_label_logprobs([{"token": "The", "logprob": -0.1}]) is None
    assert first_token_label_logprobs([]) is None


def test_falls_back_to_constrained_choice_without_logprobs(chat_server):
    def reply(body: dict) -> dict:
        if body.get("logprobs"):
            return chat_reply("visual")  # a server that ignores logprobs
        assert body["structured_outputs"] == {"choice": list(LABELS)}
        return chat_reply("nsfw")

    chat_server.default = reply
    clf = _clf(chat_server, max_concurrency=1)
    results = clf.classify(["caption one", "caption two"])
    assert [r.label for r in results] == ["nsfw", "nsfw"]
    assert all(r.method == "constrained_choice" and r.nsfw == 1.0 for r in results)
    # the first reply showed logprobs are unsupported: the second caption skips that request
    assert [bool(r["body"].get("logprobs")) for r in chat_server.requests] == [True, False, False]


def test_rejected_logprobs_request_falls_back_once(chat_server):
    def reply(body: dict) -> dict:
        if body.get("logprobs"):
            return {"status": 400, "json": {"error": "logprobs not supported"}}
        return chat_reply("text")

    chat_server.default = reply
    [r] = _clf(chat_server, choice_field="guided_choice").classify(["a page of text"])
    assert r.label == "text" and r.method == "constrained_choice"
    assert chat_server.requests[-1]["body"]["guided_choice"] == list(LABELS)


def test_strict_logprobs_mode_does_not_fall_back(chat_server):
    chat_server.default = lambda body: chat_reply("visual")
    with pytest.raises(MalformedResponseError, match="no label logprobs"):
        _clf(chat_server, mode="logprobs").classify(["x"])
    chat_server.default = lambda body: {"status": 400, "json": {"error": "no"}}
    with pytest.raises(BackendRequestError):
        _clf(chat_server, mode="logprobs").classify(["x"])


def test_off_label_choice_answers_are_retried_then_raise(chat_server):
    chat_server.script = [chat_reply("maybe a photo")]
    chat_server.default = lambda body: chat_reply("Visual.")
    [r] = _clf(chat_server, mode="choice").classify(["x"])
    assert r.label == "visual" and len(chat_server.requests) == 2

    chat_server.default = lambda body: chat_reply("dunno")
    with pytest.raises(MalformedResponseError, match="not one of"):
        _clf(chat_server, mode="choice", max_attempts=2).classify(["x"])


def test_order_is_kept_under_concurrency(chat_server):
    answers = {"alpha": "visual", "beta": "text", "gamma": "nsfw", "delta": "text"}

    def reply(body: dict) -> dict:
        content = body["messages"][0]["content"]
        word = next(w for w in answers if w in content)
        return {**logprob_reply([(answers[word], -0.01), ("other", -5.0)]), "sleep": 0.02}

    chat_server.default = reply
    results = _clf(chat_server, max_concurrency=4).classify(list(answers))
    assert [r.label for r in results] == list(answers.values())


def test_identity_depends_on_mode_and_model_not_server(chat_server):
    a = _clf(chat_server).identity
    assert OpenAIClassifier("test-lm", base_url="http://h:1/v1", api_key="z").identity == a
    assert _clf(chat_server, mode="choice").identity != a
    assert OpenAIClassifier("other", base_url=chat_server.base_url).identity != a
