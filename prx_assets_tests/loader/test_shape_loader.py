"""ShapeBatchedLoader and discover_streams on one (unsimulated) rank."""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import pytest

from prx_assets.loader import (
    ShapeBatchedLoader,
    SkipListChanged,
    discover_streams,
)

from .conftest import MdsRoot


def _shape_of(key: str) -> str:
    return key.split("/")[1]


def _loader(m: MdsRoot, **kwargs) -> ShapeBatchedLoader:
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_canonical_nodes", 1)
    return ShapeBatchedLoader(discover_streams(m.root), **kwargs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_hold_one_shape_and_cover_the_kept_set(mds_root: MdsRoot, num_workers: int):
    skipped = mds_root.random_skips(random.Random(21))
    kept = mds_root.all_keys() - skipped
    loader = _loader(mds_root, num_workers=num_workers)
    assert loader.shapes == ["16x24", "24x16"]
    for _ in range(2):
        batches = [b["key"] for b in loader]
        assert len(batches) == len(loader)
        for keys in batches:
            assert len({_shape_of(k) for k in keys}) == 1 and 1 <= len(keys) <= 4
        flat = [k for keys in batches for k in keys]
        assert Counter(flat) == Counter(kept)
        # Only the last batch of each shape may be short.
        for shape in loader.shapes:
            sizes = [len(k) for k in batches if _shape_of(k[0]) == shape]
            assert all(s == 4 for s in sizes[:-1])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_gives_exactly_the_rest_of_the_order(mds_root: MdsRoot, num_workers: int):
    mds_root.random_skips(random.Random(4))
    loader = _loader(mds_root, num_workers=num_workers)
    epoch0 = [b["key"] for b in loader]
    it = iter(loader)
    head = [next(it)["key"] for _ in range(7)]
    state = loader.state_dict()
    tail = [b["key"] for b in it]
    assert state["epoch"] == 1 and state["step"] == 7

    resumed = _loader(mds_root, num_workers=num_workers)
    resumed.load_state_dict(state)
    rest = [b["key"] for b in resumed]
    assert rest == tail
    assert Counter(k for b in head + rest for k in b) == Counter(k for b in epoch0 for k in b)
    # And the epoch after the resumed one is the same as in the uninterrupted run.
    assert [b["key"] for b in resumed] == [b["key"] for b in loader]


def test_loader_refuses_changed_skiplists(mds_root: MdsRoot):
    loader = _loader(mds_root)
    it = iter(loader)
    seen = {k for _ in range(3) for k in next(it)["key"]}
    state = loader.state_dict()
    del it
    rel = "1/24x16/b0"
    victim = next(k for s in mds_root.shards[rel] for k in s if k not in seen)
    shard_no = next(i for i, s in enumerate(mds_root.shards[rel]) if victim in s)
    mds_root.apply_skips(
        {rel: {shard_no: {mds_root.shards[rel][shard_no].index(victim): ["opt_out"]}}}
    )
    with pytest.raises(SkipListChanged):
        _loader(mds_root).load_state_dict(state)
    allowed = _loader(mds_root, allow_skiplist_change=True)
    with pytest.warns(UserWarning, match="changed skip-lists"):
        allowed.load_state_dict(state)
    rest = {k for b in allowed for k in b["key"]}
    assert victim not in rest
    # Only the changed bucket resumes approximately; the untouched one is still exact.
    assert all(_shape_of(k) == "24x16" for k in rest & seen)
    assert {k for k in mds_root.all_keys() if _shape_of(k) == "16x24"} <= rest | seen


def test_abandoned_iteration_starts_the_next_epoch(mds_root: MdsRoot):
    loader = _loader(mds_root)
    reference = _loader(mds_root)
    ref_epochs = [[b["key"] for b in reference] for _ in range(2)]
    it = iter(loader)
    next(it)
    del it
    assert [b["key"] for b in loader] == ref_epochs[1]


def test_state_from_another_bucket_set_is_rejected(mds_root: MdsRoot):
    state = _loader(mds_root).state_dict()
    only_one = ShapeBatchedLoader(
        discover_streams(mds_root.root, shapes=["16x24"]), batch_size=4, num_canonical_nodes=1
    )
    with pytest.raises(ValueError, match="buckets"):
        only_one.load_state_dict(state)
    with pytest.raises(ValueError, match="prx-shape-loader"):
        only_one.load_state_dict({"epoch": 0})


def test_discover_filters_weights_and_layout(mds_root: MdsRoot, tmp_path: Path):
    all_b = discover_streams(mds_root.root)
    assert [b.relpath for b in all_b] == ["0/16x24/b0", "0/16x24/b1", "1/24x16/b0"]
    assert all(b.remote is None and b.counts.samples == 40 for b in all_b)
    assert [b.relpath for b in discover_streams(mds_root.root, tiers=[1])] == ["1/24x16/b0"]
    assert len(discover_streams(mds_root.mds, shapes=[(16, 24)])) == 2  # mds/ itself works too
    assert [b.batch for b in discover_streams(mds_root.root, shapes=["16x24"], batches=["b1"])] == [
        "b1"
    ]

    weighted = discover_streams(mds_root.root, weights={"0/*/b1": 2.0, "*": 1.0})
    assert [b.repeat for b in weighted] == [1.0, 2.0, 1.0]
    loader = ShapeBatchedLoader(weighted, batch_size=4, num_canonical_nodes=1)
    counts = Counter(k for b in loader for k in b["key"])
    assert {c for k, c in counts.items() if "/b1/" in k} == {2}
    assert {c for k, c in counts.items() if "/b1/" not in k} == {1}

    rel = "1/24x16/b0"
    mds_root.apply_skips(
        {
            rel: {
                i: dict.fromkeys(range(len(s)), ["opt_out"])
                for i, s in enumerate(mds_root.shards[rel])
            }
        }
    )
    with pytest.warns(UserWarning, match="all 40 samples are skipped"):
        assert [b.relpath for b in discover_streams(mds_root.root)] == ["0/16x24/b0", "0/16x24/b1"]

    cached = discover_streams(
        mds_root.root, cache_dir=tmp_path / "cache", source="public", drop_empty=False
    )
    assert cached[0].remote == str(mds_root.dir("0/16x24/b0"))
    assert cached[0].local == str(tmp_path / "cache" / "public" / "0/16x24/b0")

    with pytest.raises(ValueError, match="pass cache_dir"):
        discover_streams("s3://bucket/prx")
    # s3:// trees are listed through their pointers (prx_assets_tests/s3/); other schemes
    # cannot be listed and are streamed as named.
    with pytest.raises(ValueError, match="cannot be listed"):
        discover_streams("gs://bucket/prx", cache_dir=tmp_path / "c")
    url = discover_streams("gs://bucket/prx", cache_dir=tmp_path / "c", partitions=["2/8x8/b3"])
    assert url[0].remote == "gs://bucket/prx/mds/2/8x8/b3" and url[0].counts is None

    # The writer's hidden in-flight copies are not partitions.
    hidden = mds_root.mds / "0" / "16x24" / ".b0.tmp-1234"
    hidden.mkdir()
    (hidden / "index.json").write_text("{}")
    found = discover_streams(mds_root.root, drop_empty=False)
    assert ".b0.tmp-1234" not in {b.batch for b in found} and len(found) == 3
    (mds_root.mds / "0" / "wide" / "b0").mkdir(parents=True)
    with pytest.raises(ValueError, match="not named <H>x<W>"):
        discover_streams(mds_root.root)


def test_mixed_sources_share_shape_buckets_with_weights(mds_root: MdsRoot, tmp_path: Path):
    internal = MdsRoot(tmp_path / "internal", layout=(("0", "16x24", "b0", 24),), key_suffix="-int")
    skipped = internal.random_skips(random.Random(2), drop_whole_shard=False)
    buckets = discover_streams(mds_root.root, source="public") + discover_streams(
        internal.root, source="internal", weights={"*": 2.0}, cache_dir=tmp_path / "cache"
    )
    loader = ShapeBatchedLoader(buckets, batch_size=4, num_canonical_nodes=1)
    assert len(loader.datasets["16x24"].streams) == 3  # two public partitions + internal
    batches = [b["key"] for b in loader]
    assert all(len({_shape_of(k) for k in keys}) == 1 for keys in batches)
    counts = Counter(k for keys in batches for k in keys)
    internal_kept = internal.all_keys() - skipped
    assert {k for k in counts if k.endswith("-int")} == internal_kept
    assert {counts[k] for k in internal_kept} == {2}  # repeat=2 on the internal source
    assert {c for k, c in counts.items() if not k.endswith("-int")} == {1}
    # The internal stream read through its cache (remote = the internal root).
    assert any((tmp_path / "cache" / "internal" / "0/16x24/b0").glob("shard.*.mds"))


def test_the_package_docstring_example_finds_real_buckets(tmp_path: Path):
    """Finding: the documented ``discover_streams(..., tiers=[0, 1])`` returned nothing."""
    import re

    import prx_assets.loader
    from prx_assets.core.shards.buckets import DEFAULT_TIERS
    from prx_assets.core.skiplists.sidecars import write_partition_skiplists

    from .conftest import write_partition

    match = re.search(
        r"discover_streams\(\"[^\"]+\", tiers=\[([\d, ]+)\]\)", prx_assets.loader.__doc__
    )
    assert match, "the package docstring shows discover_streams with a tier filter"
    tiers = [int(t) for t in match.group(1).split(",")]
    assert set(tiers) <= set(DEFAULT_TIERS)  # the tiers the bucket table really writes
    for tier in (*tiers, 4096):
        write_partition(tmp_path / "mds", str(tier), "16x24", "b0", 24)
        write_partition_skiplists(tmp_path / "mds" / str(tier) / "16x24" / "b0", {})
    found = discover_streams(tmp_path, tiers=tiers)
    assert sorted(int(b.tier) for b in found) == sorted(tiers)
    # The old example's tiers match nothing: an error naming the tiers that exist.
    with pytest.raises(ValueError, match=r"tiers=\['0', '1'\]; there are tiers \['512', '1024'"):
        discover_streams(tmp_path, tiers=[0, 1])


def test_discovery_and_loader_refuse_an_unscreened_partition(mds_root: MdsRoot):
    from prx_assets.core.skiplists.sidecars import MANIFEST_BASENAME, SkipListMissing
    from prx_assets.loader import IGNORE_SKIPLISTS_UNSAFE, UnscreenedDataWarning

    mds_root.apply_skips({"0/16x24/b1": {0: {0: ["opt_out"]}}})
    victim = mds_root.shards["0/16x24/b1"][0][0]
    screened = discover_streams(mds_root.root)
    (mds_root.dir("0/16x24/b1") / MANIFEST_BASENAME).unlink()
    with pytest.raises(SkipListMissing, match="never screened"):
        discover_streams(mds_root.root)
    with pytest.raises(SkipListMissing, match="never screened"):  # specs discovered earlier
        ShapeBatchedLoader(screened, batch_size=4, num_canonical_nodes=1)
    with pytest.warns(UnscreenedDataWarning):
        raw = discover_streams(mds_root.root, skiplists=IGNORE_SKIPLISTS_UNSAFE)
    assert [b.counts.kept_samples for b in raw] == [40, 40, 40]
    with pytest.warns(UnscreenedDataWarning) as caught:
        loader = ShapeBatchedLoader(
            raw, batch_size=4, num_canonical_nodes=1, skiplists=IGNORE_SKIPLISTS_UNSAFE
        )
    # One warning per stream (a retry of streaming's prefix race, under load, warns again
    # for the streams it rebuilds: the same messages).
    unscreened = {str(w.message) for w in caught if w.category is UnscreenedDataWarning}
    assert len(unscreened) == 3
    assert victim in {k for b in loader for k in b["key"]}


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_descriptors_grow_with_buckets_not_their_square_and_not_with_epochs(tmp_path: Path):
    """streaming keeps every shared-memory handle it opens until exit, including its peeks at
    other datasets' prefixes (O(buckets²)) and each epoch's resume segment; the small demo's
    11 buckets held 1,343 descriptors, past a 1,024 limit. Now: a bounded number per bucket,
    and none more per epoch."""
    shapes = [f"{8 * (1 + i % 4)}x{8 * (1 + i // 4)}" for i in range(12)]
    root = MdsRoot(tmp_path / "data", layout=[("0", s, "b0", 24) for s in shapes])
    before = _open_descriptors()
    loader = ShapeBatchedLoader(discover_streams(root.root), batch_size=4, num_canonical_nodes=1)
    assert len(loader.shapes) == 12
    built = _open_descriptors() - before
    assert built <= 16 * 12, f"{built} descriptors for 12 buckets"
    keys = [k for b in loader for k in b["key"]]
    after_first = _open_descriptors()
    for _ in range(3):
        assert sorted(k for b in loader for k in b["key"]) == sorted(keys)
    assert _open_descriptors() <= after_first
