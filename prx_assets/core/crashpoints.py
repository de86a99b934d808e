"""Named points in the writers' filesystem steps where a test can kill the process.

Why: crash safety is only proven by crashing. Each writer calls ``crashpoint("<name>")``
right after a step that changes what is on disk (a file written, a rename done, a commit
made). With ``PRX_CRASH_AT=<name>:<n>`` in the environment, the ``n``-th time the process
reaches ``<name>`` it sends itself SIGKILL: no ``finally``, no atexit, no flush, exactly
what ``kill -9`` or a lost machine leaves behind. Without the variable a crashpoint is one
dictionary lookup. The kill tests (``prx_assets_tests/test_kill.py``) use every point.

Points (the writer, then the step just completed):

- ``mds.sample_written``: one sample handed to MDSWriter in the temporary directory (shards
  flushed so far sit there, half a directory);
- ``mds.tmp_written``: the temporary directory holds every shard and ``index.json``, no
  skip-lists yet;
- ``mds.tmp_screened``: the temporary directory also holds its first skip-list generation;
- ``mds.old_moved_away``: the previous directory was renamed away, the new one not yet in;
- ``mds.dir_in_place``: the new directory is in place, the previous one not yet deleted;
- ``mds.stale_dir_moved_away``: a directory the partition no longer has was renamed away;
- ``mds.old_condemned``: a renamed-away version lost its ``index.json`` (its deletion began;
  it can no longer be restored), the rest of it not yet deleted;
- ``skiplists.sidecar_written``: one sidecar of a new generation is written (not published);
- ``skiplists.generation_written``: every sidecar of a generation is written;
- ``skiplists.manifest_staged``: the new manifest is written under a temporary name;
- ``skiplists.manifest_published``: the manifest rename is done (the generation is live);
- ``skiplists.stale_removed``: one file no manifest names was swept;
- ``lab.fragment_batch``: one record batch streamed into new Lance fragment files;
- ``lab.fragments_written``: a partition's new fragments are complete, not committed;
- ``ingest.chunk_written``: an ingest worker wrote its chunk's rows as a fragment (not
  committed; only workers reach it, the step never);
- ``lab.committed``: the partition's replacement is committed, indexes not yet refreshed;
- ``snapshots.pinned``: one directory of a training snapshot pinned (nothing committed);
- ``snapshots.file_written``: a snapshot's manifest file is staged, its lab row not yet;
- ``snapshots.recorded``: its lab row is committed, its manifest not yet published.
- ``storage.object_uploaded``: one object of a shard directory or generation is uploaded;
- ``storage.shards_uploaded``: a remote version prefix is complete, its pointer not yet put;
- ``storage.pointer_published``: a directory's pointer names its new version;
- ``storage.stale_pointer_removed``: a directory the partition lost has no pointer any more;
- ``storage.stale_removed``: one superseded remote object was deleted;
- ``storage.generation_staged``: a directory's new sidecars are all on the remote;
- ``storage.manifest_put``: a directory's new ``skiplists.json`` is on the remote (live).

Holding instead of dying: with ``PRX_HOLD_AT=<name>:<n>:<dir>`` the ``n``-th visit of
``<name>`` writes ``<dir>/held.<pid>`` and waits there until ``<dir>/release`` exists (at most
``HOLD_LIMIT_S``), then goes on; with ``release`` already present it does not stop. A test
uses it to do something to the process *from outside* at a known point of its work, e.g.
kill the Ray node a run is on while that run is in the middle of a step
(``prx_assets_tests/s3/test_ray_runs_cluster.py``); a rerun after ``release`` passes through.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV_VAR = "PRX_CRASH_AT"
HOLD_ENV = "PRX_HOLD_AT"
RELEASE_FILE = "release"
HOLD_LIMIT_S = 600.0
CRASHPOINTS: tuple[str, ...] = (
    "mds.sample_written",
    "mds.tmp_written",
    "mds.tmp_screened",
    "mds.old_moved_away",
    "mds.dir_in_place",
    "mds.stale_dir_moved_away",
    "mds.old_condemned",
    "skiplists.sidecar_written",
    "skiplists.generation_written",
    "skiplists.manifest_staged",
    "skiplists.manifest_published",
    "skiplists.stale_removed",
    "lab.fragment_batch",
    "lab.fragments_written",
    "lab.committed",
    "ingest.chunk_written",
    "snapshots.pinned",
    "snapshots.file_written",
    "snapshots.recorded",
    "storage.object_uploaded",
    "storage.shards_uploaded",
    "storage.pointer_published",
    "storage.stale_pointer_removed",
    "storage.stale_removed",
    "storage.generation_staged",
    "storage.manifest_put",
)
_reached: dict[str, int] = {}


def parse_spec(spec: str) -> tuple[str, int]:
    """``"<name>:<n>"`` -> (name, n); unknown names and n < 1 are errors (a typo in a test
    must not silently crash nowhere)."""
    name, sep, count = spec.rpartition(":")
    if not sep or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected '<crashpoint>:<n>' with n >= 1")
    if name not in CRASHPOINTS:
        raise ValueError(f"{ENV_VAR}={spec!r}: unknown crashpoint {name!r}; known: {CRASHPOINTS}")
    return name, int(count)


def crashpoint(name: str) -> None:
    """Die by SIGKILL here if ``PRX_CRASH_AT`` names this point and this is its n-th visit
    (or wait here, if ``PRX_HOLD_AT`` does)."""
    hold = os.environ.get(HOLD_ENV)
    if hold:
        _hold(name, hold)
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    if name not in CRASHPOINTS:
        raise ValueError(f"crashpoint {name!r} is not registered in CRASHPOINTS")
    target, nth = parse_spec(spec)
    if target != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == nth:
        os.kill(os.getpid(), signal.SIGKILL)


_held: dict[str, int] = {}


def _hold(name: str, spec: str) -> None:
    target, sep, rest = spec.partition(":")
    count, sep2, folder = rest.partition(":")
    if not (sep and sep2 and folder and count.isdigit() and int(count) >= 1):
        raise ValueError(f"{HOLD_ENV}={spec!r}: expected '<crashpoint>:<n>:<directory>'")
    if target not in CRASHPOINTS:
        raise ValueError(f"{HOLD_ENV}={spec!r}: unknown crashpoint {target!r}")
    if target != name:
        return
    _held[name] = _held.get(name, 0) + 1
    release = Path(folder) / RELEASE_FILE
    if _held[name] != int(count) or release.exists():
        return
    marker = Path(folder) / f"held.{os.getpid()}"
    staged = marker.with_name(f".{marker.name}.tmp")
    staged.write_text(name)
    staged.rename(marker)  # seen whole or not at all
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def reset() -> None:
    """Forget the visits counted so far (a forked child starts from its parent's counts)."""
    _reached.clear()
    _held.clear()
