"""Duplicate clusters over 64-bit perceptual hashes, and which copy of each cluster to keep.

- ``cluster_exact``: Hamming-0 clusters of up to ~1e8 hashes on one core without pairwise
  work. numpy's uint64 sort is a plain introsort here (~70 ns/item), so instead of sorting the
  hashes we sort a 32-bit mixed fingerprint in place (half the bytes, ~2x faster), mark the
  fingerprints that occur twice in two byte tables (their top and bottom 27 bits), and group
  only the candidates those let through (true duplicates, plus ~2% of items at 1e8 whose
  32-bit fingerprints collide) by their full hash. Memory beside the input: 4 bytes/item plus
  256 MiB of tables, then the int32 outputs (8 bytes/item, half reusing the fingerprints).
- ``radius_pairs`` / ``cluster_radius``: pairs within Hamming distance r (0-16) by multi-index
  hashing (split the 64 bits into r+1 chunks; by pigeonhole a pair within r agrees exactly on
  at least one chunk), verified by popcount, and connected components over them: what a
  looser threshold would remove. Candidate work grows like n^2 / 2^(64/(r+1)), so this is for
  audits on samples or small collections, not for 1e8 hashes at r=8.
- ``choose_keepers``: the keeper rule over the clusters of all batches at once.

Low-information hashes (near-flat images, see ``phash``) are passed as ``singletons``: they
are never merged on the hash alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse
import scipy.sparse.csgraph

HashesLike = np.ndarray | Sequence[int]  # uint64 / int64 arrays, or Python ints
_U64 = (1 << 64) - 1
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying permutes uint64; high bits see all bits
_CHUNK = 1 << 22
_TABLE_BITS = 27  # candidate filter tables: at most 2**27 bytes each
_PAIR_BLOCK = 1 << 22
MAX_RADIUS = 16


@dataclass(frozen=True)
class Clusters:
    """Per item: the index of its cluster's first (lowest-index) member, and the cluster size.

    ``cluster_of`` is int32 below 2**31 items (400 MB instead of 800 MB at 1e8), else int64.
    """

    cluster_of: np.ndarray
    size: np.ndarray  # int32

    @property
    def n_clusters(self) -> int:
        count = 0
        for lo in range(0, len(self.cluster_of), _CHUNK):  # no n-sized temporaries
            part = self.cluster_of[lo : lo + _CHUNK]
            count += int(np.count_nonzero(part == np.arange(lo, lo + len(part))))
        return count

    @property
    def n_duplicates(self) -> int:
        """Items that are not their cluster's first member (what dedup would drop)."""
        return len(self.cluster_of) - self.n_clusters


def _as_hashes(hashes: HashesLike) -> np.ndarray:
    """uint64 view of hashes given as uint64/int64 arrays or Python ints (either signedness)."""
    if isinstance(hashes, np.ndarray) and hashes.dtype != object:
        if hashes.dtype == np.int64:
            hashes = hashes.view(np.uint64)
        elif hashes.dtype != np.uint64:
            if hashes.dtype.kind not in "iu" or (hashes.dtype.kind == "i" and (hashes < 0).any()):
                raise TypeError(f"hashes must be 64-bit integers, got dtype {hashes.dtype}")
            hashes = hashes.astype(np.uint64)
        if hashes.ndim != 1:
            raise ValueError(f"hashes must be one-dimensional, got shape {hashes.shape}")
        return hashes
    values = []
    for h in hashes:
        if isinstance(h, np.ndarray | list | tuple):
            raise ValueError("hashes must be one-dimensional")
        if not isinstance(h, int | np.integer) or not -(1 << 63) <= int(h) < 1 << 64:
            raise TypeError(f"hashes must be 64-bit integers, got {h!r}")
        values.append(int(h) & _U64)
    return np.array(values, dtype=np.uint64)


def _as_mask(mask: Any, n: int, name: str) -> np.ndarray | None:
    if mask is None:
        return None
    arr = np.asarray(mask, dtype=bool)
    if arr.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {arr.shape}")
    return arr


def _mixed(h: np.ndarray, buf: np.ndarray) -> np.ndarray:
    """h * _MIX (a bijection of uint64 whose high bits depend on every bit), into ``buf``."""
    out = buf[: len(h)]
    np.multiply(h, _MIX, out=out)
    return out


def _high_halves(x: np.ndarray) -> np.ndarray:
    """The high 32 bits of each uint64, as a strided view where the byte order allows."""
    if sys.byteorder == "little":
        return x.view(np.uint32)[1::2]
    return (x >> np.uint64(32)).astype(np.uint32)


def _index_dtype(n: int) -> type[np.signedinteger]:
    return np.int32 if n < 2**31 else np.int64


def cluster_exact(
    hashes: HashesLike, singletons: np.ndarray | Sequence[bool] | None = None
) -> Clusters:
    """Hamming-0 clusters: items with equal hashes share the first member's index.

    ``singletons`` (bool per item, e.g. ``low_information``) are never merged with anything.
    """
    h = _as_hashes(hashes)
    n = len(h)
    single = _as_mask(singletons, n, "singletons")
    buf = np.empty(min(n, _CHUNK), dtype=np.uint64)

    # 1. 32-bit fingerprints (high half of h * _MIX), sorted in place; the repeated ones.
    fp = np.empty(n, dtype=np.uint32)
    for lo in range(0, n, _CHUNK):
        fp[lo : lo + _CHUNK] = _high_halves(_mixed(h[lo : lo + _CHUNK], buf))
    fp.sort()
    repeated = fp[1:][fp[1:] == fp[:-1]]

    # 2. Candidates: items whose fingerprint's top bits, then bottom bits, are marked in byte
    #    tables (128 MiB each at most). No false negatives; the few false positives (~0.03% of
    #    items at 1e8) are only extra candidates.
    bits = min(_TABLE_BITS, max(10, (2 * n).bit_length()))
    low_mask = np.uint64((1 << bits) - 1)
    top = np.zeros(1 << bits, dtype=bool)
    top[repeated >> np.uint32(32 - bits)] = True
    bottom = np.zeros(1 << bits, dtype=bool)
    bottom[repeated.astype(np.uint64) & low_mask] = True
    del repeated
    found = []
    for lo in range(0, n, _CHUNK):
        slot = _mixed(h[lo : lo + _CHUNK], buf)
        np.right_shift(slot, np.uint64(64 - bits), out=slot)
        found.append(np.flatnonzero(np.take(top, slot.view(np.int64))) + lo)
    cand = np.concatenate(found) if found else np.empty(0, dtype=np.intp)
    del found, buf, top
    bottom_bits = ((h[cand] * _MIX) >> np.uint64(32)) & low_mask
    cand = cand[np.take(bottom, bottom_bits.view(np.int64))]
    del bottom, bottom_bits
    if single is not None:
        cand = cand[~single[cand]]

    # 3. Group the candidates by their full hash; ``size`` reuses the fingerprints' buffer.
    member, first, count = _groups(h[cand], cand)
    del cand
    size = fp.view(np.int32)
    size.fill(1)
    size[member] = count
    cluster_of = np.arange(n, dtype=_index_dtype(n))
    cluster_of[member] = first
    return Clusters(cluster_of, size)


def _groups(values: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Items sharing a value: (member index, lowest index in its group, group size)."""
    if len(values) < 2:
        return idx[:0], idx[:0], np.empty(0, dtype=np.int64)
    order = np.argsort(values)  # unstable is fine: the lowest index is taken explicitly
    sv, si = values[order], idx[order]
    del order
    starts = np.flatnonzero(np.r_[True, sv[1:] != sv[:-1]])
    counts = np.diff(np.r_[starts, len(sv)])
    multi = counts > 1
    lowest = np.minimum.reduceat(si, starts)[multi]
    group_counts = counts[multi]
    return (
        si[np.repeat(multi, counts)],
        np.repeat(lowest, group_counts),
        np.repeat(group_counts, group_counts),
    )


# ---------------------------------------------------------------------------------------------
# Radius search (multi-index hashing)


def chunk_masks(radius: int) -> list[np.uint64]:
    """The r + 1 bit masks of multi-index hashing: a pair within r agrees on one of them."""
    parts = radius + 1
    widths = [64 // parts + (1 if i < 64 % parts else 0) for i in range(parts)]
    masks, shift = [], 0
    for w in widths:
        masks.append(np.uint64(((1 << w) - 1) << shift))
        shift += w
    return masks


def _bucket_pairs(keys: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (i, j) arrays of all index pairs i != j with equal keys, in bounded blocks."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    m = len(sk)
    starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    ends = np.r_[starts[1:], m]
    end_of = np.repeat(ends, ends - starts)  # exclusive end of each position's bucket
    partners = end_of - np.arange(m) - 1
    pos = np.flatnonzero(partners)
    if len(pos) == 0:
        return
    cnt = partners[pos]
    cum = np.cumsum(cnt)
    lo = 0
    while lo < len(pos):
        base = cum[lo - 1] if lo else 0
        hi = max(lo + 1, int(np.searchsorted(cum, base + _PAIR_BLOCK, side="right")))
        p, c = pos[lo:hi], cnt[lo:hi]
        left = np.repeat(p, c)
        offsets = np.arange(len(left)) - np.repeat(np.cumsum(c) - c, c)
        right = left + 1 + offsets
        yield order[left], order[right]
        lo = hi


def radius_pairs(hashes: HashesLike, radius: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All pairs (i < j) with Hamming distance <= ``radius``: arrays (i, j, distance)."""
    if not 0 <= radius <= MAX_RADIUS:
        raise ValueError(f"radius must be in 0..{MAX_RADIUS}, got {radius}")
    h = _as_hashes(hashes)
    masks = chunk_masks(radius)
    out_i, out_j, out_d = [], [], []
    for c, mask in enumerate(masks):
        for i, j in _bucket_pairs(h & mask):
            x = h[i] ^ h[j]
            d = np.bitwise_count(x)
            keep = d <= radius
            for earlier in masks[:c]:  # report each pair once: at its first agreeing chunk
                keep &= (x & earlier) != 0
            i, j, d = i[keep], j[keep], d[keep]
            out_i.append(np.minimum(i, j))
            out_j.append(np.maximum(i, j))
            out_d.append(d.astype(np.uint8))
    if not out_i:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty.copy(), np.empty(0, dtype=np.uint8)
    i, j, d = np.concatenate(out_i), np.concatenate(out_j), np.concatenate(out_d)
    order = np.lexsort((j, i))
    return i[order].astype(np.int64), j[order].astype(np.int64), d[order]


def cluster_radius(
    hashes: HashesLike, radius: int, singletons: np.ndarray | Sequence[bool] | None = None
) -> Clusters:
    """Connected components of the "within ``radius``" graph (transitive, like union-find)."""
    h = _as_hashes(hashes)
    n = len(h)
    single = _as_mask(singletons, n, "singletons")
    cluster_of = np.arange(n, dtype=_index_dtype(n))
    size = np.ones(n, dtype=np.int32)
    idx = np.arange(n) if single is None else np.flatnonzero(~single)
    if len(idx) < 2:
        return Clusters(cluster_of, size)
    uniq, inverse = np.unique(h[idx], return_inverse=True)  # exact duplicates collapse first
    i, j, _ = radius_pairs(uniq, radius)
    graph = scipy.sparse.coo_matrix(
        (np.ones(len(i), dtype=np.int8), (i, j)), shape=(len(uniq), len(uniq))
    )
    _, label_of_unique = scipy.sparse.csgraph.connected_components(graph, directed=False)
    label = label_of_unique[inverse]
    counts = np.bincount(label)
    order = np.argsort(label, kind="stable")  # idx ascending within each component
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    first = idx[order][starts]
    cluster_of[idx] = first[label]
    size[idx] = counts[label]
    return Clusters(cluster_of, size)


# ---------------------------------------------------------------------------------------------
# Keeper rule


@dataclass(frozen=True)
class KeeperDecision:
    """Per image: its cluster, the cluster's keeper, and whether it is the keeper.

    ``cluster_id`` is the smallest key (string order) in the cluster: it names a real image,
    does not depend on input order or batching, and changes only when membership does. A
    singleton's cluster_id is its own key.
    """

    keys: np.ndarray
    cluster_id: np.ndarray
    cluster_size: np.ndarray
    keeper_key: np.ndarray
    is_keeper: np.ndarray
    low_information: np.ndarray

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "key": k,
                "cluster_id": c,
                "cluster_size": s,
                "keeper_key": kk,
                "is_keeper": ik,
                "low_information": lo,
            }
            for k, c, s, kk, ik, lo in zip(
                self.keys.tolist(),
                self.cluster_id.tolist(),
                self.cluster_size.tolist(),
                self.keeper_key.tolist(),
                self.is_keeper.tolist(),
                self.low_information.tolist(),
                strict=True,
            )
        ]


def choose_keepers(
    keys: Sequence[str] | np.ndarray,
    hashes: HashesLike,
    pixels: Sequence[int] | np.ndarray,
    file_sizes: Sequence[int] | np.ndarray,
    low_information: Sequence[bool] | np.ndarray | None = None,
    radius: int = 0,
) -> KeeperDecision:
    """Cluster all images (every batch at once) and pick one keeper per cluster.

    Keeper: most pixels, then larger file, then smallest key. ``radius`` > 0 clusters by
    connected components within that Hamming distance instead of exact equality.
    """
    key_arr = np.asarray(keys)
    if key_arr.dtype == object:
        key_arr = key_arr.astype(str)
    n = len(key_arr)
    if key_arr.ndim != 1 or (n and key_arr.dtype.kind != "U"):
        raise TypeError("keys must be a one-dimensional sequence of strings")
    h = _as_hashes(hashes)
    px = np.asarray(pixels, dtype=np.int64)
    fs = np.asarray(file_sizes, dtype=np.int64)
    for name, arr in (("hashes", h), ("pixels", px), ("file_sizes", fs)):
        if arr.shape != (n,):
            raise ValueError(f"{name} has shape {arr.shape}, expected ({n},) like keys")
    if (px < 0).any() or (fs < 0).any():
        raise ValueError("pixels and file_sizes must be >= 0")
    low = _as_mask(low_information, n, "low_information")
    low = np.zeros(n, dtype=bool) if low is None else low
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return KeeperDecision(key_arr, key_arr, empty, key_arr, np.empty(0, bool), low)

    key_order = np.argsort(key_arr, kind="stable")
    sorted_keys = key_arr[key_order]
    if n > 1 and (sorted_keys[1:] == sorted_keys[:-1]).any():
        dup = sorted_keys[1:][sorted_keys[1:] == sorted_keys[:-1]][0]
        raise ValueError(f"keys must be unique; {str(dup)!r} appears more than once")
    key_rank = np.empty(n, dtype=np.int64)
    key_rank[key_order] = np.arange(n)

    clusters = (
        cluster_exact(h, singletons=low)
        if radius == 0
        else cluster_radius(h, radius, singletons=low)
    )
    cl = clusters.cluster_of
    # Within each cluster: most pixels, then larger file, then smallest key.
    order = np.lexsort((key_rank, -fs, -px, cl))
    starts = np.flatnonzero(np.r_[True, cl[order][1:] != cl[order][:-1]])
    counts = np.diff(np.r_[starts, n])
    keeper_of_group = order[starts]
    min_rank_of_group = np.minimum.reduceat(key_rank[order], starts)
    group_of_sorted = np.repeat(np.arange(len(starts)), counts)
    group = np.empty(n, dtype=np.int64)
    group[order] = group_of_sorted
    keeper = keeper_of_group[group]
    return KeeperDecision(
        keys=key_arr,
        cluster_id=sorted_keys[min_rank_of_group[group]],
        cluster_size=counts[group].astype(np.int64),
        keeper_key=key_arr[keeper],
        is_keeper=keeper == np.arange(n),
        low_information=low,
    )
