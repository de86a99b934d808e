"""The shard stage's row builders and planners: rows exactly as the tables' contracts say."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pytest

from prx_assets.core.captions.models.prompts import caption_word_count
from prx_assets.core.captions.tables import CAPTIONS
from prx_assets.core.lab import Lab
from prx_assets.core.shards.buckets import assign_bucket, bucket_table, bucket_table_json
from prx_assets.core.shards.mds import Placement
from prx_assets.core.shards.pieces import PlanMismatch, read_piece_samples
from prx_assets.core.shards.plan import (
    CAPTION_EMPTY,
    CAPTION_MISSING,
    NO_USABLE_CAPTION,
    CaptionInfo,
    plan_by_reference,
    plan_shards,
    planned_caption,
)
from prx_assets.core.shards.render import BucketRenderer, RenderFailures
from prx_assets.core.shards.tables import (
    BUCKET_ASSIGNMENTS,
    SHARD_SAMPLES,
    assignment_from_row,
    assignment_rows,
    bucket_table_sha256,
    bucket_totals,
    placement_rows,
    summarise_assignments,
    written_without_caption,
)
from prx_assets.core.tables import IMAGES
from prx_assets.demo.jpegs import demo_photo, encoded

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"
SIZES = [(900, 600), (600, 900), (1024, 1024), (4000, 1000), (384, 2000), (3000, 2000)]


def _resolution(sizes=SIZES, batch: str = "b0") -> pa.Table:
    return pa.table(
        {
            "key": [f"k{i}" for i in range(len(sizes))],
            "batch": [batch] * len(sizes),
            "width": [w for w, _ in sizes],
            "height": [h for _, h in sizes],
        }
    )


def test_assignment_rows_record_the_bucket_rule_exactly_and_read_back_to_it():
    rows = assignment_rows(_resolution())
    assert rows.schema == BUCKET_ASSIGNMENTS.schema
    assert set(rows.column("bucket_table_sha256").to_pylist()) == {bucket_table_sha256()}
    assert bucket_table_sha256() != bucket_table_sha256({512: bucket_table()[512]})
    assert len(bucket_table_json()) > 0
    for row, (w, h) in zip(rows.to_pylist(), SIZES, strict=True):
        a = assign_bucket(w, h)
        assert a is not None
        assert assignment_from_row(row) == a  # the row is the assignment, no recomputation
        assert (row["tier"], row["shape"], row["height"], row["width"]) == (
            a.tier,
            a.shape.name,
            a.shape.height,
            a.shape.width,
        )
        assert (row["source_width"], row["source_height"]) == (w, h)
        assert row["crop_fraction"] == pytest.approx(a.crop_fraction)
    with pytest.raises(ValueError, match="no recorded size"):
        assignment_rows(pa.table({"key": ["k"], "batch": ["b0"], "width": [None], "height": [9]}))
    with pytest.raises(ValueError, match="under the bucket cutoff"):
        assignment_rows(_resolution([(100, 100)]))
    bad = {**rows.to_pylist()[0]}
    bad["crop_right"] += 1
    with pytest.raises(ValueError, match="crop box"):
        assignment_from_row(bad)


def test_summary_lists_every_bucket_in_aspect_order_and_counts_the_hazards():
    rows = assignment_rows(_resolution())
    summary = summarise_assignments(rows)
    table = bucket_table()
    assert {t: list(s) for t, s in summary.fill.items()} == {
        t: [s.name for s in shapes] for t, shapes in table.items()
    }
    assert summary.assigned == sum(n for s in summary.fill.values() for n in s.values()) == 6
    listed = rows.to_pylist()
    assert summary.upscaled == sum(r["upscaled"] for r in listed)
    assert summary.outside_aspect_range == sum(r["outside_aspect_range"] for r in listed)
    mean = sum(r["crop_fraction"] for r in listed) / len(listed)
    assert summary.mean_crop_fraction == pytest.approx(mean)
    empty = summarise_assignments(BUCKET_ASSIGNMENTS.schema.empty_table())
    assert empty.assigned == 0 and empty.mean_crop_fraction == 0.0
    foreign = rows.set_column(rows.schema.get_field_index("shape"), "shape", pa.array(["1x1"] * 6))
    with pytest.raises(ValueError, match="not in the bucket table"):
        summarise_assignments(foreign)


def _caption(key: str, text: str, fp: str = "fp") -> dict:
    provenance = {"backend": "alt_text", "model_id": "m", "prompt_version": "v"}
    return {
        "key": key,
        "caption": text,
        "is_fallback": True,
        "backend_fingerprint": fp,
    } | provenance


def test_plan_writes_every_assigned_image_and_names_why_one_has_no_caption():
    assignments = assignment_rows(_resolution())
    captions = pa.Table.from_pylist(
        [_caption("k0", "a dog"), _caption("k1", "   "), _caption("k3", "a cat")]
    )
    plan = plan_shards(assignments, captions)
    assert plan.planned == 6
    assert plan.uncaptioned == {
        "k1": CAPTION_EMPTY,
        "k2": CAPTION_MISSING,
        "k4": CAPTION_MISSING,
        "k5": CAPTION_MISSING,
    }
    assert plan.captions["k0"] == CaptionInfo("a dog", True, "alt_text", "m", "v", "fp")
    assert plan.captions["k1"] == CaptionInfo("", True, "alt_text", "m", "v", "fp", usable=False)
    assert plan.captions["k2"] == NO_USABLE_CAPTION
    for (tier, shape), rows in plan.buckets.items():
        assert [r["key"] for r in rows] == sorted(r["key"] for r in rows)
        assert all((r["tier"], r["shape"]) == (tier, shape) for r in rows)
    assert sorted(r["key"] for rows in plan.buckets.values() for r in rows) == [
        f"k{i}" for i in range(6)
    ]
    with pytest.raises(ValueError, match="two caption rows"):
        plan_shards(assignments, pa.concat_tables([captions, captions]))
    nothing = plan_shards(assignments, pa.table({}))  # no captions table at all
    assert set(nothing.uncaptioned) == {f"k{i}" for i in range(6)}


def _caption_table(texts: dict[str, str | None]) -> pa.Table:
    rows = [
        {
            "key": k,
            "batch": "b0",
            "caption": t,
            "word_count": None if t is None else caption_word_count(t),
            "backend_fingerprint": f"fp-{k}",
        }
        for k, t in texts.items()
    ]
    return pa.Table.from_pylist(rows, schema=CAPTIONS.schema)


def test_plan_by_reference_is_plan_shards_from_fewer_columns(tmp_path: Path) -> None:
    """Same plan without the texts: only captions without a word (blank, or "...") are
    read to tell blank from not, with every character Python's ``str.strip`` removes."""
    assignments = assignment_rows(_resolution())
    spaces = "".join(chr(c) for c in range(0x3001) if chr(c).isspace())
    texts = {"k0": "a dog", "k1": spaces, "k3": "...", "k4": None}
    lab = Lab(tmp_path / "lab")
    lab.replace_partition(CAPTIONS, "b0", _caption_table(texts))
    view = lab.view()
    where = "batch = 'b0'"
    asked: list[list[str]] = []

    def read_texts(keys):  # noqa: ANN001, ANN202
        asked.append(sorted(keys))
        return {k: texts[k] for k in keys}

    captions = view.read(CAPTIONS.name, ["key", "backend_fingerprint", "word_count"], where)
    by_ref = plan_by_reference(assignments.select(["key", "tier", "shape"]), captions, read_texts)
    assert asked == [["k1", "k3", "k4"]]  # never "a dog"
    full = plan_shards(assignments, view.read(CAPTIONS.name, None, where))
    assert (
        by_ref.uncaptioned
        == full.uncaptioned
        == {
            "k1": CAPTION_EMPTY,
            "k2": CAPTION_MISSING,
            "k4": CAPTION_EMPTY,
            "k5": CAPTION_MISSING,
        }
    )
    assert by_ref.fingerprints == full.fingerprints
    assert by_ref.fingerprints["k3"] == "fp-k3" and by_ref.fingerprints["k1"] is None
    assert {b: [r["key"] for r in rows] for b, rows in by_ref.buckets.items()} == {
        b: [r["key"] for r in rows] for b, rows in full.buckets.items()
    }
    with pytest.raises(ValueError, match="two caption rows"):
        plan_by_reference(assignments, pa.concat_tables([captions, captions]), read_texts)
    with pytest.raises(ValueError, match="not the rows planned"):
        plan_by_reference(assignments, captions, lambda keys: {})


def test_a_caption_that_disagrees_with_the_plan_is_refused() -> None:
    row = _caption("k", "a dog")
    assert planned_caption(row, True).caption == "a dog"
    with pytest.raises(ValueError, match="not blank, planned as unusable"):
        planned_caption(row, False)
    with pytest.raises(ValueError, match="blank, planned as usable"):
        planned_caption(_caption("k", "\u2028"), True)
    with pytest.raises(ValueError, match="no caption row"):
        planned_caption(None, True)
    assert planned_caption(None, False) == NO_USABLE_CAPTION


def test_piece_rows_that_disagree_with_the_plan_fail_the_piece() -> None:
    """A worker reads its piece's rows itself; rows that contradict the step's plan (made
    from the same versions) fail the piece instead of writing an undecided sample."""
    assigned = assignment_rows(_resolution()).to_pylist()
    images = [{"key": r["key"], "image": f"ref-{r['key']}", "source": "s"} for r in assigned]

    def read(keys, uncaptioned, captions):  # noqa: ANN001, ANN202
        return read_piece_samples(
            "b0",
            keys,
            uncaptioned,
            lambda c, f: [r for r in assigned if r["key"] in keys],
            lambda c, f: [_caption(k, t) for k, t in captions.items() if k in keys],
            lambda c, f: [r for r in images if r["key"] in keys],
            by_ref=True,
        )

    (good, bare) = read(["k0", "k1"], {"k1"}, {"k0": "a dog"})
    assert good.fields["caption"] == "a dog" and good.ref == "ref-k0" and good.data is None
    assert bare.fields["caption"] == "" and not bare.missing
    with pytest.raises(PlanMismatch, match="'k0': its caption's text disagrees"):
        read(["k0"], {"k0"}, {"k0": "a dog"})
    with pytest.raises(PlanMismatch, match="'k0': planned with a usable caption"):
        read(["k0"], set(), {})
    assigned = assigned[1:]
    with pytest.raises(PlanMismatch, match="'k0' is planned but has no bucket_assignments"):
        read(["k0"], {"k0"}, {})


def test_placement_rows_locate_each_sample_and_mark_those_without_a_caption():
    captions = {"a": "fp-a", "b": None}  # ShardPlan.fingerprints: None = no usable caption
    placements = [
        Placement("b", 1024, "32x32", "b0", "shard.00001.mds", 0, 3),
        Placement("a", 512, "16x24", "b0", "shard.00000.mds", 2, 2),
    ]
    digests = {"mds/1024/32x32/b0": "d1", "mds/512/16x24/b0": "d2"}
    jpeg = {"a": ("sha-a", 10), "b": ("sha-b", 20)}
    rows = placement_rows(placements, "b0", digests, jpeg, captions)
    assert rows.schema == SHARD_SAMPLES.schema
    got = rows.to_pylist()
    assert [r["key"] for r in got] == ["a", "b"]  # sorted by key
    assert got[0] == {
        "key": "a",
        "batch": "b0",
        "tier": 512,
        "shape": "16x24",
        "relative_dir": "mds/512/16x24/b0",
        "shard": "shard.00000.mds",
        "index_in_shard": 2,
        "sample_index": 2,
        "dir_digest": "d2",
        "jpeg_sha256": "sha-a",
        "jpeg_bytes": 10,
        "caption_fingerprint": "fp-a",
    }
    assert got[1]["caption_fingerprint"] is None and got[1]["dir_digest"] == "d1"
    assert [written_without_caption(r) for r in got] == [False, True]
    with pytest.raises(ValueError, match="is for batch 'b0', not 'b1'"):
        placement_rows(placements, "b1", digests, jpeg, captions)


def test_bucket_totals_count_samples_shards_and_directories_per_bucket():
    rows = pa.table(
        {
            "tier": [512, 512, 512, 1024, 512],
            "shape": ["24x16", "24x16", "24x16", "32x32", "16x24"],
            "relative_dir": [
                f"mds/{d}"
                for d in (
                    "512/24x16/b0",
                    "512/24x16/b0",
                    "512/24x16/b1",
                    "1024/32x32/b0",
                    "512/16x24/b0",
                )
            ],
            "shard": [f"shard.0000{i}.mds" for i in (0, 1, 0, 0, 0)],
        }
    )
    totals = bucket_totals(rows)
    assert list(totals) == [(512, "24x16"), (512, "16x24"), (1024, "32x32")]  # aspect order
    t = totals[(512, "24x16")]
    assert (t.samples, t.shards, t.partitions) == (3, 3, 2)
    assert bucket_totals(SHARD_SAMPLES.schema.empty_table()) == {}


def test_renderer_skips_a_broken_image_and_keeps_the_rest(tmp_path: Path) -> None:
    store = Lab(tmp_path / "lab")
    good = encoded(demo_photo((900, 600), "coffee.png"), "JPEG", quality=90)
    images = {"a-good": good, "b-broken": good[: len(good) // 2], "c-good": good}
    rows = [
        {"key": k, "batch": "b0", "width": 900, "height": 600, "image": v, "source": "s"}
        for k, v in images.items()
    ]
    store.replace_partition(IMAGES, "b0", pa.Table.from_pylist(rows, schema=IMAGES.schema))
    assignments = assignment_rows(
        pa.Table.from_pylist(rows).select(["key", "batch", "width", "height"])
    )
    captions = pa.Table.from_pylist(
        [{"key": k, "caption": f"c {k}", "is_fallback": False} for k in images]
    )
    plan = plan_shards(assignments, captions)
    ((bucket, planned),) = plan.buckets.items()
    renderer = BucketRenderer(store.view(), "b0", plan.captions, chunk_size=2)
    samples = list(renderer.samples(planned))
    assert [s.key for s in samples] == ["a-good", "c-good"]
    assert samples[0].image == samples[1].image  # same source, same bytes
    assert set(renderer.log.failures) == {"b-broken"}
    assert "truncated" in renderer.log.failures["b-broken"]
    # The digest the worker recorded is that of the bytes written, and their size.
    assert renderer.log.jpeg == {
        s.key: (hashlib.sha256(s.image).hexdigest(), len(s.image)) for s in samples
    }
    # A systematic fault (every image failing) stops the run instead of emptying shards.
    strict = BucketRenderer(store.view(), "b0", plan.captions, max_failures=0)
    with pytest.raises(RenderFailures, match="1 images of batch 'b0' failed.*b-broken"):
        list(strict.samples(planned))
    with pytest.raises(ValueError, match="resample must be"):
        BucketRenderer(None, "b0", {}, resample="nearest")
    # No images table at all is refused at once, not turned into a failure per image.
    with pytest.raises(ValueError, match="no images table"):
        BucketRenderer(Lab(tmp_path / "empty").view(), "b0", plan.captions)


def test_bucket_streams_run_one_pipeline_across_buckets_in_write_order(tmp_path: Path) -> None:
    """One pipeline feeds every bucket (the workers do not drain at each bucket's end): the
    same samples as rendering bucket by bucket, in ``bucket_order``, and a stream read out
    of turn is refused rather than handed another bucket's samples."""
    from prx_assets.core.shards.mds import bucket_order
    from prx_assets.core.workers import ProcessPool

    store = Lab(tmp_path / "lab")
    sizes = {"a": (900, 600), "b": (600, 900), "c": (700, 700), "d": (900, 600), "e": (640, 640)}
    images = {
        k: encoded(demo_photo(size, "coffee.png"), "JPEG", quality=90) for k, size in sizes.items()
    }
    images["f-broken"] = images["a"][: len(images["a"]) // 2]
    sizes["f-broken"] = sizes["a"]
    rows = [
        {"key": k, "batch": "b0", "width": w, "height": h, "image": images[k], "source": "s"}
        for k, (w, h) in sizes.items()
    ]
    store.replace_partition(IMAGES, "b0", pa.Table.from_pylist(rows, schema=IMAGES.schema))
    assignments = assignment_rows(
        pa.Table.from_pylist(rows).select(["key", "batch", "width", "height"])
    )
    captions = pa.Table.from_pylist([{"key": k, "caption": f"c {k}"} for k in sizes])
    plan = plan_shards(assignments, captions)
    assert len(plan.buckets) >= 3  # landscape, portrait, square

    per_bucket = BucketRenderer(store.view(), "b0", plan.captions, chunk_size=2)
    expected = {
        b: [(s.key, s.image) for s in per_bucket.samples(r)] for b, r in plan.buckets.items()
    }
    with ProcessPool(2) as pool:
        shared = BucketRenderer(store.view(), "b0", plan.captions, chunk_size=2, pool=pool)
        streams = shared.bucket_streams(plan.buckets, window=3)
        assert list(streams) == bucket_order(plan.buckets)
        got = {b: [(s.key, s.image) for s in stream] for b, stream in streams.items()}
    assert got == expected
    assert shared.log.failures.keys() == per_bucket.log.failures.keys() == {"f-broken"}
    assert shared.log.jpeg == per_bucket.log.jpeg

    streams = BucketRenderer(store.view(), "b0", plan.captions).bucket_streams(plan.buckets)
    second = list(streams)[1]
    with pytest.raises(RuntimeError, match="out of turn"):
        next(streams[second])
