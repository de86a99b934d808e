"""Fixtures: tiny random models built offline, demo photos, and a scripted OpenAI server.

The tiny models are real architectures (Qwen3-VL, Qwen3) with a tokenizer trained here,
saved to disk and reloaded by the backends through the Auto* classes exactly as a hub
checkpoint would be. Their text is garbage; the tests check shapes, flow and provenance.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from prx_assets_tests.core.models.chat_process import data_url_digest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# A minimal Qwen-style template: system/user/assistant turns, image items as vision pads.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# "nsfw" is deliberately absent so it tokenises into more pieces than "visual": the
# length-normalisation tests need labels of unequal token counts.
TOKENIZER_CORPUS = [
    "a photo of a cat on a sofa with visible text and a watermark near the logo",
    "caption this image in one dense paragraph describing colour light and texture",
    "which class does the captioned image belong to answer with exactly one word",
    "visual text visual text screenshot document photograph illustration render",
]


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS * 10, trainer)
    hf = Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    hf.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return hf


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen3-VL + processor saved to disk (~150k parameters)."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLImageProcessorFast,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    out = tmp_path_factory.mktemp("tiny-qwen3-vl")
    tok = _train_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    image_processor = Qwen2VLImageProcessorFast(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=32 * 32,
        max_pixels=64 * 64,  # at most 4 merged image tokens: fast on CPU
    )
    video_processor = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 1024,
            "initializer_range": 0.5,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
            "initializer_range": 0.5,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen3 causal LM + tokenizer with a chat template, saved to disk."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3")
    tok = _train_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(1)
    Qwen3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def demo_photos() -> dict[str, bytes]:
    """The bundled demo photographs, by file name."""
    root = resources.files("prx_assets") / "demo" / "photos"
    photos = {p.name: p.read_bytes() for p in root.iterdir() if p.name.endswith((".png", ".jpg"))}
    assert len(photos) >= 6, "demo photos missing"
    return photos


@pytest.fixture(scope="session")
def minilm() -> Any:
    from prx_assets.core.captions.models import MiniLMEmbedder

    return MiniLMEmbedder(device="cpu")


# --------------------------------------------------------------------------- scripted server

Reply = dict[str, Any]


def chat_reply(content: str | None, finish_reason: str = "stop", **extra: Any) -> Reply:
    """A 200 chat-completions reply with one choice."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "finish_reason": finish_reason,
    }
    choice.update(extra)
    return {"status": 200, "json": {"id": "x", "object": "chat.completion", "choices": [choice]}}


@dataclass
class ChatServer:
    """A real HTTP server on 127.0.0.1 speaking ``POST /v1/chat/completions``.

    ``script`` replies are consumed in arrival order; when it is empty ``default(body)``
    answers. A reply is a dict: ``status`` + ``json`` | ``raw`` (bytes), optional
    ``headers`` and ``sleep`` (seconds before answering, to provoke client timeouts).
    """

    base_url: str = ""
    script: list[Reply] = field(default_factory=list)
    default: Callable[[dict[str, Any]], Reply] = field(
        default=lambda body: chat_reply(f"a caption for image {data_url_digest(body)}")
    )
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    max_in_flight: int = 0
    connections: set[Any] = field(default_factory=set)  # open client sockets

    def next_reply(self, body: dict[str, Any]) -> Reply:
        with self.lock:
            if self.script:
                return self.script.pop(0)
        return self.default(body)


def _make_handler(state: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def setup(self) -> None:
            super().setup()
            with state.lock:
                state.connections.add(self.connection)

        def finish(self) -> None:
            with state.lock:
                state.connections.discard(self.connection)
            try:
                super().finish()
            except OSError:
                pass  # the server was killed under this connection

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                body = {"_unparseable": raw.decode("utf-8", "replace")}
            with state.lock:
                state.requests.append(
                    {"path": self.path, "headers": dict(self.headers.items()), "body": body}
                )
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if self.path != "/v1/chat/completions":
                    reply: Reply = {"status": 404, "json": {"error": "not found"}}
                else:
                    reply = state.next_reply(body)
                if reply.get("sleep"):
                    time.sleep(reply["sleep"])
                payload = reply["raw"] if "raw" in reply else json.dumps(reply["json"]).encode()
                self.send_response(reply.get("status", 200))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for k, v in reply.get("headers", {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)
            except OSError:
                pass  # the client gave up (timeout) or the server was killed: fault tests
            finally:
                with state.lock:
                    state.in_flight -= 1

    return Handler


class LiveChatServer:
    """A :class:`ChatServer` that can die and come back on the same port.

    ``kill()`` is what a crashed server looks like from the client: the listening socket
    is closed (new connections are refused) and every open connection is shut down
    (requests in flight get no answer). ``start()`` listens again on the same port.
    """

    def __init__(self, state: ChatServer | None = None) -> None:
        self.state = state or ChatServer()
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self._server is not None

    def start(self) -> LiveChatServer:
        with self._lock:
            if self._server is not None:
                return self
            server = ThreadingHTTPServer(("127.0.0.1", self.port), _make_handler(self.state))
            server.daemon_threads = True
            self.port = server.server_address[1]
            self.state.base_url = f"http://127.0.0.1:{self.port}/v1"
            self._thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
            self._thread.start()
            self._server = server
        return self

    def kill(self) -> None:
        with self._lock:
            server, thread, self._server = self._server, self._thread, None
            if server is None:
                return
            server.shutdown()
            server.server_close()
            with self.state.lock:
                sockets = list(self.state.connections)
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    live = LiveChatServer().start()
    try:
        yield live.state
    finally:
        live.kill()


@pytest.fixture
def chat_fleet() -> Iterator[Callable[[int], list[LiveChatServer]]]:
    """``chat_fleet(n)``: n live servers on 127.0.0.1, all stopped when the test ends."""
    started: list[LiveChatServer] = []

    def make(n: int) -> list[LiveChatServer]:
        servers = [LiveChatServer().start() for _ in range(n)]
        started.extend(servers)
        return servers

    try:
        yield make
    finally:
        for server in started:
            server.kill()
