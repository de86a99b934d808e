"""The skip policy: reasons per sample, per-shard skip maps, audit rows and 'since when'."""

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prx_assets.core.skip_policy import (
    SKIP_AUDIT,
    DedupDecision,
    SampleRef,
    SkipPolicy,
    SkipPolicyError,
    audit_rows,
    decide,
    exclusion_changes,
    first_excluded,
    samples_from_rows,
)
from prx_assets.core.skiplists import REASON_CODES, encode_skiplist

DIR_A = "mds/512/512x512/b.000"
DIR_B = "mds/512/384x640/b.000"
T0 = datetime(2024, 1, 1, tzinfo=UTC)


def _sample(key: str, rel: str = DIR_A, shard: str = "shard.00000.mds", index: int = 0):
    return SampleRef(key, rel, shard, index, 512, rel.split("/")[2])


KEEPER = DedupDecision(True, "k", False)
DUP = DedupDecision(False, "keeper-key", False)
FLAT = DedupDecision(True, "k", True)

# (label, dedup, opt-out lists, policy) -> expected reasons
CASES = [
    ("visual", KEEPER, (), SkipPolicy(), ()),
    ("text", KEEPER, (), SkipPolicy(), ("class_text",)),
    ("nsfw", KEEPER, (), SkipPolicy(), ("class_nsfw",)),
    ("text", KEEPER, (), SkipPolicy(excluded_classes={"nsfw"}), ()),
    ("nsfw", KEEPER, (), SkipPolicy(excluded_classes=set()), ()),
    ("visual", DUP, (), SkipPolicy(), ("duplicate",)),
    ("visual", DUP, (), SkipPolicy(skip_duplicates=False), ()),
    ("visual", FLAT, (), SkipPolicy(), ()),
    ("visual", FLAT, (), SkipPolicy(quality_flags={"low_information"}), ("quality",)),
    ("visual", KEEPER, ("l1",), SkipPolicy(), ("opt_out",)),
    # Opt-outs apply whatever the policy, and without any class or dedup decision.
    (
        None,
        None,
        ("l1", "l0"),
        SkipPolicy(excluded_classes=set(), skip_duplicates=False),
        ("opt_out",),
    ),
    ("nsfw", DUP, ("l1",), SkipPolicy(), ("class_nsfw", "duplicate", "opt_out")),
    (None, None, (), SkipPolicy(), ()),
]


@pytest.mark.parametrize(("label", "dedup", "lists", "policy", "expected"), CASES)
def test_reasons_table(label, dedup, lists, policy, expected):
    labels = {} if label is None else {"k": label}
    dd = {} if dedup is None else {"k": dedup}
    opt = {"k": lists} if lists else {}
    out = decide([_sample("k")], labels, dd, opt, policy)
    (d,) = out.decisions
    assert d.reasons == expected
    assert d.excluded == bool(expected)
    assert d.opt_out_list_ids == tuple(sorted(lists))
    assert d.duplicate_of == ("keeper-key" if "duplicate" in expected else None)
    assert out.unclassified == (label is None) and out.undecided == (dedup is None)
    if expected:  # the sidecar writer accepts what the policy produces
        skips = out.skips_by_dir()[DIR_A]["shard.00000.mds"]
        assert encode_skiplist("shard.00000.mds", skips)


def test_policy_validation_and_fingerprint():
    with pytest.raises(SkipPolicyError, match="cannot exclude"):
        SkipPolicy(excluded_classes={"visual"})
    with pytest.raises(SkipPolicyError, match="unknown quality flag"):
        SkipPolicy(quality_flags={"blurry"})
    base = SkipPolicy()
    assert base.fingerprint() == SkipPolicy(excluded_classes=["nsfw", "text"]).fingerprint()
    variants = [
        SkipPolicy(excluded_classes={"nsfw"}),
        SkipPolicy(skip_duplicates=False),
        SkipPolicy(quality_flags={"low_information"}),
    ]
    fps = {base.fingerprint(), *(v.fingerprint() for v in variants)}
    assert len(fps) == 4 and all(len(f) == 16 for f in fps)


def test_contract_violations_are_errors():
    with pytest.raises(SkipPolicyError, match="appears twice"):
        decide([_sample("a"), _sample("a", index=1)], {}, {}, {}, SkipPolicy())
    with pytest.raises(SkipPolicyError, match="two samples claim"):
        decide([_sample("a"), _sample("b")], {}, {}, {}, SkipPolicy())
    with pytest.raises(SkipPolicyError, match="index -1"):
        decide([_sample("a", index=-1)], {}, {}, {}, SkipPolicy())
    with pytest.raises(SkipPolicyError, match="class label 'cat'"):
        decide([_sample("a")], {"a": "cat"}, {}, {}, SkipPolicy())


# --------------------------------------------------------------------------- properties

_labels = st.sampled_from([None, "visual", "text", "nsfw"])
_dedup = st.one_of(st.none(), st.builds(DedupDecision, st.booleans(), st.just("kk"), st.booleans()))
_lists = st.lists(st.sampled_from(["l0", "l1", "l2"]), max_size=2)
_policies = st.builds(
    SkipPolicy,
    st.frozensets(st.sampled_from(["text", "nsfw"])),
    st.booleans(),
    st.frozensets(st.just("low_information")),
)


@st.composite
def _partitions(draw):
    n = draw(st.integers(0, 40))
    samples, labels, dedup, opt = [], {}, {}, {}
    for i in range(n):
        rel = draw(st.sampled_from([DIR_A, DIR_B]))
        shard = f"shard.{draw(st.integers(0, 2)):05d}.mds"
        key = f"k{i:03d}"
        samples.append(SampleRef(key, rel, shard, i, 512, rel.split("/")[2]))
        if (lab := draw(_labels)) is not None:
            labels[key] = lab
        if (dd := draw(_dedup)) is not None:
            dedup[key] = dd
        if ls := draw(_lists):
            opt[key] = ls
    return samples, labels, dedup, opt


@settings(max_examples=150, deadline=None)
@given(_partitions(), _policies)
def test_every_reason_follows_from_its_input(part, policy):
    samples, labels, dedup, opt = part
    out = decide(samples, labels, dedup, opt, policy)
    assert [d.sample for d in out.decisions] == sorted(
        samples, key=lambda s: (s.relative_dir, s.shard, s.index_in_shard)
    )
    for d in out.decisions:
        k = d.sample.key
        expected = set()
        if opt.get(k):
            expected.add("opt_out")
        if labels.get(k) in policy.excluded_classes:
            expected.add(f"class_{labels[k]}")
        if k in dedup and policy.skip_duplicates and not dedup[k].is_keeper:
            expected.add("duplicate")
        if k in dedup and policy.quality_flags and dedup[k].low_information:
            expected.add("quality")
        assert d.reasons == tuple(sorted(expected))
        assert set(d.reasons) <= set(REASON_CODES)
    # The per-shard map holds exactly the excluded samples, at their indices.
    skips = out.skips_by_dir()
    flat = {
        (rel, shard, i): tuple(r)
        for rel, shards in skips.items()
        for shard, m in shards.items()
        for i, r in m.items()
    }
    assert flat == {
        (d.sample.relative_dir, d.sample.shard, d.sample.index_in_shard): d.reasons
        for d in out.decisions
        if d.excluded
    }
    assert set(skips) == {s.relative_dir for s in samples}  # every directory is listed
    counts = out.bucket_counts()
    assert sum(k + s for k, s in counts.values()) == len(samples)
    assert sum(s for _, s in counts.values()) == len(out.excluded_keys)
    reasons = out.reason_counts()
    assert set(reasons) == set(REASON_CODES)
    assert sum(reasons.values()) == sum(len(d.reasons) for d in out.decisions)
    assert out.unclassified == sum(1 for s in samples if s.key not in labels)
    assert out.undecided == sum(1 for s in samples if s.key not in dedup)


# --------------------------------------------------------------------------- audit


def test_first_excluded_is_carried_while_excluded():
    t1 = T0 + timedelta(days=3)
    assert first_excluded(False, (True, T0), t1) is None
    assert first_excluded(True, None, t1) == t1  # never seen
    assert first_excluded(True, (False, None), t1) == t1  # was kept
    assert first_excluded(True, (True, T0), t1) == T0  # still excluded: since T0
    assert first_excluded(True, (True, None), t1) == t1  # legacy row without a date


def test_audit_rows_and_changes():
    samples = [_sample("a", index=0), _sample("b", index=1), _sample("c", DIR_B, index=0)]
    out = decide(samples, {"b": "nsfw"}, {"c": DUP}, {"a": ["l9"]}, SkipPolicy())
    t1 = T0 + timedelta(hours=5)
    previous = {"a": (True, T0), "b": (False, None), "z": (True, T0)}
    table = audit_rows("b.000", out, previous, t1)
    assert table.schema == SKIP_AUDIT.schema
    rows = {r["key"]: r for r in table.to_pylist()}
    assert rows["a"]["reasons"] == ["opt_out"] and rows["a"]["opt_out_list_ids"] == ["l9"]
    assert rows["a"]["first_excluded_at"] == T0  # excluded before, still excluded
    assert rows["b"]["reasons"] == ["class_nsfw"] and rows["b"]["first_excluded_at"] == t1
    assert rows["b"]["class_label"] == "nsfw"
    assert rows["c"]["duplicate_of"] == "keeper-key" and rows["c"]["relative_dir"] == DIR_B
    assert all(r["decided_at"] == t1 and r["batch"] == "b.000" for r in rows.values())
    assert {r["policy_fingerprint"] for r in rows.values()} == {SkipPolicy().fingerprint()}
    assert exclusion_changes(out, previous) == (2, 0)  # b and c are new; z is gone, not kept
    kept_now = decide(samples, {}, {}, {}, SkipPolicy())
    assert exclusion_changes(kept_now, previous) == (0, 1)  # a is no longer excluded
    rows = samples_from_rows(
        [{"key": "a", "relative_dir": DIR_A, "shard": "s", "index_in_shard": 3, "tier": 512}]
    )
    assert rows == [SampleRef("a", DIR_A, "s", 3, 512, None)]
