"""Streaming's file locks of datasets that are gone are removed; a live dataset's stay."""

import gc
import os
import tempfile
from pathlib import Path

import pytest
import streaming

from prx_assets.loader.locks import remove_dead_streaming_locks
from prx_assets_tests.core.stage_inputs import streaming_memory_released
from prx_assets_tests.streaming_memory import plain_streaming_dataset

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux shared memory")


def _write_mds(root: Path) -> None:
    with streaming.MDSWriter(out=str(root), columns={"key": "str"}) as out:
        for i in range(3):
            out.write({"key": f"k{i}"})


def _locks(tmp: str) -> set[str]:
    return {n for n in os.listdir(tmp) if n.endswith("_filelock") and n[:6].isdigit()}


def test_dead_locks_go_and_a_live_datasets_locks_stay(tmp_path):
    tmp = tempfile.gettempdir()
    shm = set(os.listdir("/dev/shm"))
    used = {int(n[:6]) for n in shm | _locks(tmp) if n[:6].isdigit()}
    dead = max(used, default=0) + 500  # a prefix nobody holds
    stale = {f"{dead:06d}_barrier_filelock", f"{dead:06d}_cache_filelock"}
    for name in stale:
        Path(tmp, name).touch()
    _write_mds(tmp_path / "mds")
    with streaming_memory_released():
        ds = plain_streaming_dataset(local=str(tmp_path / "mds"), batch_size=1)
        assert [s["key"] for s in ds] == ["k0", "k1", "k2"]  # iterating takes the locks
        mine = {n for n in _locks(tmp) if int(n[:6]) == ds._shm_prefix_int}
        assert mine  # what streaming leaves behind
        assert remove_dead_streaming_locks() >= 2
        assert not stale & _locks(tmp)
        assert mine <= _locks(tmp)  # its dataset is alive: kept
        assert [s["key"] for s in ds] == ["k0", "k1", "k2"]  # and still works
        del ds
        gc.collect()
    remove_dead_streaming_locks()  # its shared memory is released now
    assert not mine & _locks(tmp)


def test_nothing_happens_without_a_shared_memory_directory(tmp_path):
    Path(tmp_path, "000001_barrier_filelock").touch()
    assert remove_dead_streaming_locks(str(tmp_path), shm_dir=str(tmp_path / "absent")) == 0
    assert Path(tmp_path, "000001_barrier_filelock").exists()


def test_the_loader_clears_dead_locks_before_it_builds_its_datasets(mds_root):
    from prx_assets.loader import ShapeBatchedLoader, discover_streams

    tmp = tempfile.gettempdir()
    used = {int(n[:6]) for n in set(os.listdir("/dev/shm")) | _locks(tmp) if n[:6].isdigit()}
    dead = {f"{max(used, default=0) + 700 + i:06d}_cache_filelock" for i in range(3)}
    for name in dead:
        Path(tmp, name).touch()
    loader = ShapeBatchedLoader(
        discover_streams(mds_root.root), batch_size=4, num_canonical_nodes=1
    )
    assert not dead & _locks(tmp)
    assert {k for b in loader for k in b["key"]} == mds_root.all_keys()
