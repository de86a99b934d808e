"""Exact and radius clustering of 64-bit hashes, and the keeper rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from prx_assets.core.dedup import clustering as C
from prx_assets.core.dedup import phash as P
from prx_assets.demo.jpegs import encoded

U64 = (1 << 64) - 1
PHOTOS = Path(__file__).parents[2] / "prx_assets" / "demo" / "photos"


def _planted(n: int, dups: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    h = rng.integers(0, U64, size=n, dtype=np.uint64, endpoint=True)
    h[rng.integers(0, n, dups)] = h[rng.integers(0, n, dups)]
    return h


def _expected_exact(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per item: lowest index holding the same value, and how many items hold it."""
    uniq, inverse, counts = np.unique(h, return_inverse=True, return_counts=True)
    first = np.full(len(uniq), len(h), dtype=np.int64)
    np.minimum.at(first, inverse, np.arange(len(h)))
    return first[inverse], counts[inverse]


def _brute_components(h: np.ndarray, radius: int, single: np.ndarray) -> list[int]:
    """Union-find over all pairs, the slow obvious way."""
    n = len(h)
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    dist = np.bitwise_count(h[:, None] ^ h[None, :])
    for i, j in zip(*np.nonzero(np.triu(dist <= radius, 1)), strict=True):
        if not (single[i] or single[j]):
            ra, rb = find(int(i)), find(int(j))
            parent[max(ra, rb)] = min(ra, rb)
    return [find(i) for i in range(n)]  # root = lowest index of the component


# ---------------------------------------------------------------------------------------------
# Exact clustering


def test_cluster_exact_matches_numpy_unique_on_planted_duplicates() -> None:
    h = _planted(200_000, 3_000, seed=1)
    c = C.cluster_exact(h)
    first, counts = _expected_exact(h)
    assert c.cluster_of.dtype == np.int32 and c.size.dtype == np.int32
    assert np.array_equal(c.cluster_of, first)
    assert np.array_equal(c.size, counts)
    assert c.n_duplicates == len(h) - len(np.unique(h)) > 2_500


def test_cluster_exact_separates_fingerprint_and_table_collisions() -> None:
    # Hashes built backwards from chosen 32-bit fingerprints (the high half of h * _MIX):
    # f1 is shared by two different hashes, f2 by a true duplicate pair, and f3 takes its top
    # 27 bits from f1 and its bottom 27 bits from f2, so it passes both filter tables without
    # repeating. Only the true pair may merge.
    inv = pow(int(C._MIX), -1, 1 << 64)
    mid = 0xDEADBEE0 & ((1 << 27) - 1) & ~31
    f1 = (0b10101 << 27) | mid | 0b00011
    f2 = (0b01010 << 27) | mid | 0b11100
    f3 = (0b10101 << 27) | mid | 0b11100
    assert f3 >> 5 == f1 >> 5 and f3 & ((1 << 27) - 1) == f2 & ((1 << 27) - 1)
    products = [(f1 << 32) | 1, (f1 << 32) | 2, (f2 << 32) | 3, (f2 << 32) | 3, (f3 << 32) | 4]
    hashes = [(p * inv) & U64 for p in products]
    assert [((h * int(C._MIX)) & U64) >> 32 for h in hashes] == [f1, f1, f2, f2, f3]
    c = C.cluster_exact(np.array([12345, *hashes, hashes[1]], dtype=np.uint64))
    assert c.cluster_of.tolist() == [0, 1, 2, 3, 3, 5, 2]
    assert c.size.tolist() == [1, 1, 2, 2, 2, 1, 2]


def test_cluster_exact_singletons_are_never_merged() -> None:
    h = np.array([5, 5, 5, 9, 9, 7], dtype=np.uint64)
    single = np.array([False, True, False, True, False, True])
    c = C.cluster_exact(h, singletons=single)
    assert c.cluster_of.tolist() == [0, 1, 0, 3, 4, 5]
    assert c.size.tolist() == [2, 1, 2, 1, 1, 1]


def test_cluster_exact_edge_inputs() -> None:
    assert C.cluster_exact(np.empty(0, dtype=np.uint64)).cluster_of.tolist() == []
    assert C.cluster_exact([42]).size.tolist() == [1]
    same = C.cluster_exact(np.full(1000, 7, dtype=np.uint64))
    assert set(same.cluster_of.tolist()) == {0} and set(same.size.tolist()) == {1000}
    # Python ints above 2**63 and signed int64 storage mean the same bits.
    as_ints = [U64, 3, U64, 1 << 63]
    as_signed = np.array([-1, 3, -1, -(1 << 63)], dtype=np.int64)
    for form in (as_ints, as_signed):
        assert C.cluster_exact(form).cluster_of.tolist() == [0, 1, 0, 3]


def test_cluster_exact_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="64-bit integers"):
        C.cluster_exact(np.zeros(3, dtype=np.float64))
    with pytest.raises(ValueError, match="one-dimensional"):
        C.cluster_exact(np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises(ValueError, match=r"singletons must have shape \(3,\)"):
        C.cluster_exact(np.zeros(3, dtype=np.uint64), singletons=[True])


# ---------------------------------------------------------------------------------------------
# Radius search


def _with_near_pairs(n: int, seed: int, biased: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    h = rng.integers(0, U64, size=n, dtype=np.uint64, endpoint=True)
    if biased:  # pHash-like: the top bits are nearly always set
        h |= np.uint64(0xF000000000000000)
    for d in range(0, 12):
        for _ in range(12):
            i, j = rng.integers(0, n, 2)
            flip = sum(1 << int(b) for b in rng.choice(64, d, replace=False))
            h[j] = h[i] ^ np.uint64(flip)
    return h


@pytest.mark.parametrize("biased", [False, True])
def test_radius_pairs_equal_brute_force(biased: bool) -> None:
    h = _with_near_pairs(1200, seed=5, biased=biased)
    dist = np.bitwise_count(h[:, None] ^ h[None, :])
    for radius in range(0, 9):
        i, j, d = C.radius_pairs(h, radius)
        bi, bj = np.nonzero(np.triu(dist <= radius, 1))
        assert np.array_equal(i, bi) and np.array_equal(j, bj), radius
        assert np.array_equal(d, dist[bi, bj])
        assert len(i) > 10 * (radius + 1)  # the planted pairs are there


@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(st.integers(0, U64), min_size=1, max_size=40),
    flips=st.lists(st.tuples(st.integers(0, 39), st.integers(0, U64)), max_size=40),
    radius=st.integers(0, 8),
    sparse=st.booleans(),
)
def test_radius_pairs_property(base, flips, radius, sparse) -> None:
    hashes = list(base)
    for src, mask in flips:  # neighbours of existing hashes, a few bits (or many) away
        if sparse:
            mask &= mask >> 7 & mask >> 13
        hashes.append(hashes[src % len(base)] ^ mask)
    h = np.array(hashes, dtype=np.uint64)
    i, j, d = C.radius_pairs(h, radius)
    expected = {
        (a, b, (hashes[a] ^ hashes[b]).bit_count())
        for a in range(len(h))
        for b in range(a + 1, len(h))
        if (hashes[a] ^ hashes[b]).bit_count() <= radius
    }
    got = list(zip(i.tolist(), j.tolist(), d.tolist(), strict=True))
    assert len(got) == len(set(got))  # each pair once, even when several chunks agree
    assert set(got) == expected


def test_cluster_radius_equals_union_find_over_brute_force_pairs() -> None:
    h = _with_near_pairs(800, seed=9)
    h[10:14] = h[3]  # an exact-duplicate group joins the graph too
    single = np.zeros(len(h), dtype=bool)
    single[np.random.default_rng(2).integers(0, len(h), 40)] = True
    for radius in (1, 3, 6):
        c = C.cluster_radius(h, radius, singletons=single)
        roots = np.array(_brute_components(h, radius, single))
        assert np.array_equal(c.cluster_of, roots)
        assert np.array_equal(c.size, np.bincount(roots)[roots])
        assert c.size[single].max() == 1
    assert np.array_equal(C.cluster_radius(h, 0).cluster_of, C.cluster_exact(h).cluster_of)


def test_radius_is_validated() -> None:
    h = np.arange(5, dtype=np.uint64)
    for bad in (-1, C.MAX_RADIUS + 1):
        with pytest.raises(ValueError, match="radius must be in 0..16"):
            C.radius_pairs(h, bad)


# ---------------------------------------------------------------------------------------------
# Keeper rule


def _decide(rows: list[tuple[str, int, int, int]], **kw) -> dict[str, dict]:
    keys, hashes, pixels, sizes = zip(*rows, strict=True)
    decision = C.choose_keepers(list(keys), list(hashes), list(pixels), list(sizes), **kw)
    return {r["key"]: r for r in decision.records()}


def test_keeper_is_the_copy_with_most_pixels_then_larger_file_then_smallest_key() -> None:
    rows = [
        # key, hash, pixels, file size
        ("b/most-pixels", 1, 4_000_000, 10),
        ("a/fewer-pixels", 1, 1_000_000, 999_999),
        ("z/larger-file", 2, 500, 2_000),
        ("y/smaller-file", 2, 500, 1_000),
        ("m/tie", 3, 500, 1_000),
        ("k/tie", 3, 500, 1_000),
        ("x/alone", 4, 10, 10),
    ]
    out = _decide(rows)
    assert [k for k, r in out.items() if r["is_keeper"]] == [
        "b/most-pixels",
        "z/larger-file",
        "k/tie",
        "x/alone",
    ]
    assert out["a/fewer-pixels"]["keeper_key"] == "b/most-pixels"
    # cluster_id: the smallest key in the cluster, whoever is kept.
    assert out["b/most-pixels"]["cluster_id"] == "a/fewer-pixels"
    assert out["z/larger-file"]["cluster_id"] == "y/smaller-file"
    assert out["m/tie"]["cluster_id"] == out["m/tie"]["keeper_key"] == "k/tie"
    assert out["x/alone"] == {
        "key": "x/alone",
        "cluster_id": "x/alone",
        "cluster_size": 1,
        "keeper_key": "x/alone",
        "is_keeper": True,
        "low_information": False,
    }
    assert {r["cluster_size"] for k, r in out.items() if k != "x/alone"} == {2}


def test_keeper_decision_does_not_depend_on_input_order_or_batches() -> None:
    rng = np.random.default_rng(4)
    n = 3_000
    keys = [f"batch{i % 7}/img{i:05d}.jpg" for i in range(n)]
    hashes = rng.integers(0, 200, n).astype(np.uint64)  # many clusters spanning batches
    pixels = rng.integers(1, 4, n) * 1_000_000
    sizes = rng.integers(1, 3, n) * 1000
    low = rng.random(n) < 0.05
    a = C.choose_keepers(keys, hashes, pixels, sizes, low_information=low)
    perm = rng.permutation(n)
    b = C.choose_keepers(
        [keys[i] for i in perm], hashes[perm], pixels[perm], sizes[perm], low_information=low[perm]
    )
    by_key_a = {r["key"]: r for r in a.records()}
    assert {r["key"]: r for r in b.records()} == by_key_a
    # One keeper per cluster, clusters span batches, sizes add up.
    assert a.is_keeper.sum() == len(set(a.cluster_id.tolist()))
    spans = {}
    for r in by_key_a.values():
        spans.setdefault(r["cluster_id"], set()).add(r["key"].split("/")[0])
    assert max(len(s) for s in spans.values()) == 7
    assert all(r["cluster_size"] == 1 for r in by_key_a.values() if r["low_information"])


def test_low_information_images_that_collide_are_not_clustered() -> None:
    """A near-white and a near-grey frame, different content, same pHash."""
    ramp = np.linspace(0.0, 1.0, 320)
    near_white = np.tile(250 + 3 * ramp, (240, 1))  # a faint left-to-right shading
    near_grey = np.tile(120 + 3 * ramp, (240, 1))  # the same shading on a grey frame
    photo = np.asarray(Image.open(PHOTOS / "coffee.png"))
    datas = []
    for arr in (near_white, near_grey):
        datas.append(encoded(Image.fromarray(np.clip(arr, 0, 255).round().astype(np.uint8)), "PNG"))
    for quality in (95, 90):
        datas.append(encoded(Image.fromarray(photo), "JPEG", quality=quality))
    results = P.phash_many(datas)
    hashes = [r.hash for r in results]
    low = [r.low_information for r in results]
    assert hashes[0] == hashes[1] and hashes[2] == hashes[3]  # both pairs collide
    assert low == [True, True, False, False]
    keys = ["white.png", "grey.png", "coffee-q95.jpg", "coffee-q90.jpg"]
    decision = C.choose_keepers(keys, hashes, [76_800] * 4, [1, 1, 2, 1], low_information=low)
    assert decision.cluster_size.tolist() == [1, 1, 2, 2]
    assert decision.is_keeper.tolist() == [True, True, True, False]
    # Without the flag the two frames would have been merged.
    assert C.cluster_exact(hashes).size.tolist() == [2, 2, 2, 2]


def test_keepers_with_a_radius_merge_near_copies() -> None:
    rows = [("a", 0b0000, 10, 1), ("b", 0b0001, 20, 1), ("c", 0b0011, 5, 1), ("d", 0xFF00, 1, 1)]
    exact = _decide(rows)
    assert all(r["cluster_size"] == 1 for r in exact.values())
    loose = _decide(rows, radius=1)  # a-b and b-c are within 1: one component of three
    assert [loose[k]["keeper_key"] for k in "abcd"] == ["b", "b", "b", "d"]
    assert [loose[k]["cluster_id"] for k in "abcd"] == ["a", "a", "a", "d"]


def test_choose_keepers_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="'k' appears more than once"):
        C.choose_keepers(["k", "k"], [1, 2], [1, 1], [1, 1])
    with pytest.raises(ValueError, match=r"pixels has shape \(1,\), expected \(2,\)"):
        C.choose_keepers(["a", "b"], [1, 2], [1], [1, 1])
    with pytest.raises(ValueError, match="must be >= 0"):
        C.choose_keepers(["a", "b"], [1, 2], [1, -1], [1, 1])
    with pytest.raises(TypeError, match="strings"):
        C.choose_keepers([1, 2], [1, 2], [1, 1], [1, 1])
    empty = C.choose_keepers([], [], [], [])
    assert empty.records() == []
