"""The endpoint pool's state machine, stepped on an explicit clock (no sleeping, no network).

The real servers are exercised in ``test_openai_fleet.py``; here every transition is
driven by hand so each rule is checked exactly: who gets the next request, when a server
is ejected, when it is probed, when the whole fleet counts as down.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from prx_assets.core.captions.models import BackendCancelledError
from prx_assets.core.captions.models.fleet import (
    Endpoint,
    EndpointPool,
    FleetDownError,
    FleetPolicy,
)

URLS = ("http://a:1/v1", "http://b:1/v1", "http://c:1/v1")


def pool(**kw: object) -> EndpointPool:
    args = {
        "max_concurrency": 2,
        "circuit_failures": 3,
        "circuit_cooldown_s": 10.0,
        "circuit_cooldown_max_s": 40.0,
        "max_fleet_down_s": 100.0,
        **kw,
    }
    return EndpointPool(URLS, FleetPolicy(**args), clock=lambda: 0.0)  # type: ignore[arg-type]


def take(p: EndpointPool, now: float = 0.0, avoid: tuple[int, ...] = ()) -> Endpoint:
    ep = p.try_acquire(avoid, now=now)
    assert ep is not None, "expected a usable endpoint"
    return ep


def test_requests_spread_over_the_least_busy_and_stop_at_the_per_server_limit():
    p = pool()
    first = [take(p).index for _ in range(6)]
    assert first == [0, 1, 2, 0, 1, 2]  # fewest in flight, ties in rotation
    assert p.try_acquire(now=0.0) is None  # 2 per server: all six slots are taken
    p.release(p.endpoints[1], "ok", now=0.0)
    assert take(p).index == 1  # the freed slot is the least busy
    # Sequential requests (each released at once) rotate over every server.
    q = pool()
    seen = Counter()
    for _ in range(30):
        ep = take(q)
        seen[ep.index] += 1
        q.release(ep, "ok", now=0.0)
    assert seen == {0: 10, 1: 10, 2: 10}
    assert [c.requests for c in q.counts()] == [10, 10, 10]


def test_a_retry_goes_to_a_server_it_has_not_failed_on():
    p = pool()
    assert take(p, avoid=(0,)).index == 1
    assert take(p, avoid=(0, 1)).index == 2
    # B and C full: a retry that failed on A waits for them rather than go back to A.
    for _ in range(2):
        take(p, avoid=(0,))
    assert [e.in_flight for e in p.endpoints] == [0, 2, 2]
    assert p.try_acquire((0,), now=0.0) is None
    p.release(p.endpoints[2], "ok", now=0.0)
    assert take(p, avoid=(0,)).index == 2
    # The others out of service: the server it failed on is its last resort.
    q = pool(circuit_failures=1)
    q.release(take(q, avoid=(0, 2)), "connection_error", now=0.0)
    q.release(take(q, avoid=(0, 1)), "connection_error", now=0.0)
    assert take(q, now=1.0, avoid=(0,)).index == 0
    # A server due for its probe is taken even by a request that failed there before.
    assert take(q, now=10.0, avoid=(0, 1, 2)).state == "half_open"
    one = EndpointPool(URLS[:1], clock=lambda: 0.0)
    assert take(one, avoid=(0,)).index == 0


def test_consecutive_down_failures_open_the_circuit_and_alive_answers_reset_it():
    p = pool()
    a = p.endpoints[0]
    for outcome in ("connection_error", "http_5xx"):
        p.release(take(p, avoid=(1, 2)), outcome, now=0.0)
    # 429, a client error and a malformed body all show the server alive: count reset.
    for alive in ("http_429", "client_error", "malformed"):
        p.release(take(p, avoid=(1, 2)), alive, now=0.0)
        assert a.consecutive_down == 0 and a.state == "closed"
        for outcome in ("timeout", "http_5xx"):
            p.release(take(p, avoid=(1, 2)), outcome, now=0.0)
    p.release(take(p, avoid=(1, 2)), "connection_error", now=1.0)
    assert a.state == "open" and a.circuit_opens == 1
    # Open: no traffic to it, even when a request would rather avoid the others.
    assert {take(p, now=5.0, avoid=(1, 2)).index for _ in range(4)} == {1, 2}
    counts = p.counts()[0]
    assert (counts.requests, counts.errors, counts.state) == (12, 12, "open")
    assert (counts.connection_errors, counts.timeouts, counts.http_5xx) == (2, 3, 4)
    assert (counts.http_429, counts.client_errors, counts.malformed) == (1, 1, 1)


def test_after_the_cool_down_one_probe_decides_and_failed_probes_back_off():
    p = pool(circuit_failures=1)
    a = p.endpoints[0]
    p.release(take(p), "connection_error", now=0.0)
    assert a.state == "open"
    assert take(p, now=9.9, avoid=(1, 2)).index != 0  # still cooling down
    probe = take(p, now=10.0, avoid=(1, 2))
    assert probe is a and a.state == "half_open" and a.probes == 1
    assert take(p, now=10.0, avoid=(1, 2)).index != 0  # one probe at a time
    p.release(a, "connection_error", now=10.5)  # the probe failed: twice the cool-down
    assert a.state == "open" and a.not_before == pytest.approx(30.5)
    assert take(p, now=30.0, avoid=(1, 2)).index != 0
    p.release(take(p, now=30.5, avoid=(1, 2)), "timeout", now=31.0)
    assert a.not_before == pytest.approx(71.0)  # 40 s, the cap
    p.release(take(p, now=71.0, avoid=(1, 2)), "timeout", now=71.0)
    assert a.not_before == pytest.approx(111.0)  # still the cap
    # A probe that succeeds closes the circuit and resets the cool-down.
    p.release(take(p, now=111.0, avoid=(1, 2)), "ok", now=111.0)
    assert a.state == "closed" and a.consecutive_down == 0 and a.cooldown_s == 10.0
    assert a.circuit_opens == 4 and a.probes == 4
    # A probe we abandoned ourselves says nothing about the server: it can be probed again.
    p.release(take(p, now=111.0, avoid=(1, 2)), "connection_error", now=111.0)
    assert a.state == "open"
    p.release(take(p, now=121.0, avoid=(1, 2)), "aborted", now=121.0)
    assert a.state == "open" and take(p, now=121.0, avoid=(1, 2)) is a
    assert p.counts()[0].requests == 6  # the aborted attempt is not a request


def test_retry_after_keeps_a_server_idle_until_then():
    p = pool(max_retry_after_s=30.0)
    b = p.endpoints[1]
    p.release(take(p, avoid=(0, 2)), "http_429", retry_after=5.0, now=0.0)
    assert b.state == "closed"
    assert {take(p, now=4.9).index for _ in range(4)} == {0, 2}
    assert take(p, now=5.0).index == 1
    p.release(b, "http_5xx", retry_after=3600.0, now=10.0)  # capped at max_retry_after_s
    assert b.not_before == pytest.approx(40.0)


def test_the_fleet_is_down_once_no_circuit_has_been_closed_for_the_limit():
    p = pool(circuit_failures=1, max_fleet_down_s=100.0)
    for i, now in enumerate((0.0, 1.0, 2.0)):
        p.release(take(p, now=now, avoid=tuple(j for j in range(3) if j != i)), "http_5xx", now=now)
    assert p.out_of_service() == 3
    assert p.try_acquire(now=5.0) is None  # cooling down: wait
    probe = take(p, now=50.0)
    p.release(probe, "connection_error", now=60.0)
    with pytest.raises(FleetDownError, match=r"all 3 endpoint\(s\) out of service") as info:
        p.try_acquire(now=102.0)
    assert "http://a:1/v1 open" in str(info.value)
    # One server answering again ends the outage.
    q = pool(circuit_failures=1, max_fleet_down_s=100.0)
    for i in range(3):
        q.release(take(q, now=0.0, avoid=tuple(j for j in range(3) if j != i)), "timeout", now=0.0)
    q.release(take(q, now=99.0), "ok", now=99.0)
    assert q.out_of_service() == 2
    assert take(q, now=150.0) is not None  # no FleetDownError: one server is in service


def test_acquire_waits_for_a_slot_and_sees_a_cancel():
    p = EndpointPool(URLS[:1], FleetPolicy(max_concurrency=1))
    held = p.acquire()
    got: list[Endpoint] = []
    waiter = threading.Thread(target=lambda: got.append(p.acquire()))
    waiter.start()
    p.release(held, "ok")
    waiter.join(timeout=5)
    assert got == [held]
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(BackendCancelledError):
        p.acquire(cancel=cancel)


def test_bad_pool_settings_are_refused():
    for kw in (
        {"max_concurrency": 0},
        {"circuit_failures": 0},
        {"circuit_cooldown_s": 0},
        {"circuit_cooldown_s": 10.0, "circuit_cooldown_max_s": 5.0},
        {"max_fleet_down_s": 0},
    ):
        with pytest.raises(ValueError):
            FleetPolicy(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="distinct"):
        EndpointPool([URLS[0], URLS[0]])


def test_client_options_are_the_policy_fields():
    """A backend's ``**client`` keywords and the policy they build are one list: a field
    added to one and not the other would be refused at run time, or silently untyped."""
    import dataclasses
    import typing

    from prx_assets.core.captions.models.openai_http import ClientOptions, ClientPolicy

    fields = {f.name for f in dataclasses.fields(ClientPolicy)}
    assert set(typing.get_type_hints(ClientOptions)) == fields
    assert {f.name for f in dataclasses.fields(FleetPolicy)} < fields
