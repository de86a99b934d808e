"""The fleet client's stream: a bounded window, input order, no chunk barrier, fail-fast.

The window logic is exercised with plain functions in place of requests (what is under test
is the scheduling, not HTTP); the captioner's stream runs against real HTTP servers on
127.0.0.1. Every assertion is about counts and order; the only timeouts are safety bounds
that make a broken stream fail instead of hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image

from prx_assets.core.captions.models import (
    BackendInputError,
    BackendRequestError,
    CaptionInput,
    OpenAICaptioner,
)
from prx_assets.core.captions.models.openai_http import OpenAIChatClient

from .conftest import LiveChatServer, chat_reply, data_url_digest

SAFETY_S = 10.0
FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5.0}


def _client(endpoints: int = 2, max_concurrency: int = 3, **kw: Any) -> OpenAIChatClient:
    """A client whose fleet is only used for its size (the tests' fns make no request)."""
    urls = [f"http://127.0.0.1:{9 + i}/v1" for i in range(endpoints)]
    return OpenAIChatClient(urls, None, max_concurrency=max_concurrency, **kw)


class Counting:
    """An input iterator that records how far it was read, and the widest gap between
    what was read and what the consumer has taken (the window's real occupancy)."""

    def __init__(self, n: int) -> None:
        self.n, self.pulled, self.taken, self.widest = n, 0, 0, 0
        self.lock = threading.Lock()

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            with self.lock:
                self.pulled += 1
                self.widest = max(self.widest, self.pulled - self.taken)
            yield i


def test_results_come_back_in_input_order_whatever_order_they_finish_in():
    client = _client()
    n = 40

    def late_first(i: int, cancel: threading.Event) -> str:
        time.sleep(0.001 * ((n - i) % 7))  # later items often finish first
        return f"r{i}"

    assert list(client.stream(late_first, range(n), window=12)) == [f"r{i}" for i in range(n)]


def test_the_window_bounds_what_is_read_prepared_and_in_flight():
    client = _client(endpoints=2, max_concurrency=3)  # 6 slots
    source = Counting(200)
    lock = threading.Lock()
    running = {"now": 0, "max": 0, "prepared": 0}

    def prepare(i: int) -> int:
        with lock:
            running["prepared"] += 1
        return i

    def fn(i: int, cancel: threading.Event) -> int:
        with lock:
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
        time.sleep(0.001)
        with lock:
            running["now"] -= 1
        return i

    out = []
    for r in client.stream(fn, source, prepare=prepare, prepare_workers=2, window=10):
        out.append(r)
        with source.lock:
            source.taken += 1
    assert out == list(range(200))
    assert source.widest <= 10  # never more than the window read ahead of the consumer
    assert running["max"] <= 6  # never more requests than the fleet's slots
    assert running["prepared"] == 200


def test_a_slow_request_does_not_stop_the_next_ones_while_the_window_has_room():
    """The head of the line is held; every other item of the window is still sent and
    answered, and nothing beyond the window is read until the head is done."""
    client = _client(endpoints=1, max_concurrency=4)
    source = Counting(50)
    release, others_done = threading.Event(), threading.Event()
    done: list[int] = []
    lock = threading.Lock()

    def fn(i: int, cancel: threading.Event) -> int:
        if i == 0:
            assert release.wait(SAFETY_S)
        else:
            with lock:
                done.append(i)
                if len(done) == 7:  # items 1..7 of a window of 8
                    others_done.set()
        return i

    stream = client.stream(fn, source, window=8)
    first: list[int] = []
    consumer = threading.Thread(target=lambda: first.append(next(stream)))
    consumer.start()
    assert others_done.wait(SAFETY_S), f"only {len(done)} sent while the head was held"
    assert source.pulled == 8  # the window is full: item 8 waits for the head
    release.set()
    consumer.join(SAFETY_S)
    assert first == [0]
    assert list(stream) == list(range(1, 50))


def test_the_first_real_failure_fails_the_stream_and_stops_the_rest():
    client = _client(endpoints=1, max_concurrency=4)
    source = Counting(1000)
    started: list[int] = []

    def fn(i: int, cancel: threading.Event) -> int:
        started.append(i)
        if i == 0:  # the head waits until the stream is cancelled
            assert cancel.wait(SAFETY_S)
        if i == 3:
            raise BackendRequestError("caption 3: HTTP 400", 400)
        return i

    with pytest.raises(BackendRequestError, match="caption 3"):
        list(client.stream(fn, source, window=16))
    assert source.pulled <= 16  # fail-fast: the input was not drained
    assert len(started) <= 16


def test_a_preparation_failure_fails_the_stream():
    client = _client()

    def prepare(i: int) -> int:
        if i == 5:
            raise BackendInputError(f"k{i}", "image rejected")
        return i

    with pytest.raises(BackendInputError, match="k5: image rejected"):
        list(client.stream(lambda i, cancel: i, range(30), prepare=prepare, window=4))


# --------------------------------------------------------------------------- real servers


def _images(n: int) -> list[CaptionInput]:
    return [
        CaptionInput(f"img-{i:03d}", image=Image.new("RGB", (40, 32), (i * 7 % 256, i, 60)))
        for i in range(n)
    ]


def _expected(cap: OpenAICaptioner, item: CaptionInput) -> str:
    body = {
        "messages": [
            {"content": [{"type": "image_url", "image_url": {"url": cap.image_url(item)}}]}
        ]
    }
    return f"a caption for image {data_url_digest(body)}"


class GatedCaptioner(OpenAICaptioner):
    """Preparing the last image waits (bounded) until the servers have answered requests:
    a captioner that prepares everything before sending anything never gets there."""

    answered: threading.Event

    def image_url(self, item: CaptionInput) -> str:
        if item.key == "img-011":
            self.saw_answers = self.answered.wait(2.0)
        return super().image_url(item)


def test_requests_are_sent_while_later_images_are_still_being_prepared(chat_fleet):
    servers: list[LiveChatServer] = chat_fleet(2)
    answered = threading.Event()
    count = {"n": 0}
    lock = threading.Lock()

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        with lock:
            count["n"] += 1
            if count["n"] >= 3:
                answered.set()
        return chat_reply(f"a caption for image {data_url_digest(body)}")

    for s in servers:
        s.state.default = reply
    items = _images(12)
    cap = GatedCaptioner(
        "test-vlm", base_url=[s.state.base_url for s in servers], max_side=64, **FAST
    )
    cap.answered = answered
    with cap:
        results = cap.caption(items)
        assert cap.saw_answers  # requests went out before the last image was prepared
        assert [r.caption for r in results] == [_expected(cap, i) for i in items]
    assert sum(len(s.state.requests) for s in servers) == 12  # one request per image


# --------------------------------------------------------------------------- preparation


def test_draft_resize_gives_the_same_size_and_near_pixels_and_is_its_own_identity():
    """``resize="draft"`` decodes a multi-megapixel JPEG at a DCT scale (the long side still
    >= max_side) instead of in full: the same output size, pixels close to the original
    recipe's, and a different fingerprint (other pixels: a swap), while the default
    recipe's fingerprint is the one it always had (no ``resize`` param)."""
    import io

    import numpy as np

    from prx_assets.demo.jpegs import bundled_photos, crop_to_aspect, jpeg_bytes

    url = "http://127.0.0.1:9/v1"
    plain, draft = (
        OpenAICaptioner("m", base_url=url),
        OpenAICaptioner("m", base_url=url, resize="draft"),
    )
    assert "resize" not in dict(plain.identity.params)
    assert draft.identity.param("resize") == "draft"
    assert draft.identity.fingerprint() != plain.identity.fingerprint()
    for aspect in (1.5, 0.7):  # landscape and portrait, 2.2-2.6 k px long side
        src = crop_to_aspect(bundled_photos()[0], aspect)
        w = 2400 if aspect > 1 else round(2400 * aspect)
        big = src.resize((w, round(w / aspect)), Image.Resampling.LANCZOS)
        item = CaptionInput("k", image=jpeg_bytes(big))
        a = np.asarray(Image.open(io.BytesIO(_jpeg(plain.image_url(item)))), dtype=np.float32)
        b = np.asarray(Image.open(io.BytesIO(_jpeg(draft.image_url(item)))), dtype=np.float32)
        assert a.shape == b.shape and max(a.shape[:2]) == 1024
        assert float(np.abs(a - b).mean()) < 4.0  # near-identical to the eye


def _jpeg(data_url: str) -> bytes:
    import base64

    assert data_url.startswith("data:image/jpeg;base64,")
    return base64.b64decode(data_url.split(",", 1)[1])
