"""Near-duplicate look-ups through the hash halves' indexes: the same closure as the scan."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from prx_assets.core.dedup import corpus as C
from prx_assets.core.dedup import decisions as D
from prx_assets.core.dedup.runner import add_phash_halves
from prx_assets.core.dedup.tables import HALF_COLUMNS
from prx_assets.core.lab import Lab, TableSpec
from prx_assets.core.tables import IMAGE_HASHES
from prx_assets_tests.core.dedup_rows import brute_closure, hash_table


def _flip(h: int, bits: list[int]) -> int:
    for b in bits:
        h ^= 1 << b
    return h


@pytest.fixture
def lab(tmp_path) -> tuple[Lab, list[int]]:
    """Seeds; near copies 1-3 bits away in both halves (top-bit hashes included); a chain
    of 3-bit steps that only rounds reach; a low-information copy; an old hash version;
    random rows; several partitions."""
    lab = Lab(tmp_path / "lab")
    rng = np.random.default_rng(11)
    seeds = [int(h) for h in rng.integers(0, 2**64 - 1, 12, dtype=np.uint64, endpoint=True)]
    seeds[0] |= 1 << 63
    items = []
    for i, s in enumerate(seeds):
        for j, n in enumerate((1, 2, 3)):
            bits = [int(b) for b in rng.choice(64, size=n, replace=False)]
            items.append((f"near{i}-{j}", _flip(s, bits), 10 + j, 9))
    step = seeds[1]
    for k in range(6):  # a chain: each 3 bits from the last, far from the seed at the end
        step = _flip(step, [k * 9, (k * 9 + 33) % 64, (k * 9 + 17) % 64])
        items.append((f"chain{k}", step, 5, 9))
    randoms = [(f"r{i}", int(h), 5, 9) for i, h in enumerate(rng.integers(0, 2**63, 200))]
    for p in range(4):
        lab.replace_partition(
            IMAGE_HASHES, f"c{p}", hash_table(f"c{p}", items[p::4] + randoms[p::4])
        )
    lab.replace_partition(IMAGE_HASHES, "flat", hash_table("flat", [("f", seeds[2], 9, 0.1)]))
    lab.replace_partition(
        IMAGE_HASHES, "old", hash_table("old", [("o", seeds[3], 9, 9)], "reference-v1")
    )
    return lab, seeds


@pytest.mark.parametrize("radius", [1, 2, 3])
def test_the_indexed_closure_is_the_scanned_one(lab, radius):
    store, seeds = lab
    settings = D.DedupSettings(radius=radius)
    view = store.view()
    view.pin([IMAGE_HASHES.name])
    late = hash_table("late", [("late", _flip(seeds[4], [1]), 9, 9)])
    store.replace_partition(IMAGE_HASHES, "late", late)  # after the view: never read
    scanned, s_read = C.closure_rows(view, seeds, settings, mode=C.NEAR_SCAN)
    indexed, i_read = C.closure_rows(view, seeds, settings, mode=C.NEAR_INDEX)
    assert (s_read["near_path_index"], i_read["near_path_index"]) == (0, 1)
    assert i_read["corpus_hashes_scanned"] == 0 and i_read["probe_values"] > 0
    rows = store.read(IMAGE_HASHES.name, None, "batch != 'late'").to_pylist()
    want = brute_closure(rows, seeds, radius)
    assert sorted(indexed.column("key").to_pylist()) == sorted(want)
    assert sorted(scanned.column("key").to_pylist()) == sorted(want)
    assert indexed.sort_by("key").equals(scanned.sort_by("key"))
    assert "late" not in want and "f" not in want and "o" not in want
    if radius == 3:
        assert {f"chain{k}" for k in range(6)} <= want  # reached round after round
        assert i_read["closure_rounds"] >= 6


def test_rows_without_halves_make_the_look_up_scan(lab):
    """A row with null halves would be invisible to the indexes: the look-up scans."""
    store, seeds = lab
    settings = D.DedupSettings(radius=2)
    assert C.near_path(store.view(), len(seeds), settings, mode=C.NEAR_INDEX) == C.NEAR_INDEX
    hidden = hash_table("legacy", [("legacy", _flip(seeds[5], [40]), 9, 9)], halves=False)
    store.replace_partition(IMAGE_HASHES, "legacy", hidden)
    view = store.view()
    assert not C.halves_indexed(view, settings)
    rows, read = C.closure_rows(view, seeds, settings, mode=C.NEAR_INDEX)
    assert read["near_path_index"] == 0 and "legacy" in rows.column("key").to_pylist()
    # Beyond radius 3 the halves cannot find every pair: always the scan.
    far = dataclasses.replace(settings, radius=4)
    assert C.near_path(view, 1, far, mode=C.NEAR_INDEX) == C.NEAR_SCAN
    with pytest.raises(ValueError, match="near-duplicate path"):
        C.near_path(view, 1, settings, mode="fast")


def test_auto_probes_the_index_only_where_that_is_cheaper(lab):
    store, seeds = lab
    settings = D.DedupSettings(radius=3)
    view = store.view()
    rows = view.count_rows(IMAGE_HASHES.name)
    fits = rows // (C.PROBE_TO_SCAN_COST * C.probe_values(1, 3))
    assert fits == 0  # a small corpus: scanning it is cheaper than one hash's probes
    assert C.near_path(view, 1, settings) == C.NEAR_SCAN
    assert C.probe_values(10, 3) == 2 * 10 * 33 and C.probe_values(10, 1) == 20


def test_a_table_written_before_the_halves_gains_them_for_every_row(tmp_path):
    lab = Lab(tmp_path / "lab")
    old_schema = pa.schema([f for f in IMAGE_HASHES.schema if f.name not in HALF_COLUMNS])
    old_spec = TableSpec(
        IMAGE_HASHES.name,
        old_schema,
        IMAGE_HASHES.identity,
        tuple(ix for ix in IMAGE_HASHES.indexes if ix[0] not in HALF_COLUMNS),
    )
    hashes = [2**64 - 1, 0, 2**63 + 7, 0x123456789ABCDEF0]
    table = hash_table("b0", [(f"k{i}", h, 9, 9) for i, h in enumerate(hashes)], halves=False)
    lab.replace_partition(old_spec, "b0", table.select(old_schema.names))
    assert not C.halves_indexed(lab.view(), D.DedupSettings(radius=2))
    assert add_phash_halves(lab)
    assert not add_phash_halves(lab)  # once
    got = lab.read(IMAGE_HASHES.name, ["key", "phash_hi", "phash_lo"]).to_pylist()
    by_key = {r["key"]: (r["phash_hi"], r["phash_lo"]) for r in got}
    assert by_key == {f"k{i}": (h >> 32, h & 0xFFFFFFFF) for i, h in enumerate(hashes)}
    indexed = {tuple(ix["fields"]) for ix in lab.dataset(IMAGE_HASHES.name).list_indices()}
    assert {("phash_hi",), ("phash_lo",)} <= indexed
    assert C.halves_indexed(lab.view(), D.DedupSettings(radius=2))
    # The table now takes rows written under the current spec.
    lab.replace_partition(IMAGE_HASHES, "b1", hash_table("b1", [("n", 5, 9, 9)]))
    assert lab.read(IMAGE_HASHES.name, ["key"]).num_rows == 5
