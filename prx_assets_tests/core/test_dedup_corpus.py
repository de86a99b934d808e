"""Reading what touches a batch from a real lab: index look-ups, former members, radius."""

from __future__ import annotations

import numpy as np
import pytest

from prx_assets.core.dedup import corpus as C
from prx_assets.core.dedup import decisions as D
from prx_assets.core.dedup.bands import BAND_COLUMNS, band_values
from prx_assets.core.dedup.tables import migrate_image_hashes_table
from prx_assets.core.lab import Lab
from prx_assets.core.tables import IMAGE_HASHES
from prx_assets_tests.core.dedup_rows import S0, by_key, hash_table, run_batch


def test_gather_finds_shared_hashes_through_the_index_and_former_members(tmp_path):
    lab = Lab(tmp_path / "lab")
    big = 2**63 + 5  # a hash with the top bit set: stored negative, looked up correctly
    lab.replace_partition(
        IMAGE_HASHES, "b0", hash_table("b0", [("o", big, 100, 9), ("u", 1, 9, 9)])
    )
    lab.replace_partition(
        IMAGE_HASHES, "b9", hash_table("b9", [("old", big, 1, 9)], "reference-v1")
    )
    run_batch(lab, "b0")  # decided before b1 existed: o keeps
    lab.replace_partition(
        IMAGE_HASHES, "b1", hash_table("b1", [("x", big, 900, 9), ("y", 2, 5, 9)])
    )
    plan = run_batch(lab, "b1")
    indexes = {tuple(ix["fields"]) for ix in lab.dataset(IMAGE_HASHES.name).list_indices()}
    assert ("phash",) in indexes
    assert [(c.batch, c.key) for c in plan.changes] == [("b0", "o")]
    assert by_key(plan.rows)[("b1", "x")]["is_keeper"]
    # Another hash version is never compared.
    assert ("b9", "old") not in by_key(plan.decisions)
    # b1's x leaves (rehashed to something else): b0's o must be re-decided on its own.
    run_batch(lab, "b0")
    lab.replace_partition(IMAGE_HASHES, "b1", hash_table("b1", [("x", 77, 900, 9), ("y", 2, 5, 9)]))
    g = C.gather_corpus(lab, "b1", S0)
    assert g.lookups["former_members"] == 1
    plan = D.plan_batch("b1", g.corpus, g.stored, S0)
    assert [(c.batch, c.key, c.after) for c in plan.changes] == [("b0", "o", "keeper of b0:o")]


def test_gather_at_radius_follows_chains_through_the_band_indexes(tmp_path):
    lab = Lab(tmp_path / "lab")
    a = 0x0123_4567_89AB_CDEF
    lab.replace_partition(
        IMAGE_HASHES, "b0", hash_table("b0", [("o", a ^ 0b11, 50, 9), ("p", a ^ 0b1111, 5, 9)])
    )
    lab.replace_partition(IMAGE_HASHES, "b0f", hash_table("b0f", [("flat", a, 99, 0.1)]))
    lab.replace_partition(IMAGE_HASHES, "b1", hash_table("b1", [("n", a, 10, 9)]))
    s2 = D.DedupSettings(radius=2)
    g = C.gather_corpus(lab, "b1", s2)
    assert sorted(g.corpus.column("key").to_pylist()) == ["n", "o", "p"]  # flat never merges
    assert g.lookups["closure_hashes"] == 3
    plan = D.plan_batch("b1", g.corpus, g.stored, s2)
    assert by_key(plan.rows)[("b1", "n")]["keeper_key"] == "o"
    assert g.lookups["band_lookups"] > 0 and "corpus_distinct_hashes_scanned" not in g.lookups


def _random_corpus(lab: Lab, rng: np.random.Generator, batches: int = 6, per: int = 400):
    """Hashes with planted chains: each batch holds random hashes and mutations (1-4 bits)
    of hashes in other batches, so closures cross batches and need several rounds."""
    pool: list[int] = []
    for b in range(batches):
        items = []
        for k in range(per):
            if pool and rng.random() < 0.5:
                h = int(rng.choice(pool))
                for bit in rng.choice(64, size=int(rng.integers(1, 5)), replace=False):
                    h ^= 1 << int(bit)
            else:
                h = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))
            pool.append(h)
            items.append((f"k{k}", h, 100 + k, float(rng.choice([0.2, 9.0, 9.0, 9.0]))))
        lab.replace_partition(IMAGE_HASHES, f"b{b}", hash_table(f"b{b}", items))
    return pool


@pytest.mark.parametrize("radius", [1, 2, 3])
def test_banded_closure_is_exactly_the_corpus_scan(tmp_path, radius):
    """Against the scan it replaces, on a real lab: the same closure for every radius the
    four bands cover, from seeds across the corpus; and what it reads is far less."""
    rng = np.random.default_rng(radius)
    lab = Lab(tmp_path / "lab")
    pool = _random_corpus(lab, rng)
    settings = D.DedupSettings(radius=radius)
    view = lab.view()
    assert C.bands_complete(view, settings)
    universe = C.corpus_hashes(view, settings)
    for trial in range(5):
        seeds = np.asarray(rng.choice(pool, size=20), dtype=np.uint64).view(np.int64)
        want = D.radius_closure(seeds, universe, radius)
        got, read = C.banded_closure(view, seeds.tolist(), settings, chunk=64)
        assert got.tolist() == want.tolist(), f"trial {trial}"
        assert read["band_rows_read"] < 4 * len(universe)


def test_a_table_from_before_the_bands_is_migrated_and_scanned_until_then(tmp_path):
    """Rows written without band columns are never invisible to a radius look-up: the scan
    serves until the migration has computed every row's bands from its stored hash."""
    import lance

    lab = Lab(tmp_path / "lab")
    a = 0x0123_4567_89AB_CDEF
    old = hash_table("b0", [("o", a ^ 0b1, 50, 9), ("p", 5, 5, 9)]).drop_columns(list(BAND_COLUMNS))
    lance.write_dataset(old, lab.uri(IMAGE_HASHES.name))
    s1 = D.DedupSettings(radius=1)
    assert not C.bands_complete(lab.view(), s1)
    assert migrate_image_hashes_table(lab) == list(BAND_COLUMNS)
    assert migrate_image_hashes_table(lab) == []
    stored = lab.read(IMAGE_HASHES.name, ["phash", *BAND_COLUMNS]).to_pylist()
    for row in stored:
        assert [row[c] for c in BAND_COLUMNS] == band_values([row["phash"]])[0].tolist()
    lab.replace_partition(IMAGE_HASHES, "b1", hash_table("b1", [("n", a, 10, 9)]))
    assert C.bands_complete(lab.view(), s1)
    g = C.gather_corpus(lab, "b1", s1)
    assert sorted(g.corpus.column("key").to_pylist()) == ["n", "o"]
    assert g.lookups["band_lookups"] > 0
