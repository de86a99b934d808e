"""skip_lists for one partition: its skip-list generations and its ``skip_audit`` rows.

Read -> decide -> write -> verify, all through ``Lab`` and the sidecar module:

1. read: the partition's ``shard_samples`` rows, checked against the MDS tree (each
   directory's digest computed once, and bound to the ``index.json`` it covered);
2. decide: :func:`~prx_assets.core.skiplists.decisions.decide_partition` from the lab's
   current facts, and the other batches whose recorded decisions those facts contradict;
3. write, in this order: the contradicted batches are listed in ``skip_dirty`` first (a crash
   later still reruns them); then every directory's new generation is staged (sidecars, not
   yet live), then each directory's manifest flips (one atomic rename each: what training
   obeys), then the audit table (what it records) is committed;
4. verify: every generation was written for the ``index.json`` the digest check covered and
   that index is still in place (a concurrent ``mds_shards`` rewrite voids the run); the
   decision is taken again and a difference (a fact changed meanwhile) marks this batch
   itself; last, the marks this run answered are cleared.

What a reader can see at any instant, crashes included: every directory on exactly one
complete generation, either the one it had before this run (consistent with the
``skip_audit`` rows committed before it) or the one this run decided (consistent with the
audit this run commits, or its rerun commits after a crash); never a directory with a mix
of the two, never one without a generation. A crash between two flips leaves some
directories on each; the rerun brings every one to the new decisions and commits the audit.

No work is done twice: a directory's digest is computed once, and the generation's sidecar
count and digest come from what was written, not from reading the files back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prx_assets.core.lab import Lab
from prx_assets.core.shards.mds import list_partition_dirs, partition_digest, partition_dir
from prx_assets.core.shards.remote import RemoteShardTree
from prx_assets.core.shards.tables import written_without_caption
from prx_assets.core.skiplists.decisions import (
    CaptionCoverage,
    SkipChange,
    caption_coverage,
    changed_during_run,
    clear_skip_dirty,
    contradicted_elsewhere,
    decide_partition,
    ensure_audit_columns,
    mark_skip_dirty,
    read_skip_dirty,
)
from prx_assets.core.skiplists.policy import (
    PartitionDecisions,
    PreviousDecision,
    SampleRef,
    SkipPolicy,
    SkipPolicyError,
    audit_rows,
    exclusion_changes,
    samples_from_rows,
)
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    PublishedGeneration,
    SkipListError,
    publish_partition_generations,
    published_digest,
)
from prx_assets.core.tables import (
    CAPTION_CLASSES,
    CAPTIONS,
    IMAGES,
    PHASH_CLUSTERS,
    SHARD_SAMPLES,
    SKIP_AUDIT,
)

# Table read -> the asset that writes it (for the "materialise X first" message).
REQUIRED_TABLES: tuple[tuple[str, str], ...] = (
    (SHARD_SAMPLES.name, "mds_shards"),
    (CAPTIONS.name, "captions"),
    (CAPTION_CLASSES.name, "caption_classes"),
    (PHASH_CLUSTERS.name, "phash_clusters"),
    (IMAGES.name, "raw_images"),
)


class SkipListsError(RuntimeError):
    """skip_lists cannot (or could not safely) finish for this partition; the message says
    what to rerun. Whatever the run wrote before is consistent (module docstring)."""


class UpstreamMissing(SkipListsError):
    """A table the decisions read does not exist yet."""


class ShardTreeMismatch(SkipListsError):
    """``shard_samples`` does not describe the MDS tree on disk (stale or rewritten)."""


class RewrittenDuringRun(SkipListsError):
    """A directory was rewritten while its skip-lists were being written."""


class Undecidable(SkipListsError):
    """The facts break a table contract the policy relies on (e.g. a sample not in images)."""


@dataclass(frozen=True)
class ShardDir:
    """One MDS directory of the partition, checked against ``shard_samples``."""

    relative_dir: str
    path: Path
    index_sha256: str  # of the index.json the digest check covered


def _index_sha256(path: Path) -> str:
    return hashlib.sha256((path / INDEX_BASENAME).read_bytes()).hexdigest()


def verified_dirs(shards_root: str, batch: str, rows: list[dict[str, Any]]) -> dict[str, ShardDir]:
    """relative_dir -> directory, after checking the tree is what ``shard_samples`` describes:
    each listed directory where the layout puts it, with the recorded digest (computed once),
    and no directory of the batch without rows."""
    recorded: dict[str, dict[str, Any]] = {}
    for r in rows:
        rel = r["relative_dir"]
        if rel in recorded:
            continue
        expected = partition_dir(shards_root, int(r["tier"]), r["shape"], batch)
        path = Path(shards_root) / rel
        if path != expected:
            raise ShardTreeMismatch(
                f"shard_samples row of {r['key']} names {rel}, expected "
                f"{expected.relative_to(shards_root)}"
            )
        if not (path / INDEX_BASENAME).is_file():
            raise ShardTreeMismatch(
                f"{path} is missing but shard_samples lists samples there: "
                f"rerun mds_shards for {batch}"
            )
        recorded[rel] = r
    dirs: dict[str, ShardDir] = {}
    for rel, r in recorded.items():
        path = Path(shards_root) / rel
        index_sha = _index_sha256(path)  # before the digest: a rewrite in between shows
        if partition_digest(path) != r["dir_digest"]:
            raise ShardTreeMismatch(
                f"{path} was rewritten after shard_samples recorded it (dir_digest "
                f"differs): rerun mds_shards for {batch}, then skip_lists"
            )
        dirs[rel] = ShardDir(rel, path, index_sha)
    on_disk = {d.path for d in list_partition_dirs(shards_root, batch)}
    stray = sorted(str(p) for p in on_disk - {d.path for d in dirs.values()})
    if stray:
        raise ShardTreeMismatch(
            f"MDS directories of {batch} with no shard_samples rows: {stray[:5]}; "
            "shard_samples is stale: rerun mds_shards"
        )
    return dirs


@dataclass(frozen=True)
class SkipListsOutcome:
    """What one skip_lists run decided, published and recorded."""

    batch: str
    policy: SkipPolicy
    decisions: PartitionDecisions
    published: dict[str, PublishedGeneration]  # relative_dir -> its new generation, sorted
    newly_excluded: int
    no_longer_excluded: int
    marked_elsewhere: tuple[SkipChange, ...]  # other batches' decisions now contradicted
    changed_during_run: tuple[SkipChange, ...]  # this batch's, changed while it ran
    cleared: int  # skip_dirty marks this run answered
    coverage: CaptionCoverage
    skiplist_digest: str
    audit_version: int

    @property
    def samples(self) -> int:
        return len(self.decisions.decisions)

    @property
    def kept(self) -> int:
        return sum(k for k, _ in self.decisions.bucket_counts().values())

    @property
    def skipped(self) -> int:
        return self.samples - self.kept

    @property
    def directories(self) -> int:
        return len(self.published)

    @property
    def sidecars(self) -> int:
        return sum(p.shards for p in self.published.values())

    @property
    def generations(self) -> dict[str, str]:
        return {rel: p.generation for rel, p in self.published.items()}

    @property
    def lists_applied(self) -> list[str]:
        return sorted({i for d in self.decisions.decisions for i in d.opt_out_list_ids})

    @property
    def other_batches(self) -> list[str]:
        return sorted({c.batch for c in self.marked_elsewhere})


class PartitionSkipLists:
    """The skip_lists run of one partition (module docstring); ``run()`` once."""

    def __init__(self, lab: Lab, shards_root: str, batch: str, policy: SkipPolicy) -> None:
        self.lab = lab
        self.shards_root = shards_root
        self.batch = batch
        self.policy = policy

    def run(self) -> SkipListsOutcome:
        lab, batch = self.lab, self.batch
        self._require_tables()
        # Marks read before the facts: those cleared at the end are the ones this run answers.
        answered = read_skip_dirty(lab, batch).column("dirty_id").to_pylist()
        rows = lab.read_batch(SHARD_SAMPLES.name, batch).to_pylist()
        for r in rows:  # what the writer stored: an empty caption rules the sample out
            r["caption_usable"] = not written_without_caption(r)
        # On object storage: a local mirror of the batch's live versions (index and
        # generation), staged there, then pushed as one unit (core/shards/remote.py).
        with RemoteShardTree(self.shards_root, batch) as tree:
            tree.pull_generations()
            dirs = verified_dirs(tree.local_root, batch, rows)
            samples = samples_from_rows(rows)
            decisions = self._decide(samples)
            elsewhere = contradicted_elsewhere(lab, decisions)
            mark_skip_dirty(lab, elsewhere, batch)
            published = self._publish(dirs, decisions)
            tree.publish_skiplists(sorted(dirs))

        ensure_audit_columns(lab)
        previous = self._previous()
        audit = audit_rows(batch, decisions, previous, datetime.now(UTC))
        written = lab.replace_partition(SKIP_AUDIT, batch, audit)
        raced = changed_during_run(batch, decisions, self._decide(samples))
        mark_skip_dirty(lab, raced, batch)
        cleared = clear_skip_dirty(lab, answered)
        newly, gone = exclusion_changes(decisions, previous)
        return SkipListsOutcome(
            batch=batch,
            policy=self.policy,
            decisions=decisions,
            published=published,
            newly_excluded=newly,
            no_longer_excluded=gone,
            marked_elsewhere=tuple(elsewhere),
            changed_during_run=tuple(raced),
            cleared=cleared,
            coverage=caption_coverage(lab, batch),
            skiplist_digest=published_digest(list(published.values())),
            audit_version=written["version"],
        )

    def _require_tables(self) -> None:
        view = self.lab.view()
        missing = [(t, a) for t, a in REQUIRED_TABLES if not view.exists(t)]
        if missing:
            raise UpstreamMissing(
                "skip_lists needs its upstream tables; missing: "
                + ", ".join(f"`{t}` (materialise {a} for {self.batch} first)" for t, a in missing)
            )

    def _decide(self, samples: list[SampleRef]) -> PartitionDecisions:
        try:
            return decide_partition(self.lab, self.batch, samples, self.policy)
        except SkipPolicyError as exc:
            raise Undecidable(f"{self.batch}: {exc}") from None

    def _publish(
        self, dirs: dict[str, ShardDir], decisions: PartitionDecisions
    ) -> dict[str, PublishedGeneration]:
        """Stage every directory's generation, flip the manifests, then check each was
        written for the index the digest covered and that index is still the live one."""
        skips = decisions.skips_by_dir()
        order = sorted(dirs)
        try:
            published = publish_partition_generations(
                {dirs[rel].path: skips.get(rel, {}) for rel in order}
            )
        except SkipListError as exc:
            raise ShardTreeMismatch(
                f"{self.batch}: shard_samples does not match the MDS tree ({exc}): "
                "rerun mds_shards, then skip_lists"
            ) from None
        out = dict(zip(order, published, strict=True))
        for rel, generation in out.items():
            path = dirs[rel].path
            if not (
                generation.index_sha256 == dirs[rel].index_sha256 == _index_sha256(path)
            ):  # a concurrent mds_shards rewrite would void the sidecars
                raise RewrittenDuringRun(f"{path} was rewritten while skip_lists ran: rerun it")
        return out

    def _previous(self) -> dict[str, PreviousDecision]:
        """key -> the partition's audit row before this run (what the new times carry over).

        A row from before per-reason times has none: each of its reasons is dated by its
        ``decided_at``, the earliest moment it is known to have applied (never earlier).
        """
        rows = self.lab.read_batch(
            SKIP_AUDIT.name,
            self.batch,
            ["key", "excluded", "first_excluded_at", "reasons", "reason_since", "decided_at"],
        )
        out = {}
        for r in rows.to_pylist():
            reasons = r["reasons"] or []
            since = r["reason_since"] or []
            if len(since) != len(reasons):
                since = [r["decided_at"]] * len(reasons)
            known = {k: t for k, t in zip(reasons, since, strict=True) if t is not None}
            out[r["key"]] = PreviousDecision(bool(r["excluded"]), r["first_excluded_at"], known)
        return out
