"""mds_shards' workers render and write whole shard files; the step ships references only.

On the real demo batch (real ingest, Lance, MDS, a moto S3 server on 127.0.0.1): what
crosses the pool boundary is measured on the real pools (pickled size of every task and
result), the output of inline and process pools, on local disk and on object storage, is
compared byte for byte, and the crash and failure rules of the step still hold on the
piece path (orphaned staging cleaned, a failing image left out the same way everywhere, a
decoder that kills its worker costs that image, not the partition).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from prx_assets.core.lab import Lab
from prx_assets.core.lab.blobs import LocalBlobs
from prx_assets.core.lab.view import LabView
from prx_assets.core.shards import pieces
from prx_assets.core.shards import runner as shard_runner
from prx_assets.core.shards.pieces import PieceResult, PieceTask
from prx_assets.core.shards.render import RenderFailures
from prx_assets.core.shards.runner import BatchAssignment, BatchShards, ShardSettings
from prx_assets.core.skiplists.policy import SkipPolicy
from prx_assets.core.tables import IMAGES, SHARD_SAMPLES
from prx_assets.core.workers import InlinePool, ItemFailed, ProcessPool, WorkerPool
from prx_assets_tests.core.stage_inputs import DEMO_BATCH, ingest_demo_batch
from prx_assets_tests.facts import plant_decision_facts

KEY = DEMO_BATCH
PIECE = 1  # samples per piece: a bucket of the demo batch (9 images, 8 buckets) gets several


@pytest.fixture(scope="module")
def world(tmp_path_factory, demo_source) -> tuple[Path, list[str]]:
    """The demo batch ingested, profiled, assigned and captioned (built once; copy it)."""
    from datetime import UTC, datetime

    from prx_assets.core.captions.models import BackendIdentity, CaptionResult
    from prx_assets.core.captions.tables import caption_rows

    root = tmp_path_factory.mktemp("pieces-world")
    shutil.copytree(demo_source[0], root / "landing", symlinks=True)
    lab = Lab(root / "lab")
    eligible = ingest_demo_batch(lab, root / "landing")
    BatchAssignment(lab, KEY).run()
    identity = BackendIdentity.create(kind="test", model_id="m", prompt_version="v")
    results = [CaptionResult(k, f"caption {k[:8]}", "test", "m", "v") for k in eligible[1:]]
    when = datetime(2024, 1, 1, tzinfo=UTC)
    lab.replace_partition(CAPTIONS_SPEC(), KEY, caption_rows(KEY, results, identity, "t", when))
    plant_decision_facts(lab, KEY, eligible, labels={eligible[1]: "text"})
    shutil.rmtree(root / "landing")
    return root, eligible


def CAPTIONS_SPEC():  # noqa: N802 - the table spec, imported late (one place)
    from prx_assets.core.tables import CAPTIONS

    return CAPTIONS


def _copy(world: tuple[Path, list[str]], dest: Path) -> Path:
    shutil.copytree(world[0], dest, symlinks=True)
    return dest


class CountingPool:
    """A real pool whose boundary is measured: every task and result pickled (as the
    process pool and Ray send them) and kept for inspection. Instrumentation, not a mock:
    the wrapped pool does the work."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.workers = pool.workers
        self.same_machine = pool.same_machine
        self.tasks: list[Any] = []
        self.results: list[Any] = []
        self.task_bytes = 0
        self.result_bytes = 0

    def map_ordered(
        self, fn: Callable, items: Iterable, *, window: int | None = None
    ) -> Iterator[Any]:
        def counted() -> Iterator[Any]:
            for item in items:
                self.tasks.append(item)
                self.task_bytes += len(pickle.dumps(item, protocol=5))
                yield item

        for out in self.pool.map_ordered(fn, counted(), window=window):
            self.results.append(out)
            self.result_bytes += len(pickle.dumps(out, protocol=5))
            yield out

    def close(self) -> None:
        self.pool.close()


def _run(
    monkeypatch: pytest.MonkeyPatch,
    lab_root: str,
    shards_root: str,
    pool: WorkerPool,
    **settings: Any,
) -> tuple[shard_runner.ShardOutcome, CountingPool]:
    counting = CountingPool(pool)
    monkeypatch.setattr(shard_runner, "make_pool", lambda kind, workers: counting)
    s = ShardSettings(piece_samples=PIECE, **settings)
    return BatchShards(Lab(lab_root), shards_root, KEY, SkipPolicy(), s).run(), counting


def _tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _remote_tree(s3_server, uri: str) -> dict[str, str]:  # noqa: ANN001
    """The live versions' files on the remote, by the path they have locally."""
    prefix = uri.split("/", 3)[3]
    out = {}
    for key, data in s3_server.objects(prefix).items():
        parts = key.split("/")
        if parts[-1] == "_live.json":
            continue
        assert parts[-2].startswith("v-"), f"an object outside a version: {key}"
        out["/".join(parts[:-2] + parts[-1:])] = hashlib.sha256(data).hexdigest()
    return out


def _rows(lab_root: str) -> list[dict]:
    rows = Lab(lab_root).read_batch(SHARD_SAMPLES.name, KEY).to_pylist()
    return sorted(rows, key=lambda r: r["key"])


def _upload_dir(s3_server, local: Path, uri: str) -> None:  # noqa: ANN001
    prefix = uri.split("/", 3)[3]
    client = s3_server.client()
    for p in sorted(local.rglob("*")):
        if p.is_file():
            key = f"{prefix}/{p.relative_to(local).as_posix()}"
            client.put_object(Bucket=s3_server.bucket, Key=key, Body=p.read_bytes())


def test_tasks_carry_references_and_results_no_image_bytes(world, tmp_path, monkeypatch):
    root = _copy(world, tmp_path / "data")
    out, pool = _run(monkeypatch, str(root / "lab"), str(root / "shards"), ProcessPool(2))
    assert out.written == out.assigned == len(world[1]) and not out.failures
    assert all(isinstance(t, PieceTask) for t in pool.tasks)
    assert all(isinstance(r, PieceResult) for r in pool.results)
    # Several pieces per bucket: the cut is by sample count, not by bucket.
    assert len(pool.tasks) > len(out.directories)
    # No source bytes out, no JPEG or shard bytes back: references and small typed results.
    # The workers read their rows themselves (assignment, caption, blob reference) at the
    # versions the step planned from: a task is its keys and those tables' references.
    assert all(t.rows is not None and not t.samples and t.keys for t in pool.tasks)
    assert {t.rows.assignments.version for t in pool.tasks} == {
        Lab(root / "lab").view().version("bucket_assignments")
    }
    assert all(x.data is None for r in pool.results for x in r.shards)
    jpeg_bytes = sum(size for r in pool.results for _, _, size in r.written)
    sources = Lab(root / "lab").read_batch(IMAGES.name, KEY, ["file_size"]).column("file_size")
    source_bytes = sum(sources.to_pylist())
    per_image_back = pool.result_bytes / out.written
    per_image_out = pool.task_bytes / out.written
    assert per_image_back < 1024, per_image_back  # key, sha256, size + shard entries
    assert per_image_out < 2048, per_image_out  # one sample per task here: mostly settings
    # What grows with a piece's samples is their keys alone (rows read by the worker).
    for t in pool.tasks:
        per_key = len(pickle.dumps(t, protocol=5)) - len(
            pickle.dumps(dataclasses.replace(t, keys=()), protocol=5)
        )
        assert per_key <= sum(len(k) + 8 for k in t.keys), (per_key, t.keys)
    assert pool.result_bytes < jpeg_bytes / 50 and pool.task_bytes < source_bytes / 50
    # What the worker wrote is what the index and shard_samples say.
    for d in out.directories:
        assert d.shards >= 1 and d.samples <= d.shards * PIECE
    rows = _rows(str(root / "lab"))
    by_key = {k: (sha, size) for r in pool.results for k, sha, size in r.written}
    assert {r["key"]: (r["jpeg_sha256"], r["jpeg_bytes"]) for r in rows} == by_key


def test_output_is_byte_identical_inline_process_local_and_s3(
    world, tmp_path, monkeypatch, s3_server, s3_prefix
):
    inline = _copy(world, tmp_path / "inline")
    _run(monkeypatch, str(inline / "lab"), str(inline / "shards"), InlinePool())
    reference, rows = _tree(inline / "shards"), _rows(str(inline / "lab"))
    assert any(name.endswith("shard.00001.mds") for name in reference)

    process = _copy(world, tmp_path / "process")
    _run(monkeypatch, str(process / "lab"), str(process / "shards"), ProcessPool(2))
    assert _tree(process / "shards") == reference
    assert _rows(str(process / "lab")) == rows

    # Shard tree on S3, lab local: the workers stage the shards on S3 themselves.
    on_s3 = _copy(world, tmp_path / "tree-on-s3")
    _, pool = _run(monkeypatch, str(on_s3 / "lab"), f"{s3_prefix}/shards", InlinePool())
    assert all(t.sink.store_uri and "/_staging/" in t.sink.store_uri for t in pool.tasks)
    assert _remote_tree(s3_server, f"{s3_prefix}/shards") == reference
    assert _rows(str(on_s3 / "lab")) == rows

    # Lab and tree on S3: the worker also reads its sources from the object store.
    lab_uri = f"{s3_prefix}/lab2"
    _upload_dir(s3_server, world[0] / "lab", lab_uri)
    _, pool = _run(monkeypatch, lab_uri, f"{s3_prefix}/shards2", InlinePool())
    assert all(type(t.blobs).__name__ == "RemoteBlobs" for t in pool.tasks)
    assert _remote_tree(s3_server, f"{s3_prefix}/shards2") == reference
    assert _rows(lab_uri) == rows

    # The same with process workers, in a fresh process (this session's forkserver may
    # predate the S3 environment, and workers take theirs from it, as in a deployment).
    lab_uri = f"{s3_prefix}/lab3"
    _upload_dir(s3_server, world[0] / "lab", lab_uri)
    tree_uri = f"{s3_prefix}/shards3"
    _run_in_fresh_process(lab_uri, tree_uri)
    assert _remote_tree(s3_server, tree_uri) == reference
    assert _rows(lab_uri) == rows


def _run_in_fresh_process(lab_uri: str, tree_uri: str) -> None:
    code = "\n".join(
        [
            "from prx_assets.core.lab import Lab",
            "from prx_assets.core.shards.runner import BatchShards, ShardSettings",
            "from prx_assets.core.skiplists.policy import SkipPolicy",
            f"s = ShardSettings(piece_samples={PIECE}, workers=2, executor='process')",
            f"BatchShards(Lab({lab_uri!r}), {tree_uri!r}, {KEY!r}, SkipPolicy(), s).run()",
        ]
    )
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=repo, check=True, timeout=600)


def test_orphaned_pieces_of_a_killed_run_are_swept_and_the_rerun_is_identical(
    world, tmp_path, monkeypatch, s3_server, s3_prefix
):
    root = _copy(world, tmp_path / "data")
    out, _ = _run(monkeypatch, str(root / "lab"), str(root / "shards"), InlinePool())
    reference = _tree(root / "shards")
    # What a killed run leaves: a staging directory with a piece in every bucket (locally)
    # and a staging prefix (on S3), under a token the rerun does not know.
    for d in out.directories:
        bucket = (root / "shards" / d.relative_dir).parent
        orphan = bucket / f".{KEY}.tmp" / "0123456789abcdef"
        orphan.mkdir(parents=True)
        (orphan / "piece.00000.000.mds").write_bytes(b"orphan")
    _run(monkeypatch, str(root / "lab"), str(root / "shards"), ProcessPool(2))
    assert _tree(root / "shards") == reference
    hidden = [p for p in (root / "shards").rglob(".*")]
    assert hidden == []

    tree = f"{s3_prefix}/shards"
    _run(monkeypatch, str(root / "lab"), tree, InlinePool())
    prefix = tree.split("/", 3)[3]
    client = s3_server.client()
    for d in out.directories:
        client.put_object(
            Bucket=s3_server.bucket,
            Key=f"{prefix}/{d.relative_dir}/_staging/0123456789abcdef/piece.00000.000.mds",
            Body=b"orphan",
        )
    _run(monkeypatch, str(root / "lab"), tree, InlinePool())
    assert not [k for k in s3_server.objects(prefix) if "_staging" in k]
    assert _remote_tree(s3_server, tree) == reference


def _blob_path(lab_root: Path, key: str) -> Path:
    ref = (
        Lab(lab_root)
        .view()
        .take_matching_rows(IMAGES.name, ["key", "image"], f"key = '{key}'", blob_refs=True)[0][
            "image"
        ]
    )
    return lab_root / "_blobs" / IMAGES.name / ref[:2] / ref[2:4] / ref


def test_a_failing_image_is_left_out_alike_and_too_many_fail_closed(world, tmp_path, monkeypatch):
    victim = world[1][5]
    outs, trees = [], []
    for name, pool in (("inline", InlinePool()), ("process", ProcessPool(2))):
        root = _copy(world, tmp_path / name)
        _blob_path(root / "lab", victim).write_bytes(b"altered")
        out, _ = _run(monkeypatch, str(root / "lab"), str(root / "shards"), pool)
        outs.append(out)
        trees.append(_tree(root / "shards"))
    assert trees[0] == trees[1]
    for out in outs:
        assert list(out.failures) == [victim] and "BlobError" in out.failures[victim]
        assert out.written == out.assigned - 1
    # Over the limit: the step fails before the failing image's bucket is committed (the
    # buckets before it are rewritten with the same bytes), shard_samples is not touched.
    root = tmp_path / "process"
    before, rows = _tree(root / "shards"), _rows(str(root / "lab"))
    with pytest.raises(RenderFailures, match="1 images of batch"):
        _run(
            monkeypatch, str(root / "lab"), str(root / "shards"), ProcessPool(2),
            max_render_failures=0,
        )  # fmt: skip
    assert _tree(root / "shards") == before
    assert _rows(str(root / "lab")) == rows
    assert [p for p in (root / "shards").rglob(".*")] == []


@dataclass(frozen=True)
class KillingBlobs:
    """Local blobs whose one reference kills the worker reading it (a decoder segfault's
    stand-in: the worker process dies on that image, every time)."""

    blobs: LocalBlobs
    poison: str

    def get(self, ref: str) -> bytes:
        if ref == self.poison:
            os._exit(139)
        return self.blobs.get(ref)


def test_an_image_that_kills_its_worker_costs_that_image_not_the_partition(
    world, tmp_path, monkeypatch
):
    victim = world[1][4]
    # The reference: the same image failing without killing anything.
    altered = _copy(world, tmp_path / "altered")
    _blob_path(altered / "lab", victim).write_bytes(b"altered")
    _run(monkeypatch, str(altered / "lab"), str(altered / "shards"), ProcessPool(2))

    root = _copy(world, tmp_path / "data")
    poison = _blob_path(root / "lab", victim).name
    original = LabView.local_blobs

    def killing(self, table, column):  # noqa: ANN001, ANN202
        blobs = original(self, table, column)
        return KillingBlobs(blobs, poison) if blobs is not None else None

    monkeypatch.setattr(LabView, "local_blobs", killing)
    out, pool = _run(monkeypatch, str(root / "lab"), str(root / "shards"), ProcessPool(2))
    assert any(isinstance(r, ItemFailed) for r in pool.results)  # a piece's worker died
    assert list(out.failures) == [victim] and out.failures[victim].startswith("worker_died")
    assert out.written == out.assigned - 1
    assert _tree(root / "shards") == _tree(altered / "shards")


def test_storage_trouble_fails_the_step_and_is_never_an_image_failure(world, tmp_path, monkeypatch):
    """A blob that cannot be read (here: a directory where its file should be, an I/O
    error rather than absence) fails the piece and the step: which images a shard holds
    must never depend on whether storage answered. ``shard_samples`` is not touched (each
    bucket directory already written is screened, as after any failed run)."""
    victim = world[1][5]
    root = _copy(world, tmp_path / "flaky")
    path = _blob_path(root / "lab", victim)
    path.unlink()
    path.mkdir()  # open() raises IsADirectoryError: an OSError that is not FileNotFoundError
    rows = _rows(str(root / "lab"))
    with pytest.raises(Exception, match="could not be read"):
        _run(monkeypatch, str(root / "lab"), str(root / "shards"), InlinePool())
    assert _rows(str(root / "lab")) == rows


def test_sources_read_ahead_on_s3_fail_alike(world, tmp_path, monkeypatch, s3_server, s3_prefix):
    """With the lab on object storage the worker reads its sources ahead of rendering them
    (``pieces._prefetched``): an altered blob is still that image's failure and the rest
    of the piece is the local run's, at any read-ahead depth; a blob that is gone is too."""
    victim, gone = world[1][5], world[1][2]
    local = _copy(world, tmp_path / "local")
    _blob_path(local / "lab", victim).write_bytes(b"altered")
    _blob_path(local / "lab", gone).unlink()
    reference_out, _ = _run(monkeypatch, str(local / "lab"), str(local / "shards"), InlinePool())
    reference = _tree(local / "shards")
    assert set(reference_out.failures) == {victim, gone}
    for depth in (1, 4):
        monkeypatch.setattr(pieces, "PREFETCH_BLOBS", depth)
        lab_uri = f"{s3_prefix}/lab-{depth}"
        _upload_dir(s3_server, local / "lab", lab_uri)
        out, pool = _run(monkeypatch, lab_uri, f"{s3_prefix}/shards-{depth}", InlinePool())
        assert all(type(t.blobs).__name__ == "RemoteBlobs" for t in pool.tasks)
        assert set(out.failures) == {victim, gone}
        assert "does not match" in out.failures[victim] and "missing" in out.failures[gone]
        assert _remote_tree(s3_server, f"{s3_prefix}/shards-{depth}") == reference
