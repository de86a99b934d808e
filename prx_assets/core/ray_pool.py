"""Per-image work on long-lived Ray actors on the cluster ``RAY_ADDRESS`` names
(``PRX_EXECUTOR=ray``).

Only ``workers.make_pool("ray")`` imports this module, so nothing loads Ray unless asked.

Why actors, not tasks: with Dagster's multiprocess executor every step is a new process,
so a new Ray *job*, and Ray starts a job's task workers afresh (a process start and the
stages' imports, seconds per worker). A ``PrxWorker`` actor is *detached*: it outlives the
step that started it, so the next step's process, and every other driver running the same
code, finds it warm by name (``benchmarks/bench_ray_step.py`` measures a fresh process's
step both ways). One actor per CPU of each alive node, pinned to that node, one call at a
time; an actor that has had no call for ``PRX_RAY_ACTOR_IDLE_S`` seconds (default 120)
ends itself, so a pipeline at rest holds no CPUs of the cluster.

What the pool guarantees, and how:

- **Same bytes as the local path.** Results come back in input order, and the functions run
  are the same code as here: before a step's first item, every alive node not verified yet
  gets one probe task pinned to it, which compares a fingerprint of its ``prx_assets``
  sources with this process's, and a node with other code is refused (its shards would
  differ silently). The answer is kept in the cluster's key-value store by node id, so a
  node is probed once, not once per step or driver; a node that joins later is probed at
  the next step. The actors' names carry the fingerprint, so a driver of other code never
  reaches an actor started by this one. Deploy one image to every node.
- **Cheap steps.** The process joins the cluster once and keeps the connection for every
  later step; a step with no items joins nothing; a step looks up only as many actors as
  it has items in flight, and finds them warm.
- **A lost worker costs a retry, not the partition.** An actor whose process dies is
  restarted on its node by Ray and the calls it had are run again (``max_retries`` each);
  an actor whose node is gone cannot come back (it is pinned), and its calls are sent to
  another node's actor, ``max_retries`` times at most. When the retries are spent the map
  raises ``RayWorkerLost`` and the step fails: the writers are atomic, so nothing partial
  becomes visible. Exceptions raised by the function itself are not retried (they are
  deterministic) and come back as that item's ``ItemFailed``, as inline.
- **Bounded memory.** At most ``window`` items are in flight (submitted, result not yet
  consumed); the next item is submitted only when the oldest result has been taken.
- **Clear failure.** No ``RAY_ADDRESS``, or nothing listening there within
  ``connect_timeout`` seconds, is a ``RayUnavailable`` error at once (``ray.init`` itself
  would wait minutes on a dead address).

Unlike the local process pool, which records an item whose worker died twice as that
item's ``ItemFailed("worker_died: ...")``, an item whose worker dies more than
``max_retries`` times fails the step: on a cluster that is a lost node far more often than
a poisoned image, and the partition keeps its previous output. The actors hold one CPU
each while they live: a cluster shared with other Ray work gets its CPUs back
``PRX_RAY_ACTOR_IDLE_S`` after the last step (``release_actors`` ends them at once).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.exceptions import (
    ActorUnschedulableError,
    NodeDiedError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from prx_assets.core.pool_items import ItemFailed, call_guarded

T = TypeVar("T")
R = TypeVar("R")

ADDRESS_ENV = "RAY_ADDRESS"
DEFAULT_MAX_RETRIES = 3
PROBE_TIMEOUT_S = 120.0  # a probe starts one worker process per node
IDLE_ENV = "PRX_RAY_ACTOR_IDLE_S"
DEFAULT_IDLE_S = 120.0
ACTOR_PREFIX = "prx-worker"
NAMESPACE = "prx_assets"


class RayUnavailable(RuntimeError):
    """``PRX_EXECUTOR=ray`` was asked for, but no usable Ray cluster was reached."""


class RayWorkerLost(RuntimeError):
    """A task's worker died more often than ``max_retries`` allows: the map is abandoned."""


_NOTHING = object()


@functools.cache
def code_fingerprint() -> str:
    """sha256 over this installation's ``prx_assets`` Python sources (path and bytes)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run_prx_item(fn: Callable[[Any], Any], item: Any) -> Any:
    """One item's work, guarded as inline and in a local worker: an exception comes back as
    that item's :class:`~prx_assets.core.workers.ItemFailed`, recorded as the image's
    failure. What ``PrxWorker.run`` calls (and what a plain Ray task would run)."""
    return call_guarded(fn, item)


class PrxWorker:
    """One CPU's long-lived worker (a detached Ray actor): runs items one at a time, and
    ends itself after ``idle_s`` seconds without a call (Ray titles its process
    ``ray::PrxWorker.run`` while it runs one)."""

    def __init__(self, idle_s: float) -> None:
        self._idle_s = idle_s
        self._calls = 0
        self._busy = 0
        self._last = time.monotonic()
        self._lock = threading.Lock()
        threading.Thread(target=self._end_when_idle, daemon=True, name="prx-idle").start()

    def run(self, fn: Callable[[Any], Any], item: Any) -> Any:
        with self._lock:
            self._busy += 1
            self._calls += 1
        try:
            return run_prx_item(fn, item)
        finally:
            with self._lock:
                self._busy -= 1
                self._last = time.monotonic()

    def stats(self) -> dict[str, Any]:
        """Where this actor runs and how many items it has taken since it (re)started."""
        context = ray.get_runtime_context()
        return {"pid": os.getpid(), "node": context.get_node_id(), "calls": self._calls}

    def _end_when_idle(self) -> None:
        while True:
            time.sleep(min(self._idle_s, 5.0))
            with self._lock:
                idle = not self._busy and time.monotonic() - self._last >= self._idle_s
            if idle:  # on purpose: not restarted; a later step starts a fresh one
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


def idle_seconds() -> float:
    """How long an actor waits for a call before it ends itself (``PRX_RAY_ACTOR_IDLE_S``)."""
    raw = os.environ.get(IDLE_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_IDLE_S
    except ValueError:
        raise ValueError(f"{IDLE_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{IDLE_ENV} must be > 0, got {raw!r}")
    return value


def actor_names(fingerprint: str) -> dict[str, list[str]]:
    """The actors this code keeps per alive node (node id -> one name per CPU of it)."""
    names: dict[str, list[str]] = {}
    for node in ray.nodes():
        cpus = int(node.get("Resources", {}).get("CPU", 0)) if node.get("Alive") else 0
        if cpus:
            nid = node["NodeID"]
            names[nid] = [f"{ACTOR_PREFIX}-{fingerprint[:16]}-{nid[:16]}-{i}" for i in range(cpus)]
    return names


def _live_actors(ours: bool) -> Iterator[Any]:
    """Handles of the live worker actors of this code (``ours``) or of any other code."""
    mine = f"{ACTOR_PREFIX}-{code_fingerprint()[:16]}-"
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != NAMESPACE or not name.startswith(f"{ACTOR_PREFIX}-"):
            continue
        if name.startswith(mine) == ours:
            try:
                yield ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                continue  # ended meanwhile


def actor_stats(timeout: float = 60.0) -> list[dict[str, Any]]:
    """What each live actor of this code says of itself (``PrxWorker.stats``: pid, node,
    calls since it started), on the cluster this process has joined; [] when none. For
    operators and tests: Ray's logs name an actor once, not each call it runs."""
    if not ray.is_initialized():
        return []
    return ray.get([a.stats.remote() for a in _live_actors(ours=True)], timeout=timeout)


def release_actors(ours: bool = True) -> int:
    """End this code's actors (``ours``; else those of any other code) on the cluster now
    (they end by themselves when idle); returns how many. A new pool ends other code's
    actors (they hold CPUs its own need: the nodes run its code now, and a driver of the
    old code is refused by ``check_code``); for operators and tests, this code's."""
    if not ray.is_initialized():  # else the cluster this process has joined
        _connect(os.environ.get(ADDRESS_ENV, "") or "auto")
    found = 0
    for handle in _live_actors(ours):
        ray.kill(handle, no_restart=True)
        found += 1
    return found


def probe_node() -> tuple[str, str]:
    """The node this runs on, and the fingerprint of the ``prx_assets`` it has."""
    return ray.get_runtime_context().get_node_id(), code_fingerprint()


def _reachable(address: str, timeout: float) -> None:
    """Refuse at once when nothing listens at ``host:port`` (``ray://`` and ``auto`` pass)."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RayUnavailable(f"{ADDRESS_ENV} must be host:port, ray://host:port or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise RayUnavailable(
            f"no Ray cluster answers at {ADDRESS_ENV}={address} ({exc.__class__.__name__}); "
            "start one (`ray start --head`) or unset PRX_EXECUTOR"
        ) from None


_connected_to: str | None = None  # the address this module joined (None: not joined by us)
_verified: set[str] = set()  # nodes whose code matched ours, on the connection we hold
KV_NAMESPACE = b"prx_assets"  # the cluster's own record: node id -> fingerprint it answered


def _connect(address: str) -> None:
    """Join the cluster at ``address`` once per process and keep the connection for every
    later step (a new ``ray.init`` is a new Ray job: fresh worker processes, seconds).

    A connection someone else made (a test, a notebook) is used as it is; ours to another
    address is left for the new one.
    """
    global _connected_to
    if ray.is_initialized():
        if _connected_to in (None, address):
            return
        ray.shutdown()
        _verified.clear()
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except (ConnectionError, RuntimeError) as exc:
        raise RayUnavailable(f"cannot join the Ray cluster at {address}: {exc}") from None
    _connected_to = address
    _verified.clear()


def disconnect() -> None:
    """Leave the cluster this module joined (the cluster keeps running); a later pool joins
    again. Ray also leaves at interpreter exit."""
    global _connected_to
    if _connected_to is not None and ray.is_initialized():
        ray.shutdown()
    _connected_to = None
    _verified.clear()


def _kv_get(node: str) -> str | None:
    from ray.experimental.internal_kv import _internal_kv_get

    value = _internal_kv_get(node.encode(), namespace=KV_NAMESPACE)
    return value.decode() if value else None


def _kv_put(node: str, fingerprint: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(node.encode(), fingerprint.encode(), overwrite=True, namespace=KV_NAMESPACE)


def check_code(max_retries: int = DEFAULT_MAX_RETRIES) -> int:
    """Refuse a cluster any alive node of which runs other ``prx_assets`` code than this
    process; returns how many nodes were probed now.

    A node is probed once (a task pinned to it, which starts a worker process there): what
    it answered is kept in the cluster's key-value store under its node id, so later drivers
    and later steps with this code trust that record, and only nodes never seen before are
    probed. A node restarted with other code has a new node id and is probed again.
    """
    ours = code_fingerprint()
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    todo = []
    for node in nodes:
        if node in _verified:
            continue
        if _kv_get(node) == ours:
            _verified.add(node)
        else:
            todo.append(node)
    if not todo:
        return 0
    probe = ray.remote(num_cpus=0, max_retries=max_retries)(probe_node)
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        for node in todo
    ]
    try:
        answers = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure to answer means unverified code
        raise RayUnavailable(f"cannot verify the code on every Ray node: {exc}") from None
    for node, theirs in answers:
        _kv_put(node, theirs)
        if theirs != ours:
            raise RayUnavailable(
                f"Ray node {node[:12]} runs other prx_assets code (sources "
                f"{theirs[:12]}, here {ours[:12]}): deploy the same version to every node"
            )
        _verified.add(node)
    return len(todo)


@functools.cache
def _actor_class() -> Any:
    return ray.remote(PrxWorker)


class _InFlight:
    """One submitted item: what it is, the call running it, where, and its tries."""

    __slots__ = ("item", "ref", "slot", "tries")

    def __init__(self, item: Any, ref: ray.ObjectRef, slot: int) -> None:
        self.item, self.ref, self.slot, self.tries = item, ref, slot, 0


class RayPool:
    """A ``WorkerPool`` whose items run on the cluster's long-lived ``PrxWorker`` actors, one
    CPU each, results in input order.

    Made cheaply: the address is checked at once (a TCP connect), but the cluster is joined,
    its nodes' code checked and its actors looked up only when the first item comes (a step
    with no items touches no Ray), and the connection is the process's, kept across steps.
    """

    # A task may run on another node: it carries its bytes, or a reference to object storage
    # (ingest.remote_landing.RemoteRead), never a path on this machine.
    same_machine = False

    def __init__(
        self,
        workers: int | None = None,
        address: str | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        connect_timeout: float = 10.0,
        check_code: bool = True,
    ) -> None:
        address = address or os.environ.get(ADDRESS_ENV, "")
        if not address:
            raise RayUnavailable(
                f"PRX_EXECUTOR=ray needs {ADDRESS_ENV} naming a running Ray cluster "
                "(host:port of its head, e.g. 10.0.0.5:6379); none is set"
            )
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._idle_s = idle_seconds()
        _reachable(address, connect_timeout)
        self.address = address
        self.max_retries = max_retries
        self._check = check_code
        self._workers = workers
        # (node, actor name) per CPU of the cluster, nodes interleaved: a small step's
        # items go to as many nodes as it has items.
        self._slots: list[tuple[str, str]] = []
        self._handles: dict[int, Any] = {}
        self._gone: set[str] = set()  # nodes whose actors cannot come back (node lost)
        self._next = 0

    def _ensure(self) -> None:
        if self._slots:
            return
        _connect(self.address)
        if self._check:
            check_code(self.max_retries)
        release_actors(ours=False)
        per_node = actor_names(code_fingerprint())
        depth = max((len(v) for v in per_node.values()), default=0)
        self._slots = [
            (node, names[i])
            for i in range(depth)
            for node, names in sorted(per_node.items())
            if i < len(names)
        ]
        if not self._slots:
            raise RayUnavailable(f"the Ray cluster at {self.address} has no CPU to run tasks on")
        self._workers = self._workers or len(self._slots)
        # Drivers sharing the actors start at different ones.
        self._next = int.from_bytes(os.urandom(2), "big") % len(self._slots)

    @property
    def workers(self) -> int:
        """The cluster's CPUs (or as asked): joins the cluster if not yet joined."""
        self._ensure()
        assert self._workers is not None
        return self._workers

    def _actor(self, slot: int) -> Any:
        """The slot's actor, found warm by name or started (pinned to its node)."""
        handle = self._handles.get(slot)
        if handle is None:
            node, name = self._slots[slot]
            handle = (
                _actor_class()
                .options(
                    name=name,
                    namespace=NAMESPACE,
                    lifetime="detached",
                    get_if_exists=True,
                    num_cpus=1,
                    max_restarts=-1,  # a dead worker process comes back on its node...
                    max_task_retries=self.max_retries,  # ...and its calls run again
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                )
                .remote(self._idle_s)
            )
            self._handles[slot] = handle
        return handle

    def _submit(self, fn_ref: ray.ObjectRef, item: Any) -> tuple[ray.ObjectRef, int]:
        for _ in range(len(self._slots)):
            slot = self._next % len(self._slots)
            self._next += 1
            if self._slots[slot][0] not in self._gone:
                return self._actor(slot).run.remote(fn_ref, item), slot
        raise RayWorkerLost("no node of the Ray cluster is left to run items on")

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R | ItemFailed]:
        """``fn(item)`` for every item, on the actors, at most ``window`` in flight."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        source = iter(items)
        first = next(source, _NOTHING)
        if first is _NOTHING:  # no items: no cluster joined, no code checked, no actor
            return
        limit = window or 2 * self.workers
        fn_ref = ray.put(fn)  # shipped once, not once per item
        pending: deque[_InFlight] = deque()
        try:
            for item in itertools.chain((first,), source):
                pending.append(_InFlight(item, *self._submit(fn_ref, item)))
                while len(pending) >= limit:
                    yield self._result(pending.popleft(), fn_ref)
            while pending:
                yield self._result(pending.popleft(), fn_ref)
        finally:
            for call in pending:  # the caller stopped early (or failed): drop the rest
                ray.cancel(call.ref)

    def _result(self, call: _InFlight, fn_ref: ray.ObjectRef) -> Any:
        while True:
            try:
                return ray.get(call.ref)
            except RayTaskError as exc:  # raised by fn itself: deterministic, not retried
                raise exc.as_instanceof_cause() from None
            except (RayActorError, ActorUnschedulableError) as exc:
                # The actor is gone for good: its node was lost (it is pinned there), or it
                # ended itself as idle just as this call came. Ray's own retries are for a
                # dead process on a live node; this sends the item to another actor.
                call.tries += 1
                if call.tries > self.max_retries:
                    raise RayWorkerLost(
                        f"the Ray actors running one item were lost {call.tries} times, "
                        f"{self.max_retries} retries spent: {exc}"
                    ) from None
                node = self._slots[call.slot][0]
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                if node not in alive:
                    self._gone.add(node)
                self._handles.pop(call.slot, None)  # started again, or skipped, next time
                call.ref, call.slot = self._submit(fn_ref, call.item)
            except (WorkerCrashedError, NodeDiedError) as exc:
                raise RayWorkerLost(
                    f"a Ray worker died running one item, {self.max_retries} retries spent: {exc}"
                ) from None

    def close(self) -> None:
        """Nothing to release: the process keeps its connection to the cluster for the next
        step (``disconnect`` leaves it), and the actors stay warm for the next step until
        they have been idle ``PRX_RAY_ACTOR_IDLE_S`` seconds."""

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
