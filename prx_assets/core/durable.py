"""Making a file or directory durable before the rename that publishes it.

Every atomic publish in the project (an MDS directory, a skip-list generation, a snapshot
manifest, an export) is "write, fsync, rename, fsync the parent": a rename made durable
before the data it names could, after a power loss, point at empty or partial files. One
helper, so each writer fsyncs the same way.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

# ``json.dumps`` with these options, without building an encoder per call (the loader hashes
# a manifest per directory: 10,000 at a time).
_CANONICAL_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def canonical_json(obj: object) -> bytes:
    """The byte form every hash of a skip-list manifest, sidecar or pin is taken over."""
    return _CANONICAL_ENCODER.encode(obj).encode()


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


def atomic_write_bytes(
    path: str | os.PathLike[str], data: bytes, before_rename: Callable[[], None] | None = None
) -> None:
    """tmp + fsync + rename (+ fsync of the directory): readers see old or new, never half.

    ``before_rename`` runs once the temporary file is durable (a crashpoint hook).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_path(path.parent)
