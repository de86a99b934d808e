"""Making a file or directory durable before the rename that publishes it.

Every atomic publish in the project (an MDS directory, a skip-list generation, a snapshot
manifest, an export) is "write, fsync, rename, fsync the parent": a rename made durable
before the data it names could, after a power loss, point at empty or partial files. One
helper, so each writer fsyncs the same way.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync one file or directory (a directory: its entries, e.g. after a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(top: str | os.PathLike[str]) -> None:
    """fsync every file below ``top``, then every directory, deepest first."""
    for dirpath, _, files in os.walk(top, topdown=False):
        for name in files:
            fsync_path(Path(dirpath, name))
        fsync_path(dirpath)
