"""A small, strict client for OpenAI-compatible chat-completions servers (vLLM, SGLang).

Why not the ``openai`` SDK: it is not a dependency, and the pipeline needs exactly one
behaviour, spelled out here:

- one or several servers (a vLLM/SGLang fleet, no gateway): requests are balanced over
  them, a dead one is taken out and probed again later (:mod:`.fleet`);
- bounded concurrency (``max_concurrency`` in flight per server, one ``httpx.Client``);
- per-attempt timeouts; retries with exponential backoff and jitter, bounded by
  ``max_attempts``, on 408/429/5xx, timeouts and connection errors, and on 2xx bodies
  that are not a usable completion (truncated JSON, no choices, empty content);
  a ``Retry-After`` header is honoured (capped at ``max_retry_after_s``), by the request
  and by its server; a retry prefers a server the request has not failed on yet;
- other 4xx fail at once (:class:`BackendRequestError`): retrying a bad request is waste;
- streaming: items are prepared ahead (bounded) and sent as soon as each is ready through
  a bounded window, results yielded in input order; no chunk barrier (:meth:`stream`);
- fail-fast batches: when one item fails for good, the others stop retrying and the
  whole batch raises, so callers never write a partial result;
- the API key lives in a :class:`Secret`, is sent only as the ``Authorization`` header,
  and never appears in reprs, identities, exceptions or logs.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar, Self, TypedDict, TypeVar, Unpack
from urllib.parse import urlsplit

import httpx

from prx_assets.core.captions.models.base import (
    BackendCancelledError,
    BackendConfigError,
    BackendIdentity,
    BackendRequestError,
    BackendTimeoutError,
    BackendUnavailableError,
    DataURL,
    EmptyContentError,
    MalformedResponseError,
)
from prx_assets.core.captions.models.fleet import (
    Endpoint,
    EndpointCounts,
    EndpointPool,
    FleetDownError,
    FleetPolicy,
    Outcome,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741
P = TypeVar("P")

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class Secret:
    """A string that does not print itself."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("Secret values are not picklable")


def resolve_api_key(explicit: str | None, env_names: Sequence[str]) -> Secret | None:
    """The explicit key, else the first non-empty environment variable; None means no auth."""
    if explicit:
        return Secret(explicit)
    for name in env_names:
        value = os.environ.get(name, "").strip()
        if value:
            return Secret(value)
    return None


MAX_BASE_URLS = 64
MAX_BASE_URL_CHARS = 2048


def _check_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    shown = url if len(url) <= 200 else url[:200] + "..."
    if len(url) > MAX_BASE_URL_CHARS or not url.isprintable() or any(c.isspace() for c in url):
        raise BackendConfigError(
            f"base_url must be a printable URL of at most {MAX_BASE_URL_CHARS} characters, got {shown!r}"
        )
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise BackendConfigError(f"base_url has an invalid port: {shown!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BackendConfigError(f"base_url must be an http(s) URL with a host, got {shown!r}")
    if parts.username or parts.password:
        raise BackendConfigError("base_url must not embed credentials; pass api_key instead")
    if parts.query or parts.fragment:
        raise BackendConfigError("base_url must not have a query string or fragment")
    return url


def resolve_base_urls(
    explicit: str | Sequence[str] | None, env_names: Sequence[str]
) -> tuple[str, ...]:
    """Validated base URLs (``.../v1``), in the order given.

    ``explicit`` is one URL, a comma- or whitespace-separated list, or a sequence; unset,
    the first non-empty variable of ``env_names`` (same syntax); unset too, the default
    local server. Credentials in a URL are refused (use the key), so are duplicates.
    """
    raw: str | Sequence[str] | None = explicit
    if not raw:
        raw = next((os.environ[n] for n in env_names if os.environ.get(n, "").strip()), None)
    if not raw:
        raw = DEFAULT_BASE_URL
    pieces = raw.replace(",", " ").split() if isinstance(raw, str) else list(raw)
    urls = tuple(_check_base_url(p) for p in pieces if p.strip())
    if not urls:
        raise BackendConfigError("no base URL given")
    if len(urls) > MAX_BASE_URLS:
        raise BackendConfigError(f"at most {MAX_BASE_URLS} base URLs, got {len(urls)}")
    if len(set(urls)) != len(urls):
        raise BackendConfigError("base URLs must be distinct")
    return urls


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        ref = datetime.fromtimestamp(now if now is not None else time.time(), tz=UTC)
        seconds = (when - ref).total_seconds()
    return max(0.0, seconds) if seconds == seconds else None  # NaN guard


class _Retry(Exception):
    """Internal: one attempt failed in a retryable way."""

    def __init__(
        self,
        why: str,
        outcome: Outcome,
        status: int | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(why)
        self.why = why
        self.outcome = outcome
        self.status = status
        self.retry_after = retry_after


def encode_body(body: dict[str, Any]) -> bytes:
    """``json.dumps(body)`` as UTF-8, with every ``DataURL`` in it spliced in as it is.

    Why: the image's base64 is ~1 MB per caption request, and ``json.dumps`` scans and copies
    it to look for characters to escape, of which a ``DataURL`` has none by construction;
    this encodes the rest (the prompt, untrusted alt text included: escaped as always)
    and joins the URLs' bytes in. Each URL stands in as a placeholder holding 128 random
    bits drawn per request, so no text in the body can name one; each must be found
    exactly once. The bytes are ``json.dumps``'s, compact separators aside
    (``core/models/test_request_encoding.py`` checks both decode to the same body).
    """
    urls: list[DataURL] = []
    token = secrets.token_hex(16)

    def swap(value: Any) -> Any:
        if isinstance(value, DataURL):
            urls.append(value)
            return f"{token}:{len(urls) - 1}"
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [swap(v) for v in value]
        return value

    rest = json.dumps(swap(body), separators=(",", ":")).encode()
    if not urls:
        return rest
    parts: list[bytes] = []
    for i, url in enumerate(urls):
        head, found, rest = rest.partition(f'"{token}:{i}"'.encode())
        if not found or f"{token}:".encode() in head:
            raise AssertionError("a data URL placeholder was not found exactly once")
        parts += (head, b'"', url.encode("ascii"), b'"')
    parts.append(rest)
    return b"".join(parts)


class OpenAIChatClient:
    """POST ``/chat/completions`` with retries over one or more servers; map over items.

    ``base_urls``: one URL or several (a fleet): see :mod:`.fleet` for how requests are
    spread, how a dead server is taken out and probed again, and when the whole fleet
    counts as down. ``max_concurrency`` is per server.
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        api_key: Secret | None,
        **options: Unpack[ClientOptions],
    ) -> None:
        urls = (base_urls,) if isinstance(base_urls, str) else tuple(base_urls)
        try:
            self.policy = ClientPolicy(**options)
            self.pool = EndpointPool(urls, self.policy)
        except ValueError as exc:
            raise BackendConfigError(str(exc)) from None
        self.base_urls = urls
        self._api_key = api_key
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        auth = "set" if self._api_key else "none"
        return f"OpenAIChatClient(base_urls={self.base_urls!r}, api_key={auth})"

    # -- lifecycle

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                slots = self.policy.max_concurrency * len(self.base_urls)
                self._client = httpx.Client(
                    timeout=httpx.Timeout(
                        self.policy.timeout_s, connect=self.policy.connect_timeout_s
                    ),
                    limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots),
                )
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def endpoint_counts(self) -> tuple[EndpointCounts, ...]:
        """Requests and errors per server so far, in configuration order."""
        return self.pool.counts()

    # -- one request

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        delay = min(self.policy.backoff_max_s, self.policy.backoff_base_s * (2 ** (attempt - 1)))
        delay *= 0.5 + random.random() * 0.5  # jitter: spread synchronized retries
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.policy.max_retry_after_s))
        return delay

    def _attempt(self, endpoint: Endpoint, body: bytes, parse: Callable[[dict[str, Any]], T]) -> T:
        headers = {"Content-Type": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        try:
            resp = self._http().post(endpoint.chat_url, content=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise _Retry(f"timeout ({type(exc).__name__})", "timeout") from None
        except httpx.TransportError as exc:
            why = f"connection error ({type(exc).__name__}: {_snippet(str(exc))})"
            raise _Retry(why, "connection_error") from None
        status = resp.status_code
        if status in RETRY_STATUSES or status >= 500:
            outcome: Outcome = (
                "http_5xx" if status >= 500 else "http_429" if status == 429 else "http_retry"
            )
            raise _Retry(
                f"HTTP {status}: {_snippet(resp.text)}",
                outcome,
                status=status,
                retry_after=parse_retry_after(resp.headers.get("retry-after")),
            )
        if status >= 400:
            raise BackendRequestError(
                f"HTTP {status} from {endpoint.chat_url}: {_snippet(resp.text)}", status
            )
        try:
            data = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _Retry(f"malformed JSON body: {_snippet(resp.text)!r}", "malformed") from None
        if not isinstance(data, dict):
            raise _Retry(f"JSON body is a {type(data).__name__}, not an object", "malformed")
        try:
            return parse(data)
        except EmptyContentError as exc:
            raise _Retry(f"empty: {exc}", "malformed") from None
        except MalformedResponseError as exc:
            raise _Retry(f"malformed: {exc}", "malformed") from None

    def _on(self, endpoint: Endpoint, body: bytes, parse: Callable[[dict[str, Any]], T]) -> T:
        """One attempt on ``endpoint``, whose health learns how it ended."""
        try:
            result = self._attempt(endpoint, body, parse)
        except _Retry as exc:
            self.pool.release(endpoint, exc.outcome, exc.retry_after)
            raise
        except BackendRequestError:
            self.pool.release(endpoint, "client_error")
            raise
        except BaseException:
            self.pool.release(endpoint, "aborted")
            raise
        self.pool.release(endpoint, "ok")
        return result

    def complete(
        self,
        body: dict[str, Any],
        parse: Callable[[dict[str, Any]], T],
        *,
        label: str = "request",
        cancel: threading.Event | None = None,
    ) -> T:
        """One completion, parsed by ``parse`` (which raises MalformedResponseError if unusable).

        Each attempt goes to the endpoint the pool chooses, preferring one this request
        has not failed on; between attempts the request backs off as on one server.
        """
        last: _Retry | None = None
        failed_on: set[int] = set()
        payload = encode_body(body)  # once, not per attempt
        for attempt in range(1, self.policy.max_attempts + 1):
            if cancel is not None and cancel.is_set():
                raise BackendCancelledError(f"{label}: cancelled, another item failed")
            try:
                endpoint = self.pool.acquire(failed_on, cancel)
            except BackendCancelledError:
                raise BackendCancelledError(f"{label}: cancelled, another item failed") from None
            except FleetDownError as exc:
                raise FleetDownError(f"{label}: {exc}", attempts=attempt - 1) from None
            try:
                return self._on(endpoint, payload, parse)
            except BackendRequestError as exc:
                raise BackendRequestError(f"{label}: {exc}", exc.status) from None
            except _Retry as exc:
                last = exc
                failed_on.add(endpoint.index)
                if attempt == self.policy.max_attempts:
                    break
                delay = self._backoff(attempt, exc.retry_after)
                log.warning(
                    "%s: attempt %d/%d failed (%s); retrying in %.2fs (endpoint %s)",
                    label,
                    attempt,
                    self.policy.max_attempts,
                    exc.why,
                    delay,
                    endpoint.base_url,
                )
                if cancel is not None:
                    if cancel.wait(delay):
                        raise BackendCancelledError(
                            f"{label}: cancelled, another item failed"
                        ) from None
                else:
                    time.sleep(delay)
        assert last is not None
        where = (
            f"to {self.pool.endpoints[0].chat_url}"
            if len(self.pool) == 1
            else f"over {len(self.pool)} endpoints "
            f"({self.pool.out_of_service()} out of service: {self.pool.summary()})"
        )
        msg = f"{label}: failed after {self.policy.max_attempts} attempts {where}; last: {last.why}"
        if last.why.startswith("empty"):
            raise EmptyContentError(msg, attempts=self.policy.max_attempts)
        if last.outcome == "malformed":
            raise MalformedResponseError(msg, attempts=self.policy.max_attempts)
        if last.outcome == "timeout":
            raise BackendTimeoutError(msg, attempts=self.policy.max_attempts, status=last.status)
        raise BackendUnavailableError(msg, attempts=self.policy.max_attempts, status=last.status)

    # -- many requests

    def map(self, fn: Callable[[I, threading.Event], T], items: Sequence[I]) -> list[T]:
        """``fn`` over ``items`` with at most ``max_concurrency`` in flight per endpoint,
        order kept (:meth:`stream`, collected).

        Fail-fast: the first error cancels queued items, stops retries of running ones
        and is raised; no partial list is ever returned.
        """
        return list(self.stream(fn, items))

    def stream(
        self,
        fn: Callable[[P, threading.Event], T],
        items: Iterable[I],
        *,
        prepare: Callable[[I], P] | None = None,
        prepare_workers: int = 1,
        window: int | None = None,
    ) -> Iterator[T]:
        """``fn(prepare(item), cancel)`` for each item, yielded in input order as soon as the
        head of the line is done.

        Why a stream and not chunks: a chunk barrier (prepare a chunk, send it, wait for all
        of it) leaves the fleet idle while the next chunk is prepared and while the chunk's
        slowest request finishes. Here, up to ``window`` items (default
        ``self.policy.window``, else four times the fleet's slots) are in the pipeline at once:
        ``prepare`` runs ahead on ``prepare_workers`` threads (Pillow releases the GIL),
        each prepared item is sent as soon as it is ready, at most ``max_concurrency`` in
        flight per endpoint, and a slow request holds back only the items more than
        ``window`` behind it. Memory is bounded: only the items in the window (and their
        prepared payloads) are held; ``items`` is read lazily.

        Fail-fast as :meth:`map`: the first real error (not a cancellation it caused) is
        raised, everything queued is dropped, running retries stop; items already yielded
        are the caller's to discard (the runners write nothing unless all came back).
        """
        if prepare_workers < 1:
            raise BackendConfigError(f"prepare_workers must be >= 1, got {prepare_workers}")
        slots = self.policy.max_concurrency * len(self.pool)
        window = window or self.policy.window or 4 * slots
        if window < 1:
            raise BackendConfigError(f"window must be >= 1, got {window}")
        return self._stream(fn, iter(items), prepare, prepare_workers, window, slots)

    def _stream(
        self,
        fn: Callable[[Any, threading.Event], T],
        items: Iterator[Any],
        prepare: Callable[[Any], Any] | None,
        prepare_workers: int,
        window: int,
        slots: int,
    ) -> Iterator[T]:
        cancel = threading.Event()
        progress = threading.Condition()
        errors: list[BaseException] = []  # first real failure first; cancellations after
        requests = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="prx-openai")
        preparing = (
            ThreadPoolExecutor(max_workers=prepare_workers, thread_name_prefix="prx-prepare")
            if prepare is not None
            else None
        )

        def settle(final: Future[T], source: Future[Any]) -> None:
            """Copy ``source``'s outcome into ``final`` and wake the consumer."""
            exc = source.exception() if not source.cancelled() else BackendCancelledError("dropped")
            with progress:
                if not final.done():
                    if exc is None:
                        final.set_result(source.result())
                    else:
                        final.set_exception(exc)
                if exc is not None:
                    if isinstance(exc, BackendCancelledError):
                        errors.append(exc)
                    else:
                        errors.insert(
                            sum(not isinstance(e, BackendCancelledError) for e in errors), exc
                        )
                    cancel.set()
                progress.notify_all()

        def send(final: Future[T], payload: Any) -> None:
            try:
                sent = requests.submit(fn, payload, cancel)
            except RuntimeError:  # shut down: the stream already failed or was closed
                sent = Future()
                sent.set_exception(BackendCancelledError("cancelled, another item failed"))
            sent.add_done_callback(lambda f: settle(final, f))

        def start(item: Any) -> Future[T]:
            final: Future[T] = Future()
            if preparing is None or prepare is None:
                send(final, item)
                return final

            def prepared(f: Future[Any]) -> None:
                if f.cancelled() or f.exception() is not None or cancel.is_set():
                    settle(final, f if f.exception() is not None else _cancelled())
                else:
                    send(final, f.result())

            preparing.submit(prepare, item).add_done_callback(prepared)
            return final

        pending: deque[Future[T]] = deque()
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < window and not errors:
                    try:
                        item = next(items)
                    except StopIteration:
                        exhausted = True
                        break
                    pending.append(start(item))
                if errors:
                    raise errors[0]
                if not pending:
                    return
                head = pending[0]
                with progress:
                    while not head.done() and not errors:
                        progress.wait(0.5)
                if errors:
                    raise errors[0]
                pending.popleft()
                yield head.result()
        finally:
            cancel.set()  # a no-op for a finished stream; stops retries of an abandoned one
            if preparing is not None:
                preparing.shutdown(wait=True, cancel_futures=True)
            requests.shutdown(wait=True, cancel_futures=True)


def _cancelled() -> Future[Any]:
    f: Future[Any] = Future()
    f.set_exception(BackendCancelledError("cancelled, another item failed"))
    return f


@dataclass(frozen=True)
class ClientPolicy(FleetPolicy):
    """How a backend talks to its servers: deployment, so never part of its identity.

    The fleet's balancing and circuit breaker (:class:`FleetPolicy`) plus one request's
    timeouts and retries; checked once, when it is made (``ValueError`` naming the field).
    """

    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_attempts: int = 5
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    window: int | None = None  # items in a stream at once; None: four times the fleet's slots

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff durations must be >= 0")


class ClientOptions(TypedDict, total=False):
    """:class:`ClientPolicy`'s fields as keyword arguments (a backend's ``**client``).

    Kept equal to the dataclass's fields by ``test_client_options_are_the_policy_fields``.
    """

    timeout_s: float
    connect_timeout_s: float
    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float
    max_retry_after_s: float
    max_concurrency: int
    circuit_failures: int
    circuit_cooldown_s: float
    circuit_cooldown_max_s: float
    max_fleet_down_s: float
    window: int | None


class OpenAIBackend:
    """What every backend on OpenAI-compatible servers shares: its client and lifecycle.

    The servers are ``base_url`` (one URL, a comma-separated list or a sequence: a fleet)
    or the first set variable of ``BASE_URL_ENV`` (same syntax); the key is ``api_key`` or
    the first set variable of ``API_KEY_ENV`` (none: no ``Authorization`` header), the same
    for every server. ``CLIENT_DEFAULTS`` are the backend's defaults for the client options.
    The subclass sets ``model`` and ``identity`` (model, prompt and decoding parameters,
    never the URLs, their number or order, the key or client options: moving or resizing
    the fleet re-makes nothing; changing the model is a swap).
    """

    BASE_URL_ENV: ClassVar[tuple[str, ...]] = ()
    API_KEY_ENV: ClassVar[tuple[str, ...]] = ()
    CLIENT_DEFAULTS: ClassVar[ClientOptions] = {}

    model: str
    identity: BackendIdentity

    def _connect(
        self, base_url: str | Sequence[str] | None, api_key: str | None, options: ClientOptions
    ) -> None:
        self._client = OpenAIChatClient(
            resolve_base_urls(base_url, self.BASE_URL_ENV),
            resolve_api_key(api_key, self.API_KEY_ENV),
            **{**self.CLIENT_DEFAULTS, **options},
        )

    @property
    def base_urls(self) -> tuple[str, ...]:
        """The servers, in configuration order."""
        return self._client.base_urls

    def endpoint_counts(self) -> tuple[EndpointCounts, ...]:
        """Requests and errors per server since the backend was built."""
        return self._client.endpoint_counts()

    def _repr_extra(self) -> str:
        """``, name=value`` pairs a subclass adds to its repr."""
        return ""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.model!r}, base_urls={self.base_urls!r}"
            f"{self._repr_extra()}, fingerprint={self.identity.fingerprint()!r})"
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _snippet(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


def message_text(data: dict[str, Any]) -> tuple[str, str | None]:
    """Content and finish_reason of the first choice; MalformedResponseError if absent."""
    if "error" in data and "choices" not in data:
        raise MalformedResponseError(f"server returned an error object: {_snippet(str(data))}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedResponseError("response has no choices")
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise MalformedResponseError("first choice has no message")
    content = choice["message"].get("content")
    if isinstance(content, list):  # content parts
        content = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise MalformedResponseError(f"message content is a {type(content).__name__}")
    finish = choice.get("finish_reason")
    return content, finish if isinstance(finish, str) else None
