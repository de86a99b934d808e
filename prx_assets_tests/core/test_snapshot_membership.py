"""Snapshots cost O(directories): membership is derived from frozen generations, exactly,
and refused when it cannot be established."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.core.lab import Lab
from prx_assets.core.shards.tables import SHARD_SAMPLES
from prx_assets.core.skiplists.sidecars import (
    load_generation,
    update_skiplists,
    write_partition_skiplists,
)
from prx_assets.core.snapshots.manifest import SnapshotError
from prx_assets.core.snapshots.members import (
    frozen,
    holders,
    iter_members,
    members_of_batches,
)
from prx_assets.core.snapshots.runner import create_snapshot, retire_snapshot
from prx_assets.core.snapshots.tables import SNAPSHOT_DIRECTORIES

SHARD = "shard.00000.mds"
SAMPLES = 12


def _index(samples: int) -> bytes:
    shard = {
        "column_encodings": ["bytes"],
        "column_names": ["image"],
        "column_sizes": [None],
        "compression": None,
        "format": "mds",
        "hashes": [],
        "raw_data": {"basename": SHARD, "bytes": 8, "hashes": {}},
        "samples": samples,
        "size_limit": 1 << 26,
        "version": 2,
        "zip_data": None,
    }
    return json.dumps({"shards": [shard], "version": 2}).encode()


def _key(rel: str, i: int) -> str:
    return hashlib.sha256(f"{rel}/{i}".encode()).hexdigest()


def _tree(tmp_path: Path, directories: int = 6) -> tuple[Lab, Path, list[str]]:
    """A shard tree of ``directories`` one-shard directories (every third sample skipped)
    and the lab's ``shard_samples`` rows for it."""
    root, lab = tmp_path / "shards", Lab(tmp_path / "lab")
    rows: dict[str, list] = {f.name: [] for f in SHARD_SAMPLES.schema}
    rels = []
    for n in range(directories):
        batch = f"src.{n:03d}"
        rel = f"mds/512/512x512/{batch}"
        d = root / rel
        d.mkdir(parents=True)
        (d / "index.json").write_bytes(_index(SAMPLES))
        (d / SHARD).write_bytes(b"\0" * 8)
        write_partition_skiplists(d, {SHARD: {i: ["duplicate"] for i in range(0, SAMPLES, 3)}})
        for i in range(SAMPLES):
            values = {
                "key": _key(rel, i),
                "batch": batch,
                "tier": 512,
                "shape": "512x512",
                "relative_dir": rel,
                "shard": SHARD,
                "index_in_shard": i,
                "sample_index": i,
                "jpeg_bytes": 8,
                "caption_fingerprint": "alt_text-v1",
            }
            for name in rows:
                rows[name].append(values.get(name))
        rels.append(rel)
    lab.append(SHARD_SAMPLES, pa.table(rows, schema=SHARD_SAMPLES.schema))
    return lab, root, rels


def _expected(root: Path, rels: list[str]) -> set[tuple[str, str]]:
    """What the live generations keep, read from the sidecars themselves."""
    out = set()
    for rel in rels:
        skipped = set(load_generation(root / rel).skiplists[SHARD].indices)
        batch = rel.rsplit("/", 1)[-1]
        out |= {(batch, _key(rel, i)) for i in range(SAMPLES) if i not in skipped}
    return out


def _members(lab: Lab, snapshot_id: str) -> set[tuple[str, str]]:
    return {
        (r["batch"], r["key"]) for rows in iter_members(lab, frozen(lab, snapshot_id)) for r in rows
    }


def test_membership_is_derived_exactly_and_an_unchanged_directory_costs_no_new_rows(tmp_path):
    lab, root, rels = _tree(tmp_path)
    first = _expected(root, rels)
    create_snapshot(lab, root, "a")
    assert not lab.exists("snapshot_samples")  # nothing written per sample
    generations = lab.count("skip_generations")
    assert generations == len(rels)  # one shard per directory
    create_snapshot(lab, root, "b")  # nothing changed: no new generation rows
    assert lab.count("skip_generations") == generations
    assert lab.count("snapshot_directories") == 2 * len(rels)

    changed = rels[2]
    skips = {i: ["duplicate"] for i in range(0, SAMPLES, 3)}
    update_skiplists(root / changed, {SHARD: {**skips, 1: ["opt_out"], 2: ["opt_out"]}})
    create_snapshot(lab, root, "c")
    assert lab.count("skip_generations") == generations + 1  # only the changed directory
    assert _members(lab, "a") == _members(lab, "b") == first
    assert (
        _members(lab, "c")
        == _expected(root, rels)
        == first - {(changed.rsplit("/", 1)[-1], _key(changed, i)) for i in (1, 2)}
    )

    # By key: the opted-out sample is held by the snapshots before the change only; a
    # sample every generation skips is held by none.
    batch = changed.rsplit("/", 1)[-1]
    held = holders(lab, [_key(changed, 1), _key(changed, 0), _key(changed, 4)])
    assert held == {
        (batch, _key(changed, 1)): {"a", "b"},
        (batch, _key(changed, 4)): {"a", "b", "c"},
    }

    # Retired, its history still answers (the membership versions stay pinned).
    retire_snapshot(lab, root, "a")
    assert _members(lab, "a") == first


def test_membership_that_cannot_be_established_is_refused(tmp_path):
    lab, root, rels = _tree(tmp_path, directories=3)
    create_snapshot(lab, root, "a")
    batch = rels[1].rsplit("/", 1)[-1]
    snap = frozen(lab, "a")
    assert len(members_of_batches(lab, snap, [batch])) == SAMPLES - 4

    # A frozen generation whose rows are gone: no answer, never "held nothing".
    lab.delete("skip_generations", f"relative_dir = '{rels[1]}'")
    with pytest.raises(SnapshotError, match="no skip_generations rows"):
        members_of_batches(lab, snap, [batch])
    with pytest.raises(SnapshotError, match="no skip_generations rows"):
        holders(lab, [_key(rels[1], 1)])
    members_of_batches(lab, snap, [rels[0].rsplit("/", 1)[-1]])  # other directories answer

    # A directory row that disagrees with the pinned shard_samples (counts differ).
    lab2, root2, rels2 = _tree(tmp_path / "two", directories=2)
    create_snapshot(lab2, root2, "a")
    lab2.delete("shard_samples", f"key = '{_key(rels2[0], 1)}'")  # a kept sample's row
    snap2 = frozen(lab2, "a")  # its pinned version still holds the row: still exact
    assert len(members_of_batches(lab2, snap2, [rels2[0].rsplit("/", 1)[-1]])) == SAMPLES - 4
    row = lab2.read("snapshot_directories", None, f"relative_dir = '{rels2[0]}'").to_pylist()[0]
    row["kept_samples"] += 1
    others = lab2.read("snapshot_directories", None, f"relative_dir != '{rels2[0]}'").to_pylist()
    lab2.replace_rows(
        SNAPSHOT_DIRECTORIES,
        "snapshot_id",
        "a",
        pa.Table.from_pylist([row, *others], schema=SNAPSHOT_DIRECTORIES.schema),
    )
    with pytest.raises(SnapshotError, match="cannot be established"):
        members_of_batches(lab2, frozen(lab2, "a"), [rels2[0].rsplit("/", 1)[-1]])


def test_a_snapshot_an_older_version_made_is_read_from_its_sample_rows(tmp_path):
    """Older versions listed a snapshot's samples in ``snapshot_samples``: such a snapshot
    is read from there (its generations were never recorded), with the same answers."""
    from prx_assets.core.snapshots.tables import SKIP_GENERATIONS, SNAPSHOT_SAMPLES

    lab, root, rels = _tree(tmp_path, directories=3)
    create_snapshot(lab, root, "old")
    derived = [r for rows in iter_members(lab, frozen(lab, "old")) for r in rows]
    held = holders(lab, [r["key"] for r in derived])
    rows = [
        {**{c: r[c] for c in r if c in SNAPSHOT_SAMPLES.schema.names}, "snapshot_id": "old"}
        for r in derived
    ]
    lab.append(SNAPSHOT_SAMPLES, pa.Table.from_pylist(rows, schema=SNAPSHOT_SAMPLES.schema))
    lab.delete(SKIP_GENERATIONS.name, "true")  # as an older version left it: none recorded
    snap = frozen(lab, "old")
    assert snap.legacy
    assert [r for rows in iter_members(lab, snap) for r in rows] == derived
    assert holders(lab, [r["key"] for r in derived]) == held
