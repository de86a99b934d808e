"""Render a bucket's samples: source bytes streamed from Lance, resized, JPEG-encoded.

Rendering reads the batch's image bytes one chunk of keys at a time, in key order per
bucket, so memory holds one chunk of source bytes plus the shard being filled.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS
from prx_assets.core.lab import LabView, in_list, sql_literal
from prx_assets.core.shards.mds import MDSSample
from prx_assets.core.shards.plan import CaptionInfo
from prx_assets.core.shards.resize import RESAMPLE, RESAMPLE_CHOICES, render_jpeg
from prx_assets.core.shards.tables import assignment_from_row
from prx_assets.core.tables import IMAGES

if TYPE_CHECKING:
    from prx_assets.core.workers import WorkerPool

# MDS columns beyond mds.BASE_COLUMNS: caption provenance, and the upscale flag so a
# trainer can keep native pixels only without a lab lookup. Flags are ints (MDS has no bool).
MDS_EXTRA_COLUMNS: dict[str, str] = {
    "caption_backend": "str",
    "caption_model": "str",
    "caption_prompt_version": "str",
    "caption_fingerprint": "str",
    "is_fallback_caption": "int",
    "upscaled": "int",
}


RenderItem = tuple[dict[str, Any], dict[str, Any] | None]  # (assignment row, images row)


def render_item(item: RenderItem, max_pixels: int, resample: str) -> bytes | str:
    """One sample's JPEG, or why it cannot be rendered: a pure function of its inputs, so a
    worker anywhere (a thread, a process, a Ray task) returns the same bytes."""
    row, image = item
    if image is None or not image["image"]:
        return "image_missing: no bytes for this key in the images table"
    try:
        return render_jpeg(image["image"], assignment_from_row(row), max_pixels, resample)
    except Exception as exc:  # noqa: BLE001 - one bad image must not sink the batch
        return f"{type(exc).__name__}: {exc}"


class RenderFailures(RuntimeError):
    """More images failed to render than a run tolerates."""


@dataclass
class RenderLog:
    """What rendering learned per key: the stored JPEG's digest/size, or why it failed."""

    jpeg: dict[str, tuple[str, int]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


class BucketRenderer:
    """Streams a batch's image bytes from Lance and renders bucket samples from them.

    ``images`` is a ``LabView``: the ``images`` table is opened once, here, and every chunk
    reads that snapshot (None when there is nothing to render: the table is never opened;
    an absent table is refused at once, not turned into one render failure per image).
    Chunks of ``chunk_size`` keys are read with a ``batch AND key IN (...)`` filter (the key
    BTREE and batch BITMAP indexes serve it) and rendered on ``threads`` threads (Pillow
    releases the GIL in decode, resample and encode); results keep key order, so the output
    is the same whatever the thread count. An image that fails to render is logged in
    ``log.failures`` and not written; more than ``max_failures`` failures raise
    ``RenderFailures`` (a systematic fault, which must not silently empty the shards: the
    bucket being written keeps its previous version). With a ``pool`` (``PRX_EXECUTOR=ray``)
    the renders run there instead of on threads, still in key order.
    """

    def __init__(
        self,
        images: LabView | None,
        batch: str,
        captions: Mapping[str, CaptionInfo],
        chunk_size: int = 32,
        threads: int = 1,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        resample: str = RESAMPLE,
        max_failures: int = 20,
        pool: WorkerPool | None = None,
    ) -> None:
        if chunk_size < 1 or threads < 1:
            raise ValueError(f"chunk_size and threads must be >= 1, got {chunk_size}, {threads}")
        if resample not in RESAMPLE_CHOICES:
            raise ValueError(f"resample must be one of {RESAMPLE_CHOICES}, got {resample!r}")
        if images is not None and not images.exists(IMAGES.name):  # opens the snapshot
            raise ValueError(f"no {IMAGES.name} table to render batch {batch!r} from")
        self.images = images
        self.batch = batch
        self.captions = captions
        self.chunk_size = chunk_size
        self.threads = threads
        self.max_pixels = max_pixels
        self.resample = resample
        self.max_failures = max_failures
        self.pool = pool
        self.log = RenderLog()

    def _read(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        if self.images is None:
            raise ValueError("BucketRenderer was given no images dataset to read from")
        rows = self.images.read(
            IMAGES.name,
            columns=["key", "image", "source", "license"],
            filter=f"batch = {sql_literal(self.batch)} AND {in_list('key', keys)}",
        ).to_pylist()
        return {r["key"]: r for r in rows}

    def _render(self, item: RenderItem) -> bytes | str:
        return render_item(item, self.max_pixels, self.resample)

    def samples(self, rows: Sequence[Mapping[str, Any]]) -> Iterator[MDSSample]:
        """Samples for one bucket's assignment rows (sorted by key), rendered lazily."""
        rows = list(rows)
        if self.pool is not None:
            yield from self._samples_on_pool(rows, self.pool)
            return
        with ThreadPoolExecutor(self.threads) as pool:
            for start in range(0, len(rows), self.chunk_size):
                chunk = rows[start : start + self.chunk_size]
                images = self._read([r["key"] for r in chunk])
                items = [(dict(r), images.get(r["key"])) for r in chunk]
                results = (
                    pool.map(self._render, items) if self.threads > 1 else map(self._render, items)
                )
                for (row, image), out in zip(items, results, strict=True):
                    sample = self._accept(row, image, out)
                    if sample is not None:
                        yield sample
                del images, items

    def _samples_on_pool(
        self, rows: list[Mapping[str, Any]], pool: WorkerPool
    ) -> Iterator[MDSSample]:
        """The same samples, rendered by ``pool``: chunks are read as the pool asks for items,
        at most one chunk plus the pool's window of items held at once."""
        taken: deque[RenderItem] = deque()

        def items() -> Iterator[RenderItem]:
            for start in range(0, len(rows), self.chunk_size):
                chunk = rows[start : start + self.chunk_size]
                images = self._read([r["key"] for r in chunk])
                for r in chunk:
                    item = (dict(r), images.get(r["key"]))
                    taken.append(item)
                    yield item

        fn = partial(render_item, max_pixels=self.max_pixels, resample=self.resample)
        for out in pool.map_ordered(fn, items(), window=self.chunk_size):
            row, image = taken.popleft()
            sample = self._accept(row, image, out)
            if sample is not None:
                yield sample

    def _accept(
        self, row: dict[str, Any], image: dict[str, Any] | None, out: bytes | str
    ) -> MDSSample | None:
        """The sample for a rendered image, or None for a logged failure (over the limit:
        ``RenderFailures``)."""
        if isinstance(out, str):
            self.log.failures[row["key"]] = out
            if len(self.log.failures) > self.max_failures:
                first = next(iter(self.log.failures.items()))
                raise RenderFailures(
                    f"{len(self.log.failures)} images of batch {self.batch!r} "
                    f"failed to render (limit {self.max_failures}); first: "
                    f"{first[0]}: {first[1]}"
                )
            return None
        return self._sample(row, image, out)

    def _sample(self, row: dict[str, Any], image: dict[str, Any] | None, jpeg: bytes) -> MDSSample:
        assert image is not None
        cap = self.captions[row["key"]]
        self.log.jpeg[row["key"]] = (hashlib.sha256(jpeg).hexdigest(), len(jpeg))
        return MDSSample(
            key=row["key"],
            image=jpeg,
            caption=cap.caption,
            orig_width=int(row["source_width"]),
            orig_height=int(row["source_height"]),
            tier=int(row["tier"]),
            shape=row["shape"],
            source=image.get("source") or "",
            license=image.get("license") or "",
            extra={
                "caption_backend": cap.backend,
                "caption_model": cap.model_id,
                "caption_prompt_version": cap.prompt_version,
                "caption_fingerprint": cap.fingerprint,
                "is_fallback_caption": int(cap.is_fallback),
                "upscaled": int(bool(row["upscaled"])),
            },
        )
