"""What caps a cluster when partitions spread over it: the processes every partition shares.

Under ``PRX_EXECUTOR=ray_runs`` (docs/deploy.md, "Partitions across the cluster") each
partition's run is a Ray job on a node of its own choosing: its images, its bytes and its
step driver stay on that node, so no per-partition process caps the cluster. What does cap
it is whatever *every* partition goes through: the Dagster daemon (the landing sensor
that queues the run, the run queue, dagster-ray's launcher submitting the Ray job, run
monitoring polling it), the PostgreSQL server (the run's events, the run and asset
records), the Ray head (GCS and the dashboard's job server) and each Lance table's commits.
This benchmark runs the deployment as docs/deploy.md sets it up and measures each of those
per partition run, with Dagster's own PostgreSQL storage (``storage: postgres``, the
baseline) and with the project's (``prx_assets/pg_storage.py``, what
``dagster_ray_cluster.yaml`` configures), alternating, each phase on a database, data root
and daemon of its own:

- a real PostgreSQL 15 server (instance storage), a real local Ray cluster (a head and a
  worker node on 127.0.0.1, 2 CPUs each; the launcher's ``num_cpus`` 1, so four runs at
  once), ``dagster-daemon run`` on the project's ``dagster_ray_cluster.yaml`` (its values,
  only the addresses, ``num_cpus``, the storage class and a 1 s dequeue interval set), the
  code location in a code server of its own (``dagster code-server start``, as a deployment
  runs it), a local lab and shard tree;
- first an idle window (nothing landed) to learn each shared process's idle CPU per second;
- then ``--partitions`` landing batches of ``--photos`` real photos each, dropped at once;
  the landing sensor queues one ``batch_pipeline`` run per batch and the queue launches
  them as Ray jobs; the window ends when every run has ended (all must succeed);
- CPU per run of each shared process group = (its CPU over the window - its idle rate x
  the window) / runs, from ``/proc`` (user + system, children reaped included);
- commits per run on each Lance table (its version count before and after).

The ceiling: a shared process on one core sustains ``1 / cpu_per_run`` runs a second; a
run of a partition of S images carries S x the per-image CPU work (``raw_images`` +
``image_hashes`` + ``mds_shards``, from ``bench_scaleout``'s results file: a floor, the
other stages' work is left out), so that process keeps ``runs/s x S x work / 16`` nodes of
16 cores busy. Each Lance table's commit rate (``bench_partition_commits``' results file,
four writers on this host: a floor) caps the same way through the table's commits per run.
The judged headline is the smallest of these over the single processes (the daemon, the
code server, the GCS, the job server, a table's commits), at S = 10^4 and 10^5 (a production
batch here is 10^5 images, docs/scale.md); PostgreSQL runs a backend per connection over
its own machine's cores, so its line is stated per core of that server. On this 2-core host the cluster, the daemon and PostgreSQL
share two cores: contention inflates CPU per run (cache misses, switches) rather than
deflating it, and a database server has more than one core, so the ceilings are floors.

    python -m benchmarks.bench_cluster_ceiling [--quick] [--partitions 8] [--photos 4]
        [--repeat 2] [--pg-statements FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from prx_assets_tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BIN = Path(sys.executable).parent
TARGET_NODES = 100
# Process groups that are many processes (a server per connection): they scale with the
# cores of their own machine, so their ceiling is stated per core, apart from the judged
# line over the single processes every partition goes through.
POSTGRES = "PostgreSQL (server and every backend)"
SERVER_GROUPS = (POSTGRES,)
SETTLE_S = 30.0  # after the daemon's first heartbeat: start-up work out of the idle window
CORES_PER_NODE = 16
PARTITION_SIZES = (10_000, 100_000)
WORK_FROM = "benchmarks/results/bench_scaleout.json"
COMMITS_FROM = "benchmarks/results/bench_partition_commits_quick.json"
PER_IMAGE_STAGES = ("raw_images", "image_hashes", "mds_shards")
_TICKS = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------ CPU from /proc


def _processes() -> dict[int, tuple[int, str, float]]:
    """Every live process: pid -> (parent pid, command line, CPU seconds of it and of its
    children it has reaped). A zombie's own time is in its entry until its parent reaps it
    (then in the parent's children time): counted once either way."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        cpu = sum(int(f) for f in fields[11:15]) / _TICKS  # utime stime cutime cstime
        out[int(entry.name)] = (int(fields[1]), cmdline, cpu)
    return out


def _tree(table: dict[int, tuple[int, str, float]], roots: set[int]) -> set[int]:
    """``roots`` and every live descendant of them."""
    found = {pid for pid in roots if pid in table}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _, _) in table.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return found


def _postgres(table: dict[int, tuple[int, str, float]], port: int) -> set[int]:
    """The PostgreSQL server listening on ``port``: its postmaster and every backend."""
    postmaster = {
        pid
        for pid, (_, cmd, _) in table.items()
        if cmd.split(" ", 1)[0].endswith("/postgres") and f"-p {port}" in cmd
    }
    return _tree(table, postmaster)


class SharedProcesses:
    """The process groups every partition run goes through, found by their roots."""

    def __init__(self, daemon_pid: int, code_server_pid: int, pg_port: int, cluster) -> None:  # noqa: ANN001
        self.daemon_pid, self.code_server_pid = daemon_pid, code_server_pid
        self.pg_port, self.cluster = pg_port, cluster

    def groups(self, table: dict[int, tuple[int, str, float]]) -> dict[str, set[int]]:
        head = [p for p in self.cluster.pids() if self.cluster.node_of(p) == 0]
        gcs = {p for p in head if "gcs_server" in table.get(p, (0, "", 0))[1]}
        dashboard = {
            p
            for p in head
            if "dashboard/dashboard.py" in table.get(p, (0, "", 0))[1]
            and "agent" not in table[p][1]
        }
        return {
            "dagster-daemon (sensors, run queue, launcher, monitoring)": _tree(
                table, {self.daemon_pid}
            ),
            "code server (sensor evaluations, snapshots)": _tree(table, {self.code_server_pid}),
            POSTGRES: _postgres(table, self.pg_port),
            "Ray head: GCS": gcs,
            "Ray head: dashboard and job server": _tree(table, dashboard),
        }

    def cpu(self) -> dict[str, float]:
        table = _processes()
        return {
            name: sum(table[pid][2] for pid in pids) for name, pids in self.groups(table).items()
        }


# ------------------------------------------------------------------------------ the lab


def _table_versions(lab: Path) -> dict[str, int]:
    """Each Lance table's latest version (its commits so far)."""
    import lance

    out = {}
    for path in sorted(lab.glob("*.lance")):
        with contextlib.suppress(Exception):  # a table being created: not there yet
            out[path.name] = lance.dataset(str(path)).version
    return out


# ------------------------------------------------------------------------- the deployment


def _dagster_home(root: Path, jobs_address: str, storage: dict) -> Path:
    """``dagster_ray_cluster.yaml`` as the deployment copies it, addresses and ``num_cpus``
    set (two runs per 2-CPU node), the run queue's dequeue interval at 1 s, ``storage``
    as given."""
    home = root / "home"
    home.mkdir()
    config = yaml.safe_load((REPO / "dagster_ray_cluster.yaml").read_text())
    config["storage"] = storage
    config["run_launcher"]["config"]["ray"]["address"] = jobs_address
    config["run_launcher"]["config"]["ray"]["num_cpus"] = 1
    config["run_queue"]["dequeue_interval_seconds"] = 1
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    return home


def _workspace(root: Path, port: int) -> None:
    """workspace.yaml's code location, served by a code server of its own on ``port`` (as
    a deployment runs it: the daemon then only connects, see ``_code_server``)."""
    config = yaml.safe_load((REPO / "workspace.yaml").read_text())
    (location,) = config["load_from"]
    name = location["python_module"]["location_name"]
    served = {"grpc_server": {"host": "127.0.0.1", "port": port, "location_name": name}}
    (root / "workspace.yaml").write_text(yaml.safe_dump({"load_from": [served]}))


def _code_server(root: Path, env: dict, port: int) -> subprocess.Popen:
    """``dagster code-server start`` for workspace.yaml's module. A daemon given a
    ``python_module`` workspace starts its own code server and, every 60 s, replaces it with
    a new one (Dagster's RELOAD_WORKSPACE_INTERVAL: the code location loaded again, ~2 s of
    CPU a minute, whatever the runs); a code server of its own is what a deployment runs."""
    config = yaml.safe_load((REPO / "workspace.yaml").read_text())
    (location,) = config["load_from"]
    module = location["python_module"]
    cmd = [str(BIN / "dagster"), "code-server", "start", "-m", module["module_name"]]
    cmd += ["-a", module["attribute"], "-h", "127.0.0.1", "-p", str(port)]
    return subprocess.Popen(
        cmd,
        cwd=root,
        env=env,
        stdout=open(root / "code_server.log", "wb"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _land(landing: Path, staging: Path, partitions: int, photos: int) -> list[str]:
    """``partitions`` batches of ``photos`` distinct real photos, each written aside and
    renamed into the landing zone whole; returns their partition keys."""
    from prx_assets.demo.photo_batch import write_photo_batch

    scratch = staging / "all"
    names = write_photo_batch(scratch, partitions * photos, long_side=640)
    keys = []
    for i in range(partitions):
        batch = staging / f"c{i}"
        batch.mkdir()
        for name in names[i * photos : (i + 1) * photos]:
            for f in (name, name.replace(".jpg", ".txt")):
                shutil.copy(scratch / f, batch / f)
        (batch / "_SUCCESS").write_bytes(b"")
        keys.append(f"bench.c{i}")
    (landing / "bench").mkdir(parents=True, exist_ok=True)
    for i in range(partitions):
        os.rename(staging / f"c{i}", landing / "bench" / f"c{i}")
    return keys


def _sql(pg: dict, statement: str) -> list[tuple]:
    import psycopg2

    conn = psycopg2.connect(host=pg["host"], port=pg["port"], user=pg["user"], dbname="postgres")
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute(statement)
        return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def _log_statements(pg: dict) -> None:
    """The server logs every statement with its duration (``--pg-statements``)."""
    _sql(pg, "ALTER SYSTEM SET log_min_duration_statement = 0")
    _sql(pg, "ALTER SYSTEM SET log_connections = on")
    _sql(pg, "SELECT pg_reload_conf()")


def _copy_server_log(pg: dict, dest: str) -> None:
    """The server's log (beside its data directory, as ``postgres_running`` starts it)."""
    (data_dir,) = _sql(pg, "SHOW data_directory")[0]
    shutil.copy(Path(data_dir).parent / "log", dest)


def _connection_cost(pg: dict, n: int = 300) -> float:
    """The server's CPU seconds per connection: connect, ``SELECT 1``, close, ``n`` times
    (what Dagster's storage pays per call: it opens a connection for each)."""
    import psycopg2

    def server_cpu() -> float:
        table = _processes()
        return sum(table[pid][2] for pid in _postgres(table, pg["port"]))

    before = server_cpu()
    for _ in range(n):
        conn = psycopg2.connect(
            host=pg["host"], port=pg["port"], user=pg["user"], dbname="postgres"
        )
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
            cur.fetchall()
        conn.close()
    time.sleep(0.5)  # the last backends exit and are reaped
    return (server_cpu() - before) / n


def _per_image_work() -> float:
    """CPU seconds per image of the per-image stages, from bench_scaleout's results."""
    work = json.loads((REPO / WORK_FROM).read_text())["work_cpu_per_image_s"]
    return sum(work[stage] for stage in PER_IMAGE_STAGES)


def _commit_rate() -> float:
    """Commits per second one Lance table takes from four writers at once (local disk)."""
    data = json.loads((REPO / COMMITS_FROM).read_text())
    return data["labs"]["local"]["concurrent"]["commits_per_s"]


def _storage_block(kind: str) -> dict:
    """dagster_ray_cluster.yaml's storage block, or Dagster's ``storage: postgres`` with the
    same database settings (the baseline)."""
    config = yaml.safe_load((REPO / "dagster_ray_cluster.yaml").read_text())["storage"]
    if kind == "project":
        return config
    return {"postgres": config["custom"]["config"]}


def _profile(pid: int, out: str) -> subprocess.Popen:
    """``py-spy`` sampling the daemon and its code server (``--profile-daemon``; py-spy is
    not a dependency: put it on PATH)."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile-daemon needs py-spy on PATH (pip install py-spy)")
    cmd = [spy, "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "-o", out]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _phase(
    kind: str,
    base: dict,
    cluster,
    pg: dict,
    work: Path,
    partitions: int,
    photos: int,
    idle_s: float,
    timeout_s: float,
    profile_daemon: str = "",
) -> dict:  # noqa: ANN001
    """One deployment (its own database, data root and daemon) on the shared cluster and
    server: an idle window, then ``partitions`` landed batches until their runs end."""
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    from prx_assets.core.ray_local import free_port
    from prx_assets.defs.executors import RAY_NODE_TAG
    from prx_assets.instance import ensure_instance

    root = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=work))
    data_root = root / "data"
    data_root.mkdir()
    database = f"dagster_{kind}_{root.name.rsplit('-', 1)[1].lower()}"
    _sql(pg, f"CREATE DATABASE {database}")
    settings = {**base, "PRX_DATA_ROOT": str(data_root), "PRX_PG_DB": database}
    home = _dagster_home(root, cluster.dashboard_url, _storage_block(kind))
    env = {
        **os.environ,
        **settings,  # the launcher copies these into each run's Ray job (env_vars)
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(REPO),
        "PRX_RAY_JOBS_ADDRESS": cluster.dashboard_url,
    }
    os.environ.update({k: v for k, v in settings.items() if k.startswith("PRX_PG_")})
    os.environ["DAGSTER_HOME"] = str(home)
    ensure_instance(home).dispose()
    port = free_port()
    _workspace(root, port)
    code_server = _code_server(root, env, port)
    daemon = subprocess.Popen(
        [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
        cwd=root,
        env=env,
        stdout=open(root / "daemon.log", "wb"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        instance = DagsterInstance.from_config(str(home))
        shared = SharedProcesses(daemon.pid, code_server.pid, pg["port"], cluster)
        # The daemon is up once its sensor daemon has sent a heartbeat.
        wait_until(
            lambda: "SENSOR" in instance.get_daemon_heartbeats(),
            300,
            f"the daemon's sensor heartbeat (see {root}/daemon.log)",
            0.5,
        )
        print(f"{kind}: daemon ticking; settling, then an idle window", flush=True)
        time.sleep(SETTLE_S)  # the first ticks and snapshot fetches are start-up, not idle
        before = shared.cpu()
        t_idle = time.monotonic()
        time.sleep(idle_s)
        idle_wall = time.monotonic() - t_idle
        idle = {k: (v - before[k]) / idle_wall for k, v in shared.cpu().items()}

        lab = data_root / "lab"
        versions_before = _table_versions(lab)
        spy = _profile(daemon.pid, f"{profile_daemon}.{kind}") if profile_daemon else None
        start_cpu = shared.cpu()
        t_start = time.monotonic()
        keys = _land(data_root / "landing", root / "staging", partitions, photos)
        print(f"{kind}: {partitions} batches landed", flush=True)

        def runs():  # noqa: ANN202 - this poll's own queries are PostgreSQL load too: few
            return instance.get_runs(filters=RunsFilter(job_name="batch_pipeline"))

        def ended() -> bool:
            rs = runs()
            return len(rs) >= partitions and all(r.is_finished for r in rs)

        wait_until(ended, timeout_s, f"{partitions} runs to end ({root}/daemon.log)", 2.0)
        window = time.monotonic() - t_start
        end_cpu = shared.cpu()
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        all_runs = instance.get_runs()
        batch_runs = runs()
        failed = [r.run_id for r in batch_runs if r.status != DagsterRunStatus.SUCCESS]
        if failed:
            raise RuntimeError(f"{kind}: runs failed: {failed} (see {root}/daemon.log)")
        partitions_run = sorted({r.tags.get("dagster/partition") for r in batch_runs})
        assert partitions_run == sorted(keys), (partitions_run, keys)
        versions_after = _table_versions(lab)
        nodes = sorted({r.tags.get(RAY_NODE_TAG, "?") for r in batch_runs})
        instance.dispose()
    finally:
        for process in (daemon, code_server):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    return {
        "storage": kind,
        "partitions": partitions,
        "photos_per_partition": photos,
        "runs": len(all_runs),
        "batch_pipeline_runs": len(batch_runs),
        "ray_nodes_used": len(nodes),
        "window_s": window,
        "idle_window_s": idle_wall,
        "idle_cpu_per_s": idle,
        "window_cpu_s": {k: end_cpu[k] - start_cpu[k] for k in end_cpu},
        # below 0 (idle CPU over the window above the group's whole CPU): within the noise
        "cpu_per_run_s": {
            k: max(0.0, end_cpu[k] - start_cpu[k] - idle[k] * window) / len(all_runs)
            for k in end_cpu
        },
        "cpu_per_run_unclipped_s": {
            k: (end_cpu[k] - start_cpu[k] - idle[k] * window) / len(all_runs) for k in end_cpu
        },
        "commits_per_run": {
            table: (v - versions_before.get(table, 0)) / len(batch_runs)
            for table, v in versions_after.items()
        },
    }


def measure(
    kinds: list[str],
    partitions: int,
    photos: int,
    idle_s: float,
    timeout_s: float,
    statements_log: str = "",
    profile_daemon: str = "",
) -> list[dict]:
    """Each phase in ``kinds`` (``dagster``, ``project``) on one PostgreSQL server and one
    Ray cluster, in that order."""
    from prx_assets.core.ray_local import LocalRayCluster
    from prx_assets_tests.pg_server import postgres_running

    work = Path(tempfile.mkdtemp(prefix="prx-bench-ceiling-"))
    ray_root = Path(tempfile.mkdtemp(prefix="prx-ray-"))  # Ray's socket paths: < 108 bytes
    out = []
    cluster = None
    with postgres_running() as pg:
        connection_cost = _connection_cost(pg)
        if statements_log:  # every statement with its duration, for finding what costs
            _log_statements(pg)
        base = {
            "PRX_EXECUTOR": "ray_runs",
            "PRX_WORKERS": "1",
            "PRX_PG_HOST": pg["host"],
            "PRX_PG_PORT": str(pg["port"]),
            "PRX_PG_USER": pg["user"],
            "PRX_PG_PASSWORD": "",
            "DAGSTER_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        for var in ("PRX_LANDING_URI", "PRX_LAB_URI", "PRX_SHARDS_URI", "RAY_ADDRESS"):
            os.environ.pop(var, None)
        node_env = {
            **base,
            "PYTHONPATH": str(REPO),
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        }
        try:
            cluster = LocalRayCluster(ray_root, cpus_per_node=2, env=node_env)
            t0 = time.perf_counter()
            cluster.start()
            print(f"cluster up in {time.perf_counter() - t0:.1f} s", flush=True)
            for kind in kinds:
                out.append(
                    {"connection_cost_s": connection_cost}
                    | _phase(
                        kind,
                        base,
                        cluster,
                        pg,
                        work,
                        partitions,
                        photos,
                        idle_s,
                        timeout_s,
                        profile_daemon,
                    )
                )
        finally:
            if statements_log:
                _copy_server_log(pg, statements_log)
            if cluster is not None:
                cluster.stop()
            shutil.rmtree(ray_root, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    return out


def ceilings(measured: dict, work_s: float, commit_rate: float) -> dict:
    """Nodes of 16 cores each shared process (on one core) and each table keeps busy."""
    out: dict[str, dict[str, float]] = {}
    for size in PARTITION_SIZES:
        per_run_work = size * work_s  # CPU seconds of per-image work one run carries
        caps = {}
        for name, cpu in measured["cpu_per_run_s"].items():
            if cpu > 0:
                caps[name] = per_run_work / cpu / CORES_PER_NODE
        for table, commits in measured["commits_per_run"].items():
            if commits > 0:
                caps[f"Lance commits: {table}"] = (
                    commit_rate / commits * per_run_work / CORES_PER_NODE
                )
        out[str(size)] = caps
    return out


def _median_phase(phases: list[dict]) -> dict:
    """The phases of one storage: CPU per run per process group as their median."""
    merged = dict(phases[0])
    for field in ("cpu_per_run_s", "idle_cpu_per_s"):
        merged[field] = {
            k: statistics.median(p[field][k] for p in phases) for k in phases[0][field]
        }
    merged["commits_per_run"] = {
        k: statistics.median(p["commits_per_run"].get(k, 0) for p in phases)
        for k in phases[0]["commits_per_run"]
    }
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 partitions of 2 photos, once")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--photos", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="phases of each storage")
    parser.add_argument("--idle-s", type=float, default=65.0)
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    parser.add_argument(
        "--pg-statements", default="", help="copy PostgreSQL's log of every statement here"
    )
    parser.add_argument(
        "--profile-daemon", default="", help="py-spy the daemon in each window: FILE.<storage>"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.partitions, args.photos, args.idle_s, args.repeat = 4, 2, 20.0, 1
    t0 = time.perf_counter()
    kinds = ["dagster", "project"] * args.repeat  # alternating, the baseline first
    phases = measure(
        kinds,
        args.partitions,
        args.photos,
        args.idle_s,
        args.timeout_s,
        args.pg_statements,
        args.profile_daemon,
    )
    by_kind = {k: _median_phase([p for p in phases if p["storage"] == k]) for k in set(kinds)}
    work_s, commit_rate = _per_image_work(), _commit_rate()
    caps = {k: ceilings(m, work_s, commit_rate) for k, m in by_kind.items()}
    command = "python -m benchmarks.bench_cluster_ceiling" + (
        " --quick"
        if args.quick
        else f" --partitions {args.partitions} --photos {args.photos} --repeat {args.repeat}"
    )
    project, baseline = by_kind["project"], by_kind["dagster"]
    headlines = [
        f"{len(phases)} phases of {args.partitions} partition runs each (storage: "
        f"{', '.join(kinds)}), every run succeeded, on "
        f"{max(p['ray_nodes_used'] for p in phases)} Ray nodes"
    ]
    for name, cpu in project["cpu_per_run_s"].items():
        base = baseline["cpu_per_run_s"][name]
        ratio = f"{cpu / base:.2f}x" if base > 0 else "-"
        headlines.append(
            f"CPU per partition run, {name}: {cpu * 1000:.0f} ms with the project's storage, "
            f"{base * 1000:.0f} ms with Dagster's ({ratio}; idle "
            f"{project['idle_cpu_per_s'][name] * 1000:.0f} / "
            f"{baseline['idle_cpu_per_s'][name] * 1000:.0f} ms/s subtracted)"
        )
    headlines.append(
        f"PostgreSQL server CPU per connection (connect, SELECT 1, close): "
        f"{phases[0]['connection_cost_s'] * 1000:.2f} ms (Dagster's storage opens one per call)"
    )
    busiest = max(project["commits_per_run"].items(), key=lambda kv: kv[1], default=("-", 0))
    headlines.append(
        f"Lance commits per partition run: at most {busiest[1]:.1f} on one table "
        f"({busiest[0]}); a table takes {commit_rate:.1f} commits/s ({COMMITS_FROM})"
    )

    def single(by: dict[str, float]) -> tuple[str, float]:
        return min(((k, v) for k, v in by.items() if k not in SERVER_GROUPS), key=lambda kv: kv[1])

    ok = True
    for size in map(str, PARTITION_SIZES):
        name, nodes = single(caps["project"][size])
        _, before = single(caps["dagster"][size])
        met = nodes >= TARGET_NODES
        ok = ok and (met or size != str(PARTITION_SIZES[0]))
        headlines.append(
            f"nodes of {CORES_PER_NODE} cores before a single shared process caps (ray_runs, "
            f"{int(size):,}-image partitions, {work_s * 1000:.1f} ms per-image work): "
            f"{nodes:,.0f} (Dagster's storage: {before:,.0f}), capped by {name} "
            f"(target >= {TARGET_NODES}) {'met' if met else 'MISSED'}"
        )
    for size in map(str, PARTITION_SIZES):
        pg_nodes = caps["project"][size].get(POSTGRES, float("inf"))
        pg_before = caps["dagster"][size].get(POSTGRES, float("inf"))
        headlines.append(
            f"nodes of {CORES_PER_NODE} cores per core of the PostgreSQL server "
            f"({int(size):,}-image partitions): {pg_nodes:,.0f} (Dagster's storage: "
            f"{pg_before:,.0f}; the server's backends spread over its cores)"
        )
    summary = {
        "benchmark": "bench_cluster_ceiling",
        "command": command,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_at_end": os.getloadavg()[0],
        "elapsed_s": time.perf_counter() - t0,
        "per_image_work_s": work_s,
        "work_from": f"{WORK_FROM} (work_cpu_per_image_s: {' + '.join(PER_IMAGE_STAGES)})",
        "commit_rate_per_table": commit_rate,
        "commit_rate_from": f"{COMMITS_FROM} (labs.local.concurrent: 4 writers, a floor)",
        "phases": phases,
        "by_storage": by_kind,
        "nodes_before_a_shared_process_caps": caps,
        "headlines": headlines,
    }
    name = "bench_cluster_ceiling" + ("_quick" if args.quick else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(headlines))
    print(f"elapsed {summary['elapsed_s']:.0f} s; results: benchmarks/results/{name}.json")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
