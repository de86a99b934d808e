"""The Dagster instance: created once under a lock, and a run launcher that can tell a dead run.

Two operational faults this module closes:

- **Concurrent first start.** Dagster creates a sqlite instance lazily: the first process
  to open a fresh ``DAGSTER_HOME`` creates the tables and stamps the alembic revision. Two
  processes doing it at once (``dagster dev`` starts a webserver and a daemon; a user runs
  the CLI at the same time) can both stamp, leaving ``alembic_version`` with two rows, and
  every later start fails with "more than one head". :func:`ensure_instance` creates and
  migrates the instance under an exclusive ``flock`` on ``$DAGSTER_HOME/.init.lock`` and
  records the Dagster version it did it for, so later starts take a lock-free fast path
  and a Dagster upgrade migrates exactly once. The Makefile, the CLI and the demo all go
  through it (``python -m prx_assets.instance`` from make).
- **Killed runs that stay STARTED.** Dagster's default run launcher cannot check a run
  worker's health, so run monitoring only times out runs that never *started*; a run
  whose worker died together with its code server (OOM killer, ``kill -9`` of ``dagster
  dev``, a reboot) stays STARTED forever and holds a ``max_concurrent_runs`` slot and its
  partition's slot. :class:`LocalProcessRunLauncher` is the default launcher plus a health
  check: the run worker's pid is the one on the run's ``RUN_START`` event, and the host it
  ran on is the ``prx/worker_host`` tag; the check reports FAILED only on positive
  evidence that this process is gone, and RUNNING whenever it cannot tell (another host,
  no tag), so a live run is never failed and re-queued behind a still-writing worker.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dagster import DagsterInstance
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.launcher.base import LaunchRunContext
from dagster._core.launcher.default_run_launcher import DefaultRunLauncher
from dagster._serdes.config_class import ConfigurableClassData

if TYPE_CHECKING:
    from dagster._core.storage.dagster_run import DagsterRun

INIT_LOCK = ".init.lock"
INIT_MARKER = ".prx-initialised.json"
WORKER_HOST_TAG = "prx/worker_host"
# /proc start times are derived from the boot time and may drift with clock adjustments;
# a process that started this long after the run's RUN_START is another one (reused pid).
PID_START_SLACK_S = 60.0


# ---------------------------------------------------------------------------------------------
# Initialisation under a lock


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def install_config(dagster_home: Path, config: Path) -> bool:
    """Put ``config`` at ``$DAGSTER_HOME/dagster.yaml`` unless one is there; True if installed.

    Atomic and no-clobber: the text goes to a temporary file in the same directory, which
    is then hard-linked into place (``link`` fails if the name exists), so a reader never
    sees a partial file and a user's own dagster.yaml is never replaced.
    """
    target = dagster_home / "dagster.yaml"
    if target.exists():
        return False
    fd, tmp = tempfile.mkstemp(prefix=".dagster.yaml.", suffix=".tmp", dir=dagster_home)
    try:
        os.fchmod(fd, config.stat().st_mode & 0o777)  # mkstemp's 0600 would hide it from others
        with os.fdopen(fd, "wb") as fh:
            fh.write(config.read_bytes())
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def _dagster_version() -> str:
    from dagster.version import __version__

    return __version__


def _initialised_for(dagster_home: Path) -> str | None:
    try:
        return json.loads((dagster_home / INIT_MARKER).read_text()).get("dagster")
    except (OSError, ValueError, AttributeError):
        return None


def _write_marker(dagster_home: Path) -> None:
    marker = dagster_home / INIT_MARKER
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"dagster": _dagster_version(), "at": time.time()}))
    os.replace(tmp, marker)


def _check_home(dagster_home: str | Path | None) -> Path:
    env = os.environ.get("DAGSTER_HOME")
    home = dagster_home if dagster_home is not None else env
    if not home:
        raise ValueError("DAGSTER_HOME is not set (the Makefile sets it to .dagster_home)")
    path = Path(home).resolve()
    # dagster.yaml names its storage by `env: DAGSTER_HOME`: the two must agree.
    if env and Path(env).resolve() != path:
        raise ValueError(f"DAGSTER_HOME is {env!r}, but the instance asked for is {str(path)!r}")
    return path


def ensure_instance(
    dagster_home: str | Path | None = None, config: Path | None = None
) -> DagsterInstance:
    """Open the instance at ``dagster_home``, creating or migrating it once, under a lock.

    ``config``: a dagster.yaml to install first when the home has none (see
    :func:`install_config`). The first caller (per Dagster version) opens the instance
    inside an exclusive ``flock`` on ``.init.lock``, which creates the storage and stamps
    its revision, then runs ``instance.upgrade()`` and writes the marker; concurrent callers
    wait on the lock and then open an initialised instance. Later calls skip the lock.
    """
    home = _check_home(dagster_home)
    home.mkdir(parents=True, exist_ok=True)
    version = _dagster_version()
    needs_config = config is not None and not (home / "dagster.yaml").exists()
    if not needs_config and _initialised_for(home) == version:
        return DagsterInstance.from_config(str(home))
    with _exclusive(home / INIT_LOCK):
        if config is not None:
            install_config(home, config)
        instance = DagsterInstance.from_config(str(home))
        if _initialised_for(home) != version:
            # Dagster's sqlite storage prints its progress: keep stdout for the command's own.
            with contextlib.redirect_stdout(sys.stderr):
                instance.upgrade()
            initialise_pools(instance)
            _write_marker(home)
        return instance


def initialise_pools(instance: DagsterInstance) -> None:
    """Create the project's op-concurrency pools (``gpu``) at the configured default limit.

    Why: Dagster creates a pool's row on the first step that claims it; on PostgreSQL two
    runs claiming a fresh pool at once race (the loser's INSERT fails inside its
    transaction, its UPDATE then fails with ``InFailedSqlTransaction``, and the run fails).
    Found with four partitions starting at once on a Ray cluster
    (``prx_assets_tests/s3/test_ray_runs_cluster.py``). Made once here, under the init lock,
    the row exists before any run. No default limit: nothing to create.
    """
    from prx_assets.defs.captions.resources import GPU_POOL

    if instance.global_op_concurrency_default_limit is None:
        return
    for pool in (GPU_POOL,):
        instance.event_log_storage.initialize_concurrency_limit_to_default(pool)


def config_warnings(dagster_home: Path) -> list[str]:
    """What the installed dagster.yaml lacks that the project relies on (older homes)."""
    import yaml

    path = dagster_home / "dagster.yaml"
    if not path.exists():
        return [f"{path} is missing: Dagster's defaults apply (no run monitoring)"]
    config = yaml.safe_load(path.read_text()) or {}
    out = []
    if not (config.get("run_monitoring") or {}).get("enabled"):
        out.append(
            f"{path} does not enable run_monitoring: a run whose process is killed stays "
            "STARTED and holds its slot. Compare it with the project's dagster.yaml."
        )
    return out


# ---------------------------------------------------------------------------------------------
# Run worker health


def host_identity() -> str:
    """``<hostname>/<boot id>``: which machine, and which boot of it, a run worker ran on."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def local_run_tags() -> dict[str, str]:
    """Tags for a run executed in this process (``execute_in_process`` from the CLI)."""
    return {WORKER_HOST_TAG: host_identity()}


def _linux_start_time(pid: int) -> tuple[float, str] | None:
    """(start time as a Unix timestamp, state letter) of a live pid, or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    state, start_ticks = fields[0], int(fields[19])
    return btime + start_ticks / os.sysconf("SC_CLK_TCK"), state


def process_is_alive(pid: int, started_by: float) -> bool:
    """Whether ``pid`` is a live process that existed at ``started_by`` (not a reused pid)."""
    if pid <= 0:
        return False
    if Path("/proc/self/stat").exists():
        found = _linux_start_time(pid)
        if found is None:
            return False
        started, state = found
        if state in ("Z", "X"):  # exited, not yet reaped
            return False
        return started <= started_by + PID_START_SLACK_S
    try:  # elsewhere: existence only (a reused pid reads as alive: the safe direction)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_worker_health(
    instance: DagsterInstance,
    run: DagsterRun,
    untagged_runs_are_local: bool = False,
    here: str | None = None,
) -> CheckRunHealthResult:
    """FAILED when the run's worker process is provably gone from this host, else RUNNING."""
    from dagster._core.events import DagsterEventType

    here = here or host_identity()
    tag = run.tags.get(WORKER_HOST_TAG)
    if tag is None and not untagged_runs_are_local:
        return CheckRunHealthResult(WorkerStatus.RUNNING, f"no {WORKER_HOST_TAG} tag: not checked")
    host, _, boot = (tag or here).partition("/")
    here_host, _, here_boot = here.partition("/")
    if host != here_host:
        return CheckRunHealthResult(WorkerStatus.RUNNING, f"worker on {host}: not checked here")
    if boot != here_boot:
        return CheckRunHealthResult(
            WorkerStatus.FAILED, f"{host} rebooted since the run worker started"
        )
    starts = instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_START)
    if not starts or starts[-1].dagster_event is None or starts[-1].dagster_event.pid is None:
        return CheckRunHealthResult(WorkerStatus.RUNNING, "no RUN_START event yet")
    pid = int(starts[-1].dagster_event.pid)
    if process_is_alive(pid, started_by=starts[-1].timestamp):
        return CheckRunHealthResult(WorkerStatus.RUNNING, f"run worker pid {pid} is alive")
    return CheckRunHealthResult(
        WorkerStatus.FAILED, f"run worker process {pid} on {host} is gone (killed or crashed)"
    )


def _origin_is_local(run: DagsterRun) -> bool:
    """Whether the code server that spawns this run's worker runs on this machine."""
    from dagster._core.remote_origin import GrpcServerCodeLocationOrigin

    origin = run.remote_job_origin
    if origin is None:
        return True
    location = origin.repository_origin.code_location_origin
    if isinstance(location, GrpcServerCodeLocationOrigin):
        if location.socket:
            return True
        return location.host in ("localhost", "127.0.0.1", "::1", socket.gethostname())
    return True  # a code server this process manages (python_module / python_file)


class LocalProcessRunLauncher(DefaultRunLauncher):
    """The default launcher (a run worker per run, spawned by the code server) plus a health
    check that run monitoring uses to fail runs whose worker process died.

    dagster.yaml::

        run_launcher:
          module: prx_assets.instance
          class: LocalProcessRunLauncher
          config:
            untagged_runs_are_local: true   # sqlite: every run of this instance is local
    """

    def __init__(
        self, inst_data: ConfigurableClassData | None = None, untagged_runs_are_local: bool = False
    ) -> None:
        self._untagged_runs_are_local = untagged_runs_are_local
        super().__init__(inst_data=inst_data)

    @classmethod
    def config_type(cls) -> dict:
        from dagster import Field

        return {
            "untagged_runs_are_local": Field(
                bool,
                is_required=False,
                default_value=False,
                description=(
                    "Judge runs without a prx/worker_host tag (e.g. `dagster asset "
                    "materialize`) as local ones. True only where every process of the "
                    "instance runs on one machine (the sqlite default)."
                ),
            )
        }

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]
    ) -> LocalProcessRunLauncher:
        return cls(
            inst_data=inst_data,
            untagged_runs_are_local=bool(config_value.get("untagged_runs_are_local", False)),
        )

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        if WORKER_HOST_TAG not in run.tags and _origin_is_local(run):
            self._instance.add_run_tags(run.run_id, {WORKER_HOST_TAG: host_identity()})
        super().launch_run(context)

    @property
    def untagged_runs_are_local(self) -> bool:
        return self._untagged_runs_are_local

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        return run_worker_health(self._instance, run, self._untagged_runs_are_local)


# ---------------------------------------------------------------------------------------------
# `python -m prx_assets.instance`: what the Makefile runs before any Dagster process starts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prx_assets.instance",
        description="Create or migrate the Dagster instance at $DAGSTER_HOME, once, under a lock.",
    )
    parser.add_argument("--config", type=Path, help="dagster.yaml to install when none is there")
    args = parser.parse_args(argv)
    try:
        home = _check_home(None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    instance = ensure_instance(home, args.config)
    instance.dispose()
    for warning in config_warnings(home):
        print(f"warning: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
