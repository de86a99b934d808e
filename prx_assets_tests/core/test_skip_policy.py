"""The skip policy: per-copy reasons, cluster-wide opt-outs, the training copy, fail-closed
pending, per-shard skip maps, audit rows and 'since when'."""

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prx_assets.core.dedup import decisions as D
from prx_assets.core.skiplists.policy import (
    Copy,
    CopyStatus,
    PreviousDecision,
    SampleRef,
    SkipPolicy,
    SkipPolicyError,
    audit_rows,
    copy_status,
    decide,
    exclusion_changes,
    first_excluded,
    reason_since,
    resolve_cluster,
    samples_from_rows,
)
from prx_assets.core.skiplists.sidecars import REASON_CODES, encode_skiplist
from prx_assets.core.tables import SKIP_AUDIT

DIR_A = "mds/512/512x512/b"
DIR_B = "mds/512/384x640/b"
T0 = datetime(2024, 1, 1, tzinfo=UTC)
DEFAULT = SkipPolicy()


def cp(
    name: str,
    px: int,
    batch: str = "b",
    *,
    label: str | None = "visual",
    caption: bool = True,
    low: bool = False,
    stale: bool = False,
    written: bool | None = True,
    lists: tuple[str, ...] = (),
    cluster: str | None = "c",
    hashed: bool = True,
) -> Copy:
    """A copy named ``name`` (its key) with ``px`` pixels; the rest as given."""
    return Copy(
        batch=batch,
        key=name,
        cluster_id=cluster,
        rank=D.keeper_order(px, 1000, name, batch) if hashed else None,
        label=label,
        caption_usable=caption,
        low_information=low,
        dedup_stale=stale,
        written=written,
        opt_out_lists=lists,
    )


def _sample(key: str, rel: str = DIR_A, shard: str = "shard.00000.mds", index: int = 0):
    return SampleRef(key, rel, shard, index, 512, rel.split("/")[2])


# --------------------------------------------------------------------------- the table
#
# Each case: a cluster (copies K > C1 > C2 in keeper order unless said), the policy, and
# every copy's expected (reasons, training copy it duplicates, what it is pending on).
# "-" means kept. The training copy is the single copy expected kept.

K, C1, C2 = "K", "C1", "C2"


def three(**changes: dict) -> list[Copy]:
    """K (3000 px), C1 (2000 px), C2 (1000 px), in batch b unless changed by ``changes``."""
    return [cp(n, px, **changes.get(n, {})) for n, px in ((K, 3000), (C1, 2000), (C2, 1000))]


DUP_OF_K = (("duplicate",), K, ())
DUP_OF_C1 = (("duplicate",), C1, ())
KEPT = ((), None, ())
OPTED = (("opt_out",), None, ())

TABLE = {
    "all eligible: the keeper trains": (three(), DEFAULT, {K: KEPT, C1: DUP_OF_K, C2: DUP_OF_K}),
    "opt-out on the keeper excludes every copy": (
        three(K={"lists": ("l1",)}),
        DEFAULT,
        {K: OPTED, C1: OPTED, C2: OPTED},
    ),
    "opt-out on a copy excludes the keeper too": (
        three(C2={"lists": ("l1",)}),
        DEFAULT,
        {K: OPTED, C1: OPTED, C2: OPTED},
    ),
    "class on the keeper: the next copy trains": (
        three(K={"label": "text"}),
        DEFAULT,
        {K: (("class_text", "duplicate"), C1, ()), C1: KEPT, C2: DUP_OF_C1},
    ),
    "class on a copy: the keeper still trains": (
        three(C1={"label": "nsfw"}),
        DEFAULT,
        {K: KEPT, C1: (("class_nsfw", "duplicate"), K, ()), C2: DUP_OF_K},
    ),
    "class kept by the policy": (
        three(K={"label": "text"}),
        SkipPolicy(excluded_classes={"nsfw"}),
        {K: KEPT, C1: DUP_OF_K, C2: DUP_OF_K},
    ),
    "no caption on the keeper: the next copy trains": (
        three(K={"caption": False, "label": None}),
        DEFAULT,
        {K: (("duplicate", "no_caption"), C1, ()), C1: KEPT, C2: DUP_OF_C1},
    ),
    "two excluded keepers in a row: the third copy trains": (
        three(K={"label": "text"}, C1={"caption": False}),
        DEFAULT,
        {
            K: (("class_text", "duplicate"), C2, ()),
            C1: (("duplicate", "no_caption"), C2, ()),
            C2: KEPT,
        },
    ),
    "pending class on the keeper: every copy waits for it": (
        three(K={"label": None}),
        DEFAULT,
        {
            K: (("pending",), None, ("caption_classes",)),
            C1: (("pending",), None, ("copy b:K",)),
            C2: (("pending",), None, ("copy b:K",)),
        },
    ),
    "pending dedup (stale row) on the keeper: every copy waits for it": (
        three(K={"stale": True}),
        DEFAULT,
        {
            K: (("pending",), None, ("phash_clusters",)),
            C1: (("pending",), None, ("copy b:K",)),
            C2: (("pending",), None, ("copy b:K",)),
        },
    ),
    "pending on a copy after the training copy changes nothing": (
        three(C1={"label": None}),
        DEFAULT,
        {K: KEPT, C1: (("duplicate", "pending"), K, ("caption_classes",)), C2: DUP_OF_K},
    ),
    "excluded keeper, then a pending copy: the rest wait, the keeper keeps its reason": (
        three(K={"label": "nsfw"}, C1={"label": None}),
        DEFAULT,
        {
            K: (("class_nsfw",), None, ()),
            C1: (("pending",), None, ("caption_classes",)),
            C2: (("pending",), None, ("copy b:C1",)),
        },
    ),
    "pending keeper, excluded copy: the copy needs only its own reason": (
        three(K={"label": None}, C1={"label": "text"}),
        DEFAULT,
        {
            K: (("pending",), None, ("caption_classes",)),
            C1: (("class_text",), None, ()),
            C2: (("pending",), None, ("copy b:K",)),
        },
    ),
    "keeper's batch not sharded yet: the copies wait for it": (
        three(K={"written": None}),
        DEFAULT,
        {K: KEPT, C1: (("pending",), None, ("copy b:K",)), C2: (("pending",), None, ("copy b:K",))},
    ),
    "keeper not written (its batch is sharded): the next copy trains": (
        three(K={"written": False}),
        DEFAULT,
        {K: DUP_OF_C1, C1: KEPT, C2: DUP_OF_C1},
    ),
    "a copy without a hash row cannot be placed: every other copy waits": (
        three(C2={"hashed": False}),
        DEFAULT,
        {
            K: (("pending",), None, ("copy b:C2",)),
            C1: (("pending",), None, ("copy b:C2",)),
            C2: (("pending",), None, ("image_hashes",)),
        },
    ),
    "every copy excluded: nothing trains, each keeps its own reason": (
        three(K={"label": "text"}, C1={"caption": False}, C2={"label": "nsfw"}),
        DEFAULT,
        {
            K: (("class_text",), None, ()),
            C1: (("no_caption",), None, ()),
            C2: (("class_nsfw",), None, ()),
        },
    ),
    "duplicates kept by the policy: every eligible copy trains": (
        three(K={"label": "text"}),
        SkipPolicy(skip_duplicates=False),
        {K: (("class_text",), None, ()), C1: KEPT, C2: KEPT},
    ),
    "duplicates kept by the policy: an opt-out still takes every copy": (
        three(C1={"lists": ("l2", "l1")}),
        SkipPolicy(skip_duplicates=False),
        {K: (("opt_out",), None, ()), C1: (("opt_out",), None, ()), C2: (("opt_out",), None, ())},
    ),
    "keeper in another batch: this batch's copies are its duplicates": (
        three(K={"batch": "a"}),
        DEFAULT,
        {K: KEPT, C1: DUP_OF_K, C2: DUP_OF_K},
    ),
    "keeper in another batch, excluded: this batch's best copy trains": (
        three(K={"batch": "a", "label": "nsfw"}),
        DEFAULT,
        {K: (("class_nsfw", "duplicate"), C1, ()), C1: KEPT, C2: DUP_OF_C1},
    ),
    "keeper in another batch, pending: this batch's copies wait for it": (
        three(K={"batch": "a", "label": None}),
        DEFAULT,
        {
            K: (("pending",), None, ("caption_classes",)),
            C1: (("pending",), None, ("copy a:K",)),
            C2: (("pending",), None, ("copy a:K",)),
        },
    ),
    "opt-out and class together: both reasons, no training copy": (
        three(K={"label": "text"}, C2={"lists": ("l1",)}),
        DEFAULT,
        {K: (("class_text", "opt_out"), None, ()), C1: OPTED, C2: OPTED},
    ),
}


@pytest.mark.parametrize("case", sorted(TABLE))
def test_policy_table(case):
    copies, policy, expected = TABLE[case]
    out = resolve_cluster(copies, policy)
    got = {
        ref[1]: (o.reasons, o.duplicate_of[1] if o.duplicate_of else None, o.pending_on)
        for ref, o in out.items()
    }
    assert got == expected
    kept = [k for k, (reasons, _, _) in expected.items() if not reasons]
    assert len(kept) <= 1 or not policy.skip_duplicates  # one training copy at most
    lists = sorted({i for c in copies for i in c.opt_out_lists})
    for c in copies:
        o = out[c.ref]
        assert o.opt_out_list_ids == tuple(lists)
        assert o.opt_out_via == tuple(sorted(x.key for x in copies if x.opt_out_lists))
        if o.duplicate_of:  # names the copy actually used
            assert o.duplicate_of == next(x.ref for x in copies if x.key == kept[0])
        assert set(o.reasons) <= set(REASON_CODES)


def test_low_information_is_decided_alone_and_excluded_by_default():
    flat = cp("F", 5000, low=True, cluster="F")
    twin = cp("T", 100, cluster="F")  # a stray row with the same cluster id: not merged
    out = decide("b", [_sample("F"), _sample("T", index=1)], [flat, twin], DEFAULT)
    by_key = {d.sample.key: d for d in out.decisions}
    assert by_key["F"].reasons == ("low_information",)
    assert by_key["T"].reasons == ()  # alone in its cluster: the training copy
    kept = decide("b", [_sample("F")], [flat], SkipPolicy(skip_low_information=False))
    assert kept.decisions[0].reasons == ()


def test_a_sample_with_no_cluster_is_pending_alone():
    out = decide("b", [_sample("x")], [cp("x", 10, cluster=None)], DEFAULT)
    (d,) = out.decisions
    assert d.reasons == ("pending",) and d.pending_on == ("phash_clusters",)
    assert out.undecided == 1 and out.unclassified == 0


def test_cross_batch_cluster_decisions_and_the_other_batches_outcomes():
    # The keeper lives in batch a (not being decided); b holds two smaller copies.
    copies = [cp(K, 3000, "a", label="text"), cp(C1, 2000), cp(C2, 1000)]
    samples = [_sample(C1), _sample(C2, DIR_B)]
    out = decide("b", samples, copies, DEFAULT)
    by_key = {d.sample.key: d for d in out.decisions}
    assert by_key[C1].reasons == () and by_key[C1].cluster_id == "c"
    assert by_key[C2].reasons == ("duplicate",)
    assert (by_key[C2].duplicate_of, by_key[C2].duplicate_of_batch) == (C1, "b")
    # What this decision says of batch a's copy, for the contradiction check.
    assert out.others == {("a", K): ("c", resolve_cluster(copies, DEFAULT)[("a", K)])}
    assert out.others[("a", K)][1].reasons == ("class_text", "duplicate")
    skips = out.skips_by_dir()
    assert skips == {DIR_A: {}, DIR_B: {"shard.00000.mds": {0: ["duplicate"]}}}
    assert encode_skiplist("shard.00000.mds", skips[DIR_B]["shard.00000.mds"])


def test_the_keeper_order_is_the_order_dedup_keeps_by():
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(2, 7))
        members = [
            (
                f"b{int(rng.integers(0, 3))}",
                f"k{int(rng.integers(0, 4))}{i}",
                int(rng.integers(1, 4)) * 100,
                int(rng.integers(1, 4)) * 10,
            )
            for i in range(n)
        ]
        table = pa.Table.from_pylist(
            [
                {"key": k, "batch": b, "phash": 5, "ac_energy": 30.0, "pixels": p, "file_size": f}
                for b, k, p, f in members
            ]
        )
        decided = D.decide(table, D.DedupSettings()).to_pylist()
        keeper = next((r["batch"], r["key"]) for r in decided if r["is_keeper"])
        best = min(members, key=lambda m: D.keeper_order(m[2], m[3], m[1], m[0]))
        assert keeper == (best[0], best[1])


def test_policy_validation_and_fingerprint():
    with pytest.raises(SkipPolicyError, match="cannot exclude"):
        SkipPolicy(excluded_classes={"visual"})
    with pytest.raises(SkipPolicyError, match="skip_low_information must be a bool"):
        SkipPolicy(skip_low_information="yes")  # type: ignore[arg-type]
    base = SkipPolicy()
    assert base.skip_low_information and base.skip_duplicates
    assert base.fingerprint() == SkipPolicy(excluded_classes=["nsfw", "text"]).fingerprint()
    variants = [
        SkipPolicy(excluded_classes={"nsfw"}),
        SkipPolicy(skip_duplicates=False),
        SkipPolicy(skip_low_information=False),
    ]
    fps = {base.fingerprint(), *(v.fingerprint() for v in variants)}
    assert len(fps) == 4 and all(len(f) == 16 for f in fps)


def test_contract_violations_are_errors():
    one = [cp("a", 1), cp("b", 2, cluster="d")]
    with pytest.raises(SkipPolicyError, match="appears twice"):
        decide("b", [_sample("a"), _sample("a", index=1)], one, DEFAULT)
    with pytest.raises(SkipPolicyError, match="two samples claim"):
        decide("b", [_sample("a"), _sample("b")], one, DEFAULT)
    with pytest.raises(SkipPolicyError, match="index -1"):
        decide("b", [_sample("a", index=-1)], one, DEFAULT)
    with pytest.raises(SkipPolicyError, match="class label 'cat'"):
        decide("b", [_sample("a")], [cp("a", 1, label="cat")], DEFAULT)
    with pytest.raises(SkipPolicyError, match="no facts"):
        decide("b", [_sample("zz")], one, DEFAULT)
    with pytest.raises(SkipPolicyError, match="unique"):
        decide("b", [_sample("a")], [cp("a", 1), cp("a", 1)], DEFAULT)


# --------------------------------------------------------------------------- properties

_copies = st.builds(
    dict,
    px=st.integers(1, 4),
    batch=st.sampled_from(["a", "b"]),
    label=st.sampled_from([None, "visual", "visual", "text", "nsfw"]),
    caption=st.sampled_from([True, True, True, False]),
    stale=st.sampled_from([False, False, False, True]),
    written=st.sampled_from([True, True, True, False, None]),
    lists=st.sampled_from([(), (), (), ("l1",)]),
    hashed=st.sampled_from([True, True, True, False]),
)
_policies = st.builds(
    SkipPolicy, st.frozensets(st.sampled_from(["text", "nsfw"])), st.booleans(), st.booleans()
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_copies, min_size=1, max_size=6), _policies)
def test_no_cluster_trains_twice_none_is_lost_while_decidable(specs, policy):
    copies = [cp(f"k{i}", s.pop("px") * 100, s.pop("batch"), **s) for i, s in enumerate(specs)]
    out = resolve_cluster(copies, policy)
    status = {c.ref: copy_status(c, policy) for c in copies}
    # What could train: written copies not excluded (the others are no one's samples).
    kept = [c for c in copies if c.written and not out[c.ref].excluded]
    if any(c.opt_out_lists for c in copies):
        assert not kept and all("opt_out" in out[c.ref].reasons for c in copies)
        return
    # A kept sample never has a reason of its own.
    assert all(status[c.ref] is CopyStatus.ELIGIBLE for c in kept)
    if not policy.skip_duplicates:
        return
    ranked = sorted(copies, key=lambda c: (c.rank is not None, c.rank or ()))
    first = next((c for c in ranked if status[c.ref] is not CopyStatus.EXCLUDED), None)
    if first is not None and status[first.ref] is CopyStatus.ELIGIBLE:
        # Decidable: exactly this copy trains, everything else names it.
        assert kept == [first]
        for c in copies:
            if c is not first:
                assert out[c.ref].duplicate_of == first.ref
    else:
        # Nothing eligible, or an uncertain copy ranks first: nothing is kept.
        assert kept == []
        for c in copies:
            if status[c.ref] is CopyStatus.ELIGIBLE:
                assert "pending" in out[c.ref].reasons


_labels = st.sampled_from([None, "visual", "text", "nsfw"])


@st.composite
def _partitions(draw):
    n = draw(st.integers(0, 30))
    samples, copies = [], []
    for i in range(n):
        rel = draw(st.sampled_from([DIR_A, DIR_B]))
        shard = f"shard.{draw(st.integers(0, 2)):05d}.mds"
        key = f"k{i:03d}"
        samples.append(SampleRef(key, rel, shard, i, 512, rel.split("/")[2]))
        cluster = draw(st.sampled_from([None, "c1", "c2", key, key]))
        copies.append(cp(key, draw(st.integers(1, 9)) * 10, label=draw(_labels), cluster=cluster))
    return samples, copies


@settings(max_examples=150, deadline=None)
@given(_partitions(), _policies)
def test_skip_maps_hold_exactly_the_excluded_samples(part, policy):
    samples, copies = part
    out = decide("b", samples, copies, policy)
    assert [d.sample for d in out.decisions] == sorted(
        samples, key=lambda s: (s.relative_dir, s.shard, s.index_in_shard)
    )
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
    # Unknown is never kept: no label or no cluster always means excluded.
    for d, c in ((d, {c.key: c for c in copies}[d.sample.key]) for d in out.decisions):
        if c.label is None or c.cluster_id is None:
            assert d.excluded and "pending" in d.reasons
    # At most one kept sample per cluster.
    if policy.skip_duplicates:
        kept_per: dict[str, int] = {}
        for d in out.decisions:
            if not d.excluded and d.cluster_id is not None:
                kept_per[d.cluster_id] = kept_per.get(d.cluster_id, 0) + 1
        assert all(v == 1 for v in kept_per.values())


# --------------------------------------------------------------------------- audit


def test_first_excluded_is_carried_while_excluded():
    t1 = T0 + timedelta(days=3)
    assert first_excluded(False, (True, T0), t1) is None
    assert first_excluded(True, None, t1) == t1  # never seen
    assert first_excluded(True, (False, None), t1) == t1  # was kept
    assert first_excluded(True, (True, T0), t1) == T0  # still excluded: since T0
    assert first_excluded(True, (True, None), t1) == t1  # legacy row without a date


def test_each_reason_carries_its_own_time():
    """A copy already out as a duplicate, opted out later: the opt-out's time is its own,
    never the duplicate's (the audit's "since" must not predate the reason it names)."""
    samples = [_sample("c", index=0)]
    keeper = cp("k", 99, "other", cluster="k")
    as_duplicate = decide("b", samples, [cp("c", 10, cluster="k"), keeper], DEFAULT)
    (first,) = audit_rows("b", as_duplicate, {}, T0).to_pylist()
    assert first["reasons"] == ["duplicate"] and first["reason_since"] == [T0]
    t1 = T0 + timedelta(days=2)
    opted = decide("b", samples, [cp("c", 10, cluster="k", lists=("l1",)), keeper], DEFAULT)
    previous = {"c": PreviousDecision(True, T0, {"duplicate": T0})}
    (row,) = audit_rows("b", opted, previous, t1).to_pylist()
    since = dict(zip(row["reasons"], row["reason_since"], strict=True))
    assert since == {"opt_out": t1}  # the opt-out began now, whatever came before it
    assert row["first_excluded_at"] == T0  # out of training since T0, for another reason
    both = PreviousDecision(True, T0, {"duplicate": T0, "opt_out": t1})
    again = audit_rows("b", opted, {"c": both}, t1 + timedelta(days=1)).to_pylist()[0]
    assert again["reason_since"] == [t1]  # carried while it still applies
    # Kept in between: every reason starts again.
    assert reason_since(["opt_out"], PreviousDecision(False, None, {}), t1) == [t1]
    # A row without per-reason times (older table): no carried time, the reason is "now".
    assert reason_since(["duplicate"], (True, T0), t1) == [t1]


def test_audit_rows_and_changes():
    samples = [_sample("a", index=0), _sample("b", index=1), _sample("c", DIR_B, index=0)]
    copies = [
        cp("a", 10, cluster="a", lists=("l9",)),
        cp("b", 10, cluster="b", label="nsfw"),
        cp("c", 10, cluster="k"),
        cp("k", 99, "other", cluster="k"),  # c's keeper, in another batch
    ]
    out = decide("b", samples, [*copies[:3], copies[3]], DEFAULT)
    t1 = T0 + timedelta(hours=5)
    previous = {"a": (True, T0), "b": (False, None), "z": (True, T0)}
    table = audit_rows("b", out, previous, t1)
    assert table.schema == SKIP_AUDIT.schema
    rows = {r["key"]: r for r in table.to_pylist()}
    assert rows["a"]["reasons"] == ["opt_out"] and rows["a"]["opt_out_list_ids"] == ["l9"]
    assert rows["a"]["opt_out_via"] == ["a"]
    assert rows["a"]["first_excluded_at"] == T0  # excluded before, still excluded
    assert rows["b"]["reasons"] == ["class_nsfw"] and rows["b"]["first_excluded_at"] == t1
    assert rows["b"]["class_label"] == "nsfw"
    assert rows["c"]["duplicate_of"] == "k" and rows["c"]["duplicate_of_batch"] == "other"
    assert rows["c"]["relative_dir"] == DIR_B and rows["c"]["cluster_id"] == "k"
    assert all(r["decided_at"] == t1 and r["batch"] == "b" for r in rows.values())
    assert {r["policy_fingerprint"] for r in rows.values()} == {DEFAULT.fingerprint()}
    assert exclusion_changes(out, previous) == (2, 0)  # b and c are new; z is gone, not kept
    kept_now = decide(
        "b", samples, [cp("a", 1, cluster="a"), cp("b", 1, cluster="b"), cp("c", 1)], DEFAULT
    )
    assert exclusion_changes(kept_now, previous) == (0, 1)  # a is no longer excluded
    pending = decide("b", [_sample("a")], [cp("a", 1, label=None)], DEFAULT)
    row = audit_rows("b", pending, {}, t1).to_pylist()[0]
    assert row["reasons"] == ["pending"] and row["pending_on"] == ["caption_classes"]
    rows = samples_from_rows(
        [
            {"key": "a", "relative_dir": DIR_A, "shard": "s", "index_in_shard": 3, "tier": 512},
            {"key": "b", "relative_dir": DIR_A, "shard": "s", "index_in_shard": 4,
             "caption_usable": False},
        ]
    )  # fmt: skip
    assert rows == [
        SampleRef("a", DIR_A, "s", 3, 512, None),
        SampleRef("b", DIR_A, "s", 4, None, None, caption_usable=False),
    ]
