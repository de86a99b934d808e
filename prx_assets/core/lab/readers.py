"""Reader holds: a local lab's views say which table versions they read, so version
retention never deletes the files of a version a live reader still reads.

Why: retention protected readers by age alone (every version younger than
``version_min_age``, 15 minutes, was kept). That fails for a run that holds a view longer
than the age (a large partition's ``mds_shards`` reads its images for longer), and it kept
every version of a fast build (165 MB of manifests at 10,000 partitions). A view now takes
a shared ``flock`` on a file named after the version it opened,
``<lab>/.readers/<table>/<version>.<pid>.<nonce>``, for as long as it lives; the kernel
drops the lock when its process dies, so a crashed reader pins nothing. Version cleanup
keeps every version some live process holds (``held_versions``), and the age rule shrinks
to ``MaintenancePolicy.reader_min_age``, which covers one-shot reads (open, then read at
once). Object stores have no such locks: there the age rule stays.

A hold is taken under a dot-name and renamed into place already locked, so a cleaner never
sees a reader's file unlocked; a file it can lock exclusively has no reader, and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from pathlib import Path

READERS_DIR = ".readers"
_LEFTOVER_AGE_S = 60.0  # a dot-file older than this is a hold that never got renamed


def _table_dir(root: str, table: str) -> Path:
    return Path(root) / READERS_DIR / table


class ReaderHold:
    """One live reader of one table version; ``release`` (or process exit) ends it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def hold_version(root: str, table: str, version: int) -> ReaderHold | None:
    """Hold ``version`` of ``table`` for this process; None on object storage."""
    if "://" in root:
        return None
    directory = _table_dir(root, table)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{int(version)}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
    taking = directory / f".{name}"
    fd = os.open(taking, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(taking, directory / name)  # visible only once locked
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            taking.unlink()
        raise
    return ReaderHold(directory / name, fd)


def _unlocked(path: str) -> bool | None:
    """Whether nobody holds ``path`` (then it is left locked by nobody); None if gone."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def held_versions(root: str, table: str) -> set[int]:
    """The versions of ``table`` some live process holds; the files of dead readers are
    removed on the way. Empty on object storage."""
    if "://" in root:
        return set()
    directory = _table_dir(root, table)
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return set()
    held: set[int] = set()
    now = time.time()
    for entry in entries:
        if entry.name.startswith("."):  # a hold being taken: not yet a reader
            with contextlib.suppress(FileNotFoundError):
                old = now - entry.stat().st_mtime > _LEFTOVER_AGE_S
                if old and _unlocked(entry.path):
                    os.unlink(entry.path)
            continue
        version = entry.name.split(".", 1)[0]
        if not version.isdigit():
            continue
        free = _unlocked(entry.path)
        if free is False:
            held.add(int(version))
        elif free:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)  # its reader is gone
    return held
