"""A bucket x batch directory replaced under a built dataset: nothing more is read from it.

Skip-lists name samples by position. A rerun of ``mds_shards`` replaces the directory with
a new version (``core/shards/mds.py``: renamed into place whole), so a dataset built before
it holds the old index and the old skip-lists; read against the new shards they would skip
the wrong rows and yield an excluded sample. The writer here is the real one; the
directory is rewritten with one sample fewer at the front, so every position moves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from prx_assets.core.shards.mds import MDSSample, Placement, write_bucket_partition
from prx_assets.core.skiplists.sidecars import load_generation, update_skiplists
from prx_assets.loader import ShardsReplaced, SkipListDataset, SkipListStream
from prx_assets.loader.shape_loader import collate_samples

from .conftest import _photo_crops

BATCH, TIER, SHAPE = "b0", 512, "16x24"
N = 40
EXCLUDED = f"{BATCH}-0012"  # opted out: in every version's skip-lists


def _samples(n: int = N) -> list[MDSSample]:
    images = _photo_crops((16, 24), n, seed=7)
    return [
        MDSSample(
            key=f"{BATCH}-{i:04d}",
            image=images[i],
            caption=f"sample {i}",
            orig_width=192,
            orig_height=128,
            tier=TIER,
            shape=SHAPE,
            source="public",
            license="cc-by",
        )
        for i in range(n)
    ]


def _excluding(keys: set[str]):
    def skips_for(placements: Sequence[Placement]) -> dict[str, dict[int, list[str]]]:
        out: dict[str, dict[int, list[str]]] = {}
        for p in placements:
            if p.key in keys:
                out.setdefault(p.shard, {})[p.index_in_shard] = ["opt_out"]
        return out

    return skips_for


def _write(root: Path, samples: Iterable[MDSSample]) -> Path:
    """The real atomic writer, several shards, each shard's sha256 in index.json."""
    samples = list(samples)
    size_limit = 8 * (max(len(s.image) for s in samples) + 300)
    write_bucket_partition(
        root,
        BATCH,
        TIER,
        SHAPE,
        samples,
        skips_for=_excluding({EXCLUDED}),
        size_limit=size_limit,
        hashes=("sha256",),
    )
    out = root / "mds" / str(TIER) / SHAPE / BATCH
    assert len(json.loads((out / "index.json").read_text())["shards"]) >= 3
    return out


def _dataset(stream: SkipListStream) -> SkipListDataset:
    return SkipListDataset(streams=[stream], batch_size=1, num_canonical_nodes=1, shuffle=False)


def _read_until_refused(it) -> tuple[list[str], BaseException | None]:
    seen: list[str] = []
    try:
        for sample in it:
            seen.append(sample["key"])
    except Exception as exc:  # noqa: BLE001 - the test inspects what stopped the epoch
        return seen, exc
    return seen, None


def _caused_by_replacement(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, ShardsReplaced):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def test_a_rerun_under_an_iterating_dataset_stops_it_before_an_excluded_sample(tmp_path: Path):
    d = _write(tmp_path, _samples())
    ds = _dataset(SkipListStream(local=str(d)))
    it = iter(ds)
    seen = [next(it)["key"] for _ in range(2)]
    _write(tmp_path, _samples()[1:])  # the rerun: every later sample moves up one place

    more, stopped = _read_until_refused(it)
    assert isinstance(stopped, ShardsReplaced), stopped
    assert "was replaced" in str(stopped) and str(d) in str(stopped)
    assert EXCLUDED not in seen + more
    assert not more  # the first read after the rename is refused

    # A dataset built now reads the new version whole, its own skip-lists applied.
    keys = [s["key"] for s in _dataset(SkipListStream(local=str(d)))]
    assert keys == [s.key for s in _samples()[1:] if s.key != EXCLUDED]


def test_dataloader_workers_check_the_directory_the_dataset_was_built_from(tmp_path: Path):
    d = _write(tmp_path, _samples())
    ds = _dataset(SkipListStream(local=str(d)))
    _write(tmp_path, _samples()[1:])  # after construction, before the workers start
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate_samples)
    with pytest.raises(ShardsReplaced, match="was replaced"):
        for _ in loader:
            pass


def test_a_new_skiplist_generation_in_the_same_directory_is_no_replacement(tmp_path: Path):
    """skip_lists adds files to the directory and flips its manifest: the shards are the
    same, so the built dataset reads on with the skip-lists it loaded."""
    d = _write(tmp_path, _samples())
    ds = _dataset(SkipListStream(local=str(d)))
    it = iter(ds)
    seen = [next(it)["key"] for _ in range(2)]
    gen = load_generation(d)
    update_skiplists(d, {gen.manifest.entries[0].shard: {5: ["duplicate"]}})
    more, stopped = _read_until_refused(it)
    assert stopped is None
    assert seen + more == [s.key for s in _samples() if s.key != EXCLUDED]


def test_a_replaced_remote_directory_is_not_copied_into_the_cache(tmp_path: Path):
    """A remote that is a path is copied into the cache shard by shard, on demand: a shard
    fetched after the replacement is refused and its copy removed (it is the new
    version's), so the cache holds only shards of the index the dataset loaded."""
    d = _write(tmp_path / "remote", _samples())
    old_hashes = {
        s["raw_data"]["basename"]: s["raw_data"]["hashes"]["sha256"]
        for s in json.loads((d / "index.json").read_text())["shards"]
    }
    cache = tmp_path / "cache"
    ds = _dataset(SkipListStream(remote=str(d), local=str(cache)))
    _write(tmp_path / "remote", _samples()[1:])  # before any shard was fetched

    seen, stopped = _read_until_refused(iter(ds))
    assert _caused_by_replacement(stopped), stopped
    assert EXCLUDED not in seen
    for name, sha in old_hashes.items():
        with contextlib.suppress(FileNotFoundError):
            assert hashlib.sha256((cache / name).read_bytes()).hexdigest() == sha, name


def test_a_rerun_landing_while_the_dataset_is_built_is_read_again(tmp_path: Path, monkeypatch):
    """The directory's identity is taken before the index is read and after the last
    sidecar: a replacement in between means those reads may mix two versions, so the stream
    reads again and pins the new one."""
    d = _write(tmp_path, _samples())
    real = SkipListStream._load_skiplists
    calls = []

    def load_then_rerun(self, readers, index_raw):
        out = real(self, readers, index_raw)
        calls.append(1)
        if len(calls) == 1:
            _write(tmp_path, _samples()[1:])  # lands between the index and the pin
        return out

    monkeypatch.setattr(SkipListStream, "_load_skiplists", load_then_rerun)
    ds = _dataset(SkipListStream(local=str(d)))
    assert len(calls) == 2
    keys = [s["key"] for s in ds]
    assert keys == [s.key for s in _samples()[1:] if s.key != EXCLUDED]
