"""The shard stage's two runs: assign a batch's images to buckets, write its MDS shards.

Each run reads its inputs through ``Lab``, decides, writes (Lance through ``Lab``, shards
through ``mds.py``), checks its own accounting and returns a typed outcome; the Dagster
assets in ``defs/shards`` only turn that outcome into metadata.

Order inside ``BatchShards.run`` is part of the crash contract: every bucket directory is in
place (with its first skip-list generation) before ``shard_samples`` is committed, so a
crash in between leaves rows that a ``dir_digest`` check reveals as stale, never a sample
that is trained on without a decision.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.progress import Progress, Report
from prx_assets.core.shards.buckets import BucketTable, bucket_table
from prx_assets.core.shards.mds import (
    CommittedDir,
    PartitionDir,
    StagedPartition,
    directory_bytes,
    list_partition_dirs,
    partition_digest,
    relative_partition_dir,
)
from prx_assets.core.shards.pieces import (  # noqa: F401 - SHARD_HASHES re-exported
    SHARD_HASHES,
    PiecePlanner,
)
from prx_assets.core.shards.plan import ShardPlan, plan_by_reference
from prx_assets.core.shards.remote import RemoteShardTree, StagedShards
from prx_assets.core.shards.render import MDS_EXTRA_COLUMNS
from prx_assets.core.shards.screening import ShardScreener
from prx_assets.core.shards.settings import ShardSettings  # noqa: F401 - re-exported
from prx_assets.core.shards.small_buckets import small_bucket_problems
from prx_assets.core.shards.tables import (
    AssignmentSummary,
    BucketTotals,
    assignment_rows,
    bucket_totals,
    placement_rows,
    summarise_assignments,
)
from prx_assets.core.skiplists.policy import PartitionDecisions, SkipPolicy, SkipPolicyError
from prx_assets.core.skiplists.sidecars import current_generation
from prx_assets.core.tables import BUCKET_ASSIGNMENTS, CAPTIONS, RESOLUTION, SHARD_SAMPLES
from prx_assets.core.workers import WorkerPool, make_pool

# --------------------------------------------------------------------------- assignments


@dataclass(frozen=True)
class AssignmentOutcome:
    """What ``BatchAssignment`` wrote: the bucket fill of one batch."""

    batch: str
    eligible: int
    summary: AssignmentSummary
    version: int  # of bucket_assignments after the write

    def check(self) -> None:
        if self.summary.assigned != self.eligible:
            raise AssertionError(
                f"{self.batch}: {self.eligible} eligible images but {self.summary.assigned} "
                "assignments"
            )


class BatchAssignment:
    """Tier, shape, scale and crop box for every eligible image of a batch.

    From the ``resolution`` table's sizes alone: no image bytes are read, so the plan (and
    the bucket fill) can be judged before a pixel is resized.
    """

    def __init__(self, lab: Lab, batch: str, table: BucketTable | None = None) -> None:
        self.lab = lab
        self.batch = batch
        self.table = bucket_table() if table is None else table

    def run(self) -> AssignmentOutcome:
        eligible = self.lab.read(
            RESOLUTION.name,
            columns=["key", "batch", "width", "height"],
            filter=f"batch = {sql_literal(self.batch)} AND eligible = true",
        )
        if eligible.num_rows:
            rows = assignment_rows(eligible, self.table)
        else:
            rows = BUCKET_ASSIGNMENTS.schema.empty_table()
        written = self.lab.replace_partition(BUCKET_ASSIGNMENTS, self.batch, rows)
        outcome = AssignmentOutcome(
            batch=self.batch,
            eligible=eligible.num_rows,
            summary=summarise_assignments(rows, self.table),
            version=written["version"],
        )
        outcome.check()
        return outcome


# --------------------------------------------------------------------------- shards


class ScreeningRefused(RuntimeError):
    """The batch's first skip-lists cannot be decided: nothing was written."""


@dataclass(frozen=True)
class WrittenDir:
    """One bucket directory of the batch as written."""

    relative_dir: str
    tier: int
    shape: str
    samples: int
    shards: int
    bytes: int
    generation: str | None  # its live skip-list generation
    hazards: tuple[str, ...]  # small-bucket problems of this batch's directory alone


@dataclass(frozen=True)
class ShardOutcome:
    """What ``BatchShards`` wrote, and what it found while writing."""

    batch: str
    assigned: int
    written: int
    failures: dict[str, str]  # key -> why it could not be rendered (not written)
    uncaptioned: dict[str, str]  # key -> why it was written with an empty caption
    decisions: PartitionDecisions  # the first generation's, at the written positions
    policy_fingerprint: str
    directories: tuple[WrittenDir, ...]  # tier, then aspect order
    # "tier/shape" -> small-bucket problems of the bucket over every batch, for the buckets
    # this batch wrote (what a trainer's stream for that bucket sees).
    hazards_all_batches: dict[str, list[str]]
    version: int  # of shard_samples after the write
    settings: ShardSettings = field(default_factory=ShardSettings)

    @property
    def excluded(self) -> int:
        return len(self.decisions.excluded_keys)

    @property
    def bytes_written(self) -> int:
        return sum(d.bytes for d in self.directories)

    def check(self) -> None:
        if self.written + len(self.failures) != self.assigned:
            raise AssertionError(
                f"{self.batch}: {self.assigned} assigned but {self.written} written and "
                f"{len(self.failures)} render failures"
            )


class BatchShards:
    """Render every assigned image of a batch into its bucket's MDS directory, screened.

    Reads the batch's assignments and captions, decides the whole partition's first
    skip-lists once (``ShardScreener``), has the pool's workers render and write each
    bucket's shards piece by piece (``core/shards/pieces.py``: tasks carry references,
    results carry index entries and digests), commits each bucket directory atomically
    (``mds.StagedPartition``; on object storage, ``RemoteShardTree.publish_shards``), then
    records every sample's place in ``shard_samples``.
    """

    def __init__(
        self,
        lab: Lab,
        shards_root: str,
        batch: str,
        policy: SkipPolicy,
        settings: ShardSettings | None = None,
        report: Report | None = None,
    ) -> None:
        self.report = report  # progress lines (count, rate, ETA) while pieces render
        self.lab = lab
        self.shards_root = shards_root
        self.batch = batch
        self.policy = policy
        self.settings = settings or ShardSettings()

    def plan(self, view: LabView) -> ShardPlan:
        """Which sample goes where, from the few columns that decide it: no assignment
        geometry and no caption text but that of captions without a word (the workers read
        the rest for their own samples)."""
        where = f"batch = {sql_literal(self.batch)}"
        assignments = view.read(BUCKET_ASSIGNMENTS.name, ["key", "tier", "shape"], where)
        if assignments.num_rows == 0:
            assignments = pa.table({"key": [], "tier": [], "shape": []})
        captions = view.read(CAPTIONS.name, ["key", "backend_fingerprint", "word_count"], where)

        def texts(keys: Sequence[str]) -> dict[str, str | None]:
            out: dict[str, str | None] = {}
            for i in range(0, len(keys), 1024):
                f = f"{where} AND {in_list('key', keys[i : i + 1024])}"
                rows = view.read(CAPTIONS.name, ["key", "caption"], f).to_pylist()
                out.update((r["key"], r["caption"]) for r in rows)
            return out

        return plan_by_reference(assignments, captions, texts)

    def run(self) -> ShardOutcome:
        s = self.settings
        pool = make_pool(s.executor, s.workers)
        try:
            return self._run(pool)
        finally:
            pool.close()

    def _run(self, pool: WorkerPool) -> ShardOutcome:
        with self.lab.view() as view:  # the versions the plan and every worker read
            return self._run_at(pool, view)

    def _run_at(self, pool: WorkerPool, view: LabView) -> ShardOutcome:
        s, batch = self.settings, self.batch
        plan = self.plan(view)
        keys = {bucket: [r["key"] for r in rows] for bucket, rows in plan.buckets.items()}
        try:
            screener = ShardScreener(self.lab, batch, self.policy, keys, plan.uncaptioned)
        except SkipPolicyError as exc:
            raise ScreeningRefused(f"{batch}: cannot decide its skip-lists: {exc}") from None
        # On object storage the directories' indexes and skip-lists are written to a local
        # work copy, the workers put the shards in a staging prefix, and each directory is
        # then published (versions first, one pointer each last: core/shards/remote.py).
        with RemoteShardTree(self.shards_root, batch) as tree:
            pieces = PiecePlanner(view if plan.buckets else None, batch, plan, s, pool, tree)
            pieces.progress = Progress(f"{batch}: rendered", plan.planned, self.report)
            return self._write(tree, plan, pieces, screener, view)

    def _write(
        self,
        tree: RemoteShardTree,
        plan: ShardPlan,
        pieces: PiecePlanner,
        screener: ShardScreener,
        view: LabView,
    ) -> ShardOutcome:
        s, batch = self.settings, self.batch
        staged = StagedPartition(
            tree.local_root,
            batch,
            plan.buckets,
            extra_columns=MDS_EXTRA_COLUMNS,
            size_limit=s.size_limit,
        )
        try:
            committed = pieces.write(staged, screener)
            staged.finish()
        except BaseException:
            # Best effort (the next run sweeps what is left): the original error is the one
            # to report, not a second one from an unreachable store.
            with contextlib.suppress(Exception):
                staged.discard()
                tree.discard_staging(staged.token)
            raise
        tree.publish_shards(
            {
                rel: StagedShards(tree.staging_key(rel, staged.token), c.shards)
                for rel, c in committed.items()
            }
            if tree.remote
            else None
        )
        placements = [p for c in committed.values() for p in c.placements]
        dirs = list_partition_dirs(tree.local_root, batch)
        digests = {d.relative_dir: partition_digest(d.path) for d in dirs}
        rows = placement_rows(placements, batch, digests, pieces.jpeg, plan.fingerprints)
        mine = bucket_totals(rows)
        hazards = self._hazards_all_batches(mine, view)  # before the commit: see its doc
        written = self.lab.replace_partition(SHARD_SAMPLES, batch, rows)

        outcome = ShardOutcome(
            batch=batch,
            assigned=plan.planned,
            written=len(placements),
            failures=dict(pieces.failures),
            uncaptioned=dict(plan.uncaptioned),
            decisions=screener.decisions(),
            policy_fingerprint=self.policy.fingerprint(),
            directories=self._directories(mine, {d.relative_dir: d for d in dirs}, committed),
            hazards_all_batches=hazards,
            version=written["version"],
            settings=s,
        )
        outcome.check()
        return outcome

    def _rule(self, totals: BucketTotals) -> list[str]:
        s = self.settings
        return small_bucket_problems(
            totals.samples, totals.shards, s.canonical_nodes, s.device_batch_size
        )

    def _directories(
        self,
        mine: dict[tuple[int, str], BucketTotals],
        dirs: dict[str, PartitionDir],
        committed: dict[str, CommittedDir],
    ) -> tuple[WrittenDir, ...]:
        out = []
        for (tier, shape), totals in mine.items():
            d = dirs[relative_partition_dir(tier, shape, self.batch)]
            c = committed[d.relative_dir]
            local = {p.name for p in d.path.iterdir()}  # on object storage: no shard here
            remote_bytes = (
                sum(
                    int(e["raw_data"]["bytes"])
                    for e in json.loads((d.path / "index.json").read_bytes())["shards"]
                    if e["raw_data"]["basename"] not in local
                )
                if c.shards
                else 0
            )
            out.append(
                WrittenDir(
                    relative_dir=d.relative_dir,
                    tier=tier,
                    shape=shape,
                    samples=totals.samples,
                    shards=totals.shards,
                    bytes=directory_bytes(d.path) + remote_bytes,
                    generation=current_generation(d.path),
                    hazards=tuple(self._rule(totals)),
                )
            )
        return tuple(out)

    def _hazards_all_batches(
        self, mine: dict[tuple[int, str], BucketTotals], view: LabView
    ) -> dict[str, list[str]]:
        """The rule over every batch's samples of the buckets this batch wrote.

        Reads what decides the rule, not the buckets: at 10^9 images a bucket holds ~10^7
        rows, and reading them all made every step's cost grow with the corpus. A bucket's
        samples are counted through the ``tier``/``shape`` bitmap indexes; its shards are
        its samples at ``index_in_shard = 0`` (one per shard), read only up to the
        threshold the rule compares them with (``canonical_nodes``): past it, the rule
        holds whatever the exact number.

        Other batches are read in the step's pinned ``view``, before this batch's commit,
        and this batch's own rows come from memory (``mine``): read after the commit, each
        bucket's two queries scanned the new, not yet indexed fragment again (on object
        storage, three whole-file reads per bucket directory; measured with
        ``PRX_BENCH_S3_REQUEST_LOG``, stop 45). Batches that other steps commit after the
        view was pinned are not counted here; the rule is metadata, and the next step
        writing to the bucket counts them.
        """
        out: dict[str, list[str]] = {}
        need = self.settings.canonical_nodes
        for (tier, shape), own in mine.items():
            where = (
                f"tier = {int(tier)} AND shape = {sql_literal(shape)} "
                f"AND batch != {sql_literal(self.batch)}"
            )
            samples = view.count(SHARD_SAMPLES.name, where)
            firsts = view.read(
                SHARD_SAMPLES.name, ["key"], f"{where} AND index_in_shard = 0", limit=need
            )
            totals = BucketTotals(samples + own.samples, firsts.num_rows + own.shards, 0)
            if problems := self._rule(totals):
                out[f"{tier}/{shape}"] = problems
        return out
