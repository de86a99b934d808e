"""``raw_images`` on a real Ray cluster with the landing zone and the lab on S3 (moto on
127.0.0.1): the tasks carry references, never image bytes; each worker downloads its image,
validates it and stores its blob itself; the rows are the local path's.

One small cluster (a head and one worker node, one CPU each, no dashboard) started after the
S3 server, so its workers inherit the endpoint and credentials from the environment, as a
deployment's do.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from dagster import instance_for_test, materialize

from prx_assets.core.ingest.remote_landing import upload_landing
from prx_assets.core.ingest.runner import BatchIngest, ChunkTask
from prx_assets.core.lab import Lab
from prx_assets.core.lab.fragments import PartitionFragments
from prx_assets.core.ray_local import LocalRayCluster
from prx_assets.core.tables import BY_NAME, IMAGES, REJECTS
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.demo.photo_batch import write_photo_batch
from prx_assets_tests.s3.conftest import ACCESS_KEY, SECRET_KEY

REPO = Path(__file__).resolve().parents[2]
KEY = "photos.c0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server):
    root = Path(tmp_path_factory.mktemp("ray"))  # short: Ray's socket paths stay < 108 bytes
    cluster = LocalRayCluster(root, env={"PYTHONPATH": str(REPO), **s3_server.env}, dashboard=False)
    cluster.start()
    try:
        yield cluster
    finally:
        if "prx_assets.core.ray_pool" in sys.modules:  # this process's kept connection
            sys.modules["prx_assets.core.ray_pool"].disconnect()
        cluster.stop()
        assert cluster.pids() == [], "processes of the test's Ray cluster outlived it"


def _landing(folder: Path) -> Path:
    """Four photos with sidecars, a byte-identical copy, a corrupt JPEG, then _SUCCESS."""
    batch = folder / "photos" / "c0"
    names = write_photo_batch(batch, 4, long_side=320)
    (batch / "copy.jpg").write_bytes((batch / names[0]).read_bytes())
    (batch / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all" * 300)
    return folder


def _ingest(data_root: Path, **where: str) -> None:
    lab = LabResource(data_root=str(data_root), **where)
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, [KEY])
        result = materialize(
            [raw_images], partition_key=KEY, resources={"lab": lab}, instance=instance
        )
        assert result.success


def _rows(lab: Lab, name: str) -> list[dict]:
    """A table's rows (blobs resolved to bytes) in identity order, without timestamps."""
    table = lab.read(name)
    keep = [f.name for f in table.schema if not pa.types.is_timestamp(f.type)]
    identity = [c for c in BY_NAME[name].identity if c in keep]
    return table.select(keep).sort_by([(c, "ascending") for c in identity]).to_pylist()


def test_ray_tasks_carry_references_and_workers_store_the_blobs(
    tmp_path, s3_prefix, s3_server, cluster, monkeypatch
):
    local = _landing(tmp_path / "landing")
    _ingest(tmp_path / "ref", landing_dir=str(local))  # the local path: the reference rows
    landing, lab_uri = f"{s3_prefix}/landing", f"{s3_prefix}/lab"
    upload_landing(local, landing)

    from prx_assets.core.ray_pool import RayPool, actor_stats

    sizes: list[int] = []
    files: list[int] = []
    leaked: list[bytes] = []
    original = RayPool.map_ordered

    def spying(self, fn, items, **kw):  # noqa: ANN001, ANN202 - the pool's own signature
        def watched():
            for item in items:
                blob = pickle.dumps(item)
                sizes.append(len(blob))
                files.append(len(item.items) if isinstance(item, ChunkTask) else 0)
                leaked.extend(s for s in (ACCESS_KEY.encode(), SECRET_KEY.encode()) if s in blob)
                yield item

        return original(self, fn, watched(), **kw)

    monkeypatch.setattr(RayPool, "map_ordered", spying)
    stored_here: list[str] = []
    store_here = BatchIngest._store_here

    def storing_here(self, c, key):  # noqa: ANN001, ANN202
        stored_here.append(key)
        return store_here(self, c, key)

    monkeypatch.setattr(BatchIngest, "_store_here", storing_here)
    written_here: list[int] = []
    write = PartitionFragments.write

    def writing_here(self, data):  # noqa: ANN001, ANN202
        written_here.append(1)
        return write(self, data)

    monkeypatch.setattr(PartitionFragments, "write", writing_here)
    monkeypatch.setenv("PRX_EXECUTOR", "ray")
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    before = sum(s["calls"] for s in actor_stats())
    _ingest(tmp_path / "ray", landing_dir=landing, lab_uri=lab_uri)
    ran = sum(s["calls"] for s in actor_stats()) - before

    # Every file went through a Ray actor (a chunk of files per call: their references).
    assert sum(files) == 6 and ran >= 1, (files, sizes, ran)
    assert max(sizes) < 4096, sizes  # references and the table's schema, not image bytes
    assert leaked == []  # no credentials in any task's arguments

    ref, on_s3 = Lab(tmp_path / "ref" / "lab"), Lab(lab_uri)
    assert _rows(on_s3, IMAGES.name) == _rows(ref, IMAGES.name)  # blobs resolved: same bytes
    assert _rows(on_s3, REJECTS.name) == _rows(ref, REJECTS.name)
    reasons = sorted(r["reason"] for r in _rows(on_s3, REJECTS.name))
    assert len(_rows(on_s3, IMAGES.name)) == 4 and len(reasons) == 2, reasons
    # The blobs were stored and the rows written by the Ray workers: this process put no
    # blob and wrote no fragment (it committed the workers' fragments).
    assert stored_here == []
    assert written_here == []
    blobs = s3_server.objects(f"{lab_uri[len('s3://' + s3_server.bucket) + 1 :]}/_blobs")
    assert len(blobs) == 4
