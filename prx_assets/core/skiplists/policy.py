"""Which written samples leave training, and why: the skip policy and its audit rows.

The decision is taken per pHash cluster, not per sample, because the copies of one picture
are one work: an opt-out of any copy removes them all, and exactly one copy trains unless
none can. Inputs are :class:`Copy` facts (what is known about each image of the clusters
touching a partition, from any batch) and the policy; output is one decision per written
sample of the partition, the per-shard skip maps ``skiplists.write_partition_skiplists``
takes, and one audit row per sample.

Rules, in order (reason codes from ``skiplists.REASON_CODES``):

1. Per copy, from its own facts (:func:`copy_reasons`):
   ``no_caption`` (no caption row, or a null/empty/whitespace caption); else ``class_text``
   / ``class_nsfw`` (label in ``excluded_classes``) or ``pending`` (no class label made
   from the current caption); ``pending`` too without a current dedup decision (no
   ``phash_clusters`` row, or one ``dedup_dirty`` marks stale) or without a hash row;
   ``low_information`` for near-flat images (``skip_low_information``, on by default).
2. ``opt_out``: an accepted opt-out list names *any* copy of the cluster (always applied).
   Every copy is excluded, with the list ids and the keys of the copies named
   (``opt_out_via``); no copy is the training copy.
   ``reserved``: a machine-readable opt-out signal captured at ingest (``X-Robots-Tag:
   noai``, ``tdm-reservation: 1``, ``Content-Usage: train-ai=n`` under the aipref vocabulary
   revision :data:`~prx_assets.core.ingest.signals.CONTENT_USAGE_VOCABULARY`, or a malformed
   one: see :mod:`prx_assets.core.ingest.signals`) that the copy's source honours
   (:class:`~prx_assets.core.ingest.signals.UsagePolicy`) reserves *any* copy: like an
   opt-out, it excludes every copy of the work (``reserved_via``: the copies whose signal
   did it; ``reserved_signals``: which signal said what).
3. Otherwise (``skip_duplicates``), the training copy is the first copy in keeper order
   (``dedup.keeper_order``: most pixels, larger file, smaller key, smaller batch) that is
   *eligible*: no reason from rule 1 and written to a shard. Every other copy is a
   ``duplicate`` of it (``duplicate_of``), whatever its own reasons.
4. Fail closed: a copy is *uncertain* when its only reason is ``pending``, or when its batch
   has not been sharded yet (it may still be written). If an uncertain copy comes before
   any eligible one, nobody knows yet which copy trains: the eligible copies after it are
   ``pending`` (``pending_on`` names it) until it is decided. Copies excluded for their own
   reasons only ever need those reasons.

Low-information images are never merged (dedup keeps them singletons), so they are decided
alone. A cluster's decision for a copy of another batch is kept too (``others``), so a run
can tell which batches' stored decisions it contradicts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any, NamedTuple

import pyarrow as pa

from prx_assets.core.captions.models.base import LABELS
from prx_assets.core.ingest.signals import UNCAPTURED, UsagePolicy, reservations
from prx_assets.core.skiplists.sidecars import REASON_CODES
from prx_assets.core.tables import SKIP_AUDIT

POLICY_VERSION = 3  # 2: fail closed, low_information, no_caption, cluster-wide; 3: reserved
DEFAULT_EXCLUDED_CLASSES: frozenset[str] = frozenset({"text", "nsfw"})
EXCLUDABLE_CLASSES: tuple[str, ...] = ("text", "nsfw")
R_OPT_OUT, R_DUPLICATE, R_PENDING = "opt_out", "duplicate", "pending"
R_LOW_INFORMATION, R_NO_CAPTION = "low_information", "no_caption"
R_RESERVED = "reserved"
# What a ``pending`` sample waits for (``pending_on``); a copy is named "copy <batch>:<key>".
WAITS_FOR_CLASS = "caption_classes"
WAITS_FOR_DEDUP = "phash_clusters"
WAITS_FOR_HASH = "image_hashes"
WAITS_FOR_SIGNALS = "raw_images (usage signals not captured)"


class SkipPolicyError(ValueError):
    """Inputs the policy cannot decide on: a bad policy, a broken table contract."""


@dataclass(frozen=True)
class SkipPolicy:
    """What excludes a sample besides opt-outs (which always do, cluster-wide)."""

    excluded_classes: frozenset[str] = DEFAULT_EXCLUDED_CLASSES
    skip_duplicates: bool = True
    skip_low_information: bool = True
    # Which captured opt-out signals each source honours (default: all, malformed reserves).
    usage: UsagePolicy = field(default_factory=UsagePolicy)

    def __post_init__(self) -> None:
        object.__setattr__(self, "excluded_classes", frozenset(self.excluded_classes))
        bad = sorted(self.excluded_classes - set(EXCLUDABLE_CLASSES))
        if bad:
            raise SkipPolicyError(
                f"cannot exclude class(es) {bad}: excludable classes are {EXCLUDABLE_CLASSES}"
            )
        for name in ("skip_duplicates", "skip_low_information"):
            if not isinstance(getattr(self, name), bool):
                raise SkipPolicyError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.usage, UsagePolicy):
            raise SkipPolicyError(f"usage must be a UsagePolicy, got {type(self.usage).__name__}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": POLICY_VERSION,
            "excluded_classes": sorted(self.excluded_classes),
            "skip_duplicates": self.skip_duplicates,
            "skip_low_information": self.skip_low_information,
            "usage_signals": self.usage.as_dict(),
        }

    def fingerprint(self) -> str:
        """Stable across field order; changes with any decision-relevant setting."""
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SampleRef:
    """Where one sample sits (a ``shard_samples`` row).

    ``caption_usable``: what the writer knows of the caption it stored (None: not said);
    False excludes the sample as ``no_caption`` whatever the ``captions`` table holds now.
    """

    key: str
    relative_dir: str
    shard: str
    index_in_shard: int
    tier: int | None = None
    shape: str | None = None
    caption_usable: bool | None = None


@dataclass(frozen=True)
class Copy:
    """What the decision knows about one image of a cluster (this batch's or another's)."""

    batch: str
    key: str
    cluster_id: str | None  # its phash_clusters row's cluster (None: no row)
    rank: tuple[int, int, str, str] | None  # dedup.keeper_order (None: no hash row)
    label: str | None  # class label made from its current caption (None: none)
    caption_usable: bool
    low_information: bool = False
    dedup_stale: bool = False  # dedup_dirty marks its phash_clusters row stale
    written: bool | None = True  # in a shard; None: its batch has no shards yet
    opt_out_lists: tuple[str, ...] = ()  # accepted lists naming this copy
    usage_signals: str | None = None  # images.usage_signals (captured opt-out headers)
    # The captured headers of its refused byte-identical repeats (``rejects`` alias rows):
    # the same bytes, so a reservation any of them carries reserves this copy.
    alias_signals: tuple[str, ...] = ()

    @property
    def ref(self) -> tuple[str, str]:
        return (self.batch, self.key)

    @property
    def name(self) -> str:
        return f"{self.batch}:{self.key}"


class CopyStatus(Enum):
    """Whether one copy of a cluster may be its training copy."""

    ELIGIBLE = "eligible"  # may be the training copy
    EXCLUDED = "excluded"  # never the training copy (own reasons, or not written)
    UNCERTAIN = "uncertain"  # not known yet


def copy_reasons(copy: Copy, policy: SkipPolicy) -> tuple[set[str], list[str]]:
    """The copy's own reasons (rule 1) and, for ``pending``, what it waits for."""
    reasons: set[str] = set()
    waits: list[str] = []
    if not copy.caption_usable:
        reasons.add(R_NO_CAPTION)
    elif copy.label is None:
        reasons.add(R_PENDING)
        waits.append(WAITS_FOR_CLASS)
    elif copy.label not in LABELS:
        raise SkipPolicyError(f"image {copy.name} has class label {copy.label!r}, not in {LABELS}")
    elif copy.label in policy.excluded_classes:
        reasons.add(f"class_{copy.label}")
    if copy.cluster_id is None or copy.dedup_stale:
        reasons.add(R_PENDING)
        waits.append(WAITS_FOR_DEDUP)
    if copy.rank is None:
        reasons.add(R_PENDING)
        waits.append(WAITS_FOR_HASH)
    if copy.low_information and policy.skip_low_information:
        reasons.add(R_LOW_INFORMATION)
    if copy.usage_signals == UNCAPTURED and policy.usage.rule_for_batch(copy.batch).honour:
        reasons.add(R_PENDING)  # ingested before signal capture: a reservation is unknown
        waits.append(WAITS_FOR_SIGNALS)
    return reasons, waits


def copy_reservations(copy: Copy, policy: SkipPolicy) -> tuple[str, ...]:
    """The honoured signals reserving this copy, under its own source's rule."""
    rule = policy.usage.rule_for_batch(copy.batch)
    aliases = tuple(r for stored in copy.alias_signals for r in reservations(stored, rule))
    if copy.usage_signals == UNCAPTURED:
        return aliases  # its own are unknown: pending (copy_reasons) until re-ingested
    return tuple(dict.fromkeys(reservations(copy.usage_signals, rule) + aliases))


def copy_status(copy: Copy, policy: SkipPolicy) -> CopyStatus:
    reasons, _ = copy_reasons(copy, policy)
    if copy.written is False or reasons - {R_PENDING}:
        return CopyStatus.EXCLUDED
    if reasons or copy.written is None:
        return CopyStatus.UNCERTAIN
    return CopyStatus.ELIGIBLE


@dataclass(frozen=True)
class Outcome:
    """The decision for one copy."""

    reasons: tuple[str, ...]
    opt_out_list_ids: tuple[str, ...] = ()
    opt_out_via: tuple[str, ...] = ()  # keys of the copies an opt-out list named
    duplicate_of: tuple[str, str] | None = None  # (batch, key) of the training copy
    pending_on: tuple[str, ...] = ()
    reserved_via: tuple[str, ...] = ()  # keys of the copies whose signal reserves the work
    reserved_signals: tuple[str, ...] = ()  # "<key>: <signal>: <what it said>"

    @property
    def excluded(self) -> bool:
        return bool(self.reasons)

    def describe(self) -> str:
        """Human-readable, for dirty rows and logs."""
        if not self.reasons:
            return "kept"
        text = ",".join(self.reasons)
        if self.duplicate_of:
            text += f" (training copy {self.duplicate_of[0]}:{self.duplicate_of[1]})"
        return text


def _order(copy: Copy) -> tuple[int, tuple[int, int, str, str]]:
    # A copy without a hash row cannot be placed: it goes first, so it blocks (it is
    # uncertain) rather than letting a copy after it train.
    return (1, copy.rank) if copy.rank is not None else (0, (0, 0, copy.key, copy.batch))


def resolve_cluster(copies: Sequence[Copy], policy: SkipPolicy) -> dict[tuple[str, str], Outcome]:
    """Rules 2-4 over one cluster's copies (every batch): each copy's outcome."""
    refs = [c.ref for c in copies]
    if len(set(refs)) != len(refs):
        raise SkipPolicyError(f"a cluster lists a copy twice: {sorted(refs)}")
    lists = tuple(sorted({i for c in copies for i in c.opt_out_lists}))
    via = tuple(sorted({c.key for c in copies if c.opt_out_lists}))
    reserving = {c.key: copy_reservations(c, policy) for c in copies}
    reserved_via = tuple(sorted(k for k, r in reserving.items() if r))
    reserved_signals = tuple(sorted({f"{k}: {r}" for k in reserved_via for r in reserving[k]}))
    status = {c.ref: copy_status(c, policy) for c in copies}
    training: Copy | None = None
    blocker: Copy | None = None
    if policy.skip_duplicates and not lists and not reserved_via and len(copies) > 1:
        for c in sorted(copies, key=_order):
            if status[c.ref] is CopyStatus.UNCERTAIN:
                blocker = c
                break
            if status[c.ref] is CopyStatus.ELIGIBLE:
                training = c
                break
    out = {}
    for c in copies:
        reasons, waits = copy_reasons(c, policy)
        duplicate_of = None
        if lists:
            reasons.add(R_OPT_OUT)
        if reserved_via:
            reasons.add(R_RESERVED)
        if training is not None and c is not training:
            reasons.add(R_DUPLICATE)
            duplicate_of = training.ref
        elif blocker is not None and c is not blocker and status[c.ref] is not CopyStatus.EXCLUDED:
            reasons.add(R_PENDING)
            waits.append(f"copy {blocker.name}")
        out[c.ref] = Outcome(
            reasons=tuple(sorted(reasons)),
            opt_out_list_ids=lists,
            opt_out_via=via,
            duplicate_of=duplicate_of,
            pending_on=tuple(waits),
            reserved_via=reserved_via,
            reserved_signals=reserved_signals,
        )
    return out


@dataclass(frozen=True)
class SampleDecision:
    """One sample's skip decision: its reasons, and the opt-out lists or keeper behind them."""

    sample: SampleRef
    reasons: tuple[str, ...]
    opt_out_list_ids: tuple[str, ...]
    class_label: str | None
    duplicate_of: str | None  # the training copy's key, for reason "duplicate"
    duplicate_of_batch: str | None = None
    opt_out_via: tuple[str, ...] = ()
    cluster_id: str | None = None
    pending_on: tuple[str, ...] = ()
    reserved_via: tuple[str, ...] = ()
    reserved_signals: tuple[str, ...] = ()

    @property
    def excluded(self) -> bool:
        return bool(self.reasons)


@dataclass
class PartitionDecisions:
    """Every sample decision of one partition, under one policy, and its clusters' other copies."""

    decisions: list[SampleDecision]
    policy: SkipPolicy = field(default_factory=SkipPolicy)
    # The same clusters' outcomes for copies of other batches, for contradiction checks.
    others: dict[tuple[str, str], tuple[str | None, Outcome]] = field(default_factory=dict)

    def skips_by_dir(self) -> dict[str, dict[str, dict[int, list[str]]]]:
        """relative_dir -> shard -> {index_in_shard: reasons}; every directory listed."""
        out: dict[str, dict[str, dict[int, list[str]]]] = {}
        for d in self.decisions:
            shards = out.setdefault(d.sample.relative_dir, {})
            if d.excluded:
                shards.setdefault(d.sample.shard, {})[d.sample.index_in_shard] = list(d.reasons)
        return out

    def reason_counts(self) -> dict[str, int]:
        """Samples per reason (a sample with two reasons counts twice); every code listed."""
        counts = dict.fromkeys(REASON_CODES, 0)
        for d in self.decisions:
            for r in d.reasons:
                counts[r] += 1
        return counts

    def bucket_counts(self) -> dict[str, tuple[int, int]]:
        """relative_dir -> (kept, skipped)."""
        out: dict[str, list[int]] = {}
        for d in self.decisions:
            c = out.setdefault(d.sample.relative_dir, [0, 0])
            c[1 if d.excluded else 0] += 1
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}

    @property
    def excluded_keys(self) -> set[str]:
        return {d.sample.key for d in self.decisions if d.excluded}

    def waiting_for(self, what: str) -> int:
        """Samples pending on ``what`` (e.g. ``WAITS_FOR_CLASS``)."""
        return sum(1 for d in self.decisions if what in d.pending_on)

    @property
    def unclassified(self) -> int:
        return self.waiting_for(WAITS_FOR_CLASS)

    @property
    def undecided(self) -> int:
        return self.waiting_for(WAITS_FOR_DEDUP)


def _check_samples(samples: Sequence[SampleRef]) -> None:
    keys: set[str] = set()
    slots: set[tuple[str, str, int]] = set()
    for s in samples:
        if s.key in keys:
            raise SkipPolicyError(f"sample key {s.key!r} appears twice in the partition")
        keys.add(s.key)
        if isinstance(s.index_in_shard, bool) or int(s.index_in_shard) < 0:
            raise SkipPolicyError(f"sample {s.key!r} has index {s.index_in_shard!r} in its shard")
        slot = (s.relative_dir, s.shard, int(s.index_in_shard))
        if slot in slots:
            raise SkipPolicyError(f"two samples claim {slot} (stale shard_samples?)")
        slots.add(slot)


def clusters_of(copies: Iterable[Copy]) -> list[list[Copy]]:
    """Group copies by cluster; low-information copies and copies with no cluster alone."""
    groups: dict[str, list[Copy]] = {}
    alone: list[list[Copy]] = []
    for c in copies:
        if c.cluster_id is None or c.low_information:
            alone.append([c])
        else:
            groups.setdefault(c.cluster_id, []).append(c)
    return [groups[k] for k in sorted(groups)] + alone


def decide(
    batch: str, samples: Sequence[SampleRef], copies: Sequence[Copy], policy: SkipPolicy
) -> PartitionDecisions:
    """One decision per sample of ``batch``, in (relative_dir, shard, index) order.

    ``copies``: a :class:`Copy` for every sample (its batch is ``batch``) and for every other
    member, of any batch, of the clusters those samples are in.
    """
    _check_samples(samples)
    refs = [c.ref for c in copies]
    if len(set(refs)) != len(refs):
        raise SkipPolicyError("copies must be unique by (batch, key)")
    own = {c.key: c for c in copies if c.batch == batch}
    missing = sorted(s.key for s in samples if s.key not in own)
    if missing:
        raise SkipPolicyError(f"no facts for sample(s) {missing[:3]} of {batch}")
    outcomes: dict[tuple[str, str], Outcome] = {}
    cluster_of: dict[tuple[str, str], str | None] = {}
    for group in clusters_of(copies):
        outcomes.update(resolve_cluster(group, policy))
        for c in group:
            cluster_of[c.ref] = c.cluster_id
    decisions = []
    for s in sorted(samples, key=lambda s: (s.relative_dir, s.shard, s.index_in_shard)):
        c = own[s.key]
        o = outcomes[c.ref]
        decisions.append(
            SampleDecision(
                sample=s,
                reasons=o.reasons,
                opt_out_list_ids=o.opt_out_list_ids,
                class_label=c.label,
                duplicate_of=o.duplicate_of[1] if o.duplicate_of else None,
                duplicate_of_batch=o.duplicate_of[0] if o.duplicate_of else None,
                opt_out_via=o.opt_out_via,
                cluster_id=c.cluster_id,
                pending_on=o.pending_on,
                reserved_via=o.reserved_via,
                reserved_signals=o.reserved_signals,
            )
        )
    others = {ref: (cluster_of[ref], o) for ref, o in outcomes.items() if ref[0] != batch}
    return PartitionDecisions(decisions, policy, others)


class PreviousDecision(NamedTuple):
    """A sample's ``skip_audit`` row before this run: what the new row's times carry over."""

    excluded: bool
    first_excluded_at: datetime | None
    reason_since: Mapping[str, datetime] = {}  # reason -> when it began (empty: unknown)


def first_excluded(
    excluded: bool, previous: tuple[bool, datetime | None] | None, decided_at: datetime
) -> datetime | None:
    """Start of the current exclusion: kept while excluded, reset when the sample is kept."""
    if not excluded:
        return None
    if previous is not None and previous[0] and previous[1] is not None:
        return previous[1]
    return decided_at


def reason_since(
    reasons: Sequence[str], previous: tuple | None, decided_at: datetime
) -> list[datetime]:
    """When each reason began: carried over from the previous row while the sample stayed
    excluded for that reason, else now. A time is never earlier than the reason it names."""
    before: Mapping[str, datetime] = {}
    if previous is not None and previous[0] and len(previous) > 2:
        before = previous[2] or {}
    return [before.get(r, decided_at) for r in reasons]


def audit_rows(
    batch: str,
    decisions: PartitionDecisions,
    previous: Mapping[str, tuple],
    decided_at: datetime,
) -> pa.Table:
    """``skip_audit`` rows; ``previous`` maps key -> ``PreviousDecision`` (or its first two
    fields: excluded, first_excluded_at) before this run."""
    fp = decisions.policy.fingerprint()
    cols: dict[str, list[Any]] = {f.name: [] for f in SKIP_AUDIT.schema}
    for d in sorted(decisions.decisions, key=lambda d: d.sample.key):
        s = d.sample
        values = {
            "key": s.key,
            "batch": batch,
            "tier": s.tier,
            "shape": s.shape,
            "relative_dir": s.relative_dir,
            "shard": s.shard,
            "index_in_shard": s.index_in_shard,
            "excluded": d.excluded,
            "reasons": list(d.reasons),
            "opt_out_list_ids": list(d.opt_out_list_ids),
            "class_label": d.class_label,
            "duplicate_of": d.duplicate_of,
            "decided_at": decided_at,
            "first_excluded_at": first_excluded(d.excluded, previous.get(s.key), decided_at),
            "policy_fingerprint": fp,
            "opt_out_via": list(d.opt_out_via),
            "duplicate_of_batch": d.duplicate_of_batch,
            "cluster_id": d.cluster_id,
            "pending_on": list(d.pending_on),
            "reserved_via": list(d.reserved_via),
            "reserved_signals": list(d.reserved_signals),
            "reason_since": reason_since(d.reasons, previous.get(s.key), decided_at),
        }
        for name, value in values.items():
            cols[name].append(value)
    return pa.table(cols, schema=SKIP_AUDIT.schema)


def exclusion_changes(
    decisions: PartitionDecisions, previous: Mapping[str, tuple]
) -> tuple[int, int]:
    """(newly excluded, no longer excluded) against the previous audit of the partition."""
    newly = gone = 0
    for d in decisions.decisions:
        before = previous.get(d.sample.key)
        was = bool(before and before[0])
        newly += d.excluded and not was
        gone += was and not d.excluded
    return newly, gone


def samples_from_rows(rows: Iterable[Mapping[str, Any]]) -> list[SampleRef]:
    """``shard_samples`` rows -> SampleRefs (the location columns, and ``caption_usable``
    where the writer recorded it)."""
    return [
        SampleRef(
            key=r["key"],
            relative_dir=r["relative_dir"],
            shard=r["shard"],
            index_in_shard=int(r["index_in_shard"]),
            tier=None if r.get("tier") is None else int(r["tier"]),
            shape=r.get("shape"),
            caption_usable=None if r.get("caption_usable") is None else bool(r["caption_usable"]),
        )
        for r in rows
    ]
