"""Render a bucket's samples: source bytes from the lab, resized, JPEG-encoded.

Rendering reads the batch's image rows one chunk of keys at a time, in key order per
bucket, and maps ``render_task`` over them on a ``WorkerPool`` (every core of the process,
at most a window of images in flight; one pipeline across all of a partition's buckets,
``bucket_streams``), so memory holds one chunk of rows and the window plus the shard being
filled, and the output is the same for any worker count. Workers on this machine (and the
inline pool) get each source's blob reference and read and check the bytes themselves;
Ray workers get the bytes.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS
from prx_assets.core.lab import LabView, in_list, sql_literal
from prx_assets.core.lab.blobs import LocalBlobs
from prx_assets.core.shards.mds import MDSSample, bucket_order
from prx_assets.core.shards.plan import CaptionInfo
from prx_assets.core.shards.resize import RESAMPLE, RESAMPLE_CHOICES, SourceFacts, render_jpeg
from prx_assets.core.shards.tables import assignment_from_row
from prx_assets.core.tables import IMAGES
from prx_assets.core.workers import InlinePool, ItemFailed, WorkerPool

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


# Images in flight per worker. Eight, not four: while the writer closes a bucket (the last
# shard, fsyncs, the skip-list sidecars) the workers run on through the window instead of
# waiting for it (what is left: ``bench_pipeline --workers-check``'s ``idle_core_seconds``).
# Memory: a local task is a blob reference and a result one JPEG; a Ray call carries its
# source bytes, so up to 8 sources per worker are held.
WINDOW_PER_WORKER = 8


@dataclass(frozen=True)
class RenderTask:
    """One sample to render: its source bytes (or their blob reference, read by the
    worker), assignment row and what ingest recorded."""

    data: bytes | None
    row: dict[str, Any]  # the bucket_assignments row
    facts: SourceFacts | None
    max_pixels: int
    resample: str
    ref: str | None = None  # with ``blobs``: the source read (and checked) in the worker
    blobs: LocalBlobs | None = None


@dataclass(frozen=True)
class Rendered:
    """One rendered sample: its JPEG and that JPEG's sha256 (hex).

    Why the digest travels with the bytes: ``shard_samples`` records it for every sample,
    and hashing there, in the worker that just encoded the JPEG, runs on every core instead
    of serially in the process that writes the shards.
    """

    jpeg: bytes
    sha256: str


def render_task(task: RenderTask) -> Rendered | str:
    """The sample's JPEG and its digest, or why it cannot be rendered (a module-level
    function: picklable)."""
    try:
        data = task.data
        if data is None and task.ref is not None and task.blobs is not None:
            data = task.blobs.get(task.ref)  # BlobError when missing or altered
        if not data:
            return "image_missing: no bytes for this key in the images table"
        assignment = assignment_from_row(task.row)
        jpeg = render_jpeg(data, assignment, task.max_pixels, task.resample, task.facts)
        return Rendered(jpeg, hashlib.sha256(jpeg).hexdigest())
    except Exception as exc:  # noqa: BLE001 - one bad image must not sink the batch
        return f"{type(exc).__name__}: {exc}"


def _facts(image: Mapping[str, Any]) -> SourceFacts | None:
    """The ingest record's facts, when complete (else the renderer probes the header)."""
    values = [image.get(c) for c in ("format", "mode", "orientation", "n_frames")]
    if any(v is None for v in values):
        return None
    fmt, mode, orientation, frames = values
    return SourceFacts(str(fmt), str(mode), int(orientation), int(frames))


class RenderFailures(RuntimeError):
    """More images failed to render than a run tolerates."""


@dataclass
class RenderLog:
    """What rendering learned per key: the stored JPEG's digest/size, or why it failed."""

    jpeg: dict[str, tuple[str, int]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


_FACT_COLUMNS = ("format", "mode", "orientation", "n_frames")


class BucketRenderer:
    """Streams a batch's image bytes from Lance and renders bucket samples from them.

    ``images`` is a ``LabView``: the ``images`` table is opened once, here, and every chunk
    reads that snapshot (None when there is nothing to render: the table is never opened;
    an absent table is refused at once, not turned into one render failure per image).
    Chunks of ``chunk_size`` keys are read with a ``batch AND key IN (...)`` filter (the key
    BTREE and batch BITMAP indexes serve it) and rendered on ``pool`` (inline when None);
    results keep key order, so the output is the same whatever the worker count. The
    format, mode, orientation and frame count ingest recorded travel with the bytes, so the
    renderer does not re-probe them. An image that fails to render (in a worker or inline,
    the same way) is logged in
    ``log.failures`` and not written; more than ``max_failures`` failures raise
    ``RenderFailures`` (a systematic fault, which must not silently empty the shards: the
    bucket being written keeps its previous version).
    """

    def __init__(
        self,
        images: LabView | None,
        batch: str,
        captions: Mapping[str, CaptionInfo],
        chunk_size: int = 32,
        pool: WorkerPool | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        resample: str = RESAMPLE,
        max_failures: int = 20,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if resample not in RESAMPLE_CHOICES:
            raise ValueError(f"resample must be one of {RESAMPLE_CHOICES}, got {resample!r}")
        if images is not None and not images.exists(IMAGES.name):  # opens the snapshot
            raise ValueError(f"no {IMAGES.name} table to render batch {batch!r} from")
        self.images = images
        self.batch = batch
        self.captions = captions
        self.chunk_size = chunk_size
        self.pool: WorkerPool = pool if pool is not None else InlinePool()
        self.max_pixels = max_pixels
        self.resample = resample
        self.max_failures = max_failures
        self.log = RenderLog()
        # Workers on this machine (and the inline pool) read and check each source blob
        # themselves: the bytes are neither read nor pickled here, and a missing or
        # altered blob is that image's render failure for any worker count. Ray workers
        # may not see this filesystem: they get the bytes.
        local = self.pool.same_machine and images is not None
        self._blobs = images.local_blobs(IMAGES.name, "image") if local else None

    def _read(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        if self.images is None:
            raise ValueError("BucketRenderer was given no images dataset to read from")
        rows = self.images.take_matching_rows(
            IMAGES.name,
            columns=["key", "image", "source", "license", *_FACT_COLUMNS],
            filter=f"batch = {sql_literal(self.batch)} AND {in_list('key', keys)}",
            blob_refs=self._blobs is not None,
        )
        return {r["key"]: r for r in rows}

    def _tasks(
        self, rows: Sequence[Mapping[str, Any]], meta: deque[tuple[dict, dict | None]]
    ) -> Iterator[RenderTask]:
        """Render tasks in key order, one Lance read per chunk; ``meta`` gets each row's
        non-pixel facts in the same order (the source bytes go to the task only)."""
        for start in range(0, len(rows), self.chunk_size):
            chunk = rows[start : start + self.chunk_size]
            images = self._read([r["key"] for r in chunk])
            for r in chunk:
                row, image = dict(r), images.pop(r["key"], None)
                value = image.pop("image", None) if image is not None else None
                meta.append((row, image))
                facts = _facts(image) if image is not None else None
                if self._blobs is not None:  # a reference: the worker reads the bytes
                    yield RenderTask(
                        None, row, facts, self.max_pixels, self.resample, value, self._blobs
                    )
                else:
                    yield RenderTask(value, row, facts, self.max_pixels, self.resample)

    def samples(self, rows: Sequence[Mapping[str, Any]]) -> Iterator[MDSSample]:
        """Samples for one bucket's assignment rows (sorted by key), rendered lazily."""
        meta: deque[tuple[dict, dict | None]] = deque()
        for out in self.pool.map_ordered(render_task, self._tasks(list(rows), meta)):
            row, image = meta.popleft()
            sample = self._taken(row, image, out)
            if sample is not None:
                yield sample

    def bucket_streams(
        self,
        buckets: Mapping[tuple[int, str], Sequence[Mapping[str, Any]]],
        window: int | None = None,
    ) -> dict[tuple[int, str], Iterator[MDSSample]]:
        """Every bucket's samples from one pipeline over the whole partition.

        Why not ``samples`` per bucket: each bucket then drained the pool at its end, and
        the workers idled while the writer finished it (MDS index, fsyncs, skip-list
        sidecars) and read the next bucket's first chunk. Here the window of images in
        flight runs on into the next bucket while the writer closes this one (what is
        left idle: ``bench_pipeline --workers-check``, ``idle_core_seconds``).
        The streams are in ``mds.bucket_order`` and must be consumed in it, each to its
        end (what ``write_partition_streams`` does); one read out of turn raises instead
        of handing a sample to the wrong bucket. ``window`` (default
        ``WINDOW_PER_WORKER`` per worker) bounds the source bytes in flight.
        """
        order = bucket_order(buckets)
        rows_of = {b: list(buckets[b]) for b in order}
        meta: deque[tuple[dict, dict | None]] = deque()

        def tasks() -> Iterator[RenderTask]:
            for bucket in order:
                yield from self._tasks(rows_of[bucket], meta)

        results = self.pool.map_ordered(
            render_task,
            tasks(),
            window=window if window is not None else WINDOW_PER_WORKER * self.pool.workers,
        )
        turn = [0]

        def stream(index: int, bucket: tuple[int, str]) -> Iterator[MDSSample]:
            if turn[0] != index:
                raise RuntimeError(
                    f"bucket {bucket} read out of turn: its stream is number {index}, "
                    f"number {turn[0]} is not finished (streams share one pipeline)"
                )
            for _ in rows_of[bucket]:
                out = next(results)
                row, image = meta.popleft()
                sample = self._taken(row, image, out)
                if sample is not None:
                    yield sample
            turn[0] = index + 1

        return {bucket: stream(i, bucket) for i, bucket in enumerate(order)}

    def _taken(
        self,
        row: dict[str, Any],
        image: dict[str, Any] | None,
        out: Rendered | str | ItemFailed,
    ) -> MDSSample | None:
        """The sample for one render result, or None with the failure logged (too many
        failures raise ``RenderFailures``)."""
        if isinstance(out, ItemFailed):
            out = out.error
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

    def _sample(
        self, row: dict[str, Any], image: dict[str, Any] | None, out: Rendered
    ) -> MDSSample:
        assert image is not None
        cap = self.captions[row["key"]]
        self.log.jpeg[row["key"]] = (out.sha256, len(out.jpeg))
        return MDSSample(
            key=row["key"],
            image=out.jpeg,
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
