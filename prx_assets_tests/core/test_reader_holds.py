"""Reader holds: a live view keeps the versions it reads through retention, whatever their
age; a dead reader (kill -9) pins nothing; without holds the age rule alone applies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pyarrow as pa

from prx_assets.core.lab import Lab, MaintenancePolicy, TableSpec
from prx_assets.core.lab.readers import READERS_DIR, held_versions, hold_version

SPEC = TableSpec(
    name="t",
    schema=pa.schema([("batch", pa.string()), ("key", pa.string()), ("v", pa.int64())]),
    identity=("batch", "key"),
    indexes=(("key", "BTREE"),),
)
# Keep one version, no age: only a reader's hold can keep an older one.
EAGER = MaintenancePolicy(keep_versions=1, reader_min_age=timedelta(0), cleanup_every=1)


def _rows(batch: str, n: int, base: int) -> pa.Table:
    return pa.table(
        {
            "batch": [batch] * n,
            "key": [f"{batch}-{i}" for i in range(n)],
            "v": list(range(base, base + n)),
        },
        schema=SPEC.schema,
    )


def test_a_hold_is_seen_until_released_and_a_killed_readers_hold_is_not(tmp_path: Path) -> None:
    root = str(tmp_path)
    hold = hold_version(root, "t", 7)
    assert hold is not None and held_versions(root, "t") == {7}
    hold.release()
    assert held_versions(root, "t") == set()
    # A reader process killed with SIGKILL: the kernel drops its lock, its file is swept.
    code = (
        "import sys, time\n"
        "from prx_assets.core.lab.readers import hold_version\n"
        f"h = hold_version({root!r}, 't', 9)\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert held_versions(root, "t") == {9}
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert held_versions(root, "t") == set()
    assert list((tmp_path / READERS_DIR / "t").iterdir()) == []
    assert (
        hold_version("s3://bucket/lab", "t", 1) is None and held_versions("s3://b/l", "t") == set()
    )


def test_a_live_view_keeps_its_version_through_cleanup_and_compaction(tmp_path: Path) -> None:
    lab = Lab(tmp_path / "lab", policy=EAGER)
    lab.replace_partition(SPEC, "a", _rows("a", 3, 0))
    view = lab.view()
    seen = view.read("t").sort_by("key")  # opens (and holds) the current version
    held = view.version("t")
    for i in range(6):  # new versions, rewrites of "a", and a full maintenance
        lab.replace_partition(SPEC, "a", _rows("a", 3, 10 * (i + 1)))
        lab.replace_partition(SPEC, f"b{i}", _rows(f"b{i}", 2, 0))
    lab.maintain(SPEC, retention=timedelta(0), keep_versions=1, version_min_age=timedelta(0))
    versions = {v["version"] for v in lab.dataset("t").versions()}
    assert held in versions  # kept: a live view reads it
    assert len(versions) <= 3  # everything else went (the latest, the held one)
    assert view.read("t").sort_by("key").equals(seen)  # its files are all still there
    view.close()
    lab.maintain(SPEC, retention=timedelta(0), keep_versions=1, version_min_age=timedelta(0))
    assert held not in {v["version"] for v in lab.dataset("t").versions()}


def test_the_write_path_keeps_a_held_version_and_drops_it_once_released(tmp_path: Path) -> None:
    lab = Lab(tmp_path / "lab", policy=EAGER)
    lab.replace_partition(SPEC, "a", _rows("a", 3, 0))
    with lab.view() as view:
        held = view.version("t")
        for i in range(8):
            lab.replace_partition(SPEC, f"b{i}", _rows(f"b{i}", 2, i))
        assert held in {v["version"] for v in lab.dataset("t").versions()}
    time.sleep(0.01)
    for i in range(8):
        lab.replace_partition(SPEC, f"c{i}", _rows(f"c{i}", 2, i))
    assert held not in {v["version"] for v in lab.dataset("t").versions()}
