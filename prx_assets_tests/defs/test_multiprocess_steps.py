"""The multiprocess executor's steps: forks of a server that loaded the code location once.

A real run of ``batch_pipeline`` through ``execute_job`` on the code location module (what
the run launcher does), in a fresh interpreter so the code location reads this test's data
root.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prx_assets.defs.executors import STEP_PRELOAD, multiprocess_config, one_step_in_run
from prx_assets.demo.photo_batch import write_photo_batch

REPO = Path(__file__).resolve().parents[2]
RUN = """
import os, sys

def job():
    from prx_assets.definitions import defs
    return defs.resolve_job_def("batch_pipeline")

def report(name, result):
    starts = [e for e in result.all_events if e.event_type_value == "STEP_START"]
    done = [e for e in result.all_events if e.event_type_value == "STEP_SUCCESS"]
    print(name, int(result.success), len(starts), len(done), len({e.pid for e in starts}),
          int(os.getpid() in {e.pid for e in starts}))

if __name__ == "__main__":
    from dagster import AssetKey, execute_job, instance_for_test, reconstructable
    from prx_assets.defs.partitions import BATCHES
    tags = {"dagster/partition": "photos.two"}
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, ["photos.two"])
        report("PIPELINE", execute_job(reconstructable(job), instance, tags=tags))
        # One step (an opt-out's skip_lists rerun is one): in the run's own process.
        one = execute_job(
            reconstructable(job), instance, tags=tags, asset_selection=[AssetKey("skip_lists")]
        )
        report("ONE_STEP", one)
"""


def test_step_start_is_a_forkserver_preloading_the_code_location(monkeypatch):
    monkeypatch.delenv("PRX_STEP_START", raising=False)
    assert multiprocess_config() == {
        "max_concurrent": 2,
        "start_method": {"forkserver": {"preload_modules": list(STEP_PRELOAD)}},
    }
    assert STEP_PRELOAD[-1] == "prx_assets.definitions"  # workspace.yaml's module
    monkeypatch.setenv("PRX_STEP_START", "spawn")
    assert multiprocess_config() == {"max_concurrent": 2}
    monkeypatch.setenv("PRX_STEP_START", "fork")
    with pytest.raises(ValueError, match="PRX_STEP_START"):
        multiprocess_config()
    assert one_step_in_run()
    monkeypatch.setenv("PRX_ONE_STEP_IN_RUN", "0")
    assert not one_step_in_run()
    monkeypatch.setenv("PRX_ONE_STEP_IN_RUN", "yes")
    with pytest.raises(ValueError, match="PRX_ONE_STEP_IN_RUN"):
        one_step_in_run()


def test_real_runs_put_each_step_in_a_process_of_its_own_unless_there_is_one(tmp_path):
    """The forkserver path (the default); Dagster's spawn is its own, measured beside it in
    ``benchmarks/bench_code_location.py`` (same shard bytes)."""
    root = tmp_path / "data"
    write_photo_batch(root / "landing" / "photos" / "two", 2, 640)
    (tmp_path / "run.py").write_text(RUN)
    drop = ("PRX_EXECUTOR", "PRX_STEP_START", "PRX_ONE_STEP_IN_RUN")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PRX_DATA_ROOT=str(root), PRX_STEP_START="forkserver", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, str(tmp_path / "run.py")],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    lines = {x.split()[0]: list(map(int, x.split()[1:])) for x in out.stdout.splitlines() if x}
    assert out.returncode == 0 and "ONE_STEP" in lines, (out.stdout + out.stderr)[-4000:]
    success, started, succeeded, pids, in_run_process = lines["PIPELINE"]
    assert success == 1 and started == succeeded >= 8  # every stage of batch_pipeline
    assert pids == started and not in_run_process  # a process per step
    # A one-step run loads nothing more: its step runs in the run's own process.
    assert lines["ONE_STEP"] == [1, 1, 1, 1, 1]
    assert "lance is not fork-safe" not in out.stderr
    assert list((root / "shards").rglob("*.mds"))  # the run wrote shards
