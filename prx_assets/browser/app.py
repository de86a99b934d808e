"""The curation browser's HTTP side: a read-only JSON API and one static page.

Why the standard library: the app must run where nothing can be fetched (no npm, no CDN)
and add no dependency beyond the pinned stack; ``ThreadingHTTPServer`` is enough for one
curator on localhost. Safety by default: bound to 127.0.0.1, requests whose ``Host`` is
not a loopback name are refused (a DNS-rebinding page cannot talk to it), only GET is
served, captions are returned as JSON data and rendered by the page as text (never as
HTML), and a strict Content-Security-Policy allows only the app's own script and style.

Routes: ``/`` (the page), ``/static/app.js``, ``/static/app.css``, ``/api/facets``,
``/api/search?q=&batch=&source=&label=&tier=&shape=&skip=&min_side=&max_side=&min_mp=
&max_mp=&limit=&match=all|any&explain=1`` (no ``q``: a filtered listing),
``/api/similar?key=&<filters>``, ``/api/image/<key>/thumb?size=256|1024``,
``/api/audit/<key>``.
"""

from __future__ import annotations

import json
import socket
import sys
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from prx_assets.browser.queries import (
    KEY_RE,
    MAX_LIMIT,
    Filters,
    LabQueries,
    NotFound,
    QueryError,
    parse_number,
)
from prx_assets.browser.thumbs import THUMB_SIZES, ThumbnailCache
from prx_assets.core.ingest.decode import DecodeRejected
from prx_assets.core.snapshots.manifest import SnapshotError

LOOPBACK_HOSTS: frozenset[str] = frozenset({"localhost", "127.0.0.1", "::1"})
STATIC_FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
}


@dataclass
class Response:
    """One HTTP answer, built without a socket (the security headers are added by ``handle``)."""

    status: int
    body: bytes
    content_type: str = "application/json; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


def _json(status: int, payload: Any) -> Response:
    body = json.dumps(payload, ensure_ascii=True, default=str).encode()
    return Response(status, body, headers={"Cache-Control": "no-store"})


def _error(status: int, message: str) -> Response:
    return _json(status, {"error": message})


def host_name(host_header: str | None) -> str | None:
    """The host part of a ``Host`` header ("[::1]:8765" -> "::1"), lower-cased."""
    if not host_header:
        return None
    value = host_header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else None
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _static(name: str) -> bytes:
    return resources.files("prx_assets.browser").joinpath("static", name).read_bytes()


class BrowserApp:
    """Maps one GET request to a :class:`Response`; no sockets here, so it is testable."""

    def __init__(
        self,
        queries: LabQueries,
        thumbs: ThumbnailCache | None = None,
        allowed_hosts: frozenset[str] = LOOPBACK_HOSTS,
    ) -> None:
        self.queries = queries
        self.thumbs = thumbs or ThumbnailCache()
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)

    def handle(self, method: str, target: str, host_header: str | None) -> Response:
        response = self._route(method, target, host_header)
        response.headers = {**SECURITY_HEADERS, **response.headers}
        return response

    def _route(self, method: str, target: str, host_header: str | None) -> Response:
        host = host_name(host_header)
        if host not in self.allowed_hosts:
            # DNS rebinding: a page on evil.example resolved to 127.0.0.1 sends its own Host.
            return _error(421, f"refused: Host {host_header!r} is not one this server answers")
        if method not in ("GET", "HEAD"):
            refused = _error(405, "the browser is read-only: only GET is served")
            refused.headers["Allow"] = "GET, HEAD"
            return refused
        parts = urlsplit(target)
        path = unquote(parts.path)
        params = parse_qs(parts.query, keep_blank_values=False)
        try:
            return self._dispatch(path, params)
        except QueryError as exc:
            return _error(400, str(exc))
        except NotFound as exc:
            return _error(404, str(exc))
        except DecodeRejected as exc:
            return _error(422, f"the image cannot be shown: {exc}")
        except SnapshotError as exc:  # which snapshots held it cannot be established
            return _error(500, f"no answer: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bad request must not kill the server
            traceback.print_exc(file=sys.stderr)
            return _error(500, f"internal error: {type(exc).__name__}")

    def _dispatch(self, path: str, params: dict[str, list[str]]) -> Response:
        if path in ("/", "/index.html"):
            return Response(200, _static("index.html"), STATIC_FILES["index.html"])
        if path.startswith("/static/"):
            name = path[len("/static/") :]
            if name not in STATIC_FILES or name == "index.html":
                return _error(404, "no such file")
            return Response(200, _static(name), STATIC_FILES[name])
        if path == "/favicon.ico":
            return Response(204, b"", "image/x-icon")
        if path == "/api/facets":
            return _json(200, self.queries.facets())
        if path == "/api/search":
            return self._search(params)
        if path == "/api/similar":
            return self._similar(params)
        if path.startswith("/api/image/") and path.endswith("/thumb"):
            return self._thumb(path[len("/api/image/") : -len("/thumb")], params)
        if path.startswith("/api/audit/"):
            key = path[len("/api/audit/") :]
            return _json(200, self.queries.audit(_key(key)))
        return _error(404, "no such page")

    def _search(self, params: dict[str, list[str]]) -> Response:
        filters = Filters.from_params(params)
        text = _one(params, "q")
        limit = _int(params, "limit", 60, MAX_LIMIT)
        explain = _one(params, "explain") in ("1", "true")
        if text.strip():
            result = self.queries.search(
                text, filters, limit, match=_one(params, "match") or "all", explain=explain
            )
        else:
            result = self.queries.browse(filters, limit, explain=explain)
        return _json(200, {"filters": filters.to_dict(), **result.to_dict()})

    def _similar(self, params: dict[str, list[str]]) -> Response:
        filters = Filters.from_params(params)
        key = _key(_one(params, "key"))
        explain = _one(params, "explain") in ("1", "true")
        limit = _int(params, "limit", 60, MAX_LIMIT)
        result = self.queries.similar(key, filters, limit, explain=explain)
        return _json(200, {"filters": filters.to_dict(), **result.to_dict()})

    def _thumb(self, key: str, params: dict[str, list[str]]) -> Response:
        key = _key(key)
        size = _int(params, "size", THUMB_SIZES[0], max(THUMB_SIZES))
        if size not in THUMB_SIZES:
            raise QueryError(f"size must be one of {', '.join(map(str, THUMB_SIZES))}")
        body = self.thumbs.get(key, size, lambda: self.queries.image_bytes(key))
        # Keys are content hashes: a thumbnail never changes.
        cache = {"Cache-Control": "private, max-age=86400, immutable"}
        return Response(200, body, "image/jpeg", cache)


def _one(params: dict[str, list[str]], name: str) -> str:
    values = params.get(name) or [""]
    return values[-1]


def _int(params: dict[str, list[str]], name: str, default: int, maximum: int) -> int:
    raw = _one(params, name).strip()
    return parse_number(name, raw, int, maximum) if raw else default


def _key(key: str) -> str:
    if not KEY_RE.match(key or ""):
        raise QueryError(f"not an image key (64 lowercase hex digits): {key[:80]!r}")
    return key


class _Handler(BaseHTTPRequestHandler):
    server_version = "prx-browser"
    sys_version = ""
    app: BrowserApp
    quiet: bool = False

    def _respond(self, method: str) -> None:
        response = self.app.handle(method, self.path, self.headers.get("Host"))
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(response.body)

    def do_GET(self) -> None:
        self._respond("GET")

    def do_HEAD(self) -> None:
        self._respond("HEAD")

    def _refuse(self) -> None:
        self._respond(self.command)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _refuse

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            super().log_message(format, *args)


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def make_server(
    app: BrowserApp, host: str = "127.0.0.1", port: int = 8765, quiet: bool = False
) -> ThreadingHTTPServer:
    """A threaded server bound to ``host:port`` (port 0: any free port) serving ``app``."""
    handler = type("BrowserHandler", (_Handler,), {"app": app, "quiet": quiet})
    server_class = _Server6 if ":" in host else ThreadingHTTPServer
    server = server_class((host, port), handler)
    server.daemon_threads = True
    return server
