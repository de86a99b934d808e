"""The OpenAI-compatible backends over a fleet of real HTTP servers on 127.0.0.1.

Servers really die (listening socket closed, open connections shut down) and come back on
the same port. Every assertion is about counts and results, never about elapsed time;
the only timeouts are safety bounds that make a broken run fail instead of hang.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from prx_assets.core.captions.models import (
    BackendConfigError,
    BackendRequestError,
    BackendUnavailableError,
    CaptionInput,
    OpenAICaptioner,
    OpenAIClassifier,
)
from prx_assets.core.captions.models.fleet import FleetDownError

from .conftest import LiveChatServer, chat_reply, data_url_digest

SECRET = "sk-fleet-3c1f0a9e77d24b51"
FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5.0}
SAFETY_S = 10.0  # how long a gated reply waits at most (a bound, not an assertion)


def _images(n: int) -> list[CaptionInput]:
    """n small distinct images (distinct pixels, so distinct requests and captions)."""
    return [
        CaptionInput(f"img-{i:03d}", image=Image.new("RGB", (48, 40), (i * 5 % 256, i, 90)))
        for i in range(n)
    ]


def _captioner(servers: list[LiveChatServer], **kw: Any) -> OpenAICaptioner:
    urls = [s.state.base_url for s in servers]
    args = {"api_key": SECRET, "max_side": 64, **FAST, **kw}
    return OpenAICaptioner("test-vlm", base_url=urls, **args)


def _expected(cap: OpenAICaptioner, item: CaptionInput) -> str:
    body = {
        "messages": [
            {"content": [{"type": "image_url", "image_url": {"url": cap.image_url(item)}}]}
        ]
    }
    return f"a caption for image {data_url_digest(body)}"


def _answer(sleep: float = 0.0, before: Callable[[], None] | None = None):
    def reply(body: dict[str, Any]) -> dict[str, Any]:
        if before is not None:
            before()
        return {**chat_reply(f"a caption for image {data_url_digest(body)}"), "sleep": sleep}

    return reply


def test_balancing_spreads_requests_over_every_server(chat_fleet):
    servers = chat_fleet(3)
    for s in servers:
        s.state.default = _answer(sleep=0.02)
    items = _images(30)
    with _captioner(servers, max_concurrency=2) as cap:
        results = cap.caption(items)
        counts = cap.endpoint_counts()
        expected = [_expected(cap, item) for item in items]

    assert [r.caption for r in results] == expected
    served = [len(s.state.requests) for s in servers]
    assert sum(served) == 30  # one request per image: no retries needed
    assert min(served) >= 5, served  # least-in-flight balancing: no server starves
    assert all(s.state.max_in_flight <= 2 for s in servers)  # per-server concurrency
    # The client's counts are the servers' own, in configuration order.
    assert [c.url for c in counts] == [s.state.base_url for s in servers]
    assert [c.requests for c in counts] == served and [c.ok for c in counts] == served
    assert {c.errors for c in counts} == {0} and {c.state for c in counts} == {"closed"}
    auth = {r["headers"]["Authorization"] for s in servers for r in s.state.requests}
    assert auth == {f"Bearer {SECRET}"}  # one key for the whole fleet


def test_a_server_that_dies_mid_batch_is_ejected_probed_and_used_again(chat_fleet, caplog):
    """C dies on its 3rd request; A and B take its work; once C's circuit is open, C comes
    back; after the cool-down a probe finds it and it serves again before A and B finish."""
    a, b, c = chat_fleet(3)
    c_died, c_back = threading.Event(), threading.Event()
    c_served_after_restart: list[str] = []
    lock = threading.Lock()

    def on_c() -> None:
        with lock:
            n = len(c.state.requests)
        if not c_died.is_set() and n == 3:
            c_died.set()
            c.kill()  # this request and any other in flight on C get no answer
        elif c_died.is_set():
            with lock:
                c_served_after_restart.append("ok")
                if len(c_served_after_restart) >= 2:
                    c_back.set()

    def gate() -> None:
        if c_died.is_set():
            c_back.wait(SAFETY_S)  # A and B hold their work until C serves again

    for s in (a, b):
        s.state.default = _answer(sleep=0.01, before=gate)
    c.state.default = _answer(sleep=0.01, before=on_c)

    items = _images(40)
    cap = _captioner(
        [a, b, c],
        max_concurrency=2,
        circuit_failures=2,
        circuit_cooldown_s=0.2,
        timeout_s=3 * SAFETY_S,  # a gated reply is slow, not dead
    )
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["results"] = cap.caption(items)
        except Exception as exc:  # reported below
            out["error"] = exc

    caplog.set_level(logging.WARNING)
    worker = threading.Thread(target=run)
    worker.start()
    assert c_died.wait(SAFETY_S), "C never got its 3rd request"
    # Wait (bounded) until the client has taken C out, then bring C back on the same port.
    for _ in range(int(SAFETY_S / 0.01)):
        if cap.endpoint_counts()[2].circuit_opens >= 1:
            break
        threading.Event().wait(0.01)
    c_counts_when_open = cap.endpoint_counts()[2]
    c.start()
    worker.join(timeout=4 * SAFETY_S)
    assert not worker.is_alive()
    assert "error" not in out, out.get("error")

    results = out["results"]
    assert [r.caption for r in results] == [_expected(cap, item) for item in items]
    counts = cap.endpoint_counts()
    cap.close()
    ca, cb, cc = counts
    assert c_counts_when_open.circuit_opens == 1 and c_counts_when_open.state == "open"
    assert c_counts_when_open.connection_errors >= 2
    assert cc.probes >= 1 and cc.state == "closed"  # probed after the cool-down, back in
    assert len(c_served_after_restart) >= 2 and c_back.is_set()
    # Every image was answered exactly once; C's failed requests were moved to A and B.
    assert ca.ok + cb.ok + cc.ok == 40
    assert (ca.errors, cb.errors) == (0, 0)
    assert ca.ok == len(a.state.requests) and cb.ok == len(b.state.requests)
    assert cc.errors == cc.connection_errors >= 2
    assert "connection error" in caplog.text and SECRET not in caplog.text


class ServerProcess:
    """``chat_process.py`` in its own process: started, ``kill -9``-ed, restarted on its port."""

    SCRIPT = Path(__file__).with_name("chat_process.py")

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.port, self.proc = workdir, 0, None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        ready = self.workdir / f"ready-{self.starts}"
        cmd = [sys.executable, str(self.SCRIPT), "--port", str(self.port), "--ready", str(ready)]
        self.proc = subprocess.Popen(cmd)
        for _ in range(int(SAFETY_S / 0.01)):
            if ready.exists():
                self.port = int(ready.read_text())
                return
            assert self.proc.poll() is None, "the server process exited"
            time.sleep(0.01)
        raise AssertionError("the server process never listened")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=SAFETY_S)


def _until(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` for at most SAFETY_S (a bound, not a measurement)."""
    for _ in range(int(SAFETY_S / 0.01)):
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_server_process_killed_with_sigkill_is_replaced_then_reused(chat_fleet, tmp_path):
    """The third server is a real process, ``kill -9``-ed while it serves; the batch
    completes on the other two; restarted on its port, it is probed and serves again."""
    a, b = chat_fleet(2)
    proc = ServerProcess(tmp_path)
    proc.start()
    killed, back = threading.Event(), threading.Event()

    def gate() -> None:
        if killed.is_set():
            back.wait(SAFETY_S)  # A and B hold their work until the process serves again

    for s in (a, b):
        s.state.default = _answer(sleep=0.01, before=gate)
    items = _images(40)
    cap = OpenAICaptioner(
        "test-vlm",
        base_url=[a.state.base_url, b.state.base_url, proc.base_url],
        api_key=SECRET,
        max_side=64,
        **{**FAST, "timeout_s": 3 * SAFETY_S},
        max_concurrency=2,
        circuit_failures=2,
        circuit_cooldown_s=0.2,
    )
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["results"] = cap.caption(items)
        except Exception as exc:  # reported below
            out["error"] = exc

    worker = threading.Thread(target=run)
    try:
        worker.start()
        assert _until(lambda: cap.endpoint_counts()[2].ok >= 3), "the process never served"
        killed.set()
        proc.kill9()
        assert _until(lambda: cap.endpoint_counts()[2].circuit_opens >= 1)
        ok_while_dead = cap.endpoint_counts()[2].ok
        proc.start()  # same port
        assert _until(lambda: cap.endpoint_counts()[2].ok >= ok_while_dead + 2)
        back.set()
        worker.join(timeout=4 * SAFETY_S)
    finally:
        back.set()
        proc.kill9()
    assert not worker.is_alive() and "error" not in out, out.get("error")
    assert [r.caption for r in out["results"]] == [_expected(cap, item) for item in items]
    ca, cb, cp = cap.endpoint_counts()
    cap.close()
    assert cp.connection_errors >= 1 and cp.circuit_opens >= 1 and cp.probes >= 1
    assert cp.state == "closed" and cp.ok >= ok_while_dead + 2
    assert ca.ok + cb.ok + cp.ok == 40 and (ca.errors, cb.errors) == (0, 0)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        # Plenty of attempts: the fleet-down limit is what stops the batch.
        (
            {"max_attempts": 1000, "max_fleet_down_s": 0.3},
            FleetDownError,
            r"all 2 endpoint\(s\) out of service",
        ),
        # Few attempts: an item runs out first, and says the whole fleet is out.
        (
            {"max_attempts": 3, "max_fleet_down_s": 60.0},
            BackendUnavailableError,
            r"failed after 3 attempts over 2 endpoints \(2 out of service",
        ),
    ],
)
def test_every_server_dead_fails_the_batch_clearly(chat_fleet, options, error, message):
    servers = chat_fleet(2)
    for s in servers:
        s.kill()
    cap = _captioner(servers, circuit_failures=1, circuit_cooldown_s=0.05, **options)
    with pytest.raises(error, match=message) as info:
        cap.caption(_images(6))
    cap.close()
    assert SECRET not in str(info.value)
    assert all(c.state != "closed" for c in cap.endpoint_counts())
    assert {c.ok for c in cap.endpoint_counts()} == {0}


def test_one_refused_request_fails_as_before_and_ejects_no_server(chat_fleet):
    """A 400 shows the server alive: the batch fails at once (as on one server), every
    circuit stays closed; the server is not blamed for one bad request."""
    servers = chat_fleet(2)
    poisoned = {"digest": ""}

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        if data_url_digest(body) == poisoned["digest"]:
            return {"status": 400, "json": {"error": "image too large"}}
        return {**chat_reply("fine"), "sleep": 0.02}

    for s in servers:
        s.state.default = reply
    items = _images(8)
    cap = _captioner(servers, max_concurrency=1, circuit_failures=1)
    poisoned["digest"] = data_url_digest(
        {
            "messages": [
                {"content": [{"type": "image_url", "image_url": {"url": cap.image_url(items[3])}}]}
            ]
        }
    )
    with pytest.raises(BackendRequestError, match="HTTP 400") as info:
        cap.caption(items)
    cap.close()
    assert items[3].key in str(info.value)
    counts = cap.endpoint_counts()
    assert sum(c.client_errors for c in counts) == 1  # not retried anywhere
    assert {c.state for c in counts} == {"closed"} and {c.circuit_opens for c in counts} == {0}


def test_a_persistent_5xx_item_fails_the_batch_without_ejecting_serving_servers(chat_fleet):
    servers = chat_fleet(2)
    items = _images(12)
    cap = _captioner(servers, max_concurrency=2, max_attempts=4, circuit_failures=3)
    bad = data_url_digest(
        {
            "messages": [
                {"content": [{"type": "image_url", "image_url": {"url": cap.image_url(items[0])}}]}
            ]
        }
    )

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        if data_url_digest(body) == bad:
            return {"status": 502, "json": {"error": "bad gateway"}}
        return {**chat_reply("fine"), "sleep": 0.02}

    for s in servers:
        s.state.default = reply
    with pytest.raises(BackendUnavailableError, match="failed after 4 attempts") as info:
        cap.caption(items)
    cap.close()
    assert items[0].key in str(info.value) and info.value.status == 502
    # The poisoned request tried both servers (a retry prefers one it has not failed on).
    tried = [sum(data_url_digest(r["body"]) == bad for r in s.state.requests) for s in servers]
    assert min(tried) >= 1 and sum(tried) == 4


def test_the_classifier_uses_the_fleet_too(chat_fleet):
    servers = chat_fleet(2)
    servers[1].kill()
    for s in servers:
        s.state.default = lambda body: chat_reply("visual")
    urls = ",".join(s.state.base_url for s in servers)  # the comma-separated form
    clf = OpenAIClassifier(
        "test-lm", base_url=urls, mode="choice", circuit_failures=1, **FAST, max_concurrency=2
    )
    probs = clf.classify([f"caption {i}" for i in range(10)])
    counts = clf.endpoint_counts()
    clf.close()
    assert [p.label for p in probs] == ["visual"] * 10
    assert counts[0].ok == 10 and counts[1].ok == 0
    assert counts[1].connection_errors >= 1 and counts[1].state == "open"


def test_identity_does_not_depend_on_the_fleet_and_a_model_change_is_a_swap():
    one = OpenAICaptioner("org/vlm", base_url="http://10.0.0.1:8000/v1")
    many = OpenAICaptioner(
        "org/vlm",
        base_url=["http://10.0.0.3:8000/v1", "http://10.0.0.2:8000/v1", "http://10.0.0.1:8000/v1"],
        max_concurrency=32,
        circuit_failures=9,
        circuit_cooldown_s=1.0,
        max_fleet_down_s=5.0,
    )
    reordered = OpenAICaptioner(
        "org/vlm",
        base_url="http://10.0.0.1:8000/v1, http://10.0.0.3:8000/v1 http://10.0.0.2:8000/v1",
    )
    assert one.identity == many.identity == reordered.identity
    assert len({c.identity.fingerprint() for c in (one, many, reordered)}) == 1
    other = OpenAICaptioner("org/other-vlm", base_url=many.base_urls)
    assert other.identity.fingerprint() != one.identity.fingerprint()
    c1 = OpenAIClassifier("org/lm", base_url="http://10.0.0.1:8000/v1")
    c2 = OpenAIClassifier("org/lm", base_url=["http://10.0.0.2:8000/v1", "http://10.0.0.1:8000/v1"])
    assert c1.identity.fingerprint() == c2.identity.fingerprint()


def test_bad_fleets_are_refused():
    for urls, match in [
        ("http://a:1/v1,http://a:1/v1", "distinct"),
        ("http://a:1/v1, http://user:pw@b:1/v1", "credentials"),
        ("http://a:1/v1 http://b:1/v1?key=abc", "query"),
        (["http://a:1/v1", "ftp://b/v1"], "http"),
        (["http://a:1/v1", "http://b:1/v1\x1b[31m"], "printable"),
        ("http://a:99999/v1", "port"),
        (" , ", "no base URL"),
        (",".join(f"http://h{i}:1/v1" for i in range(65)), "at most 64"),
    ]:
        with pytest.raises(BackendConfigError, match=match):
            OpenAICaptioner("m", base_url=urls)


def test_fleet_from_the_environment(chat_fleet, monkeypatch):
    servers = chat_fleet(2)
    for s in servers:
        s.state.default = _answer()
    monkeypatch.setenv("PRX_CAPTION_BASE_URL", ",".join(s.state.base_url for s in servers))
    with OpenAICaptioner("m", max_side=64, **FAST) as cap:
        assert cap.base_urls == tuple(s.state.base_url for s in servers)
        cap.caption(_images(6))
    assert all(s.state.requests for s in servers)
