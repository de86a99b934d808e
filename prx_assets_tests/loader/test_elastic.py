"""Simulated multi-rank runs (forked ranks on one node, gloo): equal counts, elastic resume."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from prx_assets.loader import ShapeBatchedLoader, SkipListDataset, SkipListStream, discover_streams
from prx_assets.loader.shape_loader import collate_samples

from .conftest import MdsRoot, run_ranks

BATCH = 4


def _loader(root: str, num_workers: int = 0) -> ShapeBatchedLoader:
    return ShapeBatchedLoader(
        discover_streams(root), batch_size=BATCH, num_workers=num_workers, num_canonical_nodes=1
    )


def _epochs_job(rank: int, world: int, root: str, relpaths: list[str], num_workers: int) -> dict:
    loader = _loader(root, num_workers)
    epochs = [[b["key"] for b in loader] for _ in range(2)]
    ds = SkipListDataset(
        streams=[SkipListStream(local=f"{root}/mds/{r}") for r in relpaths],
        batch_size=BATCH,
        num_canonical_nodes=1,
        shuffle=True,
    )
    dl = DataLoader(ds, batch_size=BATCH, num_workers=num_workers, collate_fn=collate_samples)
    flat = [k for b in dl for k in b["key"]]
    return {"len": len(loader), "epochs": epochs, "ds_len": len(ds), "ds_keys": flat}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_world_two_ranks_get_equal_counts_and_never_a_skipped_sample(
    mds_root: MdsRoot, tmp_path: Path, num_workers: int
):
    skipped = mds_root.random_skips(random.Random(30 + num_workers))
    kept = mds_root.all_keys() - skipped
    results = run_ranks(
        _epochs_job,
        2,
        tmp_path,
        root=str(mds_root.root),
        relpaths=sorted(mds_root.shards),
        num_workers=num_workers,
    )
    for epoch in range(2):
        counts = [len(r["epochs"][epoch]) for r in results]
        assert counts[0] == counts[1] == results[0]["len"]  # same number of steps per rank
        for step in range(counts[0]):  # every step is one shape, the same on both ranks
            shapes = {k.split("/")[1] for r in results for k in r["epochs"][epoch][step]}
            assert len(shapes) == 1
        flat = [k for r in results for b in r["epochs"][epoch] for k in b]
        assert set(flat) == kept and not set(flat) & skipped
        assert len(flat) - len(kept) <= 2 * (2 - 1)  # streaming's rank padding, per shape
    # The raw dataset: equal per-rank sample counts, skipped samples never yielded.
    assert len(results[0]["ds_keys"]) == len(results[1]["ds_keys"]) == results[0]["ds_len"]
    ds_flat = results[0]["ds_keys"] + results[1]["ds_keys"]
    assert set(ds_flat) == kept and len(ds_flat) - len(kept) <= 1


def _head_job(
    rank: int, world: int, root: str, n: int, state: dict | None = None, resume_twice: bool = False
) -> dict[str, Any]:
    """Optionally resume from ``state``; take ``n`` batches, checkpoint, finish the epoch."""
    loader = _loader(root)
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    head = [next(it)["key"] for _ in range(n)]
    ckpt = loader.state_dict()
    tail = [b["key"] for b in it]
    out = {"head": head, "state": ckpt, "tail": tail}
    if resume_twice:  # same world: resuming must give exactly the uninterrupted tail
        again = _loader(root)
        again.load_state_dict(ckpt)
        out["resumed_tail"] = [b["key"] for b in again]
    return out


def _flat(batches: list[list[str]]) -> list[str]:
    return [k for b in batches for k in b]


def test_elastic_resume_across_world_sizes(mds_root: MdsRoot, tmp_path: Path):
    skipped = mds_root.random_skips(random.Random(8))
    kept = mds_root.all_keys() - skipped
    root = str(mds_root.root)

    # Uninterrupted epochs at both world sizes (for the padding bound).
    full1 = _flat(run_ranks(_head_job, 1, tmp_path, root=root, n=0)[0]["tail"])
    assert Counter(full1) == Counter(kept)

    # 1 -> 2: checkpoint after 4 batches on one rank, finish the epoch on two.
    one = _head_job(0, 1, root, 4)
    two = run_ranks(_head_job, 2, tmp_path, root=root, n=3, state=one["state"], resume_twice=True)
    pre, post = _flat(one["head"]), [k for r in two for k in _flat(r["head"] + r["tail"])]
    assert not set(pre) & set(post), "a sample was repeated across the checkpoint"
    assert set(pre) | set(post) == kept, "a sample was lost"
    assert not (set(pre) | set(post)) & skipped
    assert len(pre) + len(post) - len(kept) <= 2  # rank padding only
    assert len(two[0]["head"] + two[0]["tail"]) == len(two[1]["head"] + two[1]["tail"])

    # 2 -> 2 (same world, mid-epoch after the elastic resume): exactly the same tail per rank.
    assert two[0]["state"] == two[1]["state"]
    for r in two:
        assert r["resumed_tail"] == r["tail"]

    # 2 -> 1: checkpoint taken on two ranks (after 1->2 and 3 more batches), finish on one.
    pre2 = pre + [k for r in two for k in _flat(r["head"])]
    post2 = _flat(_head_job(0, 1, root, 0, state=two[0]["state"])["tail"])
    assert not set(pre2) & set(post2), "a sample was repeated across the checkpoint"
    assert set(pre2) | set(post2) == kept, "a sample was lost"
    assert len(pre2) + len(post2) - len(kept) <= 2
