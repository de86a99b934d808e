"""Per-image work as Ray tasks on the cluster ``RAY_ADDRESS`` names (``PRX_EXECUTOR=ray``).

Only ``workers.make_pool("ray")`` imports this module, so nothing loads Ray unless asked.

What the pool guarantees, and how:

- **Same bytes as the local path.** Results come back in input order, and the functions run
  are the same code as here: before a step's first item, every alive node not verified yet
  gets one probe task pinned to it, which compares a fingerprint of its ``prx_assets``
  sources with this process's, and a node with other code is refused (its shards would
  differ silently). The answer is kept in the cluster's key-value store by node id, so a
  node is probed once, not once per step or driver; a node that joins later is probed at
  the next step. Deploy one image to every node.
- **Cheap steps.** The process joins the cluster once (``ray.init`` is a new Ray job, with
  fresh worker processes) and keeps the connection for every later step; a step with no
  items joins nothing (``benchmarks/bench_ray_step.py``).
- **A lost worker costs a retry, not the partition.** Tasks are submitted with
  ``max_retries``: Ray reruns a task whose worker process or node died. When the retries
  are spent the map raises ``RayWorkerLost`` and the step fails: the writers are atomic, so
  nothing partial becomes visible. Exceptions raised by the function itself are not retried
  (they are deterministic) and come back as that item's ``ItemFailed``, as inline.
- **Bounded memory.** At most ``window`` items are in flight (submitted, result not yet
  consumed); the next item is submitted only when the oldest result has been taken.
- **Clear failure.** No ``RAY_ADDRESS``, or nothing listening there within
  ``connect_timeout`` seconds, is a ``RayUnavailable`` error at once (``ray.init`` itself
  would wait minutes on a dead address).

Unlike the local process pool, which records an item whose worker died twice as that
item's ``ItemFailed("worker_died: ...")``, a Ray task whose worker dies more than
``max_retries`` times fails the step: on a cluster that is a lost node far more often than
a poisoned image, and the partition keeps its previous output.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.exceptions import NodeDiedError, RayTaskError, WorkerCrashedError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from prx_assets.core.pool_items import ItemFailed, call_guarded

T = TypeVar("T")
R = TypeVar("R")

ADDRESS_ENV = "RAY_ADDRESS"
DEFAULT_MAX_RETRIES = 3
PROBE_TIMEOUT_S = 120.0  # a probe starts one worker process per node


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
    """One item's work on a Ray worker (the process title reads ``ray::run_prx_item``).

    Guarded as inline and in a local worker: an exception comes back as that item's
    :class:`~prx_assets.core.workers.ItemFailed`, recorded as the image's failure.
    """
    return call_guarded(fn, item)


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
            namespace="prx_assets",
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


class RayPool:
    """A ``WorkerPool`` whose items run as Ray tasks, one CPU each, results in input order.

    Made cheaply: the address is checked at once (a TCP connect), but the cluster is joined
    and its nodes' code checked only when the first item comes (a step with no items
    touches no Ray), and the connection is the process's, kept across steps.
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
        _reachable(address, connect_timeout)
        self.address = address
        self.max_retries = max_retries
        self._check = check_code
        self._workers = workers
        self._task: Any = None

    def _ensure(self) -> None:
        if self._task is not None:
            return
        _connect(self.address)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < 1:
            raise RayUnavailable(f"the Ray cluster at {self.address} has no CPU to run tasks on")
        if self._check:
            check_code(self.max_retries)
        self._workers = self._workers or cpus
        self._task = ray.remote(num_cpus=1, max_retries=self.max_retries)(run_prx_item)

    @property
    def workers(self) -> int:
        """The cluster's CPUs (or as asked): joins the cluster if not yet joined."""
        self._ensure()
        assert self._workers is not None
        return self._workers

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R | ItemFailed]:
        """``fn(item)`` for every item, as Ray tasks, at most ``window`` in flight."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        source = iter(items)
        first = next(source, _NOTHING)
        if first is _NOTHING:  # no items: no cluster joined, no code checked, no job
            return
        limit = window or 2 * self.workers
        fn_ref = ray.put(fn)  # shipped once, not once per task
        pending: deque[ray.ObjectRef] = deque()
        try:
            for item in itertools.chain((first,), source):
                pending.append(self._task.remote(fn_ref, item))
                while len(pending) >= limit:
                    yield self._result(pending.popleft())
            while pending:
                yield self._result(pending.popleft())
        finally:
            for ref in pending:  # the caller stopped early (or failed): drop the rest
                ray.cancel(ref)

    def _result(self, ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref)
        except RayTaskError as exc:  # raised by fn itself: deterministic, not retried
            raise exc.as_instanceof_cause() from None
        except (WorkerCrashedError, NodeDiedError) as exc:
            raise RayWorkerLost(
                f"a Ray worker died running one item, {self.max_retries} retries spent: {exc}"
            ) from None

    def close(self) -> None:
        """Nothing to release: the process keeps its connection to the cluster for the next
        step (``disconnect`` leaves it); the cluster itself keeps running."""

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
