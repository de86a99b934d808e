"""Pins on MDS directories: the files a live training snapshot needs are never removed.

A snapshot freezes, per bucket x batch directory, one ``index.json`` and one skip-list
generation. Two writers would otherwise delete those files: the skip-list writer sweeps the
sidecars a new generation supersedes, and a shard rewrite (a captioner swap re-renders the
captions into new shards) replaces the whole directory. So a snapshot writes one pin file
per directory it freezes, ``<dir>/snapshot_pins/<snapshot id>.json``, naming the sidecars
it needs, and:

- ``sweep`` (core/skiplists/sidecars.py) never deletes a sidecar a pin names;
- a shard rewrite never deletes a pinned directory: the superseded directory (pins and all)
  is *kept*, moved to ``<root>/retained/<relative dir>@<index sha16>`` (not refused: a
  rewrite is how new captions reach training, and refusing it would let an old snapshot
  block the platform). Discovery only lists ``<root>/mds``, so a retained copy is never
  read by accident; a pinned loader reads it only when told to (``reproduce-UNSAFE``).
- retiring the snapshot removes its pins, then the retained copies no pin needs any more.

Pinning and sweeping hold an exclusive ``flock`` on the directory, so a sweep can never
delete a sidecar between a snapshot reading the live generation and pinning it (local
filesystems: the skip-list writer only runs on local directories).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from prx_assets.core.durable import atomic_write_bytes, canonical_json

PINS_DIRNAME = "snapshot_pins"
RETAINED_DIRNAME = "retained"
SNAPSHOT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class PinError(RuntimeError):
    """A pin that cannot be read: every file of its directory is treated as pinned."""


def check_snapshot_id(snapshot_id: str) -> str:
    """Snapshot ids become file names: plain, short, no path characters."""
    if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_RE.match(snapshot_id):
        raise ValueError(
            f"snapshot name {str(snapshot_id)[:80]!r} must match {SNAPSHOT_ID_RE.pattern} "
            "(letters, digits, '.', '_', '-'; at most 64 characters)"
        )
    if snapshot_id in (".", "..") or snapshot_id.endswith((".json", ".tmp", ".retired")):
        raise ValueError(f"snapshot name {snapshot_id!r} is reserved")
    return snapshot_id


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike[str]) -> Iterator[None]:
    """Exclusive lock on one MDS directory (pins and sweeps of it serialise)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _pin_files(directory: Path) -> list[Path]:
    pins = directory / PINS_DIRNAME
    if not pins.is_dir():
        return []
    return sorted(p for p in pins.iterdir() if p.name.endswith(".json"))


def pin_holders(directory: str | os.PathLike[str]) -> list[str]:
    """Ids of the snapshots pinning this directory's files."""
    return [p.name[: -len(".json")] for p in _pin_files(Path(directory))]


def pinned_sidecars(directory: str | os.PathLike[str]) -> frozenset[str]:
    """Every sidecar file name a pin of ``directory`` names; ``PinError`` when a pin is
    unreadable (the caller must then delete nothing)."""
    names: set[str] = set()
    for path in _pin_files(Path(directory)):
        try:
            obj = json.loads(path.read_bytes())
            names.update(str(s) for s in obj["sidecars"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PinError(f"{path}: unreadable snapshot pin ({exc})") from None
    return frozenset(names)


def write_pin(
    directory: str | os.PathLike[str],
    snapshot_id: str,
    index_sha256: str,
    generation: str,
    sidecars: list[str],
    *,
    durable: bool = True,
) -> None:
    """Record (atomically) that ``snapshot_id`` needs these files of ``directory``; the caller
    holds ``directory_lock`` and has just verified the generation it names is live.

    ``durable=False`` skips the per-file fsyncs (tmp + rename still make it atomic): for a
    caller that pins thousands of directories and then makes them durable at once
    (``os.sync()``) before its commit point, as ``create_snapshot`` does."""
    check_snapshot_id(snapshot_id)
    pins = Path(directory) / PINS_DIRNAME
    pins.mkdir(exist_ok=True)
    payload = {
        "snapshot": snapshot_id,
        "index_sha256": index_sha256,
        "generation": generation,
        "sidecars": sorted(sidecars),
    }
    target = pins / f"{snapshot_id}.json"
    data = canonical_json(payload) + b"\n"
    if target.is_file() and target.read_bytes() == data:
        return
    if durable:
        atomic_write_bytes(target, data)
        return
    tmp = pins / f".{snapshot_id}.json.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, target)


def remove_pin(directory: str | os.PathLike[str], snapshot_id: str) -> bool:
    """Drop ``snapshot_id``'s pin of ``directory``; whether there was one."""
    check_snapshot_id(snapshot_id)
    path = Path(directory) / PINS_DIRNAME / f"{snapshot_id}.json"
    if not Path(directory).is_dir():
        return False
    with directory_lock(directory):
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only when empty
    return True


def retained_dir(root: str | os.PathLike[str], relative_dir: str, index_sha256: str) -> Path:
    """Where a superseded, pinned copy of ``relative_dir`` is kept."""
    return Path(root) / RETAINED_DIRNAME / f"{relative_dir}@{index_sha256[:16]}"


def discard_directory(
    old: Path,
    root: str | os.PathLike[str],
    relative_dir: str,
    remove: Callable[[Path], None] = shutil.rmtree,
) -> str:
    """Remove a superseded MDS directory (with ``remove``), or keep it when a snapshot pins it.

    Returns ``"removed"`` or the retained path. An unreadable pin keeps it (fail closed).
    """
    import hashlib

    if not _pin_files(old):
        remove(old)
        return "removed"
    try:
        index_sha = hashlib.sha256((old / "index.json").read_bytes()).hexdigest()
    except OSError:
        index_sha = "0" * 64  # no index: keep it anyway, under a name that says so
    target = retained_dir(root, relative_dir, index_sha)
    if target.exists():  # the same content is already kept: merge the pins, drop the copy
        for pin in _pin_files(old):
            (target / PINS_DIRNAME).mkdir(exist_ok=True)
            os.replace(pin, target / PINS_DIRNAME / pin.name)
        shutil.rmtree(old)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(old, target)
    return str(target)


def drop_unpinned_retained(root: str | os.PathLike[str]) -> list[str]:
    """Delete retained copies that no snapshot pins any more; the paths removed."""
    base = Path(root) / RETAINED_DIRNAME
    removed: list[str] = []
    if not base.is_dir():
        return removed
    for index in sorted(base.rglob("index.json")):
        d = index.parent
        if "@" in d.name and not _pin_files(d):
            shutil.rmtree(d)
            removed.append(str(d))
    return removed
