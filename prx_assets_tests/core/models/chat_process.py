"""A chat-completions server in its own process, so a test can ``kill -9`` it for real.

Run as a script (standard library only, nothing of the project is imported, so it starts
in a blink)::

    python chat_process.py --port 0 --ready /tmp/ready   # writes the bound port there

It answers every ``POST /v1/chat/completions`` like the in-process scripted server's
default (``a caption for image <digest>``, after ``--sleep`` seconds), so the same
expectations hold whichever server answered.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def data_url_digest(body: dict[str, Any]) -> str:
    """Short hash of the image data URL in a captioning request (0 if none)."""
    for msg in body.get("messages", []):
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    return hashlib.sha256(part["image_url"]["url"].encode()).hexdigest()[:12]
    return "0"


def serve(port: int, ready: str, sleep: float) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            time.sleep(sleep)
            content = f"a caption for image {data_url_digest(body)}"
            choice = {"index": 0, "message": {"role": "assistant", "content": content}}
            payload = json.dumps({"choices": [{**choice, "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    tmp = f"{ready}.tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, ready)  # the test sees the port only once the socket listens
    server.serve_forever(0.02)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--sleep", type=float, default=0.01)
    args = parser.parse_args()
    serve(args.port, args.ready, args.sleep)
