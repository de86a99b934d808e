"""``PRX_HOLD_AT``: a process waits at a named point until released, so a test can act on
it from outside (kill its Ray node) at a known moment of its work."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from prx_assets.core import crashpoints

REPO = Path(__file__).resolve().parents[2]
CHILD = (
    "from prx_assets.core.crashpoints import crashpoint\n"
    "for _ in range(3):\n    crashpoint('lab.fragment_batch')\n"
    "print('done', flush=True)\n"
)


def test_the_nth_visit_holds_until_release_and_a_released_point_passes(tmp_path):
    env = {"PRX_HOLD_AT": f"lab.fragment_batch:2:{tmp_path}", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True
    )
    marker = tmp_path / f"held.{child.pid}"
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.read_text() == "lab.fragment_batch"
    time.sleep(0.3)
    assert child.poll() is None  # still waiting at the second visit
    (tmp_path / "release").write_bytes(b"")
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip() == "done"
    # Released already: a rerun does not stop at all.
    again = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and again.stdout.strip() == "done"
    assert sorted(p.name for p in tmp_path.glob("held.*")) == [marker.name]


@pytest.mark.parametrize(
    "spec", ["lab.fragment_batch:1", "lab.fragment_batch:0:/tmp", "no.such.point:1:/tmp"]
)
def test_a_malformed_hold_spec_is_an_error(spec, monkeypatch):
    monkeypatch.setenv("PRX_HOLD_AT", spec)
    crashpoints.reset()
    with pytest.raises(ValueError, match="PRX_HOLD_AT"):
        crashpoints.crashpoint("lab.fragment_batch")
