"""The skip_lists runner (core, no Dagster) on a small real lab and real MDS shards.

``PartitionSkipLists`` reads the partition, decides, publishes one generation per directory
and commits the audit; these tests check its typed outcome against what is on disk and in
the lab, its typed errors (nothing published when refused), and that it does no work twice:
each directory's digest computed once, and no sidecar read back after it was written.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

import prx_assets.core.skiplists.runner as runner_module
from prx_assets.core.lab import Lab
from prx_assets.core.shards.mds import (
    MDSSample,
    partition_digest,
    skip_nothing,
    write_partition_buckets,
)
from prx_assets.core.skiplists.policy import SkipPolicy
from prx_assets.core.skiplists.runner import (
    PartitionSkipLists,
    ShardTreeMismatch,
    SkipListsOutcome,
    UpstreamMissing,
)
from prx_assets.core.skiplists.sidecars import (
    MANIFEST_BASENAME,
    SIDECAR_SUFFIX,
    current_generation,
    load_skiplists,
    skiplist_digest,
)
from prx_assets.core.tables import CAPTION_CLASSES, PHASH_CLUSTERS, SHARD_SAMPLES, SKIP_AUDIT
from prx_assets.demo.jpegs import encoded
from prx_assets_tests.core.skip_world import CAPTIONER, World, key_of

A, B = "src.a", "src.b"
SHAPES = ((256, "256x256"), (512, "512x512"))  # two bucket directories per batch


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return encoded(Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)), "JPEG")


def _shard(world: World, root: Path, batch: str) -> list[Path]:
    """Write the batch's sharded images as real MDS (two directories, about two samples per
    shard) and record ``shard_samples`` as mds_shards does; the directories, sorted."""
    imgs = sorted((i for i in world.images.values() if i.batch == batch and i.sharded), key=str)
    samples = []
    for n, img in enumerate(sorted(imgs, key=lambda i: i.key)):
        tier, shape = SHAPES[n % 2]
        samples.append(
            MDSSample(
                key=img.key,
                image=_jpeg(n),
                caption=img.caption or "",
                orig_width=800,
                orig_height=600,
                tier=tier,
                shape=shape,
                source="test",
                license="",
            )
        )
    limit = 2 * max(len(s.image) for s in samples) + 1500
    placements = write_partition_buckets(
        root, batch, samples, size_limit=limit, hashes=("sha256",), skips_for=skip_nothing
    )
    digests = {p.relative_dir: partition_digest(root / p.relative_dir) for p in placements}
    rows = [
        {
            "key": p.key,
            "batch": batch,
            "tier": p.tier,
            "shape": p.shape,
            "relative_dir": p.relative_dir,
            "shard": p.shard,
            "index_in_shard": p.index_in_shard,
            "sample_index": p.sample_index,
            "dir_digest": digests[p.relative_dir],
            "caption_fingerprint": CAPTIONER,
        }
        for p in placements
    ]
    world.lab.replace_partition(
        SHARD_SAMPLES, batch, pa.Table.from_pylist(rows, schema=SHARD_SAMPLES.schema)
    )
    return sorted({root / p.relative_dir for p in placements})


class Built:
    def __init__(self, world: World, root: Path, dirs: dict[str, list[Path]]) -> None:
        self.world = world
        self.lab = world.lab
        self.root = root
        self.dirs = dirs

    def run(self, batch: str = A, policy: SkipPolicy | None = None) -> SkipListsOutcome:
        return PartitionSkipLists(self.lab, str(self.root), batch, policy or SkipPolicy()).run()

    def audit(self, batch: str = A) -> dict[str, dict]:
        names = {key_of(n): n for n in self.world.images}
        rows = self.lab.read_batch(SKIP_AUDIT.name, batch).to_pylist()
        return {names[r["key"]]: r for r in rows}

    def files(self, batch: str = A) -> dict[Path, bytes]:
        return {
            p: p.read_bytes()
            for d in self.dirs[batch]
            for p in sorted(d.iterdir())
            if p.name.endswith(SIDECAR_SUFFIX) or p.name == MANIFEST_BASENAME
        }


@pytest.fixture
def built(tmp_path) -> Built:
    world = World(Lab(tmp_path / "lab"))
    world.image("keeper", A, phash=7, pixels=2_000_000)  # trains
    world.image("copy", A, phash=7)  # a duplicate of keeper
    world.image("text", A, label="text")
    world.image("named", A, url="https://example.org/named.jpg")  # opted out by URL
    world.image("unlabelled", A, label=None)  # pending its class label
    world.image("elsewhere", B, phash=7, pixels=1_000_000)  # keeper's copy in batch B
    world.image("other", B)
    world.commit()
    world.opt_out("legal.txt@1", ["https://example.org/named.jpg"])
    root = tmp_path / "shards"
    return Built(world, root, {b: _shard(world, root, b) for b in (A, B)})


def test_the_outcome_is_what_was_published_and_recorded(built):
    b = built
    out = b.run()
    expected = {
        "copy": ("duplicate",),
        "text": ("class_text",),
        "named": ("opt_out",),
        "unlabelled": ("pending",),
    }
    assert {n: tuple(r["reasons"]) for n, r in b.audit().items() if r["excluded"]} == expected
    assert (out.samples, out.kept, out.skipped) == (5, 1, 4)
    assert out.decisions.excluded_keys == {key_of(n) for n in expected}
    assert out.lists_applied == ["legal.txt@1"] and out.newly_excluded == 4
    assert out.directories == len(b.dirs[A]) == 2
    # The generations, sidecar count and digest describe exactly the files on disk.
    rels = sorted(str(d.relative_to(b.root)) for d in b.dirs[A])
    assert out.generations == {rel: current_generation(b.root / rel) for rel in rels}
    assert out.sidecars == sum(len(load_skiplists(d)) for d in b.dirs[A])
    assert out.skiplist_digest == skiplist_digest(b.dirs[A])
    # The audit commit's version (indexes are built after it) holds this run's rows.
    at_commit = b.lab.read(SKIP_AUDIT.name, ["key"], version=out.audit_version)
    assert sorted(at_commit.column("key").to_pylist()) == sorted(key_of(n) for n in b.audit())
    on_disk = {
        (str(d.relative_to(b.root)), shard, i)
        for d in b.dirs[A]
        for shard, sl in load_skiplists(d).items()
        for i in sl.indices
    }
    audit = b.audit()
    assert on_disk == {
        (audit[n]["relative_dir"], audit[n]["shard"], audit[n]["index_in_shard"]) for n in expected
    }
    # Batch B's elsewhere is decided in its own run, not this one's audit.
    assert out.marked_elsewhere == () and out.changed_during_run == ()

    # A rerun with nothing changed: byte-identical files, nothing newly excluded.
    files = b.files()
    again = b.run()
    assert b.files() == files and again.skiplist_digest == out.skiplist_digest
    assert again.newly_excluded == again.no_longer_excluded == 0


def test_a_contradicted_decision_in_another_batch_is_marked_and_cleared_by_its_rerun(built):
    b = built
    b.run(B)
    b.run(A)
    assert b.audit(B)["elsewhere"]["reasons"] == ["duplicate"]
    # keeper is reclassified: batch B's copy must now be the training copy.
    rows = b.lab.read_batch(CAPTION_CLASSES.name, A).to_pylist()
    for r in rows:
        if r["key"] == key_of("keeper"):
            r["label"] = "nsfw"
    b.lab.replace_partition(
        CAPTION_CLASSES, A, pa.Table.from_pylist(rows, schema=CAPTION_CLASSES.schema)
    )
    out = b.run(A)
    assert [(c.batch, c.key) for c in out.marked_elsewhere] == [(B, key_of("elsewhere"))]
    assert out.other_batches == [B]
    rerun = b.run(B)
    assert rerun.cleared == 1 and b.audit(B)["elsewhere"]["reasons"] == []
    assert b.lab.count("skip_dirty") == 0


def test_missing_upstream_tables_are_a_typed_error_before_anything_is_written(tmp_path):
    world = World(Lab(tmp_path / "lab"))
    world.image("x", A)
    world.commit(("images", "captions", "caption_classes", "shard_samples"))
    with pytest.raises(UpstreamMissing, match=r"`phash_clusters` \(materialise phash_clusters"):
        PartitionSkipLists(world.lab, str(tmp_path / "shards"), A, SkipPolicy()).run()
    assert not world.lab.exists(SKIP_AUDIT.name)


def test_a_directory_rewritten_after_shard_samples_is_refused_and_left_alone(built):
    b = built
    files = b.files()
    rows = b.lab.read_batch(SHARD_SAMPLES.name, A)
    digests = pa.array(["0" * 64] * rows.num_rows)
    rows = rows.set_column(rows.schema.get_field_index("dir_digest"), "dir_digest", digests)
    b.lab.replace_partition(SHARD_SAMPLES, A, rows)
    with pytest.raises(ShardTreeMismatch, match="rerun mds_shards"):
        b.run()
    assert b.files() == files and not b.lab.exists(SKIP_AUDIT.name)


def test_no_clusters_table_yet_is_refused_not_defaulted(built):
    b = built
    shutil.rmtree(b.lab.uri(PHASH_CLUSTERS.name))
    with pytest.raises(UpstreamMissing):
        b.run()


# --------------------------------------------------------------------------- double work


_EVENTS: list[tuple[str, tuple]] | None = None


def _hook(event: str, args: tuple) -> None:
    if _EVENTS is not None and event in ("open", "os.rename"):
        _EVENTS.append((event, args))


sys.addaudithook(_hook)  # audit hooks cannot be removed: this one records only when asked


@contextmanager
def _file_events() -> Iterator[list[tuple[str, tuple]]]:
    global _EVENTS
    _EVENTS = []
    try:
        yield _EVENTS
    finally:
        _EVENTS = None


def _path(path: object) -> str | None:
    """The absolute path an event names (None for a file descriptor)."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return os.path.abspath(path) if isinstance(path, str | os.PathLike) else None


def test_each_digest_is_computed_once_and_no_sidecar_is_read_back(built, monkeypatch):
    b = built
    b.world.opt_out("more.txt@2", [key_of("keeper")])  # every directory gets new sidecars
    digested: Counter[str] = Counter()

    def counting_digest(directory):  # the real digest, counted
        digested[str(directory)] += 1
        return partition_digest(directory)

    monkeypatch.setattr(runner_module, "partition_digest", counting_digest)
    with _file_events() as events:
        out = b.run()
    assert digested == Counter({str(d): 1 for d in b.dirs[A]})

    reads: Counter[str] = Counter()
    written: set[str] = set()
    for event, args in events:
        if event == "os.rename":
            name = _path(args[1])
            if name and name.endswith(SIDECAR_SUFFIX):
                written.add(name)
        else:
            name, mode = _path(args[0]), args[1]
            if name and name.endswith(SIDECAR_SUFFIX) and isinstance(mode, str) and "r" in mode:
                reads[name] += 1
    assert written, "the opt-out of a whole cluster must change sidecars"
    assert not written & set(reads), f"sidecars read back after writing: {written & set(reads)}"
    assert all(n == 1 for n in reads.values()), reads  # an unchanged sidecar: compared once
    # ... and what the outcome says is still what is on disk.
    assert out.skiplist_digest == skiplist_digest(b.dirs[A])
    assert out.sidecars == sum(len(load_skiplists(d)) for d in b.dirs[A])
