"""A run whose process is killed is marked failed by run monitoring, and the queue moves on.

Real parts: ``dagster-daemon run`` on a temporary DAGSTER_HOME holding the project's
dagster.yaml (only its intervals shortened, same keys), runs submitted with ``dagster job
launch``, ``kill -9`` of the run worker and of the daemon with its code server (a crashed
``dagster dev``), then a fresh daemon. While the code server that spawned a worker lives,
it notices the worker's death itself; once it is gone too, Dagster's default launcher
cannot tell, and the run stayed STARTED forever, holding its run, partition and gpu-pool
slots (the finding: after 36 such runs nothing launched).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from dagster import DagsterInstance, DagsterRunStatus

from prx_assets.instance import (
    WORKER_HOST_TAG,
    ensure_instance,
    host_identity,
    run_worker_health,
)
from prx_assets_tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The test's values for the project's own run_monitoring keys (fast polling).
SHORT = {
    "run_monitoring": {
        "poll_interval_seconds": 1,
        "start_timeout_seconds": 60,
        "free_slots_after_run_end_seconds": 1,
    },
    "run_queue": {"user_code_failure_retry_delay": 1},
}

JOBS = """
import os
import time
from pathlib import Path

from dagster import Definitions, in_process_executor, job, op


@op(pool="gpu")
def hold_the_gpu_slot():
    Path(os.environ["PRX_TEST_DIR"], "worker.pid").write_text(str(os.getpid()))
    time.sleep(600)


@op(pool="gpu")
def use_the_gpu_slot():
    return 1


@job(executor_def=in_process_executor)
def sleeper():
    hold_the_gpu_slot()


@job(executor_def=in_process_executor)
def follower():
    use_the_gpu_slot()


defs = Definitions(jobs=[sleeper, follower])
"""


def _write_home(root: Path) -> Path:
    home = root / "home"
    home.mkdir()
    config = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    for section, values in SHORT.items():
        for key, value in values.items():
            if key in (config.get(section) or {}):
                config[section][key] = value
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    (root / "jobs.py").write_text(JOBS)
    (root / "workspace.yaml").write_text(
        "load_from:\n  - python_file:\n      relative_path: jobs.py\n      location_name: t\n"
    )
    return home


def _env(root: Path, home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DAGSTER_HOME=str(home),
        PRX_TEST_DIR=str(root),
        PYTHONPATH=str(ROOT),
        DAGSTER_DISABLE_TELEMETRY="1",
    )
    return env


def _status(instance: DagsterInstance, run_id: str) -> DagsterRunStatus | None:
    run = instance.get_run_by_id(run_id)
    return run.status if run else None


def _parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _start_daemon(root: Path, env: dict[str, str], log: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
        cwd=root,
        env=env,
        stdout=open(root / log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its code servers and run workers share its group
    )


def _launch(root: Path, env: dict[str, str], job_name: str, tags: dict[str, str]) -> str:
    run_id = str(uuid.uuid4())
    done = subprocess.run(
        [str(BIN / "dagster"), "job", "launch", "-w", "workspace.yaml", "-j", job_name]
        + ["--tags", json.dumps(tags), "--run-id", run_id],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_id


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_killed_run_is_marked_failed_and_the_queued_run_launches(tmp_path, monkeypatch):
    home = _write_home(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # dagster.yaml names storage by this
    ensure_instance(home).dispose()  # before the daemon and the CLI open it at once
    env = _env(tmp_path, home)
    daemons = [_start_daemon(tmp_path, env, "daemon-1.log")]
    instance = DagsterInstance.from_config(str(home))
    try:
        tags = {"dagster/partition": "source.batch"}
        sleeper = _launch(tmp_path, env, "sleeper", tags)
        follower = _launch(tmp_path, env, "follower", tags)  # same partition: waits
        pid_file = tmp_path / "worker.pid"
        wait_until(pid_file.exists, 60, "the first run's worker to start")
        worker = int(pid_file.read_text())
        assert _status(instance, sleeper) == DagsterRunStatus.STARTED
        assert _status(instance, follower) == DagsterRunStatus.QUEUED
        code_server = _parent_of(worker)
        assert b"api\x00grpc" in Path(f"/proc/{code_server}/cmdline").read_bytes()
        # A live worker is never judged dead.
        live = run_worker_health(instance, instance.get_run_by_id(sleeper))
        assert live.status.value == "RUNNING", live

        # kill -9 of the code server (first, so it cannot notice), the run worker, and the
        # daemon (a crashed `dagster dev`); a new daemon starts. Nothing alive remembers the
        # run but the instance, where it is STARTED.
        os.kill(code_server, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        _kill_group(daemons[0])
        daemons.append(_start_daemon(tmp_path, env, "daemon-2.log"))

        bound = 30 * SHORT["run_monitoring"]["poll_interval_seconds"]  # whatever the config says
        wait_until(
            lambda: _status(instance, sleeper) == DagsterRunStatus.FAILURE,
            bound,
            "run monitoring to mark the killed run FAILURE (is run_monitoring enabled, with a "
            "launcher that checks the run worker?)",
        )
        wait_until(
            lambda: _status(instance, follower) == DagsterRunStatus.SUCCESS,
            60,
            "the queued run (same partition, same gpu pool) to launch and succeed",
        )
        failed = instance.get_run_record_by_id(sleeper)
        later = instance.get_run_record_by_id(follower)
        assert later.start_time >= failed.end_time  # it waited for the slots, then moved on
        messages = [e.message or "" for e in instance.all_logs(sleeper)]
        assert any(f"run worker process {worker}" in m for m in messages), messages[-3:]
    finally:
        instance.dispose()
        for daemon in daemons:
            _kill_group(daemon)  # the daemon, its code servers, any orphaned worker


CHILD = """
import sys
from dagster import DagsterInstance, job, op
import time

@op
def wait_forever():
    time.sleep(600)

@job
def waits():
    wait_forever()

tags = {"prx/worker_host": sys.argv[1]} if sys.argv[1] else {}
waits.execute_in_process(instance=DagsterInstance.get(), tags=tags)
"""


def _in_process_run(tmp_path: Path, name: str, host_tag: str):
    """A real run executed by a child process (like the CLI does); returns (child, run id)."""
    home = tmp_path / name
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = dict(os.environ, DAGSTER_HOME=str(home), PYTHONPATH=str(ROOT))
    # Created once before two processes open it (as `make` does): two first opens of a
    # fresh sqlite home race on its schema ("table jobs already exists").
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DAGSTER_HOME", str(home))  # ensure_instance opens $DAGSTER_HOME only
        ensure_instance(home).dispose()
    child = subprocess.Popen([sys.executable, "-c", CHILD, host_tag], env=env)
    instance = DagsterInstance.from_config(str(home))

    def started():
        runs = instance.get_runs()
        return runs[0] if runs and runs[0].status == DagsterRunStatus.STARTED else None

    run = wait_until(started, 60, "the child's run to start")
    return child, instance, run.run_id


def test_worker_health_is_failed_only_when_the_local_worker_is_provably_gone(tmp_path):
    child, instance, run_id = _in_process_run(tmp_path, "local", host_identity())
    try:
        assert run_worker_health(instance, instance.get_run_by_id(run_id)).status.value == (
            "RUNNING"
        )
        child.kill()
        child.wait(timeout=30)
        health = run_worker_health(instance, instance.get_run_by_id(run_id))
        assert health.status.value == "FAILED" and str(child.pid) in health.msg
        # The same dead run seen from another machine, or without a host tag: not judged.
        other = instance.get_run_by_id(run_id).with_tags({WORKER_HOST_TAG: "elsewhere/x"})
        assert run_worker_health(instance, other).status.value == "RUNNING"
        untagged = instance.get_run_by_id(run_id).with_tags({})  # replaces every tag
        assert run_worker_health(instance, untagged).status.value == "RUNNING"
        assert run_worker_health(instance, untagged, untagged_runs_are_local=True).status.value == (
            "FAILED"
        )
        # The host rebooted since (same name, another boot id): gone.
        host = host_identity().partition("/")[0]
        rebooted = instance.get_run_by_id(run_id).with_tags({WORKER_HOST_TAG: f"{host}/old"})
        assert run_worker_health(instance, rebooted).status.value == "FAILED"
    finally:
        if child.poll() is None:
            child.kill()
        instance.dispose()
