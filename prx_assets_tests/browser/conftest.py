"""A lab built once from two demo batches by the real stages (offline caption backends)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from dagster import instance_for_test, materialize

from prx_assets.core.lab import Lab, TableSpec
from prx_assets.core.tables import BUCKET_ASSIGNMENTS, SKIP_AUDIT
from prx_assets.defs.captions.assets import build_caption_assets
from prx_assets.defs.captions.resources import (
    CaptionerResource,
    ClassifierResource,
    EmbedderResource,
)
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource
from prx_assets.demo.build import build_demo_landing

BATCH_A = "public-skimage.000"  # 22 files, some under the size cutoff
BATCH_B = "public-sklearn.001"  # 8 files


def _browser_columns(spec: TableSpec, columns: tuple[str, ...]) -> TableSpec:
    """``spec`` cut to the columns the browser reads, with the indexes the spec declares on
    them: what the real stage's write path builds (the rest of its rows needs its inputs)."""
    schema = pa.schema([spec.schema.field(c) for c in columns])
    indexes = tuple((c, kind) for c, kind in spec.indexes if c in columns)
    return TableSpec(spec.name, schema, spec.identity, indexes)


# The later stages' tables as far as the browser reads them (their contracts:
# core/shards/tables.py BUCKET_ASSIGNMENTS and core/skiplists/tables.py SKIP_AUDIT).
BUCKETS_SPEC = _browser_columns(BUCKET_ASSIGNMENTS, ("key", "batch", "tier", "shape"))
SKIP_SPEC = _browser_columns(SKIP_AUDIT, ("key", "batch", "excluded", "reasons"))


@pytest.fixture(scope="session")
def browser_data_root(tmp_path_factory) -> Path:
    """raw_images, resolution_profile, captions, caption_classes, caption_embeddings of two
    full-size demo batches (the small demo has no text-class captions), materialised with
    the default offline backends; treat as read-only."""
    root = tmp_path_factory.mktemp("browser") / "data"
    build_demo_landing(root / "landing", size="full")
    captioner = CaptionerResource()
    classifier = ClassifierResource(device="cpu")
    embedder = EmbedderResource(device="cpu")
    assets = [
        raw_images,
        resolution_profile,
        *build_caption_assets(captioner, classifier, embedder),
    ]
    resources = {
        "lab": LabResource(data_root=str(root)),
        "captioner": captioner,
        "classifier": classifier,
        "embedder": embedder,
    }
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, [BATCH_A, BATCH_B])
        for key in (BATCH_A, BATCH_B):
            result = materialize(assets, partition_key=key, instance=instance, resources=resources)
            assert result.success
    return root


@pytest.fixture(scope="session")
def browser_lab(browser_data_root: Path) -> Lab:
    return Lab(browser_data_root / "lab")


def copy_lab(src: Path, dst: Path) -> Lab:
    shutil.copytree(src, dst)
    return Lab(dst)
