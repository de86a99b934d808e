"""Client-side balancing over a fleet of OpenAI-compatible servers (vLLM, SGLang), no gateway.

Why in the client: a caption fleet is a handful of identical servers; a gateway in front of
them is one more service to run and one more place for a request to die. The client knows
which of its requests are in flight and which failed how, so it can balance and eject by
itself:

- **balancing**: each request goes to the usable endpoint with the fewest requests in
  flight (ties in rotation), at most ``max_concurrency`` in flight per endpoint;
- **avoidance**: a retried request goes to an endpoint it has not failed on yet (or one
  due for its probe), waiting for one that is merely busy; it goes back to one it failed
  on only when no other is in service;
- **Retry-After**: an endpoint that answered one is sent nothing until then (capped);
- **circuit breaker**: ``circuit_failures`` consecutive *down* failures (connection error,
  timeout, 5xx) open an endpoint's circuit: it gets no traffic for a cool-down, then one
  real request probes it (half-open); a success closes the circuit, a failure opens it
  again for twice the cool-down (capped). Any answer that shows the server alive (2xx,
  429, other 4xx, a malformed body) resets the count, so one poisoned request among
  successes never ejects a healthy server;
- **fail closed**: when no endpoint's circuit has been closed for ``max_fleet_down_s``, the
  next request raises :class:`FleetDownError` instead of waiting forever.

The pool never sees a request body or the API key. Endpoint URLs are configuration (they
can hold no credentials: ``resolve_base_urls`` refuses them), shown bounded by callers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prx_assets.core.captions.models.base import BackendCancelledError, BackendUnavailableError

#: How one request on an endpoint ended (what the endpoint's counts are keyed by).
Outcome = Literal[
    "ok",
    "connection_error",
    "timeout",
    "http_5xx",
    "http_429",
    "http_retry",  # 408: the server is alive and asks for a retry
    "malformed",
    "client_error",
    "aborted",  # our side gave up (cancel, interpreter exit): says nothing about the server
]
DOWN_OUTCOMES: frozenset[str] = frozenset({"connection_error", "timeout", "http_5xx"})
CircuitState = Literal["closed", "open", "half_open"]


class FleetDownError(BackendUnavailableError):
    """Every endpoint's circuit stayed open for longer than the fleet may be down."""


@dataclass(frozen=True)
class EndpointCounts:
    """One endpoint's requests and how they ended, for metadata (no body, no key)."""

    url: str
    requests: int
    ok: int
    errors: int  # every request that did not end ok (aborted ones are not requests)
    connection_errors: int
    timeouts: int
    http_5xx: int
    http_429: int
    client_errors: int
    malformed: int
    circuit_opens: int
    probes: int
    state: CircuitState

    def as_dict(self) -> dict[str, int | str]:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class Endpoint:
    """Mutable state of one server; only :class:`EndpointPool` changes it (under its lock)."""

    index: int
    base_url: str
    in_flight: int = 0
    state: CircuitState = "closed"
    consecutive_down: int = 0
    not_before: float = 0.0  # no new request before this (Retry-After, cool-down)
    cooldown_s: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    circuit_opens: int = 0
    probes: int = 0

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def counts(self) -> EndpointCounts:
        n = self.outcomes.get
        requests = sum(v for k, v in self.outcomes.items() if k != "aborted")
        return EndpointCounts(
            url=self.base_url,
            requests=requests,
            ok=n("ok", 0),
            errors=requests - n("ok", 0),
            connection_errors=n("connection_error", 0),
            timeouts=n("timeout", 0),
            http_5xx=n("http_5xx", 0),
            http_429=n("http_429", 0),
            client_errors=n("client_error", 0),
            malformed=n("malformed", 0),
            circuit_opens=self.circuit_opens,
            probes=self.probes,
            state=self.state,
        )


@dataclass(frozen=True)
class FleetPolicy:
    """How a client spreads requests over its servers and takes a failing one out.

    The one declaration of these settings (the HTTP client's :class:`ClientPolicy` extends
    it with retries and timeouts); checked once, here, when it is made.
    """

    max_concurrency: int = 8  # requests in flight per server
    circuit_failures: int = 3  # consecutive down failures that open a server's circuit
    circuit_cooldown_s: float = 5.0  # first cool-down before a probe (doubles per failure)
    circuit_cooldown_max_s: float = 60.0
    max_retry_after_s: float = 60.0  # a server's Retry-After is honoured up to this
    max_fleet_down_s: float = 120.0  # no server in service this long: FleetDownError

    def __post_init__(self) -> None:
        if self.max_concurrency < 1 or self.circuit_failures < 1:
            raise ValueError("max_concurrency and circuit_failures must be >= 1")
        if self.circuit_cooldown_s <= 0 or self.circuit_cooldown_max_s < self.circuit_cooldown_s:
            raise ValueError("need 0 < circuit_cooldown_s <= circuit_cooldown_max_s")
        if self.max_fleet_down_s <= 0 or self.max_retry_after_s < 0:
            raise ValueError("max_fleet_down_s must be > 0 and max_retry_after_s >= 0")


class EndpointPool:
    """Chooses an endpoint per request and keeps each endpoint's health (thread-safe).

    ``clock`` is a monotonic clock in seconds (injectable so the state machine can be
    stepped exactly in tests); :meth:`try_acquire` never blocks, :meth:`acquire` waits for
    a free slot, a cool-down's end or cancellation.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        policy: FleetPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not base_urls:
            raise ValueError("an endpoint pool needs at least one base URL")
        if len(set(base_urls)) != len(base_urls):
            raise ValueError("base URLs must be distinct")
        self.policy = policy if policy is not None else FleetPolicy()
        self.endpoints = [
            Endpoint(i, url, cooldown_s=self.policy.circuit_cooldown_s)
            for i, url in enumerate(base_urls)
        ]
        self._clock = clock
        self._cond = threading.Condition()
        self._next = 0  # rotation for ties
        self._down_since: float | None = None

    def __len__(self) -> int:
        return len(self.endpoints)

    # -- choosing

    def _usable(self, ep: Endpoint, now: float) -> bool:
        if now < ep.not_before:
            return False
        if ep.state == "closed":
            return ep.in_flight < self.policy.max_concurrency
        return ep.state == "open" and ep.in_flight == 0  # cool-down over: one probe

    def _fleet_check(self, now: float) -> None:
        if self._down_since is not None and now - self._down_since >= self.policy.max_fleet_down_s:
            raise FleetDownError(
                f"all {len(self.endpoints)} endpoint(s) out of service for "
                f"{now - self._down_since:.1f}s (limit {self.policy.max_fleet_down_s:g}s): "
                f"{self.summary()}",
                attempts=0,
            )

    def try_acquire(self, avoid: Collection[int] = (), now: float | None = None) -> Endpoint | None:
        """The endpoint for the next request, counted in flight; None if none is usable now.

        Raises :class:`FleetDownError` once the whole fleet has been out past its limit.
        """
        with self._cond:
            now = self._clock() if now is None else now
            self._fleet_check(now)
            ready = [ep for ep in self.endpoints if self._usable(ep, now)]
            # A probe is always welcome: an earlier failure there predates the cool-down.
            preferred = [ep for ep in ready if ep.index not in avoid or ep.state == "open"]
            if not preferred:
                # A retry waits for a healthy server it has not failed on that is only
                # busy; the server it failed on is its last resort, not its first.
                busy = [
                    ep
                    for ep in self.endpoints
                    if ep.index not in avoid and ep.state == "closed" and now >= ep.not_before
                ]
                if busy or not ready:
                    return None
                preferred = ready
            n = len(self.endpoints)
            ep = min(preferred, key=lambda e: (e.in_flight, (e.index - self._next) % n))
            self._next = (ep.index + 1) % n
            if ep.state == "open":
                ep.state = "half_open"
                ep.probes += 1
            ep.in_flight += 1
            return ep

    def acquire(
        self, avoid: Collection[int] = (), cancel: threading.Event | None = None
    ) -> Endpoint:
        """Like :meth:`try_acquire`, waiting (in short steps, so a cancel is seen) until one is."""
        while True:
            if cancel is not None and cancel.is_set():
                raise BackendCancelledError("cancelled, another item failed")
            ep = self.try_acquire(avoid)
            if ep is not None:
                return ep
            with self._cond:
                now = self._clock()
                waits = [ep.not_before - now for ep in self.endpoints if ep.not_before > now]
                if self._down_since is not None:
                    waits.append(self._down_since + self.policy.max_fleet_down_s - now)
                self._cond.wait(timeout=max(0.001, min([0.05, *waits])))

    # -- accounting

    def release(
        self,
        ep: Endpoint,
        outcome: Outcome,
        retry_after: float | None = None,
        now: float | None = None,
    ) -> None:
        """Record how ``ep``'s request ended and update its circuit."""
        with self._cond:
            now = self._clock() if now is None else now
            ep.in_flight -= 1
            ep.outcomes[outcome] = ep.outcomes.get(outcome, 0) + 1
            if retry_after is not None:
                ep.not_before = max(
                    ep.not_before, now + min(retry_after, self.policy.max_retry_after_s)
                )
            if outcome == "aborted":
                if ep.state == "half_open":  # the probe never finished: probe again
                    ep.state = "open"
            elif outcome in DOWN_OUTCOMES:
                ep.consecutive_down += 1
                if ep.state == "half_open":
                    ep.cooldown_s = min(ep.cooldown_s * 2, self.policy.circuit_cooldown_max_s)
                    self._open(ep, now)
                elif ep.state == "closed" and ep.consecutive_down >= self.policy.circuit_failures:
                    self._open(ep, now)
            else:  # the server answered: it is alive
                ep.consecutive_down = 0
                if ep.state != "closed":
                    ep.state = "closed"
                    ep.cooldown_s = self.policy.circuit_cooldown_s
            if any(e.state == "closed" for e in self.endpoints):
                self._down_since = None
            elif self._down_since is None:
                self._down_since = now
            self._cond.notify_all()

    def _open(self, ep: Endpoint, now: float) -> None:
        ep.state = "open"
        ep.circuit_opens += 1
        ep.not_before = max(ep.not_before, now + ep.cooldown_s)

    # -- reporting

    def counts(self) -> tuple[EndpointCounts, ...]:
        with self._cond:
            return tuple(ep.counts() for ep in self.endpoints)

    def summary(self) -> str:
        """One line per fleet: each endpoint's state and last counts (URLs, no secrets)."""
        parts = []
        for ep in self.endpoints:
            c = ep.counts()
            parts.append(
                f"{ep.base_url} {ep.state} ({c.requests} requests: {c.connection_errors} "
                f"connection errors, {c.timeouts} timeouts, {c.http_5xx} 5xx)"
            )
        return "; ".join(parts)

    def out_of_service(self) -> int:
        with self._cond:
            return sum(ep.state != "closed" for ep in self.endpoints)
