"""SkipListDataset: skips applied before partitioning, exact resume, digest guard, remotes."""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import os
import random
import warnings
from collections import Counter
from pathlib import Path

import pytest
from streaming import Stream, StreamingDataLoader
from torch.utils.data import DataLoader

from prx_assets.core.skiplists.sidecars import (
    MANIFEST_BASENAME,
    SkipListCorrupt,
    SkipListError,
    SkipListMissing,
    SkipListStale,
    canonical_json,
    known_empty,
    load_generation,
    skiplist_digest,
    update_skiplists,
    write_partition_skiplists,
)
from prx_assets.loader import (
    IGNORE_SKIPLISTS_UNSAFE,
    FilteredShard,
    SkipListChanged,
    SkipListDataset,
    SkipListStream,
    SmallBucketWarning,
    UnscreenedDataWarning,
    small_bucket_problems,
)
from prx_assets.loader.shape_loader import collate_samples

from .conftest import MdsRoot

RELPATHS = ("0/16x24/b0", "0/16x24/b1", "1/24x16/b0")


def _dataset(m: MdsRoot, **kwargs) -> SkipListDataset:
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_canonical_nodes", 1)
    kwargs.setdefault("shuffle", True)
    streams = [SkipListStream(local=str(m.dir(r))) for r in RELPATHS]
    return SkipListDataset(streams=streams, **kwargs)


def _epoch_keys(ds: SkipListDataset, num_workers: int) -> list[str]:
    if num_workers == 0:
        return [s["key"] for s in ds]
    loader = DataLoader(ds, batch_size=4, num_workers=num_workers, collate_fn=collate_samples)
    return [k for batch in loader for k in batch["key"]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_random_skips_are_never_yielded(mds_root: MdsRoot, num_workers: int):
    for seed in range(3):
        skipped = mds_root.random_skips(random.Random(seed))
        kept = mds_root.all_keys() - skipped
        ds = _dataset(mds_root, shuffle_seed=seed)
        assert ds.num_samples == len(ds) == len(kept)
        assert ds.raw_num_samples == 120
        assert len(ds.dropped_shards) == 1  # random_skips empties one whole shard
        orders = []
        for _ in range(2):  # two epochs
            keys = _epoch_keys(ds, num_workers)
            assert Counter(keys) == Counter(kept)  # every kept sample exactly once
            orders.append(keys)
        assert orders[0] != orders[1]  # reshuffled per epoch, still in the filtered space
        del ds
        gc.collect()


def test_all_skipped_shard_is_dropped_cleanly(mds_root: MdsRoot):
    rel = RELPATHS[0]
    names = mds_root.shard_names(rel)
    n1 = len(mds_root.shards[rel][1])
    skipped = mds_root.apply_skips({rel: {1: dict.fromkeys(range(n1), ["duplicate"])}})
    ds = _dataset(mds_root, shuffle=False)
    assert ds.dropped_shards == [(str(mds_root.dir(rel)), names[1])]
    assert ds.num_shards == sum(len(s) for s in mds_root.shards.values()) - 1
    keys = [s["key"] for s in ds]
    assert len(keys) == 120 - n1 and not set(keys) & skipped
    # The remaining shard of that partition is a plain reader (no skips), others unchanged.
    assert not any(isinstance(s, FilteredShard) for s in ds.shards)


def test_every_sample_skipped_is_a_clear_error(mds_root: MdsRoot):
    rel = RELPATHS[2]
    mds_root.apply_skips(
        {
            rel: {
                i: dict.fromkeys(range(len(k)), ["opt_out"])
                for i, k in enumerate(mds_root.shards[rel])
            }
        }
    )
    with pytest.raises(SkipListError, match="every sample of .* is skipped"):
        _dataset(mds_root)


def test_filtered_shard_maps_kept_indices_to_real_rows(mds_root: MdsRoot):
    rel = RELPATHS[1]
    mds_root.apply_skips({rel: {0: {0: ["quality"], 3: ["class_text"], 7: ["opt_out"]}}})
    ds = _dataset(mds_root)
    shard = ds.shards[ds.shard_offset_per_stream[1]]
    assert isinstance(shard, FilteredShard)
    expected = [k for i, k in enumerate(mds_root.shards[rel][0]) if i not in (0, 3, 7)]
    assert len(shard) == shard.samples == len(expected)
    assert [shard[i]["key"] for i in range(len(shard))] == expected
    assert shard[-1]["key"] == expected[-1]
    assert shard.real_index(0) == 1
    with pytest.raises(IndexError):
        shard[len(expected)]
    assert shard.file_pairs == shard.reader.file_pairs  # files are the real shard's


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_after_n_batches_continues_exactly(mds_root: MdsRoot, num_workers: int):
    mds_root.random_skips(random.Random(11))

    def loader(ds):
        return StreamingDataLoader(
            ds, batch_size=4, num_workers=num_workers, collate_fn=collate_samples
        )

    full = [b["key"] for b in loader(_dataset(mds_root))]
    ds = _dataset(mds_root)
    dl = loader(ds)
    it = iter(dl)
    head = [next(it)["key"] for _ in range(5)]
    state = dl.state_dict()
    del it
    assert head == full[:5]
    assert state["sample_in_epoch"] == 20 and state["skiplist_digest"] == ds.skiplist_digest

    resumed = _dataset(mds_root)
    dl2 = loader(resumed)
    dl2.load_state_dict(state)
    rest = [b["key"] for b in dl2]
    assert rest == full[5:]


def test_skiplist_change_is_detected_on_resume(mds_root: MdsRoot):
    ds = _dataset(mds_root)
    it = iter(ds)
    seen = [next(it)["key"] for _ in range(6)]
    state = ds.state_dict(6, True)
    del it

    # Opt out one sample that was not yet seen.
    rel = RELPATHS[2]
    victim_shard, victim_idx = 2, 1
    victim = mds_root.shards[rel][victim_shard][victim_idx]
    assert victim not in seen
    mds_root.apply_skips({rel: {victim_shard: {victim_idx: ["opt_out"]}}})

    changed = _dataset(mds_root)
    assert changed.skiplist_digest != state["skiplist_digest"]
    with pytest.raises(SkipListChanged, match="allow_skiplist_change=True"):
        changed.load_state_dict(state)
    legacy = {k: v for k, v in state.items() if k != "skiplist_digest"}
    with pytest.raises(SkipListChanged, match="predates skip-lists"):
        changed.load_state_dict(legacy)

    allowed = _dataset(mds_root, allow_skiplist_change=True)
    with pytest.warns(UserWarning, match="changed skip-lists"):
        allowed.load_state_dict(state)
    rest = [s["key"] for s in allowed]
    assert victim not in rest
    assert len(rest) == allowed.num_samples - 6


def _live_sidecar(m: MdsRoot, rel: str, shard_no: int) -> Path:
    d = m.dir(rel)
    return d / load_generation(d).manifest.entries[shard_no].sidecar


def _rehash(obj: dict) -> bytes:
    obj = {k: v for k, v in obj.items() if k != "sha256"}
    obj["sha256"] = hashlib.sha256(canonical_json(obj)).hexdigest()
    return canonical_json(obj) + b"\n"


def _shard_keys(m: MdsRoot, rel: str, shard: int) -> set[str]:
    return set(m.shards[rel][shard])


def _read_until_refused(ds: SkipListDataset, error: type[Exception], match: str) -> set[str]:
    """Iterate ``ds`` until it raises ``error``; the keys it yielded before."""
    seen: set[str] = set()
    with pytest.raises(error, match=match):
        for sample in ds:
            seen.add(sample["key"])
    return seen


def test_tampered_sidecar_stops_the_dataset(mds_root: MdsRoot):
    """A sidecar is verified when its shard is first read (the dataset is built from the
    manifest's counts): a tampered or missing one stops the read before any sample of its
    shard is returned, in order or shuffled, however often it is tried."""
    rel = RELPATHS[0]
    mds_root.apply_skips({rel: {0: {2: ["opt_out"]}}})
    path = _live_sidecar(mds_root, rel, 0)
    original = path.read_bytes()
    obj = json.loads(original)
    obj["indices"] = []
    obj["reasons"] = []
    guarded = _shard_keys(mds_root, rel, 0)
    path.write_text(json.dumps(obj))  # un-skip an opt-out by hand
    for shuffle in (False, True):
        ds = _dataset(mds_root, shuffle=shuffle)
        assert ds.num_samples == 119  # the manifest's count: built without the sidecar
        seen = _read_until_refused(ds, SkipListCorrupt, "sha256 differs from the manifest")
        assert not seen & guarded
        del ds
    path.write_bytes(_rehash(obj))  # even with a valid self-hash: the manifest pins the bytes
    ds = _dataset(mds_root, shuffle=False)
    assert not _read_until_refused(ds, SkipListCorrupt, "sha256 differs") & guarded
    del ds
    path.unlink()  # a sidecar the manifest names is gone: not "nothing skipped"
    ds = _dataset(mds_root, shuffle=False)
    assert not _read_until_refused(ds, SkipListCorrupt, "is gone") & guarded
    del ds
    gc.collect()
    path.write_bytes(original)
    ds = _dataset(mds_root)
    keys = {s["key"] for s in ds}
    assert len(keys) == 119 and mds_root.shards[rel][0][2] not in keys


def test_a_job_keeps_its_generation_across_an_opt_out_until_the_retention_ends(
    mds_root: MdsRoot, monkeypatch
):
    """A dataset built before a new generation is published reads the one it was built on
    (its sidecars outlive the flip: ``DEFAULT_RETENTION_S``), exactly as it was built, in
    dataloader workers too; once they are swept, the next read of that shard stops it."""
    from prx_assets.core.skiplists.sidecars import RETENTION_ENV, sweep

    monkeypatch.delenv(RETENTION_ENV, raising=False)
    rel = RELPATHS[0]
    mds_root.apply_skips({rel: {0: {2: ["opt_out"]}}})
    before = _dataset(mds_root)
    digest = before.skiplist_digest
    victim = mds_root.shards[rel][0][5]
    update_skiplists(mds_root.dir(rel), {mds_root.shard_names(rel)[0]: {5: ["opt_out"]}})
    assert sweep(mds_root.dir(rel)) == []  # the superseded sidecar is within its retention
    keys = _epoch_keys(before, num_workers=2)
    assert len(keys) == 119 and victim in keys and mds_root.shards[rel][0][2] not in keys
    assert _dataset(mds_root).skiplist_digest != digest  # a new job: the new generation
    assert victim not in {s["key"] for s in _dataset(mds_root)}
    # Past the retention (0 here) the superseded sidecar is swept: a job built on it stops
    # at its next read of that shard instead of reading it unscreened.
    update_skiplists(mds_root.dir(rel), {mds_root.shard_names(rel)[0]: {6: ["opt_out"]}})
    old = _dataset(mds_root, shuffle=False)
    update_skiplists(mds_root.dir(rel), {mds_root.shard_names(rel)[0]: {7: ["opt_out"]}})
    monkeypatch.setenv(RETENTION_ENV, "0")
    assert sweep(mds_root.dir(rel))  # the generation `old` was built on is gone
    guarded = _shard_keys(mds_root, rel, 0)
    assert not _read_until_refused(old, SkipListCorrupt, "is gone") & guarded


def test_manifest_is_checked_against_the_index(mds_root: MdsRoot):
    """A manifest describes exactly one index.json: copied or stale ones are refused."""
    a, b = mds_root.dir(RELPATHS[0]), mds_root.dir(RELPATHS[1])
    manifest_b = (b / MANIFEST_BASENAME).read_bytes()
    (a / MANIFEST_BASENAME).write_bytes(manifest_b)  # same shard names, other directory
    with pytest.raises(SkipListStale, match="written for another index.json"):
        _dataset(mds_root)
    obj = json.loads(manifest_b)
    obj["index_sha256"] = hashlib.sha256((a / "index.json").read_bytes()).hexdigest()
    obj["shards"] = obj["shards"][:-1]  # drop a shard: its samples would go unscreened
    (a / MANIFEST_BASENAME).write_bytes(_rehash(obj))
    with pytest.raises(SkipListCorrupt, match="not index.json's"):
        _dataset(mds_root)
    (a / MANIFEST_BASENAME).write_bytes(b'{"format": "prx-skiplist-manif')  # truncated
    with pytest.raises(SkipListCorrupt, match="not valid JSON"):
        _dataset(mds_root)
    (a / MANIFEST_BASENAME).unlink()
    with pytest.raises(SkipListMissing, match="never screened"):
        _dataset(mds_root)


def test_plain_streams_are_converted_and_digest_matches_offline_tool(mds_root: MdsRoot):
    skipped = mds_root.random_skips(random.Random(5), drop_whole_shard=False)
    streams = [Stream(local=str(mds_root.dir(r)), repeat=1) for r in RELPATHS]
    ds = SkipListDataset(streams=streams, batch_size=4, num_canonical_nodes=1)
    assert all(isinstance(s, SkipListStream) for s in ds.streams)
    assert not {s["key"] for s in ds} & skipped
    assert ds.skiplist_digest == skiplist_digest([mds_root.dir(r) for r in RELPATHS])


def test_remote_stream_copies_shards_and_fetches_skiplists(mds_root: MdsRoot, tmp_path: Path):
    rel = RELPATHS[0]
    remote = mds_root.dir(rel)
    names = mds_root.shard_names(rel)
    skipped = mds_root.apply_skips(
        {
            rel: {
                0: {1: ["duplicate"]},
                2: dict.fromkeys(range(len(mds_root.shards[rel][2])), ["class_nsfw"]),
            }
        }
    )
    local = tmp_path / "cache" / rel

    def build(**kw) -> SkipListDataset:
        gc.collect()  # a live dataset keeps its local dir registered
        return SkipListDataset(
            remote=str(remote), local=str(local), batch_size=4, num_canonical_nodes=1, **kw
        )

    ds = build()
    keys = {s["key"] for s in ds}
    assert keys == {k for s in mds_root.shards[rel] for k in s} - skipped
    cached = set(p.name for p in local.iterdir())
    live = load_generation(remote).manifest
    skipping = {e.sidecar for e in live.entries if not known_empty(e)}
    assert skipping  # an empty sidecar's bytes are fixed by its sha256: not fetched
    assert MANIFEST_BASENAME in cached and skipping <= cached  # mirrored beside index
    assert names[0] in cached and names[2] not in cached  # the all-skipped shard never copied
    assert ds.skiplist_digest == skiplist_digest([remote])
    assert ds.streams[0].generation == live.generation
    del ds

    # Skip-lists change on the remote: the next job sees the new skips, not the stale mirror.
    new_victim = mds_root.shards[rel][1][4]
    update_skiplists(remote, {names[0]: {}, names[1]: {4: ["opt_out"]}})
    ds = build()
    keys = {s["key"] for s in ds}
    assert mds_root.shards[rel][0][1] in keys and new_victim not in keys
    cached = {p.name for p in local.iterdir() if p.name.endswith(".skip.json")}
    live = load_generation(remote).manifest
    assert {e.sidecar for e in live.entries if not known_empty(e)} <= cached <= live.sidecars
    assert cached  # ... and the old generation's mirrors dropped
    del ds

    # The remote loses its manifest (never screened, or removed): refused, mirror dropped.
    (remote / MANIFEST_BASENAME).unlink()
    with pytest.raises(SkipListMissing, match="ignore-UNSAFE"):
        build()
    assert not (local / MANIFEST_BASENAME).exists()
    with pytest.warns(UnscreenedDataWarning, match="WITHOUT skip-lists"):
        ds = build(skiplists=IGNORE_SKIPLISTS_UNSAFE)
    assert new_victim in {s["key"] for s in ds}  # unscreened: everything, as announced
    del ds

    # The remote directory is rewritten (new shards, new generation) after it was cached:
    # the cache's index.json no longer matches the skip-lists, so nothing is read from it.
    from .conftest import write_partition

    fresh = tmp_path / "rewrite"
    write_partition(fresh, "0", "16x24", "b0", 30, key_suffix="-v2")
    for f in (fresh / "0" / "16x24" / "b0").iterdir():
        os.replace(f, remote / f.name)
    write_partition_skiplists(remote, {})
    with pytest.raises(SkipListStale, match="clear that cache directory"):
        build()


def test_small_bucket_warning_states_the_rule(mds_root: MdsRoot):
    assert small_bucket_problems(100, 10, 4, 16) == []
    problems = small_bucket_problems(30, 2, 4, 16)
    assert "30 kept samples < num_canonical_nodes × batch_size = 4 × 16" in problems[0]
    assert "2 kept shards < num_canonical_nodes = 4" in problems[1]
    with pytest.warns(SmallBucketWarning, match="kept samples < num_canonical_nodes"):
        _dataset(mds_root, num_canonical_nodes=8, batch_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallBucketWarning)
        _dataset(mds_root, num_canonical_nodes=2, batch_size=4)


def test_loader_and_shard_writer_judge_small_buckets_by_one_rule():
    """The loader's warning and mds_shards' hazard report are one rule in two vocabularies."""
    from prx_assets.core.shards.small_buckets import small_bucket_problems as shard_rule

    for samples, shards, nodes, batch in itertools.product(
        (0, 3, 8, 64), (1, 4, 8), (1, 4, 8), (1, 2)
    ):
        loader = small_bucket_problems(samples, shards, nodes, batch)
        writer = shard_rule(samples, shards, nodes, batch)
        assert len(loader) == len(writer)
        assert [p.split()[0] for p in loader] == [p.split()[0] for p in writer]
    assert shard_rule(30, 2, 4, 16) == [
        "30 samples < canonical nodes x device batch = 4 x 16",
        "2 shards < canonical nodes = 4",
    ]


def test_a_directory_without_skiplists_is_refused_by_default(tmp_path: Path):
    """Finding: a missing sidecar read as "skip nothing", so unscreened shards trained."""
    from .conftest import write_partition

    shards = write_partition(tmp_path / "mds", "0", "16x24", "raw", 24)  # never screened
    local = str(tmp_path / "mds" / "0" / "16x24" / "raw")
    with pytest.raises(SkipListError, match="no skip-list manifest"):
        SkipListDataset(local=local, batch_size=4)
    with pytest.raises(ValueError, match="ignore-UNSAFE"):
        SkipListDataset(local=local, batch_size=4, skiplists="ignore")  # no quiet spelling
    for _ in range(2):  # the explicit option works, and says so every time
        with pytest.warns(UnscreenedDataWarning, match="never train on this"):
            ds = SkipListDataset(local=local, batch_size=4, skiplists=IGNORE_SKIPLISTS_UNSAFE)
        assert sorted(s["key"] for s in ds) == sorted(k for s in shards for k in s)
        assert ds.skiplist_digest != skiplist_digest([])
        del ds
        gc.collect()


def test_losing_streamings_shared_memory_prefix_race_is_retried(mds_root: MdsRoot, monkeypatch):
    """Another process registers the prefix this one just found free (streaming's
    check-then-create race, seen with test suites side by side): construction retries
    with the next free prefix instead of failing."""
    from multiprocessing.shared_memory import SharedMemory

    import streaming.base.shared.prefix as prefix_module

    real = prefix_module._check_and_find_retrying
    taken: list[SharedMemory] = []

    def racing(streams_local, streams_remote, shm_name, retry):
        prefix = real(streams_local, streams_remote, shm_name, retry)
        if not taken:  # between streaming's check and its create, another process wins
            taken.append(SharedMemory(f"/{prefix:06}_locals", create=True, size=8))
        return prefix

    monkeypatch.setattr(prefix_module, "_check_and_find_retrying", racing)
    try:
        ds = _dataset(mds_root, shuffle=False)
        assert taken, "the race was not staged"
        assert {s["key"] for s in ds} == mds_root.all_keys()
    finally:
        for shm in taken:
            shm.close()
            shm.unlink()
