"""Housekeeping for a streaming leak: the file locks of datasets that are gone.

``StreamingDataset`` creates two file locks per dataset in the temporary directory
(``NNNNNN_barrier_filelock``, ``NNNNNN_cache_filelock``) and never removes them; every
later dataset on the machine stats each earlier prefix's locks to find a free prefix, so a
node that has run many jobs builds its datasets ever more slowly (13,000 stale prefixes
made this project's test suite about twice as slow). A prefix's shared-memory segments
are created before its locks and live as long as its dataset, so a lock whose prefix has
no segment in ``/dev/shm`` belongs to a dataset that no longer exists, and is removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile

_LOCK = re.compile(r"(\d{6})_(?:barrier|cache)_filelock")
SHM_DIR = "/dev/shm"


def remove_dead_streaming_locks(tmp_dir: str | None = None, shm_dir: str = SHM_DIR) -> int:
    """Delete streaming's file locks whose prefix has no shared memory; how many went.

    Does nothing where shared memory is not a directory (not Linux)."""
    if not os.path.isdir(shm_dir):
        return 0
    tmp = tmp_dir or tempfile.gettempdir()
    # Locks first, then segments: a dataset created in between has its segment by the time
    # its locks exist, so it is seen live.
    try:
        locks = [(m.group(1), name) for name in os.listdir(tmp) if (m := _LOCK.fullmatch(name))]
    except OSError:
        return 0
    if not locks:
        return 0
    live = {name[:6] for name in os.listdir(shm_dir) if name[:6].isdigit()}
    removed = 0
    for prefix, name in locks:
        if prefix not in live:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(os.path.join(tmp, name))
                removed += 1
    return removed
