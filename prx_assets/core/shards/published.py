"""The index of a published MDS directory: readable by ``prx_assets.loader`` only.

Why: a bucket x batch directory holds every sample ``mds_shards`` wrote, opted-out ones
included; what leaves training is recorded beside the shards, in skip-lists
(``core/skiplists/sidecars.py``). A reader that does not apply them (a plain
``streaming.StreamingDataset(local=<dir>)``, a colleague's script) would train on excluded
samples, silently. So a published directory must not be readable by such a reader.

How: streaming reads ``<dir>/index.json`` and refuses any top-level ``"version"`` but 2
(``ValueError: Unsupported streaming data version: <version>. Expected version 2.``).
``mds_shards`` writes the index as MDSWriter does, then replaces that version with
``PUBLISHED_INDEX_VERSION``, a string naming ``prx_assets.loader`` and ``prx-assets
export``: a plain reader, local or through a remote and cache, stops at construction with
that text in its error. Nothing else in the file changes (each shard entry keeps its own
``"version": 2``), so the manifest's ``index_sha256``, ``partition_digest`` and the snapshot
pins bind to these exact bytes, and the name ``index.json`` keeps every ordering rule
(written last locally, uploaded before the manifest on object storage).

The loader (``loader/dataset.py``) accepts only this version when it applies skip-lists:
a plain version 2 index (a directory written before this marker, or an export) is refused
with ``UnpublishedIndex`` (fail closed: rerun ``mds_shards`` for the batch, whose code
version changed with this format). For tools that cannot use the loader, ``prx-assets
export`` writes a plain MDS tree holding only the samples the skip-lists keep
(``loader/export.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from prx_assets.core.skiplists.sidecars import INDEX_BASENAME, SkipListError

STREAMING_INDEX_VERSION = 2  # what MDSWriter writes and plain streaming reads
PUBLISHED_INDEX_VERSION = (
    "prx_assets/1 (not readable by plain streaming): this MDS directory holds samples its "
    "skip-lists exclude; read it with prx_assets.loader (SkipListDataset, discover_streams, "
    "ShapeBatchedLoader), which applies them, or write the training samples out with "
    "`prx-assets export` for tools that cannot use the loader"
)


class UnpublishedIndex(SkipListError):
    """An ``index.json`` without ``PUBLISHED_INDEX_VERSION``: not a directory ``mds_shards``
    published under this format, so the loader will not treat it as one."""


def mark_published(directory: str | os.PathLike[str]) -> bytes:
    """Rewrite ``<directory>/index.json`` (as MDSWriter left it) with the published version.

    For a directory being written, before it is fsynced and renamed into place (and before
    its skip-lists, which bind to the sha256 of the bytes returned). Deterministic: the same
    index gives the same bytes (key-sorted JSON, as MDSWriter writes it). The rewrite goes
    through a temporary name and a rename, so the file is never partial.
    """
    path = Path(directory) / INDEX_BASENAME
    obj = json.loads(path.read_bytes())
    if not isinstance(obj, dict) or obj.get("version") != STREAMING_INDEX_VERSION:
        raise ValueError(
            f"{path}: not a freshly written MDS index (version {obj.get('version')!r})"
        )
    obj["version"] = PUBLISHED_INDEX_VERSION
    raw = json.dumps(obj, sort_keys=True).encode()
    tmp = path.with_name(f".{INDEX_BASENAME}.publish.tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return raw


def published_index(raw: bytes, source: str, *, allow_plain: bool = False) -> dict[str, Any]:
    """The parsed index, its top-level version checked; ``UnpublishedIndex`` unless it is
    ``PUBLISHED_INDEX_VERSION`` (``allow_plain``: a plain version 2 index is accepted too,
    for reads that ignore skip-lists on purpose)."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SkipListError(f"{source} is empty or not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("shards"), list):
        raise SkipListError(f"{source} is not a streaming index (no shard list)")
    version = obj.get("version")
    if version == PUBLISHED_INDEX_VERSION:
        return obj
    if version == STREAMING_INDEX_VERSION:
        if allow_plain:
            return obj
        raise UnpublishedIndex(
            f"{source} is a plain MDS index (version 2), not one mds_shards published for "
            "this loader: either the directory was written before published indexes "
            "(rerun mds_shards for its batch) or it is a `prx-assets export` (read that "
            "with plain streaming; it holds only kept samples). Refused, so that the "
            "loader only reads trees a plain reader cannot read around the skip-lists"
        )
    raise UnpublishedIndex(f"{source}: unknown index version {str(version)[:80]!r}")
