"""Single-shape batches for a diffusion training loop: one skip-list dataset per shape.

A diffusion step needs every batch to be one tensor shape, and DDP needs every rank to take
the same number of steps. Both follow from building one ``SkipListDataset`` (one or more
streams: tiers, batches, sources of that shape) and one ``DataLoader`` per (H, W), and
interleaving their batches by a *schedule* that is identical on every rank:

- Streaming gives each rank the same number of samples of each shape (it pads ranks), and
  its ``-1`` worker padding only ever sits at the end of a rank's sequence, so the number of
  batches of shape k on this rank is computable up front from ``get_partitions`` (the same
  call streaming makes): ``sum over workers of ceil(valid samples / batch_size)``.
- The schedule is a seeded permutation of those counts (seed, epoch, where it started), so
  every rank draws the same shape at the same step. No shape is ever truncated or padded
  with samples of another shape.

Resumption: after ``m`` batches of shape k, each rank has consumed the first ``m * B`` of
its sequence, which streaming's partitioning makes exactly the first ``m * B * R`` samples
of the shape's global order (R ranks). That is the ``sample_in_epoch`` stored for the
bucket, so each bucket resumes exactly at any world size that streaming allows (same
``num_canonical_nodes``). The schedule is regenerated from the same inputs when the world
is the same (the resumed run continues with exactly the uninterrupted order); otherwise a
new schedule over the remaining counts starts at the checkpoint. Every epoch start pins each
dataset's epoch and offset through streaming's own resume state, so buckets never drift
out of step even when one has no batch on this rank.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from streaming import StreamingDataset
from streaming.base.partition import get_partitions
from streaming.base.world import World
from torch.utils.data import DataLoader

from prx_assets.loader.dataset import (
    REQUIRE_SKIPLISTS,
    SkipListDataset,
    check_resume_snapshot,
    check_skiplists_mode,
    collection_paused,
    default_num_canonical_nodes,
    snapshot_of,
)
from prx_assets.loader.discover import group_by_shape
from prx_assets.loader.streams import BucketStream

STATE_FORMAT = "prx-shape-loader"
STATE_VERSION = 1


def collate_samples(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Column-wise lists: the no-decoding default (images stay bytes)."""
    return {k: [s[k] for s in samples] for k in samples[0]} if samples else {}


def _close_resume_handle(ds: StreamingDataset) -> None:
    """Close this process's handle on the resume segment the previous pin wrote.

    ``StreamingDataset.load_state_dict`` opens the segment again on every call and streaming
    keeps every handle it ever opened (and its descriptor) until the process exits: one more
    per bucket per epoch. The segment itself stays (its name is reused by the next pin and
    unlinked at exit, as streaming does); only the old handle's descriptor is given back.
    """
    old = getattr(ds, "_resume_shm", None)
    for shm in [*getattr(old, "created_shms", ()), *getattr(old, "opened_shms", ())]:
        shm.close()


class ShapeBatchedLoader:
    """Iterate single-shape batches over buckets, with exact, elastic ``state_dict``.

    ``batch_size`` is per device. ``dataset_kwargs`` go to every ``SkipListDataset`` (e.g.
    ``shuffle_algo``, ``predownload``, ``cache_limit``), ``dataloader_kwargs`` to every
    ``DataLoader`` (e.g. ``pin_memory``). Keep ``num_canonical_nodes`` fixed for a whole
    run; it defaults to streaming's own default and is saved in the state. ``skiplists``:
    ``"require"`` (default; every bucket needs a valid skip-list generation) or
    ``"ignore-UNSAFE"`` (read unscreened, warning for every stream).
    """

    def __init__(
        self,
        buckets: Sequence[BucketStream],
        *,
        batch_size: int,
        collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        shuffle_seed: int = 9176,
        shuffle_algo: str = "py1e",
        num_canonical_nodes: int | None = None,
        allow_skiplist_change: bool = False,
        skiplists: str = REQUIRE_SKIPLISTS,
        dataset_kwargs: dict[str, Any] | None = None,
        dataloader_kwargs: dict[str, Any] | None = None,
    ) -> None:
        check_skiplists_mode(skiplists)
        if not buckets:
            raise ValueError("no buckets to load")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if (dataset_kwargs or {}).get("batching_method", "random") != "random":
            raise ValueError("ShapeBatchedLoader needs batching_method='random' per bucket")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle_seed = shuffle_seed
        self.num_canonical_nodes = num_canonical_nodes or default_num_canonical_nodes(shuffle_algo)
        self.datasets: dict[str, SkipListDataset] = {}
        self.loaders: dict[str, DataLoader] = {}
        # Many buckets: one pause for all (``collection_paused``).
        with collection_paused():
            for shape, group in group_by_shape(buckets).items():
                ds = SkipListDataset(
                    streams=[b.to_stream(skiplists) for b in group],
                    batch_size=batch_size,
                    shuffle=shuffle,
                    shuffle_seed=shuffle_seed,
                    shuffle_algo=shuffle_algo,
                    num_canonical_nodes=self.num_canonical_nodes,
                    allow_skiplist_change=allow_skiplist_change,
                    bucket_name=shape,
                    **(dataset_kwargs or {}),
                )
                self.datasets[shape] = ds
                self.loaders[shape] = DataLoader(
                    ds,
                    batch_size=batch_size,
                    num_workers=num_workers,
                    collate_fn=collate_fn or collate_samples,
                    **(dataloader_kwargs or {}),
                )
        self.shapes = list(self.datasets)
        self.snapshot = snapshot_of(buckets)  # training snapshot read (None: live data)
        self._epoch = 0
        self._in_epoch = False
        self._iterators: dict[str, Iterator[Any]] = {}
        self._pending: dict[str, Any] | None = None
        self._initial_physical_nodes: int | None = None
        self._reset_position(step=0, offsets=dict.fromkeys(self.shapes, 0))

    # -- bookkeeping ---------------------------------------------------------------------

    def _reset_position(self, step: int, offsets: dict[str, int]) -> None:
        self._step = step
        self._base_step = step
        self._base_offsets = dict(offsets)
        self._batches_since_base = dict.fromkeys(self.shapes, 0)

    def _world(self) -> World:
        return World.detect()

    def _world_signature(self, world: World) -> dict[str, int]:
        return {
            "num_nodes": world.num_nodes,
            "ranks_per_node": world.ranks_per_node,
            "workers_per_rank": max(1, self.num_workers),
            "batch_size": self.batch_size,
        }

    def _batch_counts(self, world: World, offsets: dict[str, int]) -> dict[str, int]:
        """Batches of each shape this rank yields from ``offsets`` to the end of the epoch."""
        counts = {}
        workers = max(1, self.num_workers)
        for shape, ds in self.datasets.items():
            ids = get_partitions(
                ds.partition_algo,
                ds.epoch_size,
                self.num_canonical_nodes,
                world.num_nodes,
                world.ranks_per_node,
                workers,
                self.batch_size,
                int(offsets[shape]),
                self._initial_physical_nodes,
            )
            mine = ids[world.node, world.rank_of_node].reshape(workers, -1)
            valid = (mine != -1).sum(axis=1)
            counts[shape] = int(sum(math.ceil(int(v) / self.batch_size) for v in valid))
        return counts

    def _schedule(self, counts: dict[str, int]) -> list[str]:
        seed = [self.shuffle_seed, self._epoch, self._base_step]
        rng = np.random.default_rng(seed)
        order = np.repeat(np.arange(len(self.shapes)), [counts[s] for s in self.shapes])
        return [self.shapes[i] for i in rng.permutation(order)]

    def __len__(self) -> int:
        """Batches per epoch on this rank (from the epoch start)."""
        return sum(self._batch_counts(self._world(), dict.fromkeys(self.shapes, 0)).values())

    # -- iteration -----------------------------------------------------------------------

    def _pin_datasets(self, offsets: dict[str, int]) -> None:
        """Write each dataset's resume state, so its next ``__iter__`` is this epoch/offset."""
        for shape, ds in self.datasets.items():
            _close_resume_handle(ds)
            StreamingDataset.load_state_dict(
                ds,
                {
                    "epoch": self._epoch,
                    "sample_in_epoch": int(offsets[shape]),
                    "num_canonical_nodes": self.num_canonical_nodes,
                    "shuffle_seed": self.shuffle_seed,
                    "initial_physical_nodes": self._initial_physical_nodes,
                },
            )

    def _close_iterators(self) -> None:
        for it in self._iterators.values():
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._iterators = {}

    def __iter__(self) -> Iterator[Any]:
        world = self._world()
        if self._initial_physical_nodes is None:
            self._initial_physical_nodes = world.num_nodes
        self._close_iterators()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._epoch = pending["epoch"]
            step, offsets = pending["step"], pending["offsets"]
            base = pending.get("base")
            if base is not None and base["world"] == self._world_signature(world):
                # Same world: rebuild the identical schedule and continue inside it.
                self._reset_position(base["step"], base["offsets"])
                self._step = step
                self._batches_since_base = dict(base["batches_since_base"])
            else:
                self._reset_position(step, offsets)
        else:
            if self._in_epoch:  # the previous iteration was abandoned: that epoch is over
                self._epoch += 1
            self._reset_position(0, dict.fromkeys(self.shapes, 0))
            offsets = dict(self._base_offsets)
        self._in_epoch = True
        self._pin_datasets(offsets)
        counts = self._batch_counts(world, self._base_offsets)
        schedule = self._schedule(counts)
        done = schedule[: self._step - self._base_step]
        if any(done.count(s) != self._batches_since_base[s] for s in self.shapes):
            # The checkpoint does not sit inside this schedule: start a new one here.
            self._reset_position(self._step, offsets)
            schedule = self._schedule(self._batch_counts(world, offsets))
        self._iterators = {shape: iter(loader) for shape, loader in self.loaders.items()}

        for shape in schedule[self._step - self._base_step :]:
            try:
                batch = next(self._iterators[shape])
            except StopIteration:
                warnings.warn(f"bucket {shape} ran out before its schedule did", stacklevel=2)
                continue
            self._step += 1
            self._batches_since_base[shape] += 1
            yield batch
        for shape, it in self._iterators.items():  # normally empty: counts are exact
            for batch in it:
                warnings.warn(f"bucket {shape} had a batch beyond its schedule", stacklevel=2)
                self._step += 1
                self._batches_since_base[shape] += 1
                yield batch
        self._close_iterators()
        self._epoch += 1
        self._in_epoch = False
        self._reset_position(0, dict.fromkeys(self.shapes, 0))

    # -- checkpointing -------------------------------------------------------------------

    def _sample_in_epoch(self, shape: str, world: World) -> int:
        consumed = self._batches_since_base[shape] * self.batch_size * world.num_ranks
        return min(self._base_offsets[shape] + consumed, self.datasets[shape].epoch_size)

    def state_dict(self) -> dict[str, Any]:
        """Where every rank is (identical on all ranks): save rank 0's with the model."""
        world = self._world()
        buckets = {}
        for shape, ds in self.datasets.items():
            buckets[shape] = {
                "epoch": self._epoch,
                "sample_in_epoch": self._sample_in_epoch(shape, world),
                "num_canonical_nodes": self.num_canonical_nodes,
                "shuffle_seed": self.shuffle_seed,
                "initial_physical_nodes": self._initial_physical_nodes or world.num_nodes,
                "skiplist_digest": ds.skiplist_digest,
            }
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "base": {
                "step": self._base_step,
                "offsets": dict(self._base_offsets),
                "batches_since_base": dict(self._batches_since_base),
                "world": self._world_signature(world),
            },
            "buckets": buckets,
            "snapshot": self.snapshot,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` on the next ``iter``; skip-list changes raise ``SkipListChanged``."""
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a {STATE_FORMAT} v{STATE_VERSION} state dict")
        check_resume_snapshot(state.get("snapshot"), self.snapshot)
        saved = set(state["buckets"])
        if saved != set(self.shapes):
            raise ValueError(
                f"checkpoint buckets {sorted(saved)} differ from loaded buckets {self.shapes}"
            )
        for shape, ds in self.datasets.items():
            ds.check_resume_digest(state["buckets"][shape])
        first = state["buckets"][self.shapes[0]]
        if first["num_canonical_nodes"] != self.num_canonical_nodes:
            warnings.warn(
                f"using the checkpoint's num_canonical_nodes={first['num_canonical_nodes']} "
                f"(was {self.num_canonical_nodes}): the sample order depends on it",
                stacklevel=2,
            )
            self.num_canonical_nodes = int(first["num_canonical_nodes"])
        self._initial_physical_nodes = first.get("initial_physical_nodes")
        changed = any(
            state["buckets"][s]["skiplist_digest"] != self.datasets[s].skiplist_digest
            for s in self.shapes
        )
        self._pending = {
            "epoch": int(state["epoch"]),
            "step": int(state["step"]),
            "offsets": {s: int(state["buckets"][s]["sample_in_epoch"]) for s in self.shapes},
            # After a skip-list change the old schedule no longer matches the datasets.
            "base": None if changed else state.get("base"),
        }
