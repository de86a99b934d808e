"""A real Ray cluster on this machine for tests, the Ray benchmark and trying ``PRX_EXECUTOR=ray``.

Its nodes are started with ``--node-ip-address=127.0.0.1``, which Ray turns into the host's
routable address; the GCS and raylets then listen beyond loopback (docs/deploy.md says what
that means for a deployment). The dashboard and its job server stay on 127.0.0.1.

A head node and worker nodes, each started by the ``ray`` command line (``ray start``) in a
session of its own, with the dashboard on 127.0.0.1 (it serves Ray's state API: ``ray list
tasks``, ``ray.util.state``; ``dashboard=False`` leaves it off), every fixed-default port
replaced by a free one
(two clusters on one machine do not collide), a small object store and a private temp dir.
``stop`` ends exactly the processes this cluster started (its sessions' process groups, and
any process carrying its marker in its environment), never another cluster's: ``ray stop``
would end every Ray process of the user on the machine.

Imports no Ray: it drives the ``ray`` executable next to this interpreter.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MARKER_ENV = "PRX_LOCAL_RAY_CLUSTER"
NODE_ENV = "PRX_LOCAL_RAY_NODE"  # <marker>:<index>: 0 the head, 1.. the worker nodes
DEFAULT_OBJECT_STORE_BYTES = 100 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


MAX_TEMP_DIR_CHARS = 36  # + "/session_<date>_<time>_<pid>/sockets/dash_MetricsHead" <= 107


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a killed process not yet reaped is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class LocalRayCluster:
    """``ray start --head`` plus ``worker_nodes`` ``ray start --address`` nodes on loopback.

    ``env`` is given to every node (and so to every Ray worker process): ``PYTHONPATH`` must
    name the checkout whose code the driver runs, or the cluster refuses it (see
    ``RayPool``'s code check).
    """

    def __init__(
        self,
        temp_dir: str | Path,
        *,
        worker_nodes: int = 1,
        cpus_per_node: int = 1,
        object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES,
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
        dashboard: bool = True,
    ) -> None:
        self.temp_dir = Path(temp_dir)
        if len(str(self.temp_dir)) > MAX_TEMP_DIR_CHARS:
            # Ray puts AF_UNIX sockets under <temp_dir>/session_<date>_<pid>/sockets/, and
            # such a path cannot exceed 107 bytes: a long temp dir fails `ray start` (its
            # dashboard modules). A short directory of its own instead.
            self.temp_dir = Path(tempfile.mkdtemp(prefix="prx-ray-", dir="/tmp"))
            self._own_temp_dir = True
        else:
            self._own_temp_dir = False
        self.dashboard = dashboard
        self.worker_nodes = worker_nodes
        self.cpus_per_node = cpus_per_node
        self.object_store_bytes = object_store_bytes
        self.start_timeout = start_timeout
        self.marker = uuid.uuid4().hex
        self.env = {
            **os.environ,
            **(env or {}),
            MARKER_ENV: self.marker,
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_port = free_port()
        # Ray's state API (``ray.util.state.list_tasks(address=...)``, ``ray list tasks``).
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}" if dashboard else None
        self._groups: list[int] = []  # process groups of the `ray start` sessions

    def _start(self, *args: str) -> None:
        index = len(self._groups)  # 0: the head; every process of a node inherits its mark
        command = [
            _ray_cli(),
            "start",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.cpus_per_node}",
            f"--object-store-memory={self.object_store_bytes}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
            *args,
        ]
        proc = subprocess.Popen(
            command,
            env={**self.env, NODE_ENV: f"{self.marker}:{index}"},
            cwd=self.temp_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # every daemon it leaves behind is in this group
        )
        self._groups.append(proc.pid)
        try:
            out, _ = proc.communicate(timeout=self.start_timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"`ray start` did not return in {self.start_timeout} s") from None
        if proc.returncode != 0:
            self.stop()
            tail = out.decode(errors="replace")[-2000:]
            raise RuntimeError(f"`ray start` failed ({proc.returncode}):\n{tail}")

    def start(self) -> LocalRayCluster:
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self._start(
            "--head",
            f"--port={self.port}",
            f"--include-dashboard={'true' if self.dashboard else 'false'}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
        )
        for _ in range(self.worker_nodes):
            self.add_worker_node()
        return self

    def add_worker_node(self) -> None:
        """One more node of ``cpus_per_node`` CPUs joining the head."""
        self._start(f"--address={self.address}")

    def pids(self) -> list[int]:
        """Every live process this cluster started (by process group or marker)."""
        mine = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                if (entry / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                    continue  # exited, waiting for its parent to reap it
                group = os.getpgid(pid)
                environ = (entry / "environ").read_bytes()
            except (OSError, ProcessLookupError, IndexError):
                continue
            if group in self._groups or f"{MARKER_ENV}={self.marker}".encode() in environ:
                mine.append(pid)
        return sorted(mine)

    def node_of(self, pid: int) -> int | None:
        """Which node of this cluster ``pid`` belongs to (0 the head, 1.. worker nodes, in
        the order they joined), from the mark every process of a node inherits; None for a
        process that is not this cluster's."""
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        prefix = f"{NODE_ENV}={self.marker}:".encode()
        for entry in environ:
            if entry.startswith(prefix):
                return int(entry[len(prefix) :])
        return None

    def kill_node(self, index: int) -> list[int]:
        """SIGKILL every process of node ``index`` at once (its raylet, its Ray workers and
        job drivers and whatever they started): a machine lost, not a clean shutdown.
        Returns the pids killed."""
        if index == 0:
            raise ValueError("node 0 is the head: killing it ends the cluster")
        killed: list[int] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # again: a dying raylet may have forked a worker
            left = [pid for pid in self.pids() if self.node_of(pid) == index]
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed += [pid for pid in left if pid not in killed]
            time.sleep(0.05)
        # A process still exiting no longer shows its environment (so ``pids`` stops listing
        # it) but is not dead yet: wait until each killed one is gone or a zombie, so that a
        # caller sees the node lost, not a node being lost (seen once in CI: a run worker
        # still alive right after this returned).
        while time.monotonic() < deadline and any(_running(pid) for pid in killed):
            time.sleep(0.01)
        return killed

    def busy_workers(self, task_name: str) -> list[int]:
        """Ray worker processes of this cluster running ``task_name`` now (Ray titles a
        worker ``ray::<function>`` while it runs a task, ``ray::IDLE`` between tasks)."""
        busy = []
        for pid in self.pids():
            with contextlib.suppress(OSError):
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                if title.decode(errors="replace").strip() == f"ray::{task_name}":
                    busy.append(pid)
        return busy

    def tasks_run(self, task_name: str) -> dict[int, int]:
        """Tasks named ``task_name`` each worker process has started, by pid, from the
        workers' own logs (Ray writes ``:task_name:<name>`` there as each task begins; a
        killed task counts on the worker it was killed on, its retry on the next)."""
        counts: dict[int, int] = {}
        marker = f":task_name:{task_name}"
        sessions = [d for d in self.temp_dir.glob("session_*") if not d.is_symlink()]
        for log in (log for d in sessions for log in d.glob("logs/worker-*.out")):
            pid = int(log.stem.rsplit("-", 1)[1])
            with contextlib.suppress(OSError):
                lines = log.read_text(errors="replace").splitlines()
                counts[pid] = counts.get(pid, 0) + sum(line == marker for line in lines)
        return counts

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM to every process of this cluster, SIGKILL to what is left after ``grace``."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            pids = self.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while pids and time.monotonic() < deadline:
                time.sleep(0.1)
                pids = self.pids()
            if not pids:
                break
        if self._own_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
