"""Gather what a partition's skip decisions depend on from the lab, and decide.

Why one entry point: ``mds_shards`` writes a first sidecar generation inside its temporary
directory and ``skip_lists`` refreshes it; both must decide the same way from the same
inputs, so both call :func:`decide_partition`.

Why it reads other batches: a sample's fate depends on the other copies of its picture
(see :mod:`prx_assets.core.skiplists.policy`). The clusters touching the partition are read
whole through the ``cluster_id`` BTREE of ``phash_clusters``, and every fact about their
members (keeper order, caption, class label, dedup staleness, whether written, opt-outs)
through the ``key`` BTREEs of the tables holding it, so the cost follows the partition and
its clusters, never the corpus. Facts are read live from the stage tables, not from other
batches' skip decisions, so a decision never waits for another batch's ``skip_lists``.

What that leaves: batch A's facts change (a copy is reclassified, captioned, written),
and batch B's *recorded* decisions become wrong (its copy should now train, or stop).
``skip_lists(A)`` finds every such contradiction (:func:`contradicted_elsewhere`) and
lists it in ``skip_dirty``; ``skip_dirty_sensor`` reruns ``skip_lists`` for exactly those
partitions. The check is state-based (recorded decision vs the current one), so any
missed or lost mark is found again by the next run that touches the cluster.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from prx_assets.core.dedup.corpus import DEFAULT_LOOKUP_CHUNK, cluster_members, lookup_by_keys
from prx_assets.core.dedup.decisions import keeper_order
from prx_assets.core.dedup.dirty import read_dirty
from prx_assets.core.ingest.signals import UNCAPTURED
from prx_assets.core.lab import Lab, TableSpec, in_list, sql_literal
from prx_assets.core.skiplists.matching import alias_signals, opted_out_keys
from prx_assets.core.skiplists.policy import (
    Copy,
    Outcome,
    PartitionDecisions,
    SampleRef,
    SkipPolicy,
    SkipPolicyError,
    decide,
)
from prx_assets.core.tables import (
    CAPTION_CLASSES,
    CAPTIONS,
    IMAGE_HASHES,
    IMAGES,
    PHASH_CLUSTERS,
    RESOLUTION,
    SHARD_SAMPLES,
    SKIP_AUDIT,
    SKIP_DIRTY,
)

IMAGE_ID_COLUMNS = ["key", "url", "source", "source_id"]  # every way a list names an image
IMAGE_FACT_COLUMNS = ["batch", *IMAGE_ID_COLUMNS, "usage_signals"]  # + captured opt-out headers


class MissingImages(SkipPolicyError):
    """Samples that are not (any more) in ``images``: the shards are stale."""


def usable_caption(caption: str | None) -> bool:
    """A caption a text encoder can learn from: not null, not empty, not only whitespace."""
    return caption is not None and bool(caption.strip())


# ---------------------------------------------------------------------------------------------
# Reading facts: this batch by its BITMAP, other batches' members by their key BTREE


def _typed_empty(spec: TableSpec, columns: Sequence[str]) -> pa.Table:
    return pa.Table.from_pylist([], schema=pa.schema([spec.schema.field(c) for c in columns]))


def _rows(
    lab: Lab,
    spec: TableSpec,
    batch: str,
    others: Sequence[tuple[str, str]],
    columns: Sequence[str],
    chunk: int,
    own: bool = True,
) -> dict[tuple[str, str], dict[str, Any]]:
    """(batch, key) -> row, for every row of ``batch`` (unless not ``own``) and for the
    ``others`` pairs.

    An absent table reads as empty: a stage that has not run yet leaves its facts unknown,
    which the policy treats as pending.
    """
    cols = list(dict.fromkeys(["batch", "key", *columns]))
    if not lab.exists(spec.name):
        return {}
    tables = [lookup_by_keys(lab, spec.name, spec.schema, others, cols, chunk=chunk)]
    if own:
        tables.append(lab.read(spec.name, cols, f"batch = {sql_literal(batch)}"))
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for table in tables:
        for r in table.to_pylist():
            ref = (r["batch"], r["key"])
            if ref in out:
                raise SkipPolicyError(f"{spec.name} holds two rows for {ref[0]}:{ref[1]}")
            out[ref] = r
    return out


def _sharded_batches(lab: Lab, batches: Iterable[str]) -> set[str]:
    """Those of ``batches`` with at least one ``shard_samples`` row (BITMAP on batch)."""
    view = lab.view()
    if not view.exists(SHARD_SAMPLES.name):
        return set()
    return {
        b
        for b in sorted(set(batches))
        if view.count(SHARD_SAMPLES.name, f"batch = {sql_literal(b)}")
    }


@dataclass(frozen=True)
class Facts:
    """Everything :func:`decide_partition` read, kept for the contradiction check."""

    copies: list[Copy]
    clusters_read: int
    other_members: int


def gather_copies(
    lab: Lab,
    batch: str,
    samples: Sequence[SampleRef],
    chunk: int = DEFAULT_LOOKUP_CHUNK,
) -> Facts:
    """A :class:`Copy` for every sample of ``batch`` and every member of their clusters."""
    keys = {s.key for s in samples}
    fact_columns = _image_fact_columns(lab)
    if lab.exists(IMAGES.name):
        images = lab.read(IMAGES.name, fact_columns, f"batch = {sql_literal(batch)}")
    else:
        images = _typed_empty(IMAGES, fact_columns)
    missing = keys - set(images.column("key").to_pylist())
    if missing:
        raise MissingImages(
            f"{len(missing)} sharded image(s) of {batch} are not in `images` "
            f"(e.g. {sorted(missing)[0]}): rerun raw_images and the stages after it"
        )
    decided = _rows(lab, PHASH_CLUSTERS, batch, [], ["cluster_id", "low_information"], chunk)
    # The clusters of every hashed image of the batch, not only of its samples: a copy that
    # never trains (under the size cutoff) may carry an opt-out or a reserving signal for
    # its cluster, and this run is where the other batches' copies learn of it
    # (``contradicted_elsewhere``), even when the batch has no samples at all.
    cluster_ids = sorted(
        {
            r["cluster_id"]
            for r in decided.values()
            if r["cluster_id"] is not None and not r["low_information"]
        }
    )
    members: list[tuple[str, str]] = []
    if cluster_ids:
        rows = cluster_members(lab, cluster_ids, ["batch", "key", "cluster_id", "low_information"])
        for r in rows.to_pylist():
            if r["low_information"]:
                continue  # never merged: not a copy of anything
            ref = (r["batch"], r["key"])
            if ref not in decided:
                decided[ref] = r
            members.append(ref)
    refs = sorted({(batch, k) for k in keys} | set(members))
    others = [r for r in refs if r[0] != batch]

    hashes = _rows(lab, IMAGE_HASHES, batch, others, ["pixels", "file_size"], chunk)
    captions = _rows(lab, CAPTIONS, batch, others, ["caption", "backend_fingerprint"], chunk)
    classes = _rows(lab, CAPTION_CLASSES, batch, others, ["label", "caption_fingerprint"], chunk)
    shard_rows = _rows(lab, SHARD_SAMPLES, batch, others, [], chunk, own=False)
    # Copies not eligible for training (e.g. under the size cutoff) are hashed, so that an
    # opt-out naming one reaches its cluster, but never written: known, not pending, even in
    # a batch that has no shards at all (which would otherwise count as not sharded yet).
    profiles = _rows(lab, RESOLUTION, batch, others, ["eligible"], chunk, own=False)
    unsharded = {b for b, _ in others} - _sharded_batches(lab, {b for b, _ in others})
    stale = {(r["batch"], r["key"]) for r in read_dirty(lab).to_pylist()}
    id_rows = lookup_by_keys(lab, IMAGES.name, IMAGES.schema, others, fact_columns, chunk=chunk)
    id_table = pa.concat_tables([images, id_rows])
    opted = opted_out_keys(lab, id_table.select(IMAGE_ID_COLUMNS))
    repeats = alias_signals(lab.view(), refs)
    refs_of = list(
        zip(id_table.column("batch").to_pylist(), id_table.column("key").to_pylist(), strict=True)
    )
    if "usage_signals" in fact_columns:
        signals = dict(zip(refs_of, id_table.column("usage_signals").to_pylist(), strict=True))
    else:  # an images table from before signal capture: not known, so pending
        signals = dict.fromkeys(refs_of, UNCAPTURED)
    caption_said = {s.key: s.caption_usable for s in samples}

    copies = []
    for ref in refs:
        b, k = ref
        dec = decided.get(ref)
        h = hashes.get(ref)
        cap = captions.get(ref)
        cls = classes.get(ref)
        caption_ok = cap is not None and usable_caption(cap["caption"])
        if b == batch and caption_said.get(k) is False:
            caption_ok = False  # the writer stored no usable caption, whatever the table says
        label = None
        if cls is not None and cap is not None:
            made_from = cls["caption_fingerprint"]
            if made_from is not None and made_from == cap["backend_fingerprint"]:
                label = cls["label"]  # a label of another caption is no label of this one
        if b == batch:
            written: bool | None = k in keys
        elif ref in shard_rows:
            written = True
        elif ref in profiles and profiles[ref]["eligible"] is False:
            written = False
        else:
            written = None if b in unsharded else False
        copies.append(
            Copy(
                batch=b,
                key=k,
                cluster_id=dec["cluster_id"] if dec else None,
                rank=keeper_order(h["pixels"], h["file_size"], k, b) if h else None,
                label=label,
                caption_usable=caption_ok,
                low_information=bool(dec and dec["low_information"]),
                dedup_stale=ref in stale,
                written=written,
                opt_out_lists=tuple(opted.get(k, ())),
                usage_signals=signals.get(ref),
                alias_signals=repeats.get(ref, ()),
            )
        )
    return Facts(copies, len(cluster_ids), len(others))


def _image_fact_columns(lab: Lab) -> list[str]:
    """The ``images`` columns the decision reads; without ``usage_signals`` on a table from
    before signal capture (its rows then count as UNCAPTURED: pending, never "no signal")."""
    schema = lab.view().schema(IMAGES.name)
    if schema is not None and "usage_signals" not in schema.names:
        return ["batch", *IMAGE_ID_COLUMNS]
    return IMAGE_FACT_COLUMNS


def decide_partition(
    lab: Lab,
    batch: str,
    samples: Sequence[SampleRef],
    policy: SkipPolicy,
    *,
    chunk: int = DEFAULT_LOOKUP_CHUNK,
) -> PartitionDecisions:
    """One decision per sample of ``batch``, from the lab's current facts (read at call time).

    ``samples`` must be *every* sample the batch has (or is about to have) in its shards,
    across all its directories: a copy of the batch that is not among them counts as not
    written, so it cannot be the training copy.
    """
    facts = gather_copies(lab, batch, samples, chunk)
    return decide(batch, samples, facts.copies, policy)


# ---------------------------------------------------------------------------------------------
# Contradictions: other batches' recorded decisions that the current facts overturn


@dataclass(frozen=True)
class SkipChange:
    """One sample whose skip decision changed between two reads of its facts."""

    batch: str
    key: str
    cluster_id: str | None
    before: str
    after: str


def _recorded(row: dict[str, Any]) -> tuple[tuple[str, ...], str | None, str | None]:
    return (
        tuple(sorted(row["reasons"] or ())),
        row["duplicate_of"],
        row.get("duplicate_of_batch"),
    )


def _current(outcome: Outcome) -> tuple[tuple[str, ...], str | None, str | None]:
    dup = outcome.duplicate_of
    return (outcome.reasons, dup[1] if dup else None, dup[0] if dup else None)


def _describe(reasons: Sequence[str], dup_key: str | None, dup_batch: str | None) -> str:
    text = ",".join(reasons) or "kept"
    return text + (f" (training copy {dup_batch}:{dup_key})" if dup_key else "")


def contradicted_elsewhere(
    lab: Lab, decisions: PartitionDecisions, chunk: int = DEFAULT_LOOKUP_CHUNK
) -> list[SkipChange]:
    """Other batches' samples whose ``skip_audit`` row disagrees with the current decision.

    Rows decided under another policy are left to the policy sensor; copies with no row
    (not written, or their batch not screened yet) get their decision when it is.
    """
    if not decisions.others or not lab.exists(SKIP_AUDIT.name):
        return []
    columns = [
        "batch",
        "key",
        "reasons",
        "duplicate_of",
        "duplicate_of_batch",
        "policy_fingerprint",
    ]
    present = set(lab.view().schema(SKIP_AUDIT.name).names)
    if not set(columns) <= present:
        return []  # an audit from before policy v2: every batch reruns under the new policy
    rows = lookup_by_keys(
        lab, SKIP_AUDIT.name, SKIP_AUDIT.schema, list(decisions.others), columns, chunk=chunk
    )
    fp = decisions.policy.fingerprint()
    changes = []
    for r in rows.to_pylist():
        if r["policy_fingerprint"] != fp:
            continue
        cluster_id, outcome = decisions.others[(r["batch"], r["key"])]
        before, after = _recorded(r), _current(outcome)
        if before != after:
            changes.append(
                SkipChange(r["batch"], r["key"], cluster_id, _describe(*before), _describe(*after))
            )
    return sorted(changes, key=lambda c: (c.batch, c.key))


def changed_during_run(
    batch: str, written: PartitionDecisions, fresh: PartitionDecisions
) -> list[SkipChange]:
    """The batch's samples whose decision differs between two reads (a fact changed)."""
    before = {d.sample.key: d for d in written.decisions}
    changes = []
    for d in fresh.decisions:
        old = before.get(d.sample.key)
        was = (old.reasons, old.duplicate_of, old.duplicate_of_batch) if old else ((), None, None)
        now = (d.reasons, d.duplicate_of, d.duplicate_of_batch)
        if old is None or was != now:
            changes.append(
                SkipChange(
                    batch, d.sample.key, d.cluster_id, _describe(*was) if old else "absent",
                    _describe(*now),
                )
            )  # fmt: skip
    return changes


# ---------------------------------------------------------------------------------------------
# The skip_dirty list (written by skip_lists runs, read by skip_dirty_sensor)


def _dirty_id(change: SkipChange, detected_by: str, detected_at: datetime) -> str:
    raw = json.dumps([change.batch, change.key, change.after, detected_by, detected_at.isoformat()])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def mark_skip_dirty(
    lab: Lab,
    changes: Sequence[SkipChange],
    detected_by: str,
    detected_at: datetime | None = None,
) -> int:
    """Append one ``skip_dirty`` row per change (appends never conflict with each other)."""
    if not changes:
        return 0
    at = detected_at or datetime.now(UTC)
    if at.tzinfo is None:
        raise ValueError("detected_at must be timezone-aware (UTC)")
    rows = pa.Table.from_pylist(
        [
            {
                "dirty_id": _dirty_id(c, detected_by, at),
                "batch": c.batch,
                "key": c.key,
                "cluster_id": c.cluster_id,
                "change": f"{c.before} -> {c.after}"[:500],
                "detected_by": detected_by,
                "detected_at": at,
            }
            for c in changes
        ],
        schema=SKIP_DIRTY.schema,
    )
    lab.append(SKIP_DIRTY, rows)
    return rows.num_rows


def read_skip_dirty(lab: Lab, batch: str | None = None) -> pa.Table:
    view = lab.view()
    if not view.exists(SKIP_DIRTY.name):
        return pa.Table.from_pylist([], schema=SKIP_DIRTY.schema)
    where = f"batch = {sql_literal(batch)}" if batch is not None else None
    return view.read(SKIP_DIRTY.name, SKIP_DIRTY.schema.names, where)


def clear_skip_dirty(lab: Lab, dirty_ids: Sequence[str]) -> int:
    """Delete exactly these rows (read before the run read its facts); later ones stay.

    ``Lab.delete`` retries a delete that lost a race with a concurrent one."""
    if not dirty_ids or not lab.exists(SKIP_DIRTY.name):
        return 0
    lab.delete(SKIP_DIRTY.name, in_list("dirty_id", dirty_ids))
    return len(set(dirty_ids))


# ---------------------------------------------------------------------------------------------
# For the opt-out sensor, the audit table's schema, and the caption coverage check


def cluster_copies(
    lab: Lab, pairs: Iterable[tuple[str, str]], chunk: int = DEFAULT_LOOKUP_CHUNK
) -> set[tuple[str, str]]:
    """These (batch, key) images and every copy in their pHash clusters, any batch."""
    wanted = set(pairs)
    if not wanted or not lab.exists(PHASH_CLUSTERS.name):
        return wanted
    rows = lookup_by_keys(
        lab,
        PHASH_CLUSTERS.name,
        PHASH_CLUSTERS.schema,
        wanted,
        ["batch", "key", "cluster_id", "low_information"],
        chunk=chunk,
    )
    ids = {
        r["cluster_id"]
        for r in rows.to_pylist()
        if r["cluster_id"] is not None and not r["low_information"]
    }
    if not ids:
        return wanted
    members = cluster_members(lab, ids, ["batch", "key", "low_information"], chunk)
    return wanted | {
        (r["batch"], r["key"]) for r in members.to_pylist() if not r["low_information"]
    }


def ensure_audit_columns(lab: Lab) -> list[str]:
    """Give a ``skip_audit`` written before policy v2 the columns it lacks (null, metadata
    only; they are appended, so the schema then equals ``SKIP_AUDIT``'s). Returns them."""
    schema = lab.view().schema(SKIP_AUDIT.name)
    if schema is None:
        return []
    have = set(schema.names)
    missing = [f for f in SKIP_AUDIT.schema if f.name not in have]
    if missing:
        order = [f.name for f in SKIP_AUDIT.schema]
        if [n for n in order if n in have] != schema.names:
            raise SkipPolicyError(
                f"skip_audit has columns {schema.names}, not a prefix-ordered subset of "
                f"{order}: drop the table and rerun skip_lists for every partition"
            )
        lab.add_columns(SKIP_AUDIT.name, missing)
    return [f.name for f in missing]


@dataclass(frozen=True)
class CaptionCoverage:
    """How many of a batch's eligible images have no usable caption."""

    eligible: int
    without_caption: int
    keys: list[str]  # the keys without one, sorted

    @property
    def share(self) -> float:
        return self.without_caption / self.eligible if self.eligible else 0.0


def caption_coverage(lab: Lab, batch: str) -> CaptionCoverage:
    """Eligible images (``resolution``) with no caption row or an unusable caption."""
    if not lab.exists(RESOLUTION.name):
        return CaptionCoverage(0, 0, [])
    eligible = set(
        lab.read(RESOLUTION.name, ["key"], f"batch = {sql_literal(batch)} AND eligible = true")
        .column("key")
        .to_pylist()
    )
    usable: set[str] = set()
    if lab.exists(CAPTIONS.name):
        caps = lab.read_batch(CAPTIONS.name, batch, ["key", "caption"]).to_pylist()
        usable = {r["key"] for r in caps if usable_caption(r["caption"])}
    lacking = sorted(eligible - usable)
    return CaptionCoverage(len(eligible), len(lacking), lacking)
