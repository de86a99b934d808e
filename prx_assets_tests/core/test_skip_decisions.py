"""decide_partition on real Lance tables: the findings of issue 10 ("correct on real data").

Each test reproduces one way the skip policy failed open (a sample it knew nothing about,
or had excluded for a reason, still reached training; or a whole cluster was lost) and
asserts the fail-closed decision instead.
"""

from dataclasses import replace

import lance
import pyarrow as pa
import pytest

from prx_assets.core.dedup.decisions import DecisionChange
from prx_assets.core.dedup.dirty import mark_dirty
from prx_assets.core.lab import Lab
from prx_assets.core.skiplists.decisions import (
    MissingImages,
    caption_coverage,
    changed_during_run,
    clear_skip_dirty,
    cluster_copies,
    contradicted_elsewhere,
    decide_partition,
    ensure_audit_columns,
    mark_skip_dirty,
    read_skip_dirty,
)
from prx_assets.core.skiplists.policy import SkipPolicy, audit_rows
from prx_assets.core.skiplists.runner import PartitionSkipLists
from prx_assets.core.tables import CAPTION_CLASSES, CAPTIONS, IMAGES, SHARD_SAMPLES, SKIP_AUDIT
from prx_assets_tests.core.skip_world import FLAT, T0, World, key_of

A, B, C = "src.a", "src.b", "src.c"
V1_COLUMNS = (
    "key", "batch", "tier", "shape", "relative_dir", "shard", "index_in_shard", "excluded",
    "reasons", "opt_out_list_ids", "class_label", "duplicate_of", "decided_at",
    "first_excluded_at", "policy_fingerprint",
)  # fmt: skip


@pytest.fixture
def world(tmp_path) -> World:
    return World(Lab(tmp_path / "lab"))


def _reasons(world: World, batch: str, policy: SkipPolicy | None = None) -> dict[str, tuple]:
    """Image name -> reasons, for every written sample of ``batch``."""
    out = decide_partition(world.lab, batch, world.samples(batch), policy or SkipPolicy())
    names = {key_of(n): n for n in world.images}
    return {names[d.sample.key]: d.reasons for d in out.decisions}


def _kept(world: World) -> set[str]:
    return {n for b in world.batches() for n, r in _reasons(world, b).items() if not r}


def test_low_information_images_are_excluded_by_default(world):
    world.image("blank", A, ac_energy=FLAT)
    world.image("photo", A)
    world.commit()
    assert _reasons(world, A) == {"blank": ("low_information",), "photo": ()}


def test_a_sample_without_a_class_label_is_pending(world):
    world.image("unlabelled", A, label=None)
    world.image("photo", A)
    world.commit()
    assert _reasons(world, A) == {"unlabelled": ("pending",), "photo": ()}


def test_a_sample_without_a_dedup_decision_is_pending(world):
    world.image("unhashed", A, hashed=False)  # no image_hashes row, so no phash_clusters row
    world.image("photo", A)
    world.commit()
    assert _reasons(world, A) == {"unhashed": ("pending",), "photo": ()}


@pytest.mark.parametrize("caption", [None, "", "  \n\t "])
def test_an_image_without_a_usable_caption_is_excluded_as_no_caption(world, caption):
    world.image("no-alt", A, caption=caption)
    world.image("no-row", A, has_caption_row=False, label=None)
    world.image("photo", A)
    world.commit()
    assert _reasons(world, A) == {
        "no-alt": ("no_caption",),
        "no-row": ("no_caption",),
        "photo": (),
    }


def test_an_excluded_keeper_hands_training_to_the_best_remaining_copy(world):
    # A 10-member cluster over three batches; the keeper (most pixels) is classified nsfw.
    world.image("keeper", A, phash=7, pixels=2000 * 600, label="nsfw")
    for i in range(9):
        world.image(f"copy{i}", (A, B, C)[i % 3], phash=7, pixels=(1000 + 10 * i) * 600)
    world.commit()
    # The best remaining copy is copy8 (most pixels after the keeper), in batch C.
    assert _kept(world) == {"copy8"}
    assert _reasons(world, A)["keeper"] == ("class_nsfw", "duplicate")


def test_an_opt_out_of_a_smaller_copy_excludes_the_larger_copy(world):
    world.image("original", A, phash=9, pixels=1600 * 600)
    small = world.image("small-copy", B, phash=9, pixels=800 * 600)
    world.image("unrelated", A)
    world.commit()
    world.opt_out("legal.txt@1", [small])
    assert _reasons(world, A) == {"original": ("opt_out",), "unrelated": ()}
    assert _reasons(world, B) == {"small-copy": ("opt_out",)}


def test_an_opt_out_naming_only_a_copy_under_the_size_cutoff_excludes_its_larger_copy(world):
    """The small copy never trains (not eligible, never written), but it is hashed, so it
    shares the cluster of its larger copy; an opt-out list naming only it reaches that copy,
    and the opt-out sensor's expansion through the cluster requests the larger copy's batch.
    """
    world.image("original", A, phash=11, pixels=1600 * 900)
    small = world.image("thumbnail", B, phash=11, pixels=300 * 200, eligible=False, sharded=False)
    world.commit()
    # B holds only the thumbnail: no shards at all. That must not hold A's copy pending.
    assert _reasons(world, A) == {"original": ()}
    assert (A, key_of("original")) in cluster_copies(world.lab, [(B, small)])
    world.opt_out("legal.txt@1", [small])
    decisions, _ = _decisions(world, A)
    assert decisions["original"].reasons == ("opt_out",)
    assert decisions["original"].opt_out_via == (small,)


def test_an_ineligible_copy_is_never_the_training_copy_even_when_it_is_the_largest(world):
    # Eligibility is not only size (e.g. an aspect outside 0.5-2.0): the largest copy of the
    # cluster may be one that is never written; training then goes to the best written one.
    world.image("panorama", B, phash=12, pixels=6000 * 1000, eligible=False, sharded=False)
    world.image("crop", A, phash=12, pixels=1000 * 900)
    world.image("smaller", A, phash=12, pixels=800 * 700)
    world.commit()
    assert _reasons(world, A) == {"crop": (), "smaller": ("duplicate",)}


# --------------------------------------------------------------------------- fail closed


def _decisions(world: World, batch: str, policy: SkipPolicy | None = None):
    out = decide_partition(world.lab, batch, world.samples(batch), policy or SkipPolicy())
    names = {key_of(n): n for n in world.images}
    return {names[d.sample.key]: d for d in out.decisions}, out


def test_a_class_label_of_another_caption_is_no_label(world):
    world.image("photo", A)
    world.image("relabelled", A)
    world.commit()
    # The captioner changed for one image; caption_classes has not caught up with it yet.
    caps = world.lab.read_batch(CAPTIONS.name, A).to_pylist()
    for r in caps:
        if r["key"] == key_of("relabelled"):
            r["backend_fingerprint"] = "another-captioner"
    world.lab.replace_partition(CAPTIONS, A, pa.Table.from_pylist(caps, schema=CAPTIONS.schema))
    got, out = _decisions(world, A)
    assert got["relabelled"].reasons == ("pending",)
    assert got["relabelled"].pending_on == ("caption_classes",) and out.unclassified == 1
    assert got["photo"].reasons == ()


def test_a_dedup_decision_marked_stale_is_no_decision(world):
    world.image("keeper", A, phash=5, pixels=1200 * 600)
    world.image("copy", B, phash=5)
    world.commit()
    mark_dirty(
        world.lab,
        [DecisionChange(A, key_of("keeper"), key_of("keeper"), "keeper", "duplicate of x")],
        detected_by=C,
    )
    got, _ = _decisions(world, A)
    assert got["keeper"].reasons == ("pending",) and got["keeper"].pending_on == ("phash_clusters",)
    got, _ = _decisions(world, B)  # its keeper is uncertain: the copy waits, it is not kept
    assert got["copy"].reasons == ("pending",)
    assert got["copy"].pending_on == (f"copy {A}:{key_of('keeper')}",)


def test_a_keeper_that_was_not_written_leaves_training_to_the_next_copy(world):
    world.image("keeper", A, phash=5, pixels=1200 * 600, sharded=False)  # failed to render
    world.image("other", A)  # batch A is sharded
    world.image("copy", B, phash=5)
    world.commit()
    got, _ = _decisions(world, B)
    assert got["copy"].reasons == ()


def test_a_keeper_whose_batch_is_not_sharded_yet_keeps_its_copies_pending(world):
    world.image("keeper", A, phash=5, pixels=1200 * 600, sharded=False)
    world.image("copy", B, phash=5)
    world.commit()
    got, _ = _decisions(world, B)
    assert got["copy"].reasons == ("pending",)
    # Once A is sharded with its keeper, the copy is a plain duplicate of it.
    world.images["keeper"].sharded = True
    world.commit((SHARD_SAMPLES.name,))
    got, _ = _decisions(world, B)
    assert got["copy"].reasons == ("duplicate",)
    assert (got["copy"].duplicate_of, got["copy"].duplicate_of_batch) == (key_of("keeper"), A)


def test_within_a_batch_every_copy_not_among_the_samples_counts_as_not_written(world):
    world.image("keeper", A, phash=5, pixels=1200 * 600)
    world.image("copy", A, phash=5)
    world.commit()
    samples = [s for s in world.samples(A) if s.key == key_of("copy")]
    out = decide_partition(world.lab, A, samples, SkipPolicy())
    assert [d.reasons for d in out.decisions] == [()]


def test_the_writer_saying_no_usable_caption_wins(world):
    world.image("photo", A)
    world.commit()
    (s,) = world.samples(A)
    out = decide_partition(world.lab, A, [replace(s, caption_usable=False)], SkipPolicy())
    assert out.decisions[0].reasons == ("no_caption",)
    out = decide_partition(world.lab, A, [replace(s, caption_usable=True)], SkipPolicy())
    assert out.decisions[0].reasons == ()


def test_missing_stage_tables_leave_every_sample_pending(world):
    world.image("photo", A)
    world.commit((IMAGES.name, CAPTIONS.name, SHARD_SAMPLES.name))
    got, out = _decisions(world, A)
    assert got["photo"].reasons == ("pending",)
    assert set(got["photo"].pending_on) == {"caption_classes", "phash_clusters", "image_hashes"}
    world.lab.replace_partition(IMAGES, A, IMAGES.schema.empty_table())
    with pytest.raises(MissingImages, match="not in `images`"):
        _decisions(world, A)


def test_opt_outs_by_url_and_source_id_reach_every_copy_across_batches(world):
    world.image("big", A, phash=3, pixels=1800 * 600)
    world.image("mid", B, phash=3, pixels=1200 * 600, url="https://example.org/mid.jpg")
    world.image("small", C, phash=3)
    world.commit()
    world.opt_out("by-url.txt@1", ["https://example.org/mid.jpg"])
    world.opt_out("by-id.txt@2", ["test:small"])
    for batch in (A, B, C):
        for d in _decisions(world, batch)[0].values():
            assert d.reasons == ("opt_out",)
            assert d.opt_out_list_ids == ("by-id.txt@2", "by-url.txt@1")
            assert d.opt_out_via == tuple(sorted([key_of("mid"), key_of("small")]))
    copies = cluster_copies(world.lab, [(B, key_of("mid"))])
    assert copies == {(A, key_of("big")), (B, key_of("mid")), (C, key_of("small"))}


# --------------------------------------------------------------------------- other batches


def _record(world: World, batch: str, policy: SkipPolicy | None = None) -> None:
    """What skip_lists(batch) records: its audit rows."""
    _, out = _decisions(world, batch, policy)
    world.lab.replace_partition(SKIP_AUDIT, batch, audit_rows(batch, out, {}, T0))


def test_an_opt_out_of_a_small_copy_clustered_later_reaches_the_recorded_larger_copy(
    world, tmp_path
):
    """The opt-out is recorded before the thumbnail is hashed: the original's batch decided
    it kept, and the sensor's cluster expansion found no other copy then. The thumbnail's
    batch has no samples, but its skip_lists run gathers the thumbnail's cluster and marks
    the original's recorded decision contradicted, so that batch reruns."""
    world.image("original", A, phash=13, pixels=1600 * 900)
    small = world.image("thumbnail", B, phash=13, pixels=300 * 200, eligible=False, sharded=False)
    world.commit()
    _record(world, A)  # kept: decided while no copy of it was opted out
    world.opt_out("legal.txt@1", [small])
    out = decide_partition(world.lab, B, world.samples(B), SkipPolicy())
    assert out.decisions == []  # B holds nothing that trains
    changes = contradicted_elsewhere(world.lab, out)
    assert [(c.batch, c.key, c.after) for c in changes] == [(A, key_of("original"), "opt_out")]
    # The stage itself, on a batch with no shards: it runs and queues A for its rerun.
    done = PartitionSkipLists(world.lab, str(tmp_path / "shards"), B, SkipPolicy()).run()
    assert done.samples == 0 and [c.batch for c in done.marked_elsewhere] == [A]
    assert read_skip_dirty(world.lab).column("batch").to_pylist() == [A]


def test_contradicted_decisions_of_other_batches_are_found(world):
    world.image("keeper", A, phash=5, pixels=1800 * 600)
    world.image("copy1", B, phash=5, pixels=1200 * 600)
    world.image("copy2", C, phash=5)
    world.image("loner", C)
    world.commit()
    for batch in (A, B, C):
        _record(world, batch)
    _, out = _decisions(world, A)
    assert contradicted_elsewhere(world.lab, out) == []  # every record agrees
    # A's keeper is reclassified as text: copy1 (B) must train now; copy2 (C) must name it.
    world.images["keeper"].label = "text"
    world.commit((CAPTION_CLASSES.name,))
    _, out = _decisions(world, A)
    changes = contradicted_elsewhere(world.lab, out)
    assert [(c.batch, c.key) for c in changes] == [(B, key_of("copy1")), (C, key_of("copy2"))]
    assert (
        changes[0].before.startswith("duplicate (training copy src.a:")
        and changes[0].after == "kept"
    )
    assert changes[1].after == f"duplicate (training copy {B}:{key_of('copy1')})"
    # Marked, read back, cleared: exactly the rows read before are removed.
    assert mark_skip_dirty(world.lab, changes, A, T0) == 2
    ids = read_skip_dirty(world.lab).column("dirty_id").to_pylist()
    assert sorted(read_skip_dirty(world.lab).column("batch").to_pylist()) == [B, C]
    mark_skip_dirty(world.lab, changes[:1], A, T0.replace(year=2025))  # a later mark
    assert clear_skip_dirty(world.lab, ids) == 2
    assert read_skip_dirty(world.lab).column("batch").to_pylist() == [B]
    # Rows decided under another policy are the policy sensor's, not contradictions.
    _record(world, B, SkipPolicy(excluded_classes={"nsfw"}))
    assert [c.batch for c in contradicted_elsewhere(world.lab, out)] == [C]


def test_changed_during_run_compares_a_batch_with_itself(world):
    world.image("photo", A)
    world.commit()
    _, first = _decisions(world, A)
    world.images["photo"].label = "nsfw"
    world.commit((CAPTION_CLASSES.name,))
    _, again = _decisions(world, A)
    (change,) = changed_during_run(A, first, again)
    assert (change.batch, change.before, change.after) == (A, "kept", "class_nsfw")
    assert changed_during_run(A, again, again) == []


def test_an_audit_from_policy_v1_gains_the_new_columns(world):
    world.image("photo", A)
    world.commit()
    old = pa.schema([f for f in SKIP_AUDIT.schema if f.name in V1_COLUMNS])
    row = {"key": "k", "batch": B, "excluded": False, "reasons": [], "policy_fingerprint": "x"}
    lance.write_dataset(pa.Table.from_pylist([row], schema=old), world.lab.uri(SKIP_AUDIT.name))
    assert ensure_audit_columns(world.lab) == [
        "opt_out_via",
        "duplicate_of_batch",
        "cluster_id",
        "pending_on",
        "reserved_via",
        "reserved_signals",
        "reason_since",
    ]
    assert world.lab.dataset(SKIP_AUDIT.name).schema == SKIP_AUDIT.schema
    assert ensure_audit_columns(world.lab) == []
    _record(world, A)  # writes the new columns next to the old rows
    rows = {r["batch"]: r for r in world.lab.read(SKIP_AUDIT.name).to_pylist()}
    assert rows[B]["cluster_id"] is None and rows[A]["cluster_id"] == key_of("photo")


def test_caption_coverage_counts_eligible_images_without_a_usable_caption(world):
    world.image("a", A)
    world.image("b", A, caption="")
    world.image("c", A, caption=" ")
    world.image("d", A, has_caption_row=False)
    world.commit()
    cov = caption_coverage(world.lab, A)
    assert (cov.eligible, cov.without_caption) == (4, 3) and cov.share == 0.75
    assert cov.keys == sorted(key_of(n) for n in "bcd")
    assert caption_coverage(world.lab, "nowhere").share == 0.0
