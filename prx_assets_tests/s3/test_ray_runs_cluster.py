"""Partitions across a real Ray cluster (``PRX_EXECUTOR=ray_runs``): four partitions run at
once on two nodes, their shards on S3 are the local run's bytes, and a node killed in the
middle of a step costs a retried run on the node that survives.

Real parts, as docs/deploy.md sets them up: PostgreSQL instance storage (started by the
test), moto S3 on 127.0.0.1 for the landing zone, the lab and the shards, a Ray head and a
worker node (``ray start`` twice, 2 CPUs each, the dashboard's job server on 127.0.0.1),
``dagster-daemon run`` on the project's ``dagster_ray_cluster.yaml`` (only intervals
shortened and the launcher's address and CPUs set), whose landing sensor queues one run per
landing batch and whose run queue launches them through dagster-ray's ``RayRunLauncher``.

The kill is placed by the filesystem: every run worker holds at its first Lance commit point
(``PRX_HOLD_AT=lab.fragments_written:1:<dir>``, fragments written, not committed: inside
``raw_images``), so the test sees all four runs inside a step at the same time, learns which
node each is on from its process, kills every process of the worker node at once, and
releases the others. Dagster's run monitoring sees the lost runs' Ray jobs failed, run
retries queue a re-execution of each, and Ray places them on the head.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import yaml
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, instance_for_test

from prx_assets.core.ingest.remote_landing import upload_landing
from prx_assets.core.ray_local import LocalRayCluster
from prx_assets.core.shards.remote import live_partitions, read_live
from prx_assets.core.storage import open_store
from prx_assets.defs.executors import PLACEMENT_MESSAGE, RAY_NODE_TAG, RAY_SUBMISSION_TAG
from prx_assets.demo.photo_batch import write_photo_batch
from prx_assets.instance import ensure_instance
from prx_assets_tests.ops.conftest import postgres_server  # noqa: F401 - a fixture
from prx_assets_tests.s3.conftest import ACCESS_KEY, SECRET_KEY
from prx_assets_tests.trees import live_tree
from prx_assets_tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
KEYS = [f"photos.c{i}" for i in range(4)]
PER_PARTITION = 2
HOLD_POINT = "lab.fragments_written"
# The test's values for keys of dagster_ray_cluster.yaml (fast polling; 1 CPU per run).
SHORT = {
    "run_monitoring": {"poll_interval_seconds": 1, "free_slots_after_run_end_seconds": 1},
    "run_queue": {"user_code_failure_retry_delay": 1},
}


def _remote_tree(shards_uri: str) -> dict[str, str]:
    """Every live shard directory's objects (the version the pointer names), by the path
    the same file has in a local tree: ``mds/<tier>/<HxW>/<batch>/<name>``."""
    store = open_store(shards_uri)
    out = {}
    for rel in live_partitions(shards_uri):
        live = read_live(store, f"mds/{rel}")
        assert live is not None, rel
        for key in store.list(live.key_prefix):
            data = store.get(key, max_bytes=1 << 30)
            assert data is not None, key
            out[f"mds/{rel}/{key.rsplit('/', 1)[-1]}"] = hashlib.sha256(data).hexdigest()
    return out


def _landing(folder: Path) -> Path:
    """Four batches of two distinct photographs each (no duplicates across partitions)."""
    scratch = folder.parent / "all-photos"
    names = write_photo_batch(scratch, 4 * PER_PARTITION, long_side=640)
    for i, key in enumerate(KEYS):
        batch = folder / key.replace(".", "/")
        batch.mkdir(parents=True)
        for name in names[i * PER_PARTITION : (i + 1) * PER_PARTITION]:
            for f in (name, name.replace(".jpg", ".txt")):
                shutil.copy(scratch / f, batch / f)
        (batch / "_SUCCESS").write_bytes(b"")
    return folder


def _local_reference(data_root: Path) -> dict[str, str]:
    """The four partitions on the default path, in process: the reference bytes. Runs in a
    spawned process while the cluster starts (the environment it inherits holds no PRX_*
    setting: the caller removed them)."""
    from prx_assets.definitions import build_defs
    from prx_assets.defs.partitions import BATCHES

    job = build_defs(str(data_root)).resolve_job_def("batch_pipeline")
    # set_dagster_home=False: the test's thread sets DAGSTER_HOME for the cluster's instance.
    with instance_for_test(set_dagster_home=False) as instance:
        instance.add_dynamic_partitions(BATCHES.name, KEYS)
        for key in KEYS:
            assert job.execute_in_process(partition_key=key, instance=instance).success
    tree = live_tree(data_root / "shards")
    assert sum(p.endswith(".mds") for p in tree) >= len(KEYS), tree
    return tree


def _home(root: Path, jobs_address: str) -> Path:
    home = root / "home"
    home.mkdir()
    config = yaml.safe_load((REPO / "dagster_ray_cluster.yaml").read_text())
    for section, values in SHORT.items():
        for key, value in values.items():
            assert key in config[section], (section, key)  # only the file's own keys change
            config[section][key] = value
    config["run_queue"]["dequeue_interval_seconds"] = 1
    ray_config = config["run_launcher"]["config"]["ray"]
    ray_config["address"] = jobs_address
    ray_config["num_cpus"] = 1  # two runs per 2-CPU node: four at once on the cluster
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    shutil.copy(REPO / "workspace.yaml", root / "workspace.yaml")
    return home


def _placement_events(instance: DagsterInstance, run_id: str) -> list[dict]:
    """The metadata of the run's placement engine events (``PLACEMENT_MESSAGE``)."""
    out = []
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        event = record.dagster_event
        if event and event.message and event.message.startswith(PLACEMENT_MESSAGE):
            out.append({k: v.value for k, v in event.engine_event_data.metadata.items()})
    return out


def _step_pids(instance: DagsterInstance, run_id: str) -> dict[str, int]:
    return {
        r.dagster_event.step_key: r.dagster_event.pid
        for r in instance.all_logs(run_id, of_type=DagsterEventType.STEP_START)
    }


def _errors(instance: DagsterInstance, run_id: str) -> list[str]:
    """What a failed run said about its failure (for the assertion message)."""
    kinds = (DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE)
    out = []
    for record in instance.all_logs(run_id):
        event = record.dagster_event
        if event and event.event_type in kinds:
            data = event.event_specific_data
            error = getattr(data, "error", None)
            out.append(f"{event.step_key}: {event.message} {error.to_string() if error else ''}")
    return out


def _alive(pid: int) -> bool:
    """Running (a killed process whose parent has not reaped it yet is a zombie: dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _batch_runs(instance: DagsterInstance) -> list:
    return [r for r in instance.get_runs() if r.job_name == "batch_pipeline"]


@pytest.mark.cluster
def test_partitions_spread_over_ray_nodes_and_a_lost_node_costs_a_retry(
    tmp_path,
    s3_server,
    s3_prefix,
    postgres_server,  # noqa: F811 - the fixture imported above
    monkeypatch,
):
    t0 = time.monotonic()

    def mark(what: str) -> None:  # where the time goes (shown when the test fails)
        print(f"{time.monotonic() - t0:7.1f} s  {what}", flush=True)

    landing = _landing(tmp_path / "landing")
    shutil.copytree(landing, tmp_path / "local" / "landing")
    upload_landing(landing, f"{s3_prefix}/landing")
    for var in ("PRX_EXECUTOR", "PRX_WORKERS", "PRX_LANDING_URI", "PRX_LAB_URI", "PRX_SHARDS_URI"):
        monkeypatch.delenv(var, raising=False)
    # The local reference runs while the cluster and Dagster start (mostly waiting).
    # In a process of its own, not a thread: its runs initialise a sqlite event log per run
    # through alembic, whose module-level state two upgrades in one process share (seen:
    # `KeyError: 'script'` in this process's PostgreSQL upgrade below).
    background = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    reference_run = background.submit(_local_reference, tmp_path / "local")

    hold = tmp_path / "hold"
    hold.mkdir()
    settings = {  # what every process of the deployment sees (no secret among them)
        "PRX_EXECUTOR": "ray_runs",
        "PRX_WORKERS": "1",
        "PRX_DATA_ROOT": str(tmp_path / "cluster-data"),
        "PRX_LANDING_URI": f"{s3_prefix}/landing",
        "PRX_LAB_URI": f"{s3_prefix}/lab",
        "PRX_SHARDS_URI": f"{s3_prefix}/shards",
        "PRX_PG_HOST": postgres_server["host"],
        "PRX_PG_PORT": str(postgres_server["port"]),
        "PRX_PG_USER": postgres_server["user"],
        "PRX_PG_DB": postgres_server["db"],
        "PRX_PG_PASSWORD": "",
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    (tmp_path / "cluster-data").mkdir()
    node_env = {
        **settings,
        **s3_server.env,  # each node's own secrets, as a deployment provisions them
        "PYTHONPATH": str(REPO),
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PRX_HOLD_AT": f"{HOLD_POINT}:1:{hold}",
        # A lost node is noticed in ~2 s, not Ray's default ~15 s.
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_failure_threshold": "4",
        "RAY_health_check_timeout_ms": "500",
    }
    ray_root = Path(tempfile.mkdtemp(prefix="prx-ray-"))  # Ray's socket paths: < 108 bytes
    cluster = LocalRayCluster(ray_root, cpus_per_node=2, env=node_env)
    cluster.start()
    mark("cluster up")
    daemon = None
    try:
        home = _home(tmp_path, cluster.dashboard_url)
        env = {
            **os.environ,
            **settings,
            "DAGSTER_HOME": str(home),
            "PYTHONPATH": str(REPO),
            "DAGSTER_EVENT_LOG_CONSUMER_DAEMON_INTERVAL_SECONDS": "1",  # run retries
        }
        env.pop("RAY_ADDRESS", None)
        for var, value in env.items():  # the instance below resolves the same env vars
            if var.startswith("PRX_PG_"):
                monkeypatch.setenv(var, value)
        monkeypatch.setenv("DAGSTER_HOME", str(home))  # dagster.yaml names storage by it
        ensure_instance(home).dispose()  # before the daemon opens it
        daemon = subprocess.Popen(
            [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            cwd=tmp_path,
            env=env,
            stdout=open(tmp_path / "daemon.log", "wb"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        instance = DagsterInstance.from_config(str(home))

        # The landing sensor queues one run per batch; the queue launches each as a Ray
        # job; every run worker holds inside raw_images. All four at once: four partitions
        # mid-step at the same moment, two per node.
        held = wait_until(
            lambda: (found := sorted(hold.glob("held.*"))) and len(found) == 4 and found,
            300,
            "four run workers held mid-step (see daemon.log)",
            poll=0.1,
        )
        mark("four runs held mid-step")
        pids = [int(p.name.split(".")[1]) for p in held]
        nodes = {pid: cluster.node_of(pid) for pid in pids}
        assert sorted(nodes.values()) == [0, 0, 1, 1], nodes  # both nodes, all runs at once
        runs = {r.run_id: r for r in _batch_runs(instance)}
        assert len(runs) == 4 and {r.tags["dagster/partition"] for r in runs.values()} == set(KEYS)
        run_of_pid = {}
        for run_id in runs:
            (placed,) = _placement_events(instance, run_id)
            run_of_pid[placed["pid"]] = run_id
        assert sorted(run_of_pid) == sorted(pids)

        killed_runs = {run_of_pid[pid] for pid in pids if nodes[pid] == 1}
        killed = cluster.kill_node(1)
        assert killed and not [p for p in cluster.pids() if cluster.node_of(p) == 1]
        assert not [pid for pid in pids if nodes[pid] == 1 and _alive(pid)]
        (hold / "release").write_bytes(b"")
        mark("worker node killed, the other runs released")

        def settled() -> bool:
            latest = {}
            for run in sorted(_batch_runs(instance), key=lambda r: r.run_id):
                key = run.tags["dagster/partition"]
                latest.setdefault(key, []).append(run.status)
            return set(latest) == set(KEYS) and all(
                DagsterRunStatus.SUCCESS in s for s in latest.values()
            )

        wait_until(settled, 400, "every partition to have a successful run (see daemon.log)", 0.5)
        mark("every partition has a successful run")

        # The runs on the head finished; those on the lost node failed, and each one's
        # retry (a re-execution queued by run retries) succeeded on the head.
        all_runs = {r.run_id: r for r in _batch_runs(instance)}
        head_node = {all_runs[run_of_pid[p]].tags[RAY_NODE_TAG] for p in pids if nodes[p] == 0}
        lost_node = {all_runs[run_of_pid[p]].tags[RAY_NODE_TAG] for p in pids if nodes[p] == 1}
        assert len(head_node) == 1 and len(lost_node) == 1 and head_node != lost_node
        for run_id in runs:
            status = all_runs[run_id].status
            if run_id in killed_runs:
                assert status == DagsterRunStatus.FAILURE, (run_id, status)
                retries = [r for r in all_runs.values() if r.parent_run_id == run_id]
                assert [r.status for r in retries] == [DagsterRunStatus.SUCCESS], retries
                assert retries[0].tags[RAY_NODE_TAG] in head_node
            elif status != DagsterRunStatus.SUCCESS:
                pytest.fail(
                    f"run {run_id} on the head: {status}\n" + "\n".join(_errors(instance, run_id))
                )

        # Every step of a successful run ran in its Ray job's driver (one pid, one node, as
        # recorded), and Ray's own record of each job agrees on the node.
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(cluster.dashboard_url)
        for run in all_runs.values():
            if run.status != DagsterRunStatus.SUCCESS:
                continue
            (placed,) = _placement_events(instance, run.run_id)
            steps = _step_pids(instance, run.run_id)
            assert steps and set(steps.values()) == {placed["pid"]}, (steps, placed)
            assert placed["ray_node_id"] == run.tags[RAY_NODE_TAG]
            info = client.get_job_info(run.tags[RAY_SUBMISSION_TAG])
            assert info.driver_node_id == run.tags[RAY_NODE_TAG]
            assert (info.metadata or {}).get("dagster/run-id") == run.run_id
        # Nothing secret went through Ray's job records (runtime_env, entrypoint, metadata).
        jobs = repr(client.list_jobs())
        assert ACCESS_KEY not in jobs and SECRET_KEY not in jobs

        # The shards on S3 are the local run's bytes, file for file.
        reference = reference_run.result(timeout=600)
        assert _remote_tree(f"{s3_prefix}/shards") == {
            p: h for p, h in reference.items() if p.startswith("mds/")
        }
    finally:
        background.shutdown(wait=True)
        if daemon is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(timeout=30)
        if "prx_assets.core.ray_pool" in sys.modules:
            sys.modules["prx_assets.core.ray_pool"].disconnect()
        cluster.stop()
        assert cluster.pids() == [], "processes of the test's Ray cluster outlived it"
        shutil.rmtree(ray_root, ignore_errors=True)
