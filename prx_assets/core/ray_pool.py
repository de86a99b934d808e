"""Per-image work as Ray tasks on the cluster ``RAY_ADDRESS`` names (``PRX_EXECUTOR=ray``).

Only ``workers.make_pool("ray")`` imports this module, so nothing loads Ray unless asked.

What the pool guarantees, and how:

- **Same bytes as the local path.** Results come back in input order, and the functions run
  are the same code as here: on connecting, one probe task pinned to every alive node
  compares a fingerprint of its ``prx_assets`` sources with this process's, and a node with
  other code is refused (its shards would differ silently). Nodes joining later are not
  probed; deploy one image to every node.
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

import hashlib
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

from prx_assets.core.workers import ItemFailed, call_guarded

T = TypeVar("T")
R = TypeVar("R")

ADDRESS_ENV = "RAY_ADDRESS"
DEFAULT_MAX_RETRIES = 3
PROBE_TIMEOUT_S = 120.0  # a probe starts one worker process per node


class RayUnavailable(RuntimeError):
    """``PRX_EXECUTOR=ray`` was asked for, but no usable Ray cluster was reached."""


class RayWorkerLost(RuntimeError):
    """A task's worker died more often than ``max_retries`` allows: the map is abandoned."""


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


class RayPool:
    """A ``WorkerPool`` whose items run as Ray tasks, one CPU each, results in input order."""

    same_machine = False  # a task may run on another node: it carries its bytes

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
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            try:
                ray.init(
                    address=address,
                    namespace="prx_assets",
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                )
            except (ConnectionError, RuntimeError) as exc:
                raise RayUnavailable(f"cannot join the Ray cluster at {address}: {exc}") from None
        self.max_retries = max_retries
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < 1:
            self.close()
            raise RayUnavailable(f"the Ray cluster at {address} has no CPU to run tasks on")
        self.workers = workers or cpus
        self._task = ray.remote(num_cpus=1, max_retries=max_retries)(run_prx_item)
        if check_code:
            self._check_code()

    def _check_code(self) -> None:
        """Refuse a cluster any node of which runs other ``prx_assets`` code than this one."""
        ours = code_fingerprint()
        probe = ray.remote(num_cpus=0, max_retries=self.max_retries)(probe_node)
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        refs = [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote()
            for node in nodes
        ]
        try:
            answers = ray.get(refs, timeout=PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure to answer means unverified code
            self.close()
            raise RayUnavailable(f"cannot verify the code on every Ray node: {exc}") from None
        for node, theirs in answers:
            if theirs != ours:
                self.close()
                raise RayUnavailable(
                    f"Ray node {node[:12]} runs other prx_assets code (sources "
                    f"{theirs[:12]}, here {ours[:12]}): deploy the same version to every node"
                )

    def map_ordered(
        self, fn: Callable[[T], R], items: Iterable[T], *, window: int | None = None
    ) -> Iterator[R | ItemFailed]:
        """``fn(item)`` for every item, as Ray tasks, at most ``window`` in flight."""
        limit = window or 2 * self.workers
        if limit < 1:
            raise ValueError(f"window must be >= 1, got {limit}")
        fn_ref = ray.put(fn)  # shipped once, not once per task
        pending: deque[ray.ObjectRef] = deque()
        try:
            for item in items:
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
        """Leave the cluster if this pool joined it (the cluster itself keeps running)."""
        if self._owns_connection and ray.is_initialized():
            ray.shutdown()
        self._owns_connection = False
