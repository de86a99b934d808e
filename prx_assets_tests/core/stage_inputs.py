"""Real inputs and read-backs for a stage's core runner: a demo batch through the real ingest
and resolution code into a real lab, a ``Lab`` that remembers what it was asked to read, and
MDS directories read back whole (skipped samples included) by the project's loader."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa

from prx_assets.core.ingest.runner import BatchIngest
from prx_assets.core.ingest.sources import resolve_batch
from prx_assets.core.lab import Lab
from prx_assets.core.resolution.profile import profile_images
from prx_assets.core.tables import IMAGES, REJECTS, RESOLUTION
from prx_assets_tests.streaming_memory import streaming_memory_released

__all__ = [
    "DEMO_BATCH",
    "RecordingLab",
    "ingest_demo_batch",
    "read_mds_dir",
    "streaming_memory_released",  # kept importable from here (tests and conftest use it)
]

DEMO_BATCH = "public-skimage.000"  # 22 files, some under the size cutoff


class RecordingLab(Lab):
    """A real lab that remembers every ``read``: (table, columns, filter, rows returned)."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, tuple[str, ...], str | None, pa.Table]] = []

    def read(self, table, columns=None, filter=None, version=None):  # noqa: A002
        out = super().read(table, columns, filter, version)
        self.reads.append((table, tuple(columns or ()), filter, out))
        return out


def ingest_demo_batch(lab: Lab, landing: Path, batch: str = DEMO_BATCH) -> list[str]:
    """The real ingest and resolution of a demo batch; returns its eligible keys, sorted."""
    run = BatchIngest(resolve_batch(landing, batch))
    lab.replace_partition(IMAGES, batch, run.image_batches())
    lab.replace_partition(REJECTS, batch, run.rejects)
    sizes = lab.read_batch(IMAGES.name, batch, ["key", "batch", "width", "height"])
    lab.replace_partition(RESOLUTION, batch, profile_images(sizes))
    profile = lab.read_batch(RESOLUTION.name, batch, ["key", "eligible"]).to_pylist()
    return sorted(r["key"] for r in profile if r["eligible"])


def read_mds_dir(directory: str | Path) -> list[dict[str, Any]]:
    """Every sample of one MDS directory in written order, skipped ones included.

    A published directory is not readable by plain streaming (core/shards/published.py), so
    it is read by the project's loader with its skip-lists ignored on purpose (the
    ``UnscreenedDataWarning`` that choice raises is expected here and silenced).
    """
    from prx_assets.loader.dataset import (
        IGNORE_SKIPLISTS_UNSAFE,
        SkipListDataset,
        UnscreenedDataWarning,
    )

    with streaming_memory_released(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UnscreenedDataWarning)
        ds = SkipListDataset(
            local=str(directory), skiplists=IGNORE_SKIPLISTS_UNSAFE, batch_size=1, shuffle=False
        )
        rows = [dict(ds[i]) for i in range(len(ds))]
        assert [r["key"] for r in ds] == [r["key"] for r in rows]  # iteration agrees
        del ds
    return rows
