"""Which written samples leave training, and why: the skip policy and its audit rows.

Inputs are one partition's ``shard_samples`` rows (where each sample sits), the caption
class of each key, the dedup decision of each key, the opt-out lists naming each key, and
the policy. Output is, per MDS directory and shard, ``{index_in_shard: [reasons]}`` (what
``skiplists.write_partition_skiplists`` takes) plus one audit row per sample.

Reason codes (``skiplists.REASON_CODES``):

- ``opt_out``: named by an accepted opt-out list (always applied; not configurable).
- ``duplicate``: ``phash_clusters.is_keeper`` is false (``skip_duplicates``). Followed
  strictly, even when the keeper itself is excluded for another reason: the copies are the
  same picture, so an opted-out or NSFW keeper takes its copies with it.
- ``class_text`` / ``class_nsfw``: the caption classifier's argmax label is in
  ``excluded_classes`` (default ``{text, nsfw}``; ``visual`` cannot be excluded).
- ``quality``: a quality flag of the policy is raised for the key; today the only flag is
  ``low_information`` (near-flat images the dedup stage never merges), off by default.

A key with no class row or no dedup row gets no class/duplicate reason (counted as
unclassified / undecided so the gap is visible); opt-outs never depend on either.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa

from prx_assets.core.lab import TableSpec
from prx_assets.core.models.base import LABELS
from prx_assets.core.skiplists import REASON_CODES

POLICY_VERSION = 1
DEFAULT_EXCLUDED_CLASSES: frozenset[str] = frozenset({"text", "nsfw"})
EXCLUDABLE_CLASSES: tuple[str, ...] = ("text", "nsfw")
QUALITY_FLAGS: tuple[str, ...] = ("low_information",)
R_OPT_OUT, R_DUPLICATE, R_QUALITY = "opt_out", "duplicate", "quality"

SKIP_AUDIT = TableSpec(
    name="skip_audit",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("tier", pa.int32()),
            pa.field("shape", pa.string()),
            pa.field("relative_dir", pa.string()),  # "mds/<tier>/<H>x<W>/<batch>"
            pa.field("shard", pa.string()),
            pa.field("index_in_shard", pa.int32()),
            pa.field("excluded", pa.bool_()),
            pa.field("reasons", pa.list_(pa.string())),  # sorted reason codes (empty: kept)
            pa.field("opt_out_list_ids", pa.list_(pa.string())),
            pa.field("class_label", pa.string()),  # the label the decision saw (null: none)
            pa.field("duplicate_of", pa.string()),  # keeper key, for reason "duplicate"
            pa.field("decided_at", pa.timestamp("us", tz="UTC")),  # this materialisation
            # Start of the current exclusion: carried over while the sample stays excluded.
            pa.field("first_excluded_at", pa.timestamp("us", tz="UTC")),
            pa.field("policy_fingerprint", pa.string()),
        ]
    ),
    identity=("batch", "key"),
    indexes=(
        ("key", "BTREE"),
        ("batch", "BITMAP"),
        ("excluded", "BITMAP"),
        ("policy_fingerprint", "BITMAP"),
    ),
)


class SkipPolicyError(ValueError):
    """Inputs the policy cannot decide on: a bad policy, a broken table contract."""


@dataclass(frozen=True)
class SkipPolicy:
    """What excludes a sample besides opt-outs (which always do)."""

    excluded_classes: frozenset[str] = DEFAULT_EXCLUDED_CLASSES
    skip_duplicates: bool = True
    quality_flags: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "excluded_classes", frozenset(self.excluded_classes))
        object.__setattr__(self, "quality_flags", frozenset(self.quality_flags))
        bad = sorted(self.excluded_classes - set(EXCLUDABLE_CLASSES))
        if bad:
            raise SkipPolicyError(
                f"cannot exclude class(es) {bad}: excludable classes are {EXCLUDABLE_CLASSES}"
            )
        bad = sorted(self.quality_flags - set(QUALITY_FLAGS))
        if bad:
            raise SkipPolicyError(f"unknown quality flag(s) {bad}; known: {QUALITY_FLAGS}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": POLICY_VERSION,
            "excluded_classes": sorted(self.excluded_classes),
            "skip_duplicates": self.skip_duplicates,
            "quality_flags": sorted(self.quality_flags),
        }

    def fingerprint(self) -> str:
        """Stable across field order; changes with any decision-relevant setting."""
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SampleRef:
    """Where one sample sits (a ``shard_samples`` row)."""

    key: str
    relative_dir: str
    shard: str
    index_in_shard: int
    tier: int | None = None
    shape: str | None = None


@dataclass(frozen=True)
class DedupDecision:
    is_keeper: bool
    keeper_key: str | None = None
    low_information: bool = False


@dataclass(frozen=True)
class SampleDecision:
    sample: SampleRef
    reasons: tuple[str, ...]
    opt_out_list_ids: tuple[str, ...]
    class_label: str | None
    duplicate_of: str | None

    @property
    def excluded(self) -> bool:
        return bool(self.reasons)


@dataclass
class PartitionDecisions:
    decisions: list[SampleDecision]
    unclassified: int = 0
    undecided: int = 0
    policy: SkipPolicy = field(default_factory=SkipPolicy)

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


def decide(
    samples: Sequence[SampleRef],
    labels: Mapping[str, str | None],
    dedup: Mapping[str, DedupDecision],
    opt_outs: Mapping[str, Sequence[str]],
    policy: SkipPolicy,
) -> PartitionDecisions:
    """One decision per sample, in (relative_dir, shard, index) order."""
    _check_samples(samples)
    decisions = []
    unclassified = undecided = 0
    for s in sorted(samples, key=lambda s: (s.relative_dir, s.shard, s.index_in_shard)):
        reasons: set[str] = set()
        lists = tuple(sorted(set(opt_outs.get(s.key, ()))))
        if lists:
            reasons.add(R_OPT_OUT)
        label = labels.get(s.key)
        if label is None:
            unclassified += 1
        elif label not in LABELS:
            raise SkipPolicyError(
                f"sample {s.key!r} has class label {label!r}, not one of {LABELS}"
            )
        elif label in policy.excluded_classes:
            reasons.add(f"class_{label}")
        decision = dedup.get(s.key)
        duplicate_of = None
        if decision is None:
            undecided += 1
        else:
            if policy.skip_duplicates and not decision.is_keeper:
                reasons.add(R_DUPLICATE)
                duplicate_of = decision.keeper_key
            if "low_information" in policy.quality_flags and decision.low_information:
                reasons.add(R_QUALITY)
        decisions.append(
            SampleDecision(
                sample=s,
                reasons=tuple(sorted(reasons)),
                opt_out_list_ids=lists,
                class_label=label,
                duplicate_of=duplicate_of,
            )
        )
    return PartitionDecisions(decisions, unclassified, undecided, policy)


def first_excluded(
    excluded: bool, previous: tuple[bool, datetime | None] | None, decided_at: datetime
) -> datetime | None:
    """Start of the current exclusion: kept while excluded, reset when the sample is kept."""
    if not excluded:
        return None
    if previous is not None and previous[0] and previous[1] is not None:
        return previous[1]
    return decided_at


def audit_rows(
    batch: str,
    decisions: PartitionDecisions,
    previous: Mapping[str, tuple[bool, datetime | None]],
    decided_at: datetime,
) -> pa.Table:
    """``skip_audit`` rows; ``previous`` maps key -> (excluded, first_excluded_at) before."""
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
        }
        for name, value in values.items():
            cols[name].append(value)
    return pa.table(cols, schema=SKIP_AUDIT.schema)


def exclusion_changes(
    decisions: PartitionDecisions, previous: Mapping[str, tuple[bool, datetime | None]]
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
    """``shard_samples`` rows -> SampleRefs (only the location columns are read)."""
    return [
        SampleRef(
            key=r["key"],
            relative_dir=r["relative_dir"],
            shard=r["shard"],
            index_in_shard=int(r["index_in_shard"]),
            tier=None if r.get("tier") is None else int(r["tier"]),
            shape=r.get("shape"),
        )
        for r in rows
    ]
