"""Whole MDS shard files rendered and written by the workers: one piece of a bucket per task.

Why: the step process used to read every source, ship it to a worker, get the JPEG back and
write the shards itself, so every image crossed one process twice (``docs/scale.md``,
``benchmarks/bench_scaleout.py``). Here a worker task is one *piece*: up to
``piece_samples`` consecutive samples of one bucket directory (key order, as planned). The
worker reads each source itself (``LocalBlobs`` on this machine, ``RemoteBlobs`` from the
lab on object storage), renders it, writes the piece's shard file(s) with MDSWriter and
puts them where the step will commit them (``PieceSink``: a staging directory on this
machine, or a staging prefix on object storage). It returns a :class:`PieceResult`: the
staged file names, their MDS index entries (sizes, sha256, sample counts) and per sample
its key, JPEG sha256 and size, or why it could not be rendered. The step merges the
entries into the directory's ``index.json`` (``mds.commit_staged_bucket``) and commits
once; no image or shard byte passes through it.

Determinism: the cut into pieces depends only on the plan (``piece_samples`` consecutive
samples of a bucket, in key order), never on worker count or pool kind, and a piece's
shards are encoded exactly as MDSWriter encodes them. So the directory is byte-identical
for inline, process and Ray pools, on local disk and on object storage; a render failure
only leaves its sample out of its own piece.

Fallback: a pool whose workers cannot reach the step's disk (Ray with a local lab or a
local shard tree, unless ``PRX_SHARED_FILESYSTEM=1`` says every node mounts them at the
same paths) gets the source bytes in the task and/or the shard bytes back (``PieceSink``
with neither location): correct everywhere, and counted by ``bench_scaleout`` as bytes
through the step process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prx_assets.core.shards.remote import RemoteShardTree

from prx_assets.core.durable import fsync_path
from prx_assets.core.lab import BlobUnavailable, LabView, TableAt, in_list, sql_literal
from prx_assets.core.progress import no_progress
from prx_assets.core.shards.mds import (
    CommittedDir,
    MDSSample,
    SkipsFor,
    StagedPartition,
    StagedShardRef,
    bucket_order,
    relative_partition_dir,
    write_piece_shards,
)
from prx_assets.core.shards.plan import (
    CAPTION_COLUMNS,
    CaptionInfo,
    ShardPlan,
    planned_caption,
)
from prx_assets.core.shards.render import _FACT_COLUMNS, RenderFailures, _facts
from prx_assets.core.shards.resize import RESAMPLE_CHOICES, SourceFacts, render_jpeg
from prx_assets.core.shards.settings import ShardSettings
from prx_assets.core.shards.tables import assignment_from_row
from prx_assets.core.storage import open_store
from prx_assets.core.tables import BUCKET_ASSIGNMENTS, CAPTIONS, IMAGES
from prx_assets.core.workers import (  # noqa: F401 - SHARED_FS_ENV: re-exported
    SHARED_FS_ENV,
    ItemFailed,
    ProcessPool,
    WorkerPool,
    shared_filesystem,
)

SHARD_HASHES = ("sha256",)  # recorded per shard in index.json: the dir_digest commits to bytes


#: What a worker needs of a ``bucket_assignments`` row (``tables.assignment_from_row``):
#: the task carries these, not the whole row (its key, batch and table digest).
ASSIGNMENT_FIELDS = (
    "tier",
    "shape",
    "height",
    "width",
    "source_width",
    "source_height",
    "scale",
    "resize_width",
    "resize_height",
    "crop_left",
    "crop_top",
    "crop_right",
    "crop_bottom",
    "outside_aspect_range",
    "upscaled",
)


class SourceBlobs(Protocol):
    """Where a worker reads a source image by its blob reference (checked on read)."""

    def get(self, ref: str) -> bytes: ...


@dataclass(frozen=True)
class PieceSample:
    """One sample of a piece: what its shard row holds, and where its source is.

    ``ref``: the source blob's reference, read by the worker from the task's ``blobs``;
    ``data``: the source bytes themselves (only when the worker cannot read the lab).
    ``fields``: the MDS columns other than the image, exactly as the row is written.
    """

    key: str
    row: dict[str, Any]  # the bucket_assignments row's ASSIGNMENT_FIELDS
    facts: SourceFacts | None
    fields: dict[str, Any]
    ref: str | None = None
    data: bytes | None = None
    missing: bool = False  # no images row for this key


@dataclass(frozen=True)
class PieceSink:
    """Where a worker puts its piece's shard files.

    ``directory``: a staging directory on the worker's filesystem (it must exist: a worker
    never creates it, so one left over from a killed run, whose directory the rerun
    removed, fails instead of writing into the rerun's); ``store_uri``: a staging prefix on
    object storage (unique per run); neither: the shard bytes come back in the result.
    """

    directory: str | None = None
    store_uri: str | None = None


@dataclass(frozen=True)
class PieceRows:
    """Where a worker reads its piece's rows itself: the tables at the versions the step
    planned from (``TableAt``), and which of the piece's keys the plan found without a
    usable caption (the worker checks each caption's text agrees: ``planned_caption``)."""

    batch: str
    assignments: TableAt
    captions: TableAt | None  # None: no captions table (every sample is uncaptioned)
    images: TableAt
    uncaptioned: frozenset[str]


@dataclass(frozen=True)
class PieceTask:
    """One piece to render and write (picklable: references, keys and settings).

    ``rows`` set: the worker reads the piece's rows (``read_piece_samples``) and
    ``samples`` is empty; else the step read them and ``samples`` carries them.
    """

    tier: int
    shape: str
    piece: int  # its number within the bucket directory
    samples: tuple[PieceSample, ...]
    blobs: SourceBlobs | None
    sink: PieceSink
    columns: dict[str, str]
    size_limit: int
    hashes: tuple[str, ...]
    max_pixels: int
    resample: str
    excluded: Mapping[str, str] = field(default_factory=dict)  # key -> why (not rendered)
    keys: tuple[str, ...] = ()  # the piece's keys, in plan order
    rows: PieceRows | None = None


@dataclass(frozen=True)
class StagedShard:
    """One shard file a piece wrote: its staged name, samples and MDS index entry."""

    name: str
    samples: int
    entry: dict[str, Any]  # MDSWriter's entry; ``raw_data.basename`` set at commit
    data: bytes | None = None  # only with a sink the worker cannot reach


@dataclass(frozen=True)
class PieceResult:
    """What a piece wrote: small and typed, no image bytes (unless the sink needs them)."""

    tier: int
    shape: str
    piece: int
    shards: tuple[StagedShard, ...]
    written: tuple[tuple[str, str, int], ...]  # (key, jpeg sha256, jpeg bytes), write order
    failures: tuple[tuple[str, str], ...]  # (key, why), plan order

    @property
    def keys(self) -> list[str]:
        return [k for k, _, _ in self.written]


def staged_name(piece: int, part: int) -> str:
    """A piece's shard file name while staged (renamed to ``shard.NNNNN.mds`` at commit)."""
    return f"piece.{piece:05d}.{part:03d}.mds"


def cut_pieces(n: int, piece_samples: int) -> list[range]:
    """Positions of a bucket's ``n`` planned samples, cut into consecutive pieces."""
    if piece_samples < 1:
        raise ValueError(f"piece_samples must be >= 1, got {piece_samples}")
    return [range(i, min(i + piece_samples, n)) for i in range(0, n, piece_samples)]


Read = Callable[[Sequence[str], str], list[dict[str, Any]]]

_IMAGE_COLUMNS = ("key", "image", "source", "license", *_FACT_COLUMNS)


class PlanMismatch(RuntimeError):
    """A piece's rows do not match the plan the step made from the same table versions
    (a planned key without its assignment row, a caption whose text disagrees with the
    plan's verdict): the piece fails, never writes a sample the skip-lists did not decide."""


def read_piece_samples(
    batch: str,
    keys: Sequence[str],
    uncaptioned: Collection[str],
    assignments: Read,
    captions: Read,
    images: Read,
    by_ref: bool,
) -> tuple[PieceSample, ...]:
    """A piece's samples, in ``keys`` order, from its rows in the three tables.

    The same function in the step (a pool that cannot read the lab: ``by_ref`` False puts
    the source bytes in the sample) and in a worker (``PieceRows``: by reference), so both
    write the same samples. ``images`` reads blob columns as references when ``by_ref``.
    """
    where = f"batch = {sql_literal(batch)} AND {in_list('key', keys)}"
    assigned = {r["key"]: r for r in assignments(["key", *ASSIGNMENT_FIELDS], where)}
    caption_rows = {r["key"]: r for r in captions(list(CAPTION_COLUMNS), where)}
    image_rows = {r["key"]: r for r in images(list(_IMAGE_COLUMNS), where)}
    out = []
    for key in keys:
        row = assigned.get(key)
        if row is None:
            raise PlanMismatch(f"{key!r} is planned but has no {BUCKET_ASSIGNMENTS.name} row")
        try:
            caption = planned_caption(caption_rows.get(key), key not in uncaptioned)
        except ValueError as exc:
            raise PlanMismatch(f"{key!r}: {exc}") from None
        image = image_rows.get(key)
        value = image.get("image") if image is not None else None
        out.append(
            PieceSample(
                key=key,
                row={c: row[c] for c in ASSIGNMENT_FIELDS},
                facts=_facts(image) if image is not None else None,
                fields=sample_fields(row, image, caption),
                ref=value if by_ref else None,
                data=None if by_ref else value,
                missing=image is None,
            )
        )
    return tuple(out)


def _worker_samples(task: PieceTask) -> tuple[PieceSample, ...]:
    """The task's samples: carried, or read by this worker (``task.rows``)."""
    rows = task.rows
    if rows is None:
        return task.samples
    cap = rows.captions
    return read_piece_samples(
        rows.batch,
        task.keys,
        rows.uncaptioned,
        lambda c, f: rows.assignments.read(c, f).to_pylist(),
        (lambda c, f: cap.read(c, f).to_pylist()) if cap is not None else (lambda c, f: []),
        lambda c, f: rows.images.read(c, f, blob_refs=True).to_pylist(),
        by_ref=True,
    )


#: Source blobs a worker reads at once ahead of the sample it renders, on object storage: a
#: read is a round trip of tens of ms against ~15 ms of rendering (``bench_scaleout``'s step
#: wall per photo). Bounded by count (sizes are known only once read): at most this many
#: reads in flight and one more queued, so a few photos held.
PREFETCH_BLOBS = 4


def _prefetched(
    task: PieceTask, planned: Sequence[PieceSample]
) -> Iterator[tuple[PieceSample, Any]]:
    """Each sample with its source read ahead (a ``concurrent.futures.Future`` of the
    bytes, or None: read at render time) when the blobs are on object storage; in order."""
    from concurrent.futures import ThreadPoolExecutor

    from prx_assets.core.lab.blobs import RemoteBlobs

    blobs = task.blobs
    if not isinstance(blobs, RemoteBlobs):
        for s in planned:
            yield s, None
        return

    def wanted(s: PieceSample) -> bool:
        return s.key not in task.excluded and s.data is None and s.ref is not None

    with ThreadPoolExecutor(PREFETCH_BLOBS, thread_name_prefix="prx-piece-read") as io:
        ahead: deque[tuple[PieceSample, Any]] = deque()
        for s in planned:
            ahead.append((s, io.submit(blobs.get, s.ref) if wanted(s) else None))
            if len(ahead) > PREFETCH_BLOBS:
                yield ahead.popleft()
        while ahead:
            yield ahead.popleft()


def _render(task: PieceTask, s: PieceSample, read: Any = None) -> tuple[bytes | None, str | None]:
    """(JPEG, None) or (None, why): one bad image must not sink the piece. ``read``: the
    source's read, started ahead (``_prefetched``); its outcome counts as the read here."""
    if s.key in task.excluded:
        return None, task.excluded[s.key]
    try:
        data = s.data
        if data is None and read is not None:
            data = read.result()  # what ``task.blobs.get`` returned or raised
        elif data is None and s.ref is not None and task.blobs is not None:
            data = task.blobs.get(s.ref)  # BlobError when missing or altered
        if s.missing or not data:
            return None, "image_missing: no bytes for this key in the images table"
        jpeg = render_jpeg(
            data,
            assignment_from_row({**s.row, "key": s.key}),
            task.max_pixels,
            task.resample,
            s.facts,
        )
        return jpeg, None
    except BlobUnavailable:  # storage trouble, not the image's: fail the piece (the step)
        raise
    except Exception as exc:  # noqa: BLE001 - recorded as this image's failure
        return None, f"{type(exc).__name__}: {exc}"


def render_piece(task: PieceTask) -> PieceResult:
    """Render a piece's samples and write its shard file(s) to ``task.sink`` (a
    module-level function: picklable for every pool)."""
    written: list[tuple[str, str, int]] = []
    failures: list[tuple[str, str]] = []
    planned = _worker_samples(task)

    def samples() -> Any:
        for s, read in _prefetched(task, planned):
            jpeg, why = _render(task, s, read)
            if jpeg is None:
                failures.append((s.key, why or "unknown"))
                continue
            written.append((s.key, hashlib.sha256(jpeg).hexdigest(), len(jpeg)))
            yield MDSSample(
                key=s.key,
                image=jpeg,
                caption=s.fields["caption"],
                orig_width=s.fields["orig_width"],
                orig_height=s.fields["orig_height"],
                tier=task.tier,
                shape=task.shape,
                source=s.fields["source"],
                license=s.fields["license"],
                extra={k: v for k, v in s.fields.items() if k not in _BASE_FIELDS},
            )

    sink = task.sink
    if sink.directory is not None:
        # A private directory inside the staging one (same filesystem: renames are atomic).
        if not os.path.isdir(sink.directory):
            raise FileNotFoundError(f"staging directory {sink.directory} is gone (a rerun?)")
        private = Path(sink.directory) / f".{task.piece:05d}.{uuid.uuid4().hex}"
        private.mkdir()
    else:
        private = Path(tempfile.mkdtemp(prefix="prx-piece-"))
    try:
        entries = write_piece_shards(
            private / "mds", samples(), task.columns, task.size_limit, task.hashes
        )
        shards = []
        for part, (entry, n) in enumerate(entries):
            name = staged_name(task.piece, part)
            path = private / "mds" / entry["raw_data"]["basename"]
            data = None
            if sink.directory is not None:
                with open(path, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.replace(path, Path(sink.directory) / name)
            elif sink.store_uri is not None:
                open_store(sink.store_uri).put_file(name, path)  # one PUT: atomic
            else:
                data = path.read_bytes()
            shards.append(StagedShard(name, n, entry, data))
        if sink.directory is not None and shards:
            fsync_path(sink.directory)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return PieceResult(
        task.tier, task.shape, task.piece, tuple(shards), tuple(written), tuple(failures)
    )


_BASE_FIELDS = frozenset(
    {"caption", "orig_width", "orig_height", "source", "license", "key", "tier", "shape"}
)


def sample_fields(
    row: Mapping[str, Any], image: Mapping[str, Any] | None, caption: CaptionInfo
) -> dict[str, Any]:
    """The MDS columns of one sample other than image, key, tier and shape."""
    return {
        "caption": caption.caption,
        "orig_width": int(row["source_width"]),
        "orig_height": int(row["source_height"]),
        "source": (image or {}).get("source") or "",
        "license": (image or {}).get("license") or "",
        "caption_backend": caption.backend,
        "caption_model": caption.model_id,
        "caption_prompt_version": caption.prompt_version,
        "caption_fingerprint": caption.fingerprint,
        "is_fallback_caption": int(caption.is_fallback),
        "upscaled": int(bool(row["upscaled"])),
    }


def probe_sample(task: PieceTask) -> str | None:
    """Render a one-sample piece and keep nothing: None when it renders, else why (what
    finds the image that kills its worker, ``PiecePlanner._isolate``)."""
    (s,) = task.samples
    return _render(task, s)[1]


class PieceFailed(RuntimeError):
    """A piece could not be written (not one image's failure: a writer or storage fault, a
    sample too large for a shard): the step fails and nothing becomes visible."""


class PiecePlanner:
    """Cuts a partition's plan into pieces, runs them on ``pool`` and commits each bucket.

    Sources: the workers read them by reference (``LocalBlobs`` when they share this
    machine, ``RemoteBlobs`` when the lab is on object storage); only a pool on other
    machines with a local lab (or a table that keeps its images inline) gets the bytes.
    Shards: a staging directory here (same machine), a staging prefix on object storage
    (the tree is remote), or, for a pool on other machines with a local tree, back in the
    result. ``jpeg`` (key -> sha256, size) and ``failures`` (key -> why) fill as pieces
    come back, in plan order; more than ``max_render_failures`` failures raise
    ``RenderFailures`` before the bucket being written is committed.
    """

    def __init__(
        self,
        images: LabView | None,
        batch: str,
        plan: ShardPlan,
        settings: ShardSettings,
        pool: WorkerPool,
        tree: RemoteShardTree,
    ) -> None:
        if settings.resample not in RESAMPLE_CHOICES:
            raise ValueError(
                f"resample must be one of {RESAMPLE_CHOICES}, got {settings.resample!r}"
            )
        if settings.read_chunk < 1:
            raise ValueError(f"read_chunk must be >= 1, got {settings.read_chunk}")
        if images is not None and not images.exists(IMAGES.name):  # opens the snapshot
            raise ValueError(f"no {IMAGES.name} table to render batch {batch!r} from")
        self.images = images
        self.batch = batch
        self.plan = plan
        self.settings = settings
        self.pool = pool
        self.tree = tree
        self.jpeg: dict[str, tuple[str, int]] = {}
        self.failures: dict[str, str] = {}
        self.progress = no_progress()  # the runner sets one that reports
        self.blobs: SourceBlobs | None = None
        self.reaches_here = pool.same_machine or shared_filesystem()
        if images is not None:
            local = images.local_blobs(IMAGES.name, "image")
            if local is not None and self.reaches_here:
                self.blobs = local
            else:
                self.blobs = images.lab.remote_blobs(IMAGES, "image")

    # -- tasks ------------------------------------------------------------------------------

    def _sink(self, staged: StagedPartition, tier: int, shape: str) -> PieceSink:
        if self.tree.remote:
            rel = relative_partition_dir(tier, shape, self.batch)
            return PieceSink(store_uri=self.tree.staging_uri(rel, staged.token))
        if self.reaches_here:
            return PieceSink(directory=str(staged.staging(tier, shape)))
        return PieceSink()  # workers elsewhere, tree here: the bytes come back

    def _rows_here(self) -> PieceRows | None:
        """What a worker needs to read its piece's rows itself, when it can reach the lab
        (``blobs`` set: this machine, a shared mount, or a lab on object storage)."""
        view = self.images
        if view is None or self.blobs is None:
            return None
        assignments, images = view.table_at(BUCKET_ASSIGNMENTS.name), view.table_at(IMAGES.name)
        if assignments is None or images is None:
            return None
        return PieceRows(
            self.batch,
            assignments,
            view.table_at(CAPTIONS.name),
            images,
            frozenset(self.plan.uncaptioned),
        )

    def _read(self, keys: Sequence[str]) -> tuple[PieceSample, ...]:
        """A piece's samples read here, through the step's view (a pool that cannot read
        the lab gets them in its tasks, with the source bytes)."""
        view = self.images
        assert view is not None
        out: list[PieceSample] = []
        chunk = self.settings.read_chunk
        for start in range(0, len(keys), chunk):
            out += read_piece_samples(
                self.batch,
                keys[start : start + chunk],
                self.plan.uncaptioned,
                lambda c, f: view.read(BUCKET_ASSIGNMENTS.name, c, f).to_pylist(),
                lambda c, f: view.read(CAPTIONS.name, c, f).to_pylist(),
                lambda c, f: view.take_matching_rows(
                    IMAGES.name, c, f, blob_refs=self.blobs is not None
                ),
                by_ref=self.blobs is not None,
            )
        return tuple(out)

    def _tasks(self, staged: StagedPartition, sent: deque[PieceTask]) -> Iterator[PieceTask]:
        s = self.settings
        by_ref = self._rows_here()
        for tier, shape in bucket_order(self.plan.buckets):
            rows = self.plan.buckets[(tier, shape)]
            sink = self._sink(staged, tier, shape)
            for number, span in enumerate(cut_pieces(len(rows), s.piece_samples)):
                keys = tuple(r["key"] for r in rows[span.start : span.stop])
                rows_of = None
                if by_ref is not None:  # the worker reads them: only its keys' verdicts go
                    rows_of = dataclasses.replace(
                        by_ref, uncaptioned=by_ref.uncaptioned.intersection(keys)
                    )
                task = PieceTask(
                    tier=int(tier),
                    shape=shape,
                    piece=number,
                    samples=() if rows_of is not None else self._read(keys),
                    keys=keys,
                    rows=rows_of,
                    blobs=self.blobs,
                    sink=sink,
                    columns=dict(staged.columns),
                    size_limit=staged.size_limit,
                    hashes=SHARD_HASHES,
                    max_pixels=s.max_pixels,
                    resample=s.resample,
                )
                sent.append(task)
                yield task

    # -- results ----------------------------------------------------------------------------

    def write(self, staged: StagedPartition, skips_for: SkipsFor) -> dict[str, CommittedDir]:
        """Every bucket's pieces rendered and written by the pool, each bucket committed
        (``StagedPartition.commit``) as soon as its last piece is in, in ``bucket_order``
        while the workers run on into the next buckets."""
        order = bucket_order(self.plan.buckets)
        n = self.settings.piece_samples
        counts = {b: len(cut_pieces(len(self.plan.buckets[b]), n)) for b in order}
        if not order:
            return {}
        sent: deque[PieceTask] = deque()
        # Pieces in flight: two per worker when tasks are references; one per worker (and
        # one more) when they carry their sources (up to piece_samples images each).
        workers = self.pool.workers
        window = 2 * workers if self.blobs is not None else workers + 1
        results = self.pool.map_ordered(render_piece, self._tasks(staged, sent), window=window)
        committed: dict[str, CommittedDir] = {}
        for tier, shape in order:
            shards: list[StagedShardRef] = []
            keys: list[str] = []
            for _ in range(counts[(tier, shape)]):
                out = next(results)
                task = sent.popleft()
                if isinstance(out, ItemFailed):
                    out = self._isolate(task, out)
                keys += self._taken(out)
                self.progress.advance(len(task.keys))
                shards += [StagedShardRef(x.name, x.samples, x.entry, x.data) for x in out.shards]
            done = staged.commit(
                tier,
                shape,
                shards,
                keys,
                skips_for=skips_for,
                local_shards=not self.tree.remote,
            )
            if done.placements:
                committed[relative_partition_dir(tier, shape, self.batch)] = done
        self.progress.finish()
        return committed

    def _taken(self, out: PieceResult) -> list[str]:
        from prx_assets.core.crashpoints import crashpoint

        for key, why in out.failures:
            self.failures[key] = why
            if len(self.failures) > self.settings.max_render_failures:
                first = next(iter(self.failures.items()))
                raise RenderFailures(
                    f"{len(self.failures)} images of batch {self.batch!r} failed to render "
                    f"(limit {self.settings.max_render_failures}); first: {first[0]}: {first[1]}"
                )
        for key, sha, size in out.written:
            self.jpeg[key] = (sha, size)
            crashpoint("mds.sample_written")  # in its staging location, not yet committed
        return out.keys

    def _isolate(self, task: PieceTask, failed: ItemFailed) -> PieceResult:
        """A piece whose worker died twice (``workers.ProcessPool``: a decoder crash): each
        of its images is tried alone in a pool of its own, the ones that kill their worker
        are that image's failure (as when images were tasks), and the piece is written
        without them: the same shards as a run where those images failed otherwise."""
        if not failed.error.startswith("worker_died"):
            raise PieceFailed(
                f"piece {task.piece} of bucket {task.tier}/{task.shape} of batch "
                f"{self.batch!r} could not be written: {failed.error}"
            )
        task = dataclasses.replace(task, samples=task.samples or self._read(task.keys), rows=None)
        with ProcessPool(1) as alone:
            singles = [dataclasses.replace(task, samples=(s,)) for s in task.samples]
            excluded = {
                t.samples[0].key: r.error
                for t, r in zip(singles, alone.map_ordered(probe_sample, singles), strict=True)
                if isinstance(r, ItemFailed)
            }
            again = next(
                alone.map_ordered(render_piece, [dataclasses.replace(task, excluded=excluded)])
            )
        if isinstance(again, ItemFailed):
            raise PieceFailed(
                f"piece {task.piece} of bucket {task.tier}/{task.shape} of batch "
                f"{self.batch!r} could not be written: {again.error}"
            )
        return again
