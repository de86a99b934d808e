"""Cross-batch dedup decisions (pure): settings, keeper rule, other batches' changes, radius."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from prx_assets.core.dedup import decisions as D
from prx_assets.core.dedup.clustering import radius_pairs
from prx_assets.core.tables import PHASH_CLUSTERS
from prx_assets_tests.core.dedup_rows import S0, by_key, rows, stored_from

# --------------------------------------------------------------------------- settings


def test_settings_validate_and_fingerprint_every_parameter():
    assert S0.fingerprint() == "r0-lo1.0-fast-v1-keeper-v1"
    prints = {
        D.DedupSettings(radius=r, low_info_threshold=t, phash_mode=m).fingerprint()
        for r, t, m in itertools.product((0, 3), (1.0, 1.5), ("fast", "reference"))
    }
    assert len(prints) == 8
    with pytest.raises(ValueError, match="radius must be in 0..8"):
        D.DedupSettings(radius=9)
    with pytest.raises(TypeError, match="radius must be an int"):
        D.DedupSettings(radius=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low_info_threshold"):
        D.DedupSettings(low_info_threshold=-1)
    with pytest.raises(ValueError, match="phash_mode"):
        D.DedupSettings(phash_mode="average")


# --------------------------------------------------------------------------- decide


def test_keeper_rule_pixels_then_file_size_then_key_then_batch():
    t = rows(
        ("b1", "k3", 7, 100, 10),
        ("b2", "k1", 7, 400, 5),  # most pixels
        ("b1", "k2", 7, 400, 5),  # same pixels and size, larger key than k1
        ("b1", "s", 9, 50, 9),  # another cluster: file size decides
        ("b2", "t", 9, 50, 99),
        ("b2", "same", 11, 10, 10),  # identical bytes in two batches: smallest batch keeps
        ("b1", "same", 11, 10, 10),
        ("b3", "alone", 12, 10, 10),
    )
    d = by_key(D.decide(t, S0))
    assert d[("b2", "k1")]["is_keeper"] and d[("b2", "k1")]["cluster_size"] == 3
    for k in (("b1", "k3"), ("b1", "k2")):
        assert not d[k]["is_keeper"]
        assert (d[k]["keeper_batch"], d[k]["keeper_key"], d[k]["cluster_id"]) == ("b2", "k1", "k1")
    assert d[("b2", "t")]["is_keeper"] and not d[("b1", "s")]["is_keeper"]
    assert d[("b1", "same")]["is_keeper"] and not d[("b2", "same")]["is_keeper"]
    assert d[("b2", "same")]["keeper_batch"] == "b1"
    assert d[("b3", "alone")]["is_keeper"] and d[("b3", "alone")]["cluster_size"] == 1
    # Input order is kept, whatever it is.
    assert D.decide(t, S0).column("key").to_pylist() == t.column("key").to_pylist()
    shuffled = t.take(np.random.default_rng(0).permutation(t.num_rows))
    assert by_key(D.decide(shuffled, S0)) == d


def test_low_information_images_are_singletons_kept_and_flagged():
    t = rows(("b", "flat1", 5, 999, 9, 0.2), ("b", "flat2", 5, 10, 1, 0.3), ("b", "photo", 5, 1, 1))
    d = by_key(D.decide(t, S0))
    for k in ("flat1", "flat2"):
        r = d[("b", k)]
        assert r["low_information"] and r["is_keeper"] and r["cluster_size"] == 1
        assert r["cluster_id"] == k
    assert d[("b", "photo")]["is_keeper"] and not d[("b", "photo")]["low_information"]
    # The threshold is configuration: at 0.25 only flat1 is flagged, flat2 merges with photo.
    d = by_key(D.decide(t, D.DedupSettings(low_info_threshold=0.25)))
    assert d[("b", "flat1")]["low_information"] and not d[("b", "flat2")]["low_information"]
    assert d[("b", "photo")]["keeper_key"] == "flat2"


def test_decide_rejects_bad_rows():
    with pytest.raises(ValueError, match=r"unique by \(batch, key\); b:k repeats"):
        D.decide(rows(("b", "k", 1, 1, 1), ("b", "k", 2, 1, 1)), S0)
    with pytest.raises(ValueError, match="lack columns"):
        D.decide(pa.table({"key": ["k"], "batch": ["b"]}), S0)
    bad = rows(("b", "k", 1, 1, 1)).set_column(4, "pixels", pa.array([None], pa.int64()))
    with pytest.raises(ValueError, match="'pixels' has 1 null"):
        D.decide(bad, S0)
    assert D.decide(rows(("b", "k", 1, 1, 1)).slice(0, 0), S0).num_rows == 0


# --------------------------------------------------------------------------- plan_batch


def test_a_higher_resolution_copy_flips_the_old_keeper_and_names_its_batch():
    old = rows(("b0", "orig", 77, 1000, 50), ("b1", "copy", 77, 500, 20), ("b0", "other", 3, 9, 9))
    stored = stored_from(D.decide(old, S0))
    corpus = pa.concat_tables([rows(("b2", "big", 77, 4000, 90)), old])
    plan = D.plan_batch("b2", corpus, stored, S0)
    own = plan.rows.to_pylist()
    assert own[0]["key"] == "big" and own[0]["is_keeper"] and own[0]["cluster_size"] == 3
    assert plan.rows.schema == PHASH_CLUSTERS.schema
    assert plan.stats.affected_batches == ["b0", "b1"]
    changes = {(c.batch, c.key): (c.before, c.after) for c in plan.changes}
    assert changes == {
        ("b0", "orig"): ("keeper of b0:orig", "duplicate of b2:big"),
        ("b1", "copy"): ("duplicate of b0:orig", "duplicate of b2:big"),
    }
    assert plan.stats.displaced_in_other_batches == 1
    assert plan.stats.keepers_over_other_batches == 1


def test_a_lower_resolution_copy_changes_no_other_batch():
    old = rows(("b0", "orig", 77, 1000, 50), ("b1", "copy", 77, 500, 20))
    stored = stored_from(D.decide(old, S0))
    corpus = pa.concat_tables([rows(("b2", "small", 77, 100, 5), ("b2", "x", 1, 9, 9)), old])
    plan = D.plan_batch("b2", corpus, stored, S0)
    assert plan.changes == [] and plan.stats.affected_batches == []
    d = by_key(plan.rows)
    assert not d[("b2", "small")]["is_keeper"] and d[("b2", "small")]["keeper_batch"] == "b0"
    assert plan.stats.duplicates_of_other_batches == 1
    assert plan.stats.cluster_sizes == {3: 1, 1: 1}


def test_undecided_and_other_config_members_are_not_changes():
    old = rows(("b0", "orig", 77, 1000, 50), ("b1", "copy", 77, 500, 20))
    stored = stored_from(D.decide(old, S0))
    other = D.DedupSettings(radius=2)
    stored = pa.concat_tables(
        [stored.filter(pa.array([True, False])), stored_from(D.decide(old, S0), other).slice(1)]
    )
    corpus = pa.concat_tables(
        [rows(("b2", "big", 77, 4000, 90)), old, rows(("b3", "new", 77, 10, 1))]
    )
    plan = D.plan_batch("b2", corpus, stored, S0)
    assert [(c.batch, c.key) for c in plan.changes] == [("b0", "orig")]
    assert plan.stats.other_config_members == 1 and plan.stats.undecided_members == 1


def test_within_batch_duplicates_are_counted_apart_from_cross_batch_ones():
    corpus = rows(("b", "a", 1, 10, 1), ("b", "a2", 1, 5, 1), ("b", "c", 2, 1, 1))
    corpus = pa.concat_tables([corpus, rows(("z", "big", 2, 99, 1))])
    plan = D.plan_batch("b", corpus, None, S0)
    assert plan.stats.within_batch_duplicates == 1
    assert plan.stats.duplicates_of_other_batches == 1
    assert plan.stats.clusters_with_duplicates == 2
    assert plan.stats.undecided_members == 1  # z has no stored rows yet


# --------------------------------------------------------------------------- radius


def _brute_closure(seeds: list[int], universe: list[int], r: int) -> set[int]:
    seen = set(seeds)
    frontier = list(seeds)
    while frontier:
        nxt = [
            u for u in universe if u not in seen and any((u ^ f).bit_count() <= r for f in frontier)
        ]
        seen.update(nxt)
        frontier = nxt
    return seen


def test_radius_closure_follows_chains_and_matches_brute_force():
    a = 0x0F0F_0F0F_0F0F_0F0F
    b = a ^ 0b11  # 2 from a
    c = b ^ (0b11 << 40)  # 2 from b, 4 from a
    far = a ^ 0xFFFF
    got = D.radius_closure(np.array([a], np.uint64), np.array([a, b, c, far], np.uint64), 2)
    assert set(got.tolist()) == {a, b, c}
    assert set(D.radius_closure(np.array([a], np.uint64), np.array([b, c], np.uint64), 1)) == {a}
    rng = np.random.default_rng(3)
    for r in (1, 3, 6):
        base = rng.integers(0, 2**63, 6, dtype=np.int64).astype(np.uint64)
        flips = [np.uint64(1) << np.uint64(int(i)) for i in rng.integers(0, 64, 60)]
        uni = np.unique(
            np.concatenate(
                [
                    base,
                    [base[i % 6] ^ f for i, f in enumerate(flips)],
                    base ^ flips[0] ^ flips[1] ^ flips[2],
                ]
            )
        )
        seeds = uni[:3]
        want = _brute_closure([int(s) for s in seeds], [int(u) for u in uni], r)
        assert set(int(x) for x in D.radius_closure(seeds, uni, r)) == want
    with pytest.raises(ValueError, match="radius in 1..8"):
        D.radius_closure(np.array([1], np.uint64), np.array([1], np.uint64), 0)


@pytest.mark.parametrize("radius", [1, 2, 3, 4, 8])
def test_radius_closure_over_the_full_hash_range_in_small_pair_blocks(radius, monkeypatch):
    """Hashes with the top bit set (negative as int64), an unsorted universe with repeats,
    seeds outside it, chains of near copies, and pair blocks of a few pairs: the closure is
    the brute force's for wide (searchsorted) and narrow (counting sort) chunks alike."""
    rng = np.random.default_rng(radius)
    base = rng.integers(0, 2**64 - 1, 40, dtype=np.uint64, endpoint=True)
    chain = []
    for b in base[:20]:
        h = int(b)
        for _ in range(4):  # a walk of 1..radius-bit steps
            for bit in rng.choice(64, size=int(rng.integers(1, radius + 1)), replace=False):
                h ^= 1 << int(bit)
            chain.append(h)
    noise = rng.integers(0, 2**64 - 1, 400, dtype=np.uint64, endpoint=True)
    uni = np.concatenate([base, np.array(chain, np.uint64), noise, base[:5]])
    rng.shuffle(uni)
    seeds = np.concatenate([base[:3], [np.uint64(int(base[3]) ^ 1)]]).astype(np.uint64)
    want = _brute_closure([int(s) for s in seeds], sorted({int(u) for u in uni}), radius)
    for block in (3, 1 << 22):
        monkeypatch.setattr(D, "_CLOSURE_PAIR_BLOCK", block)
        got = D.radius_closure(seeds.view(np.int64), uni.view(np.int64), radius)
        assert set(int(x) for x in got) == want
        assert list(got) == sorted(got)


def test_radius_decisions_merge_chains_across_batches():
    a = 0x1234_5678_9ABC_DEF0
    corpus = rows(
        ("new", "n", a, 10, 1), ("old", "o1", a ^ 0b1, 50, 1), ("old", "o2", a ^ 0b111, 5, 1)
    )
    at0 = D.plan_batch("new", corpus, None, S0)
    assert at0.stats.clusters_with_duplicates == 0
    at2 = D.plan_batch("new", corpus, None, D.DedupSettings(radius=2))
    d = by_key(at2.decisions)
    assert {r["cluster_id"] for r in d.values()} == {"o1"}  # n-o1 (1), o1-o2 (2)
    assert at2.rows.column("radius").to_pylist() == [2]
    i, j, _ = radius_pairs(np.array([a, a ^ 1, a ^ 7], np.uint64), 2)
    assert list(zip(i.tolist(), j.tolist(), strict=True)) == [(0, 1), (1, 2)]
