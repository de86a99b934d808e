"""Reading what touches a batch from a real lab: index look-ups, former members, radius."""

from __future__ import annotations

from prx_assets.core.dedup import corpus as C
from prx_assets.core.dedup import decisions as D
from prx_assets.core.lab import Lab
from prx_assets.core.tables import IMAGE_HASHES
from prx_assets_tests.core.dedup_rows import S0, brute_closure, by_key, hash_table, run_batch


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


def test_gather_at_radius_takes_exactly_the_closure_rows_of_the_pinned_version(tmp_path):
    """The closure's rows come by row id from the scan that gave the universe: the same
    rows as a brute force over every stored row (top-bit hashes, a low-information copy, an
    old hash version, rows over several partitions and fragments), and none committed
    after the view was opened."""
    import numpy as np

    lab = Lab(tmp_path / "lab")
    rng = np.random.default_rng(7)
    base = [int(h) for h in rng.integers(0, 2**64 - 1, 30, dtype=np.uint64, endpoint=True)]
    near = [h ^ (1 << int(rng.integers(0, 64))) ^ (1 << int(rng.integers(0, 64))) for h in base]
    for p in range(6):
        items = [(f"k{p}-{i}", h, 10 + i, 9) for i, h in enumerate(near[p * 5 : p * 5 + 5])]
        items += [(f"r{p}-{i}", int(h), 5, 9) for i, h in enumerate(rng.integers(0, 2**63, 20))]
        lab.replace_partition(IMAGE_HASHES, f"c{p}", hash_table(f"c{p}", items))
    lab.replace_partition(IMAGE_HASHES, "flat", hash_table("flat", [("f", near[0], 99, 0.1)]))
    lab.replace_partition(
        IMAGE_HASHES, "old", hash_table("old", [("o", near[1], 99, 9)], "reference-v1")
    )
    lab.replace_partition(
        IMAGE_HASHES, "new", hash_table("new", [(f"n{i}", h, 1, 9) for i, h in enumerate(base)])
    )
    s2 = D.DedupSettings(radius=2)
    view = lab.view()
    view.pin([IMAGE_HASHES.name])
    lab.replace_partition(IMAGE_HASHES, "late", hash_table("late", [("l", base[0], 9, 9)]))
    g = C.gather_corpus(view, "new", s2)

    rows = lab.read(IMAGE_HASHES.name, None, "batch != 'late'").to_pylist()
    want = sorted(brute_closure(rows, base, 2))
    assert sorted(g.corpus.column("key").to_pylist()) == want
    assert len([k for k in want if k.startswith("k")]) == 30  # every near copy found
    assert g.hashes_version == view.version(IMAGE_HASHES.name)
