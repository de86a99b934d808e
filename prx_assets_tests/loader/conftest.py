"""Small real MDS partitions (tiny JPEGs cut from the demo photos) and a rank simulator."""

from __future__ import annotations

import atexit
import functools
import io
import json
import multiprocessing
import os
import random
import re
import socket
import traceback
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from prx_assets.core.shards.mds import BASE_COLUMNS
from prx_assets.core.shards.published import mark_published

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"
COLUMNS_BYTES = dict(BASE_COLUMNS)  # the shard contract written by core/shards/mds.py
WORDS = "a photo of the red cat dog on grass brick wall coffee cup coins flower".split()

# Three partitions, two shapes: (tier, "HxW", batch, samples).
LAYOUT = (("0", "16x24", "b0", 40), ("0", "16x24", "b1", 40), ("1", "24x16", "b0", 40))


@functools.cache
def _sources() -> tuple[Image.Image, ...]:
    photos = sorted(p for p in PHOTOS.iterdir() if p.suffix.lower() in (".jpg", ".png"))
    return tuple(Image.open(p).convert("RGB") for p in photos[:4])


@functools.cache
def _photo_crops(shape: tuple[int, int], n: int, seed: int) -> tuple[bytes, ...]:
    from prx_assets.loader.collate import jpeg_bytes

    rng = random.Random(seed)
    sources = _sources()
    h, w = shape
    out = []
    for i in range(n):
        img = sources[i % len(sources)]
        x = rng.randrange(0, img.width - 8 * w)
        y = rng.randrange(0, img.height - 8 * h)
        crop = img.crop((x, y, x + 8 * w, y + 8 * h)).resize((w, h), Image.Resampling.BILINEAR)
        out.append(jpeg_bytes(crop, quality=85))
    return tuple(out)


def write_partition(
    mds_root: Path,
    tier: str,
    shape: str,
    batch: str,
    n: int,
    *,
    image_type: str = "bytes",
    per_shard: int = 8,
    key_suffix: str = "",
) -> list[list[str]]:
    """Write one partition; returns the keys of each shard, in shard order."""
    from streaming import MDSWriter

    h, w = (int(v) for v in shape.split("x"))
    out = mds_root / tier / shape / batch
    images = _photo_crops((h, w), n, seed=zlib.crc32(f"{tier}/{shape}/{batch}".encode()))
    columns = dict(COLUMNS_BYTES, image=image_type)
    # size_limit in bytes: roughly ``per_shard`` samples per shard, so several shards per dir.
    size_limit = per_shard * (max(len(b) for b in images) + 200)
    rows = []
    with MDSWriter(out=str(out), columns=columns, size_limit=size_limit) as writer:
        for i, data in enumerate(images):
            key = f"{tier}/{shape}/{batch}/{i:04d}{key_suffix}"
            value: Any = data if image_type == "bytes" else Image.open(io.BytesIO(data))
            writer.write(
                {
                    "image": value,
                    "caption": f"{WORDS[i % len(WORDS)]} {WORDS[(i * 7) % len(WORDS)]} {i}",
                    "key": key,
                    "orig_width": w * 8,
                    "orig_height": h * 8,
                    "tier": int(tier),
                    "shape": shape,
                    "source": "public",
                    "license": "cc-by",
                }
            )
            rows.append(key)
    mark_published(out)  # as mds_shards publishes it: plain streaming refuses it
    index = json.loads((out / "index.json").read_text())
    shards, start = [], 0
    for info in index["shards"]:
        shards.append(rows[start : start + info["samples"]])
        start += info["samples"]
    assert start == n and len(shards) >= 3
    return shards


class MdsRoot:
    """A root with LAYOUT written under ``<root>/mds``; ``shards[relpath]`` = keys per shard.

    Every partition starts screened with nothing skipped (an empty skip-list generation), as
    ``mds_shards`` leaves it when no decision excludes anything.
    """

    def __init__(self, root: Path, layout=LAYOUT, key_suffix: str = "") -> None:
        from prx_assets.core.skiplists.sidecars import write_partition_skiplists

        self.root = root
        self.mds = root / "mds"
        self.shards: dict[str, list[list[str]]] = {}
        for tier, shape, batch, n in layout:
            relpath = f"{tier}/{shape}/{batch}"
            self.shards[relpath] = write_partition(
                self.mds, tier, shape, batch, n, key_suffix=key_suffix
            )
            write_partition_skiplists(self.dir(relpath), {})

    def dir(self, relpath: str) -> Path:
        return self.mds / relpath

    def shard_names(self, relpath: str) -> list[str]:
        index = json.loads((self.dir(relpath) / "index.json").read_text())
        return [s["raw_data"]["basename"] for s in index["shards"]]

    def all_keys(self) -> set[str]:
        return {k for shards in self.shards.values() for s in shards for k in s}

    def apply_skips(self, skips: Mapping[str, Mapping[int, Mapping[int, list[str]]]]) -> set[str]:
        """skips[relpath][shard_no][index] = reasons → one new generation per partition, with
        those shards' skip sets replaced; returns the keys skipped by the listed shards."""
        from prx_assets.core.skiplists.sidecars import update_skiplists

        skipped = set()
        for relpath, by_shard in skips.items():
            names = self.shard_names(relpath)
            update_skiplists(
                self.dir(relpath), {names[no]: entries for no, entries in by_shard.items()}
            )
            for shard_no, entries in by_shard.items():
                skipped |= {self.shards[relpath][shard_no][i] for i in entries}
        return skipped

    def random_skips(self, rng: random.Random, drop_whole_shard: bool = True) -> set[str]:
        """Random skip sets over every partition (one whole shard skipped if asked)."""
        from prx_assets.core.skiplists.sidecars import REASON_CODES

        plan: dict[str, dict[int, dict[int, list[str]]]] = {}
        for relpath, shards in self.shards.items():
            plan[relpath] = {}
            for shard_no, keys in enumerate(shards):
                k = rng.randrange(0, len(keys))
                chosen = rng.sample(range(len(keys)), k)
                plan[relpath][shard_no] = {
                    i: rng.sample(REASON_CODES, rng.randrange(1, 3)) for i in chosen
                }
        if drop_whole_shard:
            relpath = rng.choice(sorted(plan))
            shard_no = rng.randrange(len(self.shards[relpath]))
            plan[relpath][shard_no] = {
                i: ["opt_out"] for i in range(len(self.shards[relpath][shard_no]))
            }
        return self.apply_skips(plan)


@pytest.fixture
def mds_root(tmp_path: Path) -> MdsRoot:
    return MdsRoot(tmp_path / "data")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """On 2 shared cores torch's intra-op threads spin against each other (~50x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- simulated ranks -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, out: str, kwargs: dict
) -> None:
    # Record what this child registers with atexit: a forked child leaves via os._exit, so
    # streaming's shared-memory cleanup must be run by hand (and only the child's own).
    handlers: list[tuple[Callable[..., Any], tuple, dict]] = []
    atexit.register = lambda f, *a, **k: handlers.append((f, a, k)) or f  # type: ignore[assignment]
    os.environ.update(
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    result: dict[str, Any]
    try:
        import torch.distributed as dist

        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            result = {"ok": fn(rank=rank, world=world, **kwargs)}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    import gc

    gc.collect()
    for f, a, k in reversed(handlers):
        try:
            f(*a, **k)
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass
    Path(out).write_text(json.dumps(result))


# Streaming picks a shared-memory prefix by taking the first free number and creating it:
# two processes constructing datasets at the same moment can pick the same one, and the
# loser fails with this. Outside torch.distributed the loader retries (dataset.py); a
# distributed job cannot (its ranks meet at barriers inside streaming), so a job of these
# tests that lost the race to a dataset of another test process runs once more.
_PREFIX_RACE = re.compile(r"FileExistsError: \[Errno 17\] File exists: '/\d+_locals'")


def run_ranks(
    fn: Callable[..., Any], world: int, tmp_path: Path, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank=, world=, **kwargs)`` in ``world`` forked processes posing as one node.

    Forking reuses the already-imported libraries (a fresh interpreter spends ~6 s CPU just
    importing streaming). Results must be JSON-serialisable. A job that lost streaming's
    shared-memory prefix race (``_PREFIX_RACE``) runs once more; any other failure raises.
    """
    try:
        return _run_ranks_once(fn, world, tmp_path, timeout, **kwargs)
    except AssertionError as exc:
        if not _PREFIX_RACE.search(str(exc)):
            raise
    return _run_ranks_once(fn, world, tmp_path, timeout, **kwargs)


def _run_ranks_once(
    fn: Callable[..., Any], world: int, tmp_path: Path, timeout: float, **kwargs: Any
) -> list[Any]:
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    outs = [tmp_path / f"rank{r}-{os.getpid()}-{port}.json" for r in range(world)]
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, str(outs[r]), kwargs))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            raise AssertionError(f"simulated rank {p.name} hung for {timeout}s")
    errors, results = [], []
    for r, out in enumerate(outs):
        if not out.exists():
            errors.append(f"rank {r} died without a result (exit {procs[r].exitcode})")
            continue
        data = json.loads(out.read_text())
        if "error" in data:
            errors.append(f"rank {r} failed:\n{data['error']}")
        else:
            results.append(data["ok"])
    # Every rank's error, not the first one's: a rank that lost streaming's prefix race
    # leaves the others failing at a barrier ("Connection reset by peer"), and only its own
    # error names the race ``run_ranks`` retries on (seen once in CI).
    if errors:
        raise AssertionError("\n".join(errors))
    return results
