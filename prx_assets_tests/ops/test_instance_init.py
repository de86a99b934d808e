"""A fresh DAGSTER_HOME is created once, under a lock, however many processes start at once.

The finding: two processes started together on a brand-new sqlite DAGSTER_HOME both
created the storage and stamped its alembic revision, leaving the instance permanently
broken ("more than one head"). Here several real CLI processes wait behind a barrier file
and start at the same moment, on a fresh home each trial; all must succeed, and the
instance must work afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dagster import DagsterInstance

from prx_assets.instance import INIT_MARKER, ensure_instance, install_config

ROOT = Path(__file__).resolve().parents[2]
TRIALS = 2
PROCESSES = 3

# Everything is imported before the barrier, so the processes reach the instance together.
CHILD = """
import os, sys, time
from prx_assets.cli import main
ready, barrier = sys.argv[1], sys.argv[2]
open(ready, "w").close()
while not os.path.exists(barrier):
    time.sleep(0.001)
sys.exit(main(sys.argv[3:]))
"""


def _landing(root: Path, chunks: int) -> list[Path]:
    out = []
    for i in range(chunks):
        chunk = root / "data" / "landing" / "src" / f"{i:03d}"
        chunk.mkdir(parents=True)
        (chunk / "_SUCCESS").write_text("")
        out.append(chunk)
    return out


def _concurrent_register(root: Path, home: Path) -> list[subprocess.CompletedProcess]:
    chunks = _landing(root, PROCESSES)
    barrier = root / "go"
    env = dict(os.environ, DAGSTER_HOME=str(home), PYTHONPATH=str(ROOT))
    ready = [root / f"ready{i}" for i in range(len(chunks))]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(flag), str(barrier), "register-batch", str(chunk)]
            + ["--data-root", str(root / "data")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag, chunk in zip(ready, chunks, strict=True)
    ]
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in ready) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a child exited before the barrier"
        time.sleep(0.05)
    barrier.write_text("")  # every child has imported: they reach the instance together
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_concurrent_first_starts_on_a_fresh_home_all_succeed(tmp_path, monkeypatch):
    for trial in range(TRIALS):
        root = tmp_path / f"trial{trial}"
        home = root / "home"
        home.mkdir(parents=True)
        (home / "dagster.yaml").write_bytes((ROOT / "dagster.yaml").read_bytes())
        results = _concurrent_register(root, home)
        for r in results:
            assert r.returncode == 0, (trial, r.stderr[-2000:])
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        instance = DagsterInstance.from_config(str(home))
        try:
            assert sorted(instance.get_dynamic_partitions("batches")) == [
                f"src.{i:03d}" for i in range(PROCESSES)
            ]
            assert instance.get_runs() == []
        finally:
            instance.dispose()


def test_the_config_is_installed_atomically_and_never_replaced(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    mine = tmp_path / "mine.yaml"
    mine.write_text("telemetry:\n  enabled: false\n")
    assert install_config(home, ROOT / "dagster.yaml")
    assert (home / "dagster.yaml").read_bytes() == (ROOT / "dagster.yaml").read_bytes()
    mode = (home / "dagster.yaml").stat().st_mode & 0o777
    assert mode == (ROOT / "dagster.yaml").stat().st_mode & 0o777
    (home / "dagster.yaml").unlink()
    (home / "dagster.yaml").write_text(mine.read_text())
    assert not install_config(home, ROOT / "dagster.yaml")  # a user's config stays
    assert (home / "dagster.yaml").read_text() == mine.read_text()
    assert sorted(p.name for p in home.iterdir()) == ["dagster.yaml"]  # no temporary left


def test_an_instance_is_migrated_once_per_dagster_version(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    ensure_instance(home, ROOT / "dagster.yaml").dispose()
    marker = json.loads((home / INIT_MARKER).read_text())
    assert (home / "dagster.yaml").exists() and marker["dagster"]
    first = (home / INIT_MARKER).stat().st_mtime_ns
    ensure_instance(home).dispose()  # initialised: the marker is not rewritten
    assert (home / INIT_MARKER).stat().st_mtime_ns == first
    # Another Dagster version initialised it: this one migrates and records itself.
    (home / INIT_MARKER).write_text(json.dumps({"dagster": "0.0.1"}))
    instance = ensure_instance(home)
    try:
        assert instance.get_runs() == []
    finally:
        instance.dispose()
    assert json.loads((home / INIT_MARKER).read_text())["dagster"] == marker["dagster"]


def test_a_home_other_than_dagster_home_is_refused(tmp_path, monkeypatch):
    import pytest

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "a"))
    with pytest.raises(ValueError, match="DAGSTER_HOME"):
        ensure_instance(tmp_path / "b")


def test_make_targets_initialise_the_instance_before_any_dagster_process(tmp_path):
    import pytest

    for target, starts in (
        ("demo", "prx-assets demo"),
        ("ui", "dg dev"),
        ("test", "-m pytest"),
    ):
        # -n prints the plan without running it (the venv path only has to be absent).
        plan = subprocess.run(
            ["make", "-n", target, f"VENV={tmp_path / 'absent-venv'}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if plan.returncode == 127:
            pytest.fail("make is not installed")
        lines = plan.stdout.splitlines()
        init = [i for i, line in enumerate(lines) if "-m prx_assets.instance" in line]
        start = [i for i, line in enumerate(lines) if starts in line]
        assert init and start and init[0] < start[0], (target, lines)
        assert "--config dagster.yaml" in lines[init[0]]
        assert not any("cp" in line.split() and "dagster.yaml" in line for line in lines)
