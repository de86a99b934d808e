"""Where the lab's bytes live: Lance datasets and pyarrow filesystems for a local path or
an ``s3://`` URI on the environment's endpoint (``core/storage.py``).

Why one place: every Lance call of the package must carry the same storage options (the
endpoint, ``allow_http``, region and credentials of an S3-compatible store; they hold
secrets, so they go to Lance only, never to a log or metadata), and every direct file
operation (blobs, version listings, orphan removal) the same filesystem.
"""

from __future__ import annotations

from pathlib import Path

import lance
import pyarrow.fs as pafs

from prx_assets.core.storage import S3Settings, lance_storage_options


def storage_options(uri: str) -> dict[str, str] | None:
    """Lance's ``storage_options`` for ``uri`` (None for a local path)."""
    return lance_storage_options(uri)


def open_dataset(uri: str, version: int | None = None) -> lance.LanceDataset:
    """``lance.dataset(uri, version)`` with the storage options ``uri`` needs."""
    return lance.dataset(uri, version=version, storage_options=storage_options(uri))


def arrow_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem and path for ``uri``: s3:// on the environment's endpoint
    (credentials from pyarrow's default chain, the same environment), else local."""
    if not uri.startswith("s3://"):
        return pafs.FileSystem.from_uri(uri if "://" in uri else str(Path(uri).resolve()))
    s = S3Settings.from_env()
    endpoint = (s.endpoint_url or "").split("://", 1)[-1] or None
    scheme = "http" if s.allow_http else "https"
    return pafs.S3FileSystem(endpoint_override=endpoint, scheme=scheme, region=s.region), uri[5:]
