"""Reading what touches a batch from a real lab: index look-ups, former members, radius."""

from __future__ import annotations

from prx_assets.core.dedup import corpus as C
from prx_assets.core.dedup import decisions as D
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


def test_gather_at_radius_scans_the_corpus_once_and_closes_chains(tmp_path):
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
