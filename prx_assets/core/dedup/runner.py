"""The dedup stage's runners: each reads, decides, writes and verifies one batch through Lab.

- :class:`BatchHashes` (``image_hashes``): hash every profiled image of the batch (copies
  under the training size cutoff included: see ``keys_to_hash``), stream the rows into one
  partition replacement, read them back against that list.
- :class:`BatchClusters` (``phash_clusters``): decide the batch against the whole corpus
  (:func:`~prx_assets.core.dedup.corpus.gather_corpus`, then
  :func:`~prx_assets.core.dedup.decisions.plan_batch`), write its rows and its
  ``dedup_state`` row, queue the other batches it contradicts in ``dedup_dirty``, clear the
  marks it answered, and check the stored clusters' keepers.

Why the cluster runner reads the corpus once, and when it reads it again: two batches
deciding at once must not both miss each other. A batch whose hashes land after this run
read the corpus decides after they landed, so it sees this run's rows if they were written
before its read; the one gap is hashes landing between this run's read and its write. The
corpus read records the ``image_hashes`` version it saw; after writing, the runner compares
it with the current one, and only when it moved does it read and decide again, marking what
the new hashes changed (this batch's own rows included, so the sensor reruns it). A run
that no other write overlapped reads the corpus once, the full scan at radius > 0 included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from prx_assets.core.batching import chunked
from prx_assets.core.dedup.checks import (
    HashCoverage,
    KeeperCheck,
    check_keepers,
    hash_coverage,
    read_cluster_members,
)
from prx_assets.core.dedup.corpus import DEFAULT_LOOKUP_CHUNK, Gathered, gather_corpus
from prx_assets.core.dedup.decisions import (
    DECISION_FIELDS,
    BatchPlan,
    DecisionChange,
    DedupSettings,
    describe_decision,
    plan_batch,
)
from prx_assets.core.dedup.dirty import clear_dirty, mark_dirty, pending_dirty, read_dirty
from prx_assets.core.dedup.phash import (
    FAST_THUMBNAIL_BYTES,
    fast_thumbnail_task,
    hash_results,
    hash_to_int64,
    phash_many,
    phash_version,
    thumbnail_from_bytes,
)
from prx_assets.core.dedup.reruns import state_row
from prx_assets.core.dedup.tables import HALF_COLUMNS, phash_halves
from prx_assets.core.ingest.decode import DecodeRejected
from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.lab.fragments import PartitionFragments, WrittenFragments
from prx_assets.core.lab.view import TableAt
from prx_assets.core.progress import Progress, Report
from prx_assets.core.tables import DEDUP_STATE, IMAGE_HASHES, IMAGES, PHASH_CLUSTERS, RESOLUTION
from prx_assets.core.workers import (
    InlinePool,
    ItemFailed,
    WorkerPool,
    call_guarded,
    make_pool,
    shared_filesystem,
)

DEFAULT_READ_CHUNK = 256
_THUMB_COLUMNS = ("phash_thumbnail", "phash_thumbnail_version")  # ingest's, see _fast


def _current_thumbnail(row: dict, version: str) -> bool:
    """Whether ingest stored a well-formed thumbnail for this pHash version in ``row``."""
    raw = row.get("phash_thumbnail")
    return (
        raw is not None
        and len(raw) == FAST_THUMBNAIL_BYTES
        and row.get("phash_thumbnail_version") == version
    )


class InputNotReady(RuntimeError):
    """An upstream table or row this run needs is missing: materialise that first."""


# --------------------------------------------------------------------------- image_hashes


def read_hash_inputs(
    read: Callable[[Sequence[str], str], pa.Table],
    batch: str,
    chunk: Sequence[str],
    thumbs_stored: bool,
) -> list[dict]:
    """The ``images`` rows of ``chunk`` (in its order) with what hashing needs: ingest's
    thumbnail where it stored a current one, the image's bytes otherwise."""
    columns = ["key", "file_size", "width", "height"]
    columns += list(_THUMB_COLUMNS) if thumbs_stored else ["image"]
    where = f"batch = {sql_literal(batch)} AND {in_list('key', chunk)}"
    rows = {r["key"]: r for r in read(columns, where).to_pylist()}
    chunk_rows = [rows[k] for k in chunk]
    if thumbs_stored:  # the bytes only of rows without a current thumbnail
        version = phash_version("fast")
        need = [r["key"] for r in chunk_rows if not _current_thumbnail(r, version)]
        if need:
            where = f"batch = {sql_literal(batch)} AND {in_list('key', need)}"
            for r in read(["key", "image"], where).to_pylist():
                rows[r["key"]]["image"] = r["image"]
    return chunk_rows


def hash_fast(
    rows: list[dict],
    decode: Callable[[Iterable[bytes | None]], Iterable[Any]],
    low_info_threshold: float,
) -> tuple[list[dict], list, dict[str, str]]:
    """Thumbnails (ingest's, or decoded by ``decode``), then one batched DCT per chunk:
    the rows hashed, their results, and why each other row was not.

    A thumbnail ingest stored for this pHash version is the one ``fast_thumbnail`` makes
    from these bytes (same steps from the same decode), so it is used as it is; any other
    row's bytes are decoded. The same hashes wherever this runs (step or worker).
    """
    version = phash_version("fast")
    ready = {
        r["key"]: thumbnail_from_bytes(r["phash_thumbnail"])
        for r in rows
        if _current_thumbnail(r, version)
    }
    todo = [r for r in rows if r["key"] not in ready]
    decoded = dict(zip((r["key"] for r in todo), decode(r.get("image") for r in todo), strict=True))
    good, thumbs, rejected = [], [], {}
    for row in rows:
        out = ready[row["key"]] if row["key"] in ready else decoded[row["key"]]
        if isinstance(out, ItemFailed):
            rejected[row["key"]] = f"hash_failed: {out.error}"
        elif isinstance(out, tuple):
            rejected[row["key"]] = f"{out[0]}: {out[1]}"
        else:
            good.append(row)
            thumbs.append(out)
    return good, hash_results(thumbs, low_info_threshold), rejected


def hash_record_batch(batch: str, good: list[dict], results: list) -> pa.RecordBatch:
    """The ``image_hashes`` rows of the hashed ``good`` rows."""
    return pa.RecordBatch.from_pylist(
        [
            {
                "key": row["key"],
                "batch": batch,
                "phash": hash_to_int64(res.hash),
                "phash_hi": res.hash >> 32,  # the halves the near-duplicate indexes probe
                "phash_lo": res.hash & 0xFFFFFFFF,
                "phash_mode": res.mode,
                "phash_version": res.version,
                "ac_energy": res.ac_energy,
                "low_information": res.low_information,
                "pixels": int(row["width"]) * int(row["height"]),
                "file_size": int(row["file_size"]),
            }
            for row, res in zip(good, results, strict=True)
        ],
        schema=IMAGE_HASHES.schema,
    )


@dataclass(frozen=True)
class HashChunk:
    """One chunk of a batch's keys for a worker: it reads their thumbnails (or bytes) from
    ``images`` at the step's version, hashes them and writes their ``image_hashes`` rows as
    one uncommitted fragment, so no thumbnail passes through the step (keys out, counts and
    a fragment's metadata back)."""

    images: TableAt
    batch: str
    keys: tuple[str, ...]
    thumbs_stored: bool
    low_info_threshold: float
    fragments: PartitionFragments


@dataclass(frozen=True)
class HashedChunk:
    """What a worker hashed and wrote for one :class:`HashChunk`."""

    written: WrittenFragments | None
    hashed: int
    low_information: int
    bytes_read: int
    rejected: tuple[tuple[str, str], ...]  # (key, why), in chunk order


def hash_and_write(task: HashChunk) -> HashedChunk:
    """Hash one chunk and write its rows (picklable; run by a worker that reaches the lab,
    or by the step itself when a worker failed: the same rows either way)."""
    rows = read_hash_inputs(task.images.read, task.batch, task.keys, task.thumbs_stored)
    good, results, rejected = hash_fast(
        rows,
        lambda datas: [call_guarded(fast_thumbnail_task, d) for d in datas],
        task.low_info_threshold,
    )
    written = None
    if good:
        written = task.fragments.write(
            pa.Table.from_batches([hash_record_batch(task.batch, good, results)])
        )
    return HashedChunk(
        written,
        len(good),
        sum(r.low_information for r in results),
        sum(len(r.get("image") or b"") for r in rows),
        tuple((k, rejected[k]) for k in task.keys if k in rejected),
    )


@dataclass(frozen=True)
class HashOutcome:
    """What ``BatchHashes.run`` wrote, and the stored rows checked against the list to hash."""

    batch: str
    settings: DedupSettings
    to_hash: int  # every profiled image of the batch
    ineligible: int  # of those, not trainable (e.g. under the size cutoff): hashed for opt-outs
    hashed: int
    low_information: int
    bytes_read: int
    seconds: float  # hashing and writing
    lance_version: int
    coverage: HashCoverage
    #: Chunks a worker failed, hashed by the step instead (the same rows, slower), and the
    #: first worker error: a wrong ``PRX_SHARED_FILESYSTEM`` or a lost node shows here.
    chunks_hashed_by_step: int = 0
    first_worker_error: str | None = None


def add_phash_halves(lab: Lab) -> bool:
    """Give an ``image_hashes`` table written before ``phash_hi``/``phash_lo`` existed those
    columns, derived from every row's ``phash`` in one commit (new rows carry them; a table
    without them cannot take rows written under the current spec). True when it did.

    Until every row has its halves, near-duplicate look-ups scan the corpus instead of
    probing the halves' indexes (``corpus.halves_indexed``): the look-up stays exact."""
    schema = lab.view().schema(IMAGE_HASHES.name)
    if schema is None or all(c in schema.names for c in HALF_COLUMNS):
        return False

    def derive(batch: pa.RecordBatch) -> pa.RecordBatch:
        hi, lo = phash_halves(batch.column("phash"))
        return pa.RecordBatch.from_arrays([hi, lo], names=list(HALF_COLUMNS))

    lab.add_derived_columns(IMAGE_HASHES.name, ["phash"], derive)
    lab.ensure_indexes(IMAGE_HASHES)
    return True


class BatchHashes:
    """Hash every profiled image of ``batch`` into its ``image_hashes`` rows (one commit).

    Only one chunk of ``read_chunk`` images' bytes is in memory at a time; in ``fast`` mode
    its thumbnails are decoded on ``workers`` processes (None: every CPU available) and
    hashed here in one batched DCT per chunk, so the hashes are the same for any worker
    count. An image that ingest accepted but the hasher cannot decode (in a worker or
    inline, the same way) is left out and named in the outcome (the completeness check then
    fails: nothing is silently dropped).
    """

    def __init__(
        self,
        lab: Lab,
        batch: str,
        settings: DedupSettings,
        read_chunk: int = DEFAULT_READ_CHUNK,
        workers: int | None = None,
        executor: str | None = None,
        report: Report | None = None,
    ) -> None:
        if read_chunk < 1:
            raise ValueError(f"read_chunk must be >= 1, got {read_chunk}")
        self.report = report  # progress lines (count, rate, ETA) while the workers run
        self.lab, self.batch, self.settings, self.read_chunk = lab, batch, settings, read_chunk
        self.workers, self.executor = workers, executor
        self.pool: WorkerPool = InlinePool()
        self.rejected: dict[str, str] = {}
        self.hashed = 0
        self.low_information = 0
        self.bytes_read = 0
        self.chunks_by_step = 0
        self.first_worker_error: str | None = None

    def keys_to_hash(self, view: LabView) -> tuple[list[str], int]:
        """Every profiled key of the batch, all present in ``images`` (else
        :class:`InputNotReady`), and how many of them are not eligible for training.

        Why the ineligible ones too: a copy under the size cutoff never trains, but an
        opt-out list or a reserving signal may name only it. Hashed, it joins the cluster of
        its larger copies, and the skip policy excludes the whole cluster for it; unhashed,
        the larger copies would train. (It can never be the training copy: it is never
        written to shards, so the skip policy counts it as excluded.)
        """
        if not view.exists(RESOLUTION.name):
            raise InputNotReady(
                f"no resolution table yet: materialise resolution_profile for {self.batch}"
            )
        where = f"batch = {sql_literal(self.batch)}"
        profile = view.read(RESOLUTION.name, ["key", "eligible"], where)
        keys = sorted(profile.column("key").to_pylist())
        ineligible = sum(1 for ok in profile.column("eligible").to_pylist() if not ok)
        stored = view.read(IMAGES.name, ["key"], where)
        present = set(stored.column("key").to_pylist()) if stored.num_columns else set()
        missing = [k for k in keys if k not in present]
        if missing:
            raise InputNotReady(
                f"{len(missing)} profiled image(s) of {self.batch} are not in `images` "
                f"(e.g. {missing[0]}): rematerialise raw_images and resolution_profile"
            )
        return keys, ineligible

    def _thumbs_stored(self, view: LabView) -> bool:
        """Whether ``images`` has ingest's thumbnail columns (fast mode uses them)."""
        schema = view.schema(IMAGES.name)
        return (
            self.settings.phash_mode == "fast"
            and schema is not None
            and set(_THUMB_COLUMNS) <= set(schema.names)
        )

    def record_batches(self, view: LabView, keys: list[str]) -> Iterator[pa.RecordBatch]:
        """The hash rows, one record batch per chunk of images (one batched DCT each)."""
        thumbs_stored = self._thumbs_stored(view)
        kw = {
            "mode": self.settings.phash_mode,
            "low_info_threshold": self.settings.low_info_threshold,
        }

        def read(columns: Sequence[str], where: str) -> pa.Table:
            return view.read(IMAGES.name, columns, where)

        for chunk in chunked(keys, self.read_chunk):
            chunk_rows = read_hash_inputs(read, self.batch, chunk, thumbs_stored)
            self.bytes_read += sum(len(r.get("image") or b"") for r in chunk_rows)
            if self.settings.phash_mode == "fast":
                good, results, rejected = hash_fast(
                    chunk_rows,
                    lambda datas: self.pool.map_ordered(fast_thumbnail_task, datas),
                    self.settings.low_info_threshold,
                )
                self.rejected.update(rejected)
            else:
                good, results = self._reference(chunk_rows, kw)
            self.hashed += len(good)
            self.low_information += sum(r.low_information for r in results)
            yield hash_record_batch(self.batch, good, results)

    def _reference(self, rows: list[dict], kw: dict) -> tuple[list[dict], list]:
        """The yardstick mode, inline (imagehash's steps on the full decode)."""
        try:
            return rows, phash_many([r["image"] for r in rows], **kw)
        except DecodeRejected:  # ingest accepted these bytes, so this is rare: find which
            good, results = [], []
            for row in rows:
                try:
                    results += phash_many([row["image"]], **kw)
                    good.append(row)
                except DecodeRejected as exc:
                    self.rejected[row["key"]] = f"{exc.reason}: {exc.detail}"
            return good, results

    def _workers_write(self, pool: WorkerPool) -> bool:
        """Whether the workers read ``images`` and write the hash rows themselves: in fast
        mode, where they reach the lab (this machine, a mount every node shares, or object
        storage). Otherwise (Ray workers and a local lab) this process reads and writes."""
        reach = pool.same_machine or shared_filesystem() or "://" in self.lab.root
        return self.settings.phash_mode == "fast" and reach

    def write_chunks(self, view: LabView, keys: list[str]) -> list[WrittenFragments]:
        """Every chunk hashed and written by a worker as one fragment of the batch's new
        rows (``Lab.commit_partition`` makes them the batch's rows). A chunk whose worker
        failed (a lost node, a worker that cannot see the lab) is hashed and written here
        instead: the same rows, so a failure costs time, never a row."""
        images = view.table_at(IMAGES.name)
        if images is None:
            raise InputNotReady(f"no images table: materialise raw_images for {self.batch}")
        fragments = self.lab.partition_fragments(IMAGE_HASHES, self.batch)
        thumbs_stored = self._thumbs_stored(view)
        tasks = [
            HashChunk(
                images,
                self.batch,
                tuple(chunk),
                thumbs_stored,
                self.settings.low_info_threshold,
                fragments,
            )
            for chunk in chunked(keys, self.read_chunk)
        ]
        written: list[WrittenFragments] = []
        progress = Progress(f"{self.batch}: hashed", len(keys), self.report)
        for task, out in zip(tasks, self.pool.map_ordered(hash_and_write, tasks), strict=True):
            if isinstance(out, ItemFailed):
                self.chunks_by_step += 1
                if self.first_worker_error is None:
                    self.first_worker_error = out.error[:500]
                    if self.report is not None:
                        self.report(
                            f"{self.batch}: a worker could not hash its chunk, the step "
                            f"hashes it (and any other) itself: {self.first_worker_error}"
                        )
                out = hash_and_write(task)
            progress.advance(len(task.keys))
            self.hashed += out.hashed
            self.low_information += out.low_information
            self.bytes_read += out.bytes_read
            self.rejected.update(out.rejected)
            if out.written is not None:
                written.append(out.written)
        progress.finish()
        return written

    def run(self) -> HashOutcome:
        add_phash_halves(self.lab)  # rows written before the halves existed gain them first
        view = self.lab.view()  # resolution and images opened once for the whole run
        keys, ineligible = self.keys_to_hash(view)
        t0 = time.perf_counter()
        self.pool = make_pool(self.executor, self.workers)
        try:
            if self._workers_write(self.pool):
                chunks = self.write_chunks(view, keys)
                written = self.lab.commit_partition(IMAGE_HASHES, self.batch, chunks)
            else:
                written = self.lab.replace_partition(
                    IMAGE_HASHES, self.batch, self.record_batches(view, keys)
                )
        finally:
            self.pool.close()
            self.pool = InlinePool()
            view.close()
        seconds = time.perf_counter() - t0
        stored = self.lab.read_batch(IMAGE_HASHES.name, self.batch, ["key", "phash_version"])
        return HashOutcome(
            batch=self.batch,
            settings=self.settings,
            to_hash=len(keys),
            ineligible=ineligible,
            hashed=self.hashed,
            low_information=self.low_information,
            bytes_read=self.bytes_read,
            seconds=seconds,
            lance_version=written["version"],
            coverage=hash_coverage(keys, stored, self.settings.phash_version, self.rejected),
            chunks_hashed_by_step=self.chunks_by_step,
            first_worker_error=self.first_worker_error,
        )


# --------------------------------------------------------------------------- phash_clusters


@dataclass(frozen=True)
class ClusterOutcome:
    """What ``BatchClusters.run`` decided, wrote and queued, and the stored keepers' check."""

    batch: str
    settings: DedupSettings
    plan: BatchPlan
    lookups: dict[str, int]
    decide_seconds: float
    lance_version: int
    dirty_marked: int  # other batches' contradicted rows queued (raced ones included)
    dirty_cleared: int  # this batch's marks answered by this run
    raced: list[DecisionChange]  # what hashes written during the run changed
    rechecked: bool  # hashes landed between the read and the write: decided again
    keepers: KeeperCheck
    pending_dirty: int  # rows left in the queue after the run (every batch)
    low_information_keys: list[str]  # flagged for review

    @property
    def kept(self) -> int:
        return sum(self.plan.rows.column("is_keeper").to_pylist())


class BatchClusters:
    """Decide ``batch``'s near-duplicate clusters against the corpus and store them."""

    def __init__(
        self,
        lab: Lab,
        batch: str,
        settings: DedupSettings,
        lookup_chunk: int = DEFAULT_LOOKUP_CHUNK,
    ) -> None:
        if lookup_chunk < 1:
            raise ValueError(f"lookup_chunk must be >= 1, got {lookup_chunk}")
        self.lab, self.batch, self.settings, self.chunk = lab, batch, settings, lookup_chunk

    def run(self) -> ClusterOutcome:
        lab, batch, settings = self.lab, self.batch, self.settings
        # The pending marks for this batch are read before the corpus (the view opens each
        # table on first use), so the rows cleared below are exactly those this run's
        # decisions account for; later marks stay.
        answered = read_dirty(lab, batch).column("dirty_id").to_pylist()
        view = lab.view()
        if not view.exists(IMAGE_HASHES.name):
            raise InputNotReady(f"no image_hashes table yet: materialise image_hashes for {batch}")
        t0 = time.perf_counter()
        gathered = gather_corpus(view, batch, settings, self.chunk)
        plan = plan_batch(batch, gathered.corpus, gathered.stored, settings)
        decide_seconds = time.perf_counter() - t0
        written = lab.replace_partition(PHASH_CLUSTERS, batch, plan.rows)
        lab.replace_partition(DEDUP_STATE, batch, state_row(batch, plan, settings, _now()))
        marked = mark_dirty(lab, plan.changes, batch)
        raced, rechecked = self._recheck(plan, gathered)
        cleared = clear_dirty(lab, answered)
        ids = plan.rows.column("cluster_id").to_pylist()
        members, pixels = read_cluster_members(lab, ids, settings, self.chunk)
        return ClusterOutcome(
            batch=batch,
            settings=settings,
            plan=plan,
            lookups=gathered.lookups,
            decide_seconds=decide_seconds,
            lance_version=written["version"],
            dirty_marked=marked + len(raced),
            dirty_cleared=cleared,
            raced=raced,
            rechecked=rechecked,
            keepers=check_keepers(members, pixels),
            pending_dirty=pending_dirty(lab),
            low_information_keys=[r["key"] for r in plan.rows.to_pylist() if r["low_information"]],
        )

    def _recheck(self, plan: BatchPlan, gathered: Gathered) -> tuple[list[DecisionChange], bool]:
        """Decide again if hashes were written since the corpus read; mark what they changed.

        Changes to this batch's own rows are marked against itself, so the sensor reruns it.
        Returns the marked changes and whether the corpus was read again.
        """
        if self.lab.version(IMAGE_HASHES.name) == gathered.hashes_version:
            return [], False
        again = gather_corpus(self.lab.view(), self.batch, self.settings, self.chunk)
        fresh = plan_batch(self.batch, again.corpus, again.stored, self.settings)
        seen = {(c.batch, c.key, c.after) for c in plan.changes}
        raced = [c for c in fresh.changes if (c.batch, c.key, c.after) not in seen]
        before = {r["key"]: r for r in plan.rows.to_pylist()}
        for r in fresh.rows.to_pylist():
            old = before.get(r["key"])
            if old is None or any(old[f] != r[f] for f in DECISION_FIELDS):
                was = describe_decision(old) if old else "absent"
                raced.append(
                    DecisionChange(self.batch, r["key"], r["cluster_id"], was, describe_decision(r))
                )
        mark_dirty(self.lab, raced, self.batch)
        return raced, True


def _now() -> datetime:
    return datetime.now(UTC)
