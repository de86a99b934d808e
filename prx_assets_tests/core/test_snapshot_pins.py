"""Pins on MDS directories: sweeps and shard rewrites keep what a live snapshot needs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from prx_assets.core.shards.mds import MDSSample, skip_nothing, write_bucket_partition
from prx_assets.core.skiplists.sidecars import (
    RETENTION_ENV,
    load_generation,
    sweep,
    update_skiplists,
)
from prx_assets.core.snapshots.manifest import (
    PinnedDirectory,
    SnapshotError,
    encode_snapshot,
    parse_snapshot,
)
from prx_assets.core.snapshots.pins import (
    PINS_DIRNAME,
    check_snapshot_id,
    drop_unpinned_retained,
    remove_pin,
    retained_dir,
    write_pin,
)


def _samples(caption: str, n: int = 3) -> list[MDSSample]:
    return [
        MDSSample(
            key=hashlib.sha256(f"k{i}".encode()).hexdigest(),
            image=b"\xff\xd8" + bytes([i]) * 64,
            caption=f"{caption} {i}",
            orig_width=512,
            orig_height=512,
            tier=512,
            shape="512x512",
            source="s",
            license="cc0",
        )
        for i in range(n)
    ]


def _write(root: Path, caption: str) -> Path:
    write_bucket_partition(
        root, "src.000", 512, "512x512", _samples(caption), skips_for=skip_nothing
    )
    return root / "mds" / "512" / "512x512" / "src.000"


def _pin(d: Path, snapshot_id: str) -> None:
    gen = load_generation(d)
    write_pin(
        d,
        snapshot_id,
        gen.manifest.index_sha256,
        gen.generation,
        [e.sidecar for e in gen.manifest.entries],
    )


def test_a_sweep_keeps_pinned_sidecars_and_deletes_nothing_behind_an_unreadable_pin(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(RETENTION_ENV, "0")  # the pin, not the retention, keeps them
    d = _write(tmp_path, "first")
    old = load_generation(d)
    _pin(d, "run-a")
    update_skiplists(d, {old.manifest.entries[0].shard: {0: ["opt_out"]}})  # sweeps inside
    assert all((d / e.sidecar).is_file() for e in old.manifest.entries)
    remove_pin(d, "run-a")
    sweep(d)
    assert not any((d / e.sidecar).exists() for e in old.manifest.entries)

    new = load_generation(d)
    _pin(d, "run-b")
    update_skiplists(d, {new.manifest.entries[0].shard: {}})
    (d / PINS_DIRNAME / "run-b.json").write_bytes(b"{not json")
    assert sweep(d) == []  # fail closed: an unreadable pin could name anything
    assert all((d / e.sidecar).is_file() for e in new.manifest.entries)


def test_a_rewrite_keeps_a_pinned_directory_retained_until_unpinned(tmp_path):
    d = _write(tmp_path, "first")
    index_sha = hashlib.sha256((d / "index.json").read_bytes()).hexdigest()
    _pin(d, "run-a")
    _write(tmp_path, "second")  # a captioner swap re-renders the directory
    assert hashlib.sha256((d / "index.json").read_bytes()).hexdigest() != index_sha
    kept = retained_dir(tmp_path, "mds/512/512x512/src.000", index_sha)
    assert hashlib.sha256((kept / "index.json").read_bytes()).hexdigest() == index_sha
    load_generation(kept)  # complete: shards, index and its pinned generation
    assert drop_unpinned_retained(tmp_path) == []
    remove_pin(kept, "run-a")
    assert drop_unpinned_retained(tmp_path) == [str(kept)]
    assert not kept.exists()
    # Unpinned directories are replaced and deleted as before.
    _write(tmp_path, "third")
    assert not any((tmp_path / "retained").rglob("index.json"))


def test_snapshot_names_are_plain_and_an_edited_manifest_is_refused():
    for bad in ("../x", "a/b", "", ".hidden", "x" * 65, "a b", "run.json"):
        with pytest.raises(ValueError):
            check_snapshot_id(bad)
    d = PinnedDirectory("mds/512/512x512/b.000", "0" * 64, "1" * 64, (), 3, 2)
    data = encode_snapshot("run-a", "2026-12-01T00:00:00+00:00", {"skip_audit": 3}, {}, [d])
    assert parse_snapshot(data, "m").kept_samples == 2
    with pytest.raises(SnapshotError, match="edited or damaged"):
        parse_snapshot(data.replace(b'"kept_samples":2', b'"kept_samples":3'), "m")
    evil = PinnedDirectory("mds/../../etc/x", "0" * 64, "1" * 64, (), 3, 2)
    with pytest.raises(SnapshotError, match="not mds"):
        parse_snapshot(encode_snapshot("run-a", "t", {}, {}, [evil]), "m")
