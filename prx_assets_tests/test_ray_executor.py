"""``PRX_EXECUTOR=ray`` on a real local Ray cluster: same bytes as the local path, a killed
worker costs a retry, and the default path never loads Ray.

One cluster for the module (``ray start --head`` on 127.0.0.1 with the dashboard on 127.0.0.1, plus
one ``ray start --address`` worker node, one CPU each, a 100 MiB object store, its own temp
dir), stopped at the end with every process it started checked gone. The batch is 24 real
photographs (the bundled ones, upscaled to a 1600 px long side) so that rendering keeps the
workers busy long enough to be killed in the middle of it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.core.lab import Lab
from prx_assets.core.ray_local import LocalRayCluster
from prx_assets.core.shards.runner import BatchShards, ShardOutcome
from prx_assets.core.shards.settings import PIECE_SAMPLES
from prx_assets.core.tables import BY_NAME, SHARD_SAMPLES
from prx_assets.core.workers import InlinePool, ItemFailed
from prx_assets.demo.photo_batch import write_photo_batch
from prx_assets_tests.ray_pipeline import late_square, materialize_batch, refuse_seven
from prx_assets_tests.trees import live_tree

REPO = Path(__file__).resolve().parents[1]
KEY = "photos.big"
PHOTOS = 24
TASK = "PrxWorker.run"  # RayPool's actor method, as Ray names it in titles and logs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # A short root: Ray's unix socket paths must stay under 108 bytes.
    root = Path(tmp_path_factory.mktemp("ray"))
    cluster = LocalRayCluster(root, env={"PYTHONPATH": str(REPO)})
    cluster.start()
    try:
        yield cluster
    finally:
        if "prx_assets.core.ray_pool" in sys.modules:  # this process's kept connection
            sys.modules["prx_assets.core.ray_pool"].disconnect()
        cluster.stop()
        assert cluster.pids() == [], "processes of the test's Ray cluster outlived it"


@pytest.fixture(scope="module")
def landing(tmp_path_factory) -> Path:
    landing = tmp_path_factory.mktemp("photos") / "landing"
    write_photo_batch(landing / "photos" / "big", PHOTOS)
    return landing


def _data_root(base: Path, landing: Path) -> Path:
    shutil.copytree(landing, base / "data" / "landing")
    return base / "data"


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, landing) -> tuple[Path, dict]:
    """The default path, in a fresh interpreter: the reference bytes, and what it imported."""
    root = _data_root(tmp_path_factory.mktemp("local"), landing)
    env = {k: v for k, v in os.environ.items() if k not in ("PRX_EXECUTOR", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-m", "prx_assets_tests.ray_pipeline", str(root), KEY],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return root, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory, landing, cluster) -> tuple[Path, dict[int, int]]:
    """The same batch with PRX_EXECUTOR=ray, in this process; and the calls each actor
    process ran for it."""
    root = _data_root(tmp_path_factory.mktemp("on-ray"), landing)
    before = calls_by_pid()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRX_EXECUTOR", "ray")
        mp.setenv("RAY_ADDRESS", cluster.address)
        assert materialize_batch(root, KEY)
    return root, _delta(before, calls_by_pid())


def calls_by_pid() -> dict[int, int]:
    """Items each live ``PrxWorker`` actor process has run (a restarted one counts anew)."""
    from prx_assets.core.ray_pool import actor_stats

    return {s["pid"]: s["calls"] for s in actor_stats()}


def _delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {pid: n - before.get(pid, 0) for pid, n in after.items() if n > before.get(pid, 0)}


def _rows(lab: Lab, name: str) -> list[dict]:
    """A table's rows in identity order, without wall-clock columns (when a row was made)."""
    table = lab.read(name)
    keep = [
        f.name
        for f in table.schema
        if not pa.types.is_timestamp(f.type)
        and not (pa.types.is_list(f.type) and pa.types.is_timestamp(f.type.value_type))
    ]
    identity = [c for c in BY_NAME[name].identity if c in keep]
    rows = table.select(keep).sort_by([(c, "ascending") for c in identity]).to_pylist()
    # A model's probabilities are not bit-reproducible across processes (torch's reductions
    # follow its thread count, which differs between a Ray worker and the local step under
    # load: seen 0.98314792 vs 0.98314798 in one full-suite run); everything else is exact.
    return [{k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def test_the_default_path_never_imports_ray(local_run):
    _, report = local_run
    assert report["success"]
    assert report["ray_modules"] == []


def test_a_batch_on_ray_gives_the_local_paths_bytes_and_rows(local_run, ray_run):
    (local, _), (on_ray, tasks) = local_run, ray_run
    samples = Lab(on_ray / "lab").count(SHARD_SAMPLES.name)
    assert samples == PHOTOS
    # Ingest validation (a task per image) and the shard pieces (a task per piece of a
    # bucket: core/shards/pieces.py) ran on the cluster's workers (each stage joins the
    # cluster with its own pool, so each brings its own worker processes; image_hashes
    # reuses ingest's stored thumbnails and has no per-image task here).
    shards = live_tree(local / "shards")
    assert sum(tasks.values()) >= samples + _pieces(shards) and len(tasks) >= 2, tasks
    assert shards and any(p.endswith(".mds") for p in shards)
    assert live_tree(on_ray / "shards") == shards
    local_lab, ray_lab = Lab(local / "lab"), Lab(on_ray / "lab")
    names = sorted(p.name.removesuffix(".lance") for p in (local / "lab").glob("*.lance"))
    assert SHARD_SAMPLES.name in names
    assert names == sorted(p.name.removesuffix(".lance") for p in (on_ray / "lab").glob("*.lance"))
    for name in names:
        assert _rows(ray_lab, name) == _rows(local_lab, name), name


def _pieces(shards: dict[str, str]) -> int:
    """Worker tasks mds_shards ran for a tree: one per bucket directory here (none holds
    more than the 24 photos, fewer than a piece's 64 samples)."""
    assert PHOTOS <= PIECE_SAMPLES
    return sum(p.endswith("/index.json") for p in shards)


def _rerun_shards(root: Path) -> BatchShards:
    from prx_assets.defs.resources import LabResource
    from prx_assets.defs.shards.assets import MDSShardsConfig
    from prx_assets.defs.skiplists.config import SkipPolicyResource

    resource = LabResource(data_root=str(root))
    settings = MDSShardsConfig().settings(resource.max_pixels)
    policy = SkipPolicyResource().policy()
    return BatchShards(resource.lab(), resource.shards_root, KEY, policy, settings)


def test_a_worker_killed_mid_step_is_retried_and_the_partition_completes(
    tmp_path, cluster, ray_run, monkeypatch
):
    on_ray, _ = ray_run
    reference_shards = live_tree(on_ray / "shards")
    reference_rows = _rows(Lab(on_ray / "lab"), SHARD_SAMPLES.name)
    root = tmp_path / "data"
    shutil.copytree(on_ray, root)
    shutil.rmtree(root / "shards")  # the rerun must write every directory again
    monkeypatch.setenv("PRX_EXECUTOR", "ray")
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    from prx_assets.core.ray_pool import actor_stats

    actors_before = {s["node"]: s["pid"] for s in actor_stats()}  # warm from ray_run

    result: dict[str, ShardOutcome | BaseException] = {}

    def step() -> None:
        try:
            result["outcome"] = _rerun_shards(root).run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result["error"] = exc

    runner = threading.Thread(target=step)
    runner.start()
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and runner.is_alive() and time.monotonic() < deadline:
        busy = cluster.busy_workers(TASK)
        if busy:
            killed = busy[0]
            os.kill(killed, signal.SIGKILL)
        else:
            time.sleep(0.005)
    runner.join(timeout=300)
    assert not runner.is_alive()
    assert killed is not None, "no Ray actor was seen running a render: nothing was killed"
    assert killed in actors_before.values()  # the warm actor ray_run left, reused
    assert "error" not in result, result.get("error")
    outcome = result["outcome"]
    assert isinstance(outcome, ShardOutcome)
    assert outcome.written == outcome.assigned == PHOTOS and not outcome.failures
    # Ray restarted the killed actor on its node (a new process) and ran its calls again.
    assert killed not in cluster.pids()
    after = {s["node"]: s["pid"] for s in actor_stats()}
    assert set(after) == set(actors_before)
    assert [n for n in after if after[n] != actors_before[n]] == [
        n for n in actors_before if actors_before[n] == killed
    ]
    assert live_tree(root / "shards") == reference_shards
    assert _rows(Lab(root / "lab"), SHARD_SAMPLES.name) == reference_rows


def _counted(n: int, pulled: list[int]):
    for i in range(n):
        pulled.append(i)
        yield i


def test_ray_pool_yields_input_order_with_a_bounded_window_and_the_works_own_errors(
    cluster, monkeypatch
):
    from prx_assets.core.ray_pool import RayPool

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    pool = RayPool()
    try:
        assert pool.workers == 2  # the two nodes' CPUs
        pulled: list[int] = []
        out = []
        for value in pool.map_ordered(late_square, _counted(20, pulled), window=3):
            out.append(value)
            assert len(pulled) - len(out) <= 3  # never more than the window in flight
        assert out == [i * i for i in range(20)]
        # An exception of the work itself is not retried; it comes back in that item's
        # place as ItemFailed, exactly as inline, and the other items are unaffected.
        got = list(pool.map_ordered(refuse_seven, range(10)))
        assert got[7] == ItemFailed("ValueError: seven is refused")
        assert got[:7] + got[8:] == [refuse_seven(i) for i in range(10) if i != 7]
        assert got == list(InlinePool().map_ordered(refuse_seven, range(10)))
    finally:
        pool.close()


def test_a_driver_running_other_code_than_the_cluster_is_refused(tmp_path, cluster):
    """The nodes run this checkout; a driver from a copy with one line changed would get
    shards rendered by code it does not have: RayPool refuses before its first item runs."""
    other = tmp_path / "other"
    shutil.copytree(REPO / "prx_assets", other / "prx_assets", ignore=_no_data)
    changed = other / "prx_assets" / "core" / "shards" / "resize.py"
    changed.write_text(changed.read_text() + "\n# another version\n")
    # The driver imports the copy through PYTHONPATH alone. Its working directory holds no
    # code: Ray puts a driver's working directory on its workers' sys.path.
    (tmp_path / "cwd").mkdir()
    env = {**os.environ, "PYTHONPATH": str(other), "RAY_ADDRESS": cluster.address}
    code = (
        "from prx_assets.core.ray_pool import RayUnavailable\n"
        "from prx_assets.core.workers import make_pool\n"
        "import prx_assets\n"
        "print('DRIVER', prx_assets.__file__)\n"
        "try:\n    list(make_pool('ray').map_ordered(abs, [-1]))\n"
        "except RayUnavailable as exc:\n    print('REFUSED', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path / "cwd",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"DRIVER {other / 'prx_assets'}" in out.stdout, out.stdout
    assert "REFUSED" in out.stdout and "runs other prx_assets code" in out.stdout, out.stdout


def _no_data(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("photos", "__pycache__")]


def test_steps_share_one_ray_job_probe_each_node_once_and_show_in_the_state_api(
    cluster, ray_run, monkeypatch
):
    """Per-step fixed cost: a step's pool reuses the process's connection (one Ray job, its
    workers warm) and probes no node already verified; the documented cluster keeps Ray's
    state API (``ray list tasks``) answering, on 127.0.0.1."""
    import ray
    from ray.util.state import list_tasks

    from prx_assets.core import ray_pool
    from prx_assets.core.workers import make_pool

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    probes = cluster.tasks_run("probe_node")
    jobs = set()
    for _ in range(3):
        pool = make_pool("ray")
        assert list(pool.map_ordered(late_square, range(4))) == [0, 1, 4, 9]
        jobs.add(ray.get_runtime_context().get_job_id())
        pool.close()
    assert len(jobs) == 1, jobs
    assert _delta(probes, cluster.tasks_run("probe_node")) == {}  # ray_run verified them
    # A fresh driver (another step's process) trusts what the cluster recorded per node.
    ray_pool._verified.clear()
    assert ray_pool.check_code() == 0
    assert _delta(probes, cluster.tasks_run("probe_node")) == {}

    assert cluster.dashboard_url and cluster.dashboard_url.startswith("http://127.0.0.1:")
    seen: list = []
    deadline = time.monotonic() + 120  # task events reach the state API in batches
    while not seen and time.monotonic() < deadline:
        seen = list_tasks(
            address=cluster.dashboard_url, filters=[("name", "=", TASK)], limit=10_000
        )
        if not seen:
            time.sleep(0.5)
    assert seen, f"Ray's state API lists no {TASK} call"
    assert {t.name for t in seen} == {TASK}


_FRESH_DRIVER = """
import json
from prx_assets.core.ray_pool import actor_stats
from prx_assets.core.workers import make_pool
from prx_assets_tests.ray_pipeline import late_square
assert list(make_pool("ray").map_ordered(late_square, range(4))) == [0, 1, 4, 9]
print(json.dumps(sorted(s["pid"] for s in actor_stats())))
"""


def test_a_fresh_step_process_finds_the_actors_warm_and_idle_ones_give_back_their_cpus(
    tmp_path, cluster, monkeypatch
):
    """Dagster's multiprocess executor runs each step in a new process, so a new Ray job: its
    items go to the actors an earlier step started (same processes), not to fresh workers.
    Actors with no call for PRX_RAY_ACTOR_IDLE_S seconds end themselves."""
    import ray

    from prx_assets.core.ray_pool import actor_stats, release_actors
    from prx_assets.core.workers import make_pool

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("PRX_RAY_ACTOR_IDLE_S", "2")
    release_actors()  # so that the ones made below are made with a 2 s idle limit
    assert list(make_pool("ray").map_ordered(late_square, range(4))) == [0, 1, 4, 9]
    warm = sorted(s["pid"] for s in actor_stats())
    assert len(warm) == 2  # one per CPU: a head and a worker node, one CPU each
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _FRESH_DRIVER], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == warm  # no new actor process

    deadline = time.monotonic() + 60
    while actor_stats() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert actor_stats() == []
    assert not set(warm) & set(cluster.pids())  # their processes are gone
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == 2  # every CPU back to the cluster


def test_with_a_shared_mount_ray_workers_write_the_ingest_rows(
    tmp_path, landing, cluster, local_run, monkeypatch
):
    """``PRX_SHARED_FILESYSTEM=1`` (the nodes share this disk, as on a shared mount): the
    ``raw_images`` tasks are chunks of file references, the Ray workers read the files,
    store the blobs and write the rows, and this process only commits; the rows are the
    local path's."""
    import pickle

    from prx_assets.core.ingest.runner import BatchIngest, ChunkTask
    from prx_assets.core.ingest.sources import resolve_batch
    from prx_assets.core.lab.fragments import PartitionFragments
    from prx_assets.core.ray_pool import RayPool
    from prx_assets.core.tables import IMAGES

    root = _data_root(tmp_path, landing)
    sizes: list[int] = []
    files: list[int] = []
    original = RayPool.map_ordered

    def spying(self, fn, items, **kw):  # noqa: ANN001, ANN202 - the pool's own signature
        def watched():
            for item in items:
                assert isinstance(item, ChunkTask), type(item)
                sizes.append(len(pickle.dumps(item)))
                files.append(len(item.items))
                yield item

        return original(self, fn, watched(), **kw)

    here: list[str] = []
    write, store_here = PartitionFragments.write, BatchIngest._store_here
    monkeypatch.setattr(RayPool, "map_ordered", spying)
    monkeypatch.setattr(
        PartitionFragments, "write", lambda self, data: here.append("rows") or write(self, data)
    )
    monkeypatch.setattr(
        BatchIngest, "_store_here", lambda self, c, k: here.append("blob") or store_here(self, c, k)
    )
    monkeypatch.setenv("PRX_EXECUTOR", "ray")
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("PRX_SHARED_FILESYSTEM", "1")
    lab = Lab(root / "lab")
    run = BatchIngest(
        resolve_batch(root / "landing", KEY), blob_sink=lab.local_blobs(IMAGES, "image")
    )
    fragments = lab.partition_fragments(IMAGES, KEY, stored_blobs=run.stored_blobs)
    lab.commit_partition(IMAGES, KEY, run.write_images(fragments))

    assert sum(files) == PHOTOS and max(sizes) < 16_384, (files, sizes)  # references only
    assert here == []  # every blob stored and every row written by the Ray workers
    local, _ = local_run
    assert _rows(lab, IMAGES.name) == _rows(Lab(local / "lab"), IMAGES.name)


def test_a_pool_ends_the_actors_of_other_code_which_hold_cpus_its_own_need(cluster, monkeypatch):
    import ray

    from prx_assets.core import ray_pool

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    ray_pool.release_actors()  # the CPUs free for the other code's actor below
    name = f"{ray_pool.ACTOR_PREFIX}-{'0' * 16}-elsewhere-0"  # another fingerprint
    stale = (
        ray.remote(ray_pool.PrxWorker)
        .options(name=name, namespace=ray_pool.NAMESPACE, lifetime="detached", num_cpus=1)
        .remote(600.0)
    )
    assert ray.get(stale.stats.remote(), timeout=120)["calls"] == 0  # placed: holds a CPU
    pool = ray_pool.RayPool()
    assert list(pool.map_ordered(late_square, range(4))) == [0, 1, 4, 9]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=ray_pool.NAMESPACE)
        except ValueError:
            break  # ended
        time.sleep(0.2)
    else:
        raise AssertionError("the other code's actor is still alive")
    assert len(ray_pool.actor_stats()) == 2  # this code's, one per CPU
