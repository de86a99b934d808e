"""skip_lists on a real demo partition: sidecars, the loader, the audit, policy changes."""

import io
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from dagster import AssetKey, SensorResult, build_sensor_context, materialize
from PIL import Image

from prx_assets.core.dedup.corpus import gather_corpus
from prx_assets.core.dedup.decisions import DedupSettings, plan_batch
from prx_assets.core.shards.buckets import assign_bucket
from prx_assets.core.shards.mds import (
    MDSSample,
    partition_digest,
    skip_nothing,
    write_partition_buckets,
)
from prx_assets.core.skiplists.identifiers import parse_identifier
from prx_assets.core.skiplists.intake import opt_out_rows
from prx_assets.core.skiplists.sidecars import (
    MANIFEST_BASENAME,
    current_generation,
    load_generation,
    load_skiplists,
    read_skiplist,
    sweep,
)
from prx_assets.core.tables import (
    CAPTION_CLASSES,
    CAPTIONS,
    IMAGE_HASHES,
    IMAGES,
    OPT_OUTS,
    PHASH_CLUSTERS,
    RESOLUTION,
    SHARD_SAMPLES,
    SKIP_AUDIT,
)
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.skiplists.assets import build_skiplist_assets
from prx_assets.defs.skiplists.config import SkipPolicyResource
from prx_assets.defs.skiplists.sensors import skip_policy_sensor
from prx_assets.demo.jpegs import encoded
from prx_assets_tests.loader_keys import loader_keys

KEY = "public-skimage.000"
T0 = datetime(2024, 1, 1, tzinfo=UTC)
CAPTIONER = "test-captioner"


def _thumb(data: bytes) -> bytes:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    img.thumbnail((48, 48))
    return encoded(img, "JPEG", quality=80)


class Built:
    """The demo batch ingested, sharded (small shards) and classified/deduplicated."""

    def __init__(self, store, root: Path, keys: list[str], placements, urls, sizes):
        self.store = store
        self.root = root
        self.keys = keys  # sorted sharded keys
        self.where = {p.key: p for p in placements}
        self.urls = urls
        self.sizes = sizes  # key -> (pixels, file_size)
        # The smallest group of images sharing a URL (>= 2): one URL opt-out removes all.
        groups: dict[str, set[str]] = {}
        for k in keys:
            if urls.get(k):
                groups.setdefault(urls[k], set()).add(k)
        self.url_group = min((g for g in groups.values() if len(g) >= 2), key=len)
        self.url_key = min(self.url_group)
        others = [k for k in keys if k not in self.url_group]
        assert len(others) >= 7, "the demo batch needs more eligible images for this test"
        (self.text, self.nsfw, self.dup, self.keeper, self.flat, self.unclassified) = others[:6]
        self.heir = others[6]  # a copy of text, which keeps its cluster (most pixels)
        self.pairs = {self.dup: self.keeper, self.heir: self.text}  # copy -> keeper

    def dirs(self) -> list[Path]:
        return sorted({self.root / p.relative_dir for p in self.where.values()})


def _captions_and_classes(store, b: Built) -> None:
    caps = [
        {
            "key": k,
            "batch": KEY,
            "caption": f"a photo {k[:8]}",  # what the shards hold
            "backend_fingerprint": CAPTIONER,
            "created_at": T0,
        }
        for k in b.keys
    ]
    store.replace_partition(CAPTIONS, KEY, pa.Table.from_pylist(caps, schema=CAPTIONS.schema))
    labels = {b.text: "text", b.nsfw: "nsfw"}
    rows = [
        {
            "key": k,
            "batch": KEY,
            "label": labels.get(k, "visual"),
            "caption_fingerprint": CAPTIONER,
            "created_at": T0,
        }
        for k in b.keys
        if k != b.unclassified
    ]
    store.replace_partition(
        CAPTION_CLASSES, KEY, pa.Table.from_pylist(rows, schema=CAPTION_CLASSES.schema)
    )


def _clusters(store, b: Built) -> None:
    """Hash rows (the planted pairs share a hash; flat is near-flat), then real decisions."""
    settings = DedupSettings()
    keepers = set(b.pairs.values())
    rows = []
    for i, k in enumerate(b.keys):
        pixels, size = b.sizes[k]
        rows.append(
            {
                "key": k,
                "batch": KEY,
                "phash": 1000 + b.keys.index(b.pairs.get(k, k)),
                "phash_mode": settings.phash_mode,
                "phash_version": settings.phash_version,
                "ac_energy": 0.1 if k == b.flat else 30.0 + i,
                "pixels": pixels * (4 if k in keepers else 1),
                "file_size": size,
            }
        )
    store.replace_partition(
        IMAGE_HASHES, KEY, pa.Table.from_pylist(rows, schema=IMAGE_HASHES.schema)
    )
    gathered = gather_corpus(store, KEY, settings)
    plan = plan_batch(KEY, gathered.corpus, gathered.stored, settings)
    store.replace_partition(PHASH_CLUSTERS, KEY, plan.rows)
    decided = {r["key"]: r for r in plan.rows.to_pylist()}
    for copy, keeper in b.pairs.items():
        assert decided[copy]["keeper_key"] == keeper and decided[keeper]["is_keeper"]


def _build(instance, lab_resource, with_phash: bool = True) -> Built:
    instance.add_dynamic_partitions(BATCHES.name, [KEY])
    ok = materialize(
        [raw_images, resolution_profile],
        partition_key=KEY,
        instance=instance,
        resources={"lab": lab_resource},
    )
    assert ok.success
    store = lab_resource.lab()
    res = store.read_batch(RESOLUTION.name, KEY, ["key", "width", "height", "eligible"])
    eligible = {r["key"]: r for r in res.to_pylist() if r["eligible"]}
    images = store.read_batch(IMAGES.name, KEY, ["key", "image", "url", "source", "license"])
    samples = []
    urls = {}
    sizes = {}
    files = dict(
        zip(
            *(store.read_batch(IMAGES.name, KEY, ["key", "file_size"]).column(c).to_pylist()
              for c in ("key", "file_size")),
            strict=True,
        )
    )  # fmt: skip
    for row in images.to_pylist():
        if row["key"] not in eligible:
            continue
        r = eligible[row["key"]]
        a = assign_bucket(r["width"], r["height"])
        urls[row["key"]] = row["url"]
        sizes[row["key"]] = (r["width"] * r["height"], files[row["key"]])
        samples.append(
            MDSSample(
                key=row["key"],
                image=_thumb(row["image"]),
                caption=f"a photo {row['key'][:8]}",
                orig_width=r["width"],
                orig_height=r["height"],
                # Coarse buckets (one square shape per tier) so that a directory holds
                # several shards of several samples; skip_lists only follows shard_samples.
                tier=a.tier,
                shape=f"{a.tier}x{a.tier}",
                source=row["source"] or "",
                license=row["license"] or "",
            )
        )
    assert len(samples) >= 9
    root = Path(lab_resource.shards_root)
    limit = 2 * max(len(x.image) for x in samples) + 1500  # about two samples per shard
    placements = write_partition_buckets(
        root, KEY, samples, size_limit=limit, hashes=("sha256",), skips_for=skip_nothing
    )
    digests = {p.relative_dir: partition_digest(root / p.relative_dir) for p in placements}
    rows = [
        {
            "key": p.key,
            "batch": KEY,
            "tier": p.tier,
            "shape": p.shape,
            "relative_dir": p.relative_dir,
            "shard": p.shard,
            "index_in_shard": p.index_in_shard,
            "sample_index": p.sample_index,
            "dir_digest": digests[p.relative_dir],
            "caption_fingerprint": CAPTIONER,
        }
        for p in placements
    ]
    store.replace_partition(
        SHARD_SAMPLES, KEY, pa.Table.from_pylist(rows, schema=SHARD_SAMPLES.schema)
    )
    b = Built(store, root, sorted(p.key for p in placements), placements, urls, sizes)
    assert len({p.relative_dir for p in placements}) >= 2  # several bucket directories
    assert any(p.shard != "shard.00000.mds" for p in placements)  # several shards
    assert any(p.index_in_shard > 0 for p in placements)  # several samples per shard
    _captions_and_classes(store, b)
    if with_phash:
        _clusters(store, b)
    return b


@pytest.fixture
def built(instance, lab_resource) -> Built:
    return _build(instance, lab_resource)


def _opt_out(store, list_id: str, identifiers: list[str], when: datetime) -> None:
    ids = [parse_identifier(i) for i in identifiers]
    # No resolution needed: skip_lists matches from the partition side.
    store.replace_rows(
        OPT_OUTS, "list_id", list_id, opt_out_rows(list_id, dict.fromkeys(ids, []), when)
    )


def _run(instance, lab_resource, policy: SkipPolicyResource | None = None, built_with=None):
    policy = policy or SkipPolicyResource()
    assets = build_skiplist_assets(built_with or policy)
    return materialize(
        assets,
        partition_key=KEY,
        instance=instance,
        resources={"lab": lab_resource, "skip_policy": policy},
        raise_on_error=False,
    )


def _skiplist_files(b: Built) -> dict[Path, bytes]:
    """Every skip-list file (sidecars and manifests) of the batch's directories."""
    return {
        p: p.read_bytes()
        for d in b.dirs()
        for p in sorted(d.iterdir())
        if p.name.endswith(".skip.json") or p.name == MANIFEST_BASENAME
    }


def _sidecar_skips(b: Built) -> dict[str, tuple[str, ...]]:
    """Key -> reasons, read back from the live generations (every sidecar re-read too)."""
    out = {}
    files = set(_skiplist_files(b))
    assert len(files) >= sum(len(load_skiplists(x)) + 1 for x in b.dirs())
    # Beyond the live generation only superseded sidecars (kept for the retention) remain,
    # and a sweep without retention leaves one sidecar per shard and the manifest.
    assert not any(p.name.startswith(".") for p in files)
    for d in b.dirs():
        sweep(d, retention_s=0)
    assert len(_skiplist_files(b)) == sum(len(load_skiplists(x)) + 1 for x in b.dirs())
    for d in b.dirs():
        live = load_generation(d)
        for entry in live.manifest.entries:  # one sidecar per shard, named by the manifest
            assert read_skiplist(d / entry.sidecar) == live.skiplists[entry.shard]
        for shard, sl in live.skiplists.items():
            by_index = sl.as_mapping()
            for key, p in b.where.items():
                if (
                    b.root / p.relative_dir == d
                    and p.shard == shard
                    and p.index_in_shard in by_index
                ):
                    out[key] = by_index[p.index_in_shard]
    return out


def _audit(store) -> dict[str, dict]:
    return {r["key"]: r for r in store.read_batch(SKIP_AUDIT.name, KEY).to_pylist()}


def test_skip_lists_end_to_end(instance, lab_resource, built):
    b = built
    store = b.store
    _opt_out(store, "legal.txt@1", [b.urls[b.url_key]], T0)
    result = _run(instance, lab_resource)
    assert result.success
    expected = {
        b.text: ("class_text", "duplicate"),  # heir's keeper, excluded: heir trains instead
        b.nsfw: ("class_nsfw",),
        b.dup: ("duplicate",),
        b.flat: ("low_information",),  # excluded by default
        b.unclassified: ("pending",),  # no class label: never kept
        **{k: ("opt_out",) for k in b.url_group},
    }
    assert {b.heir, b.keeper}.isdisjoint(expected)

    # Sidecars: exactly the expected indices with their reasons, one per shard.
    assert _sidecar_skips(b) == expected
    # The real loader never yields a skipped key and yields every other one once.
    keys = loader_keys(b.root)
    assert sorted(keys) == sorted(set(b.keys) - set(expected))

    audit = _audit(store)
    assert sorted(audit) == b.keys
    for key, row in audit.items():
        assert tuple(row["reasons"]) == expected.get(key, ())
        assert row["excluded"] == (key in expected)
        p = b.where[key]
        assert (row["relative_dir"], row["shard"], row["index_in_shard"]) == (
            p.relative_dir,
            p.shard,
            p.index_in_shard,
        )
        if key in expected:
            assert row["first_excluded_at"] == row["decided_at"]
        else:
            assert row["first_excluded_at"] is None
    # The record of why: the training copy actually used, what a pending sample awaits.
    assert (audit[b.dup]["duplicate_of"], audit[b.dup]["duplicate_of_batch"]) == (b.keeper, KEY)
    assert audit[b.text]["duplicate_of"] == b.heir and audit[b.heir]["cluster_id"] == b.text
    assert audit[b.unclassified]["pending_on"] == ["caption_classes"]
    assert audit[b.url_key]["opt_out_list_ids"] == ["legal.txt@1"]
    assert audit[b.text]["opt_out_list_ids"] == [] and audit[b.text]["opt_out_via"] == []

    md = result.asset_materializations_for_node("skip_lists")[0].metadata
    shards = sum(len(load_skiplists(d)) for d in b.dirs())
    assert md["sidecars"].value == shards and md["directories"].value == len(b.dirs())
    assert md["samples"].value == len(b.keys)
    assert md["skipped"].value == len(expected) and md["kept"].value == len(b.keys) - len(expected)
    assert f"| `opt_out` | {len(b.url_group)} |" in md["skip_reasons"].value
    assert "| `duplicate` | 2 |" in md["skip_reasons"].value
    assert "| `low_information` | 1 |" in md["skip_reasons"].value
    assert "| `pending` | 1 |" in md["skip_reasons"].value
    for rel in {p.relative_dir for p in b.where.values()}:
        assert f"| `{rel}` |" in md["buckets"].value
    assert md["pending"].value == 1 and md["pending_on_class_label"].value == 1
    assert md["pending_on_dedup_decision"].value == 0 and md["no_caption"].value == 0
    assert md["opt_out_lists_applied"].value == ["legal.txt@1"]
    assert md["newly_excluded"].value == len(expected)
    assert md["other_batches_marked"].value == [] and md["skip_dirty_marked"].value == 0
    first = {k: audit[k]["first_excluded_at"] for k in expected}
    files = _skiplist_files(b)
    generations = md["skiplist_generations"].value
    assert generations == {str(d.relative_to(b.root)): current_generation(d) for d in b.dirs()}

    # Rerun with nothing changed: byte-identical skip-list files, exclusion dates kept.
    assert _run(instance, lab_resource).success
    assert _skiplist_files(b) == files
    assert {k: _audit(store)[k]["first_excluded_at"] for k in expected} == first

    # A second list names two smaller copies: dup (a duplicate of the kept keeper) and heir
    # (the training copy of text's cluster). Each takes its whole cluster out: the keeper
    # with the list and the copy that matched; text gains the reason and keeps its date.
    _opt_out(store, "second.csv@2", [b.dup, b.heir], T0)
    result = _run(instance, lab_resource)
    assert result.success
    audit = _audit(store)
    assert audit[b.keeper]["reasons"] == ["opt_out"]
    assert audit[b.keeper]["opt_out_list_ids"] == ["second.csv@2"]
    assert audit[b.keeper]["opt_out_via"] == [b.dup] and audit[b.keeper]["duplicate_of"] is None
    assert audit[b.keeper]["first_excluded_at"] == audit[b.keeper]["decided_at"] > first[b.text]
    assert audit[b.dup]["reasons"] == ["opt_out"] and audit[b.dup]["duplicate_of"] is None
    assert audit[b.dup]["first_excluded_at"] == first[b.dup]
    assert audit[b.text]["reasons"] == ["class_text", "opt_out"]
    assert audit[b.text]["opt_out_via"] == [b.heir]
    assert audit[b.text]["first_excluded_at"] == first[b.text]
    assert audit[b.heir]["reasons"] == ["opt_out"]
    md = result.asset_materializations_for_node("skip_lists")[0].metadata
    assert md["newly_excluded"].value == 2 and md["no_longer_excluded"].value == 0
    assert {b.keeper, b.heir}.isdisjoint(loader_keys(b.root))


def test_no_caption_is_skipped_counted_and_checked(instance, lab_resource, built):
    b = built
    # Three images lose their caption (no alt text: the fallback caption is empty).
    blank = sorted({b.flat, b.keeper, b.nsfw})
    caps = b.store.read_batch(CAPTIONS.name, KEY).to_pylist()
    for row in caps:
        if row["key"] in blank:
            row["caption"] = "  " if row["key"] == b.flat else ""
    b.store.replace_partition(CAPTIONS, KEY, pa.Table.from_pylist(caps, schema=CAPTIONS.schema))
    result = _run(instance, lab_resource, SkipPolicyResource(max_no_caption_share=0.5))
    assert result.success
    audit = _audit(b.store)
    assert all("no_caption" in audit[k]["reasons"] for k in blank)
    assert audit[b.dup]["reasons"] == []  # its keeper has no caption: the copy trains
    assert audit[b.keeper]["duplicate_of"] == b.dup
    md = result.asset_materializations_for_node("skip_lists")[0].metadata
    assert md["no_caption"].value == 3 and "| `no_caption` | 3 |" in md["skip_reasons"].value
    eligible = b.store.dataset(RESOLUTION.name).count_rows(f"batch = '{KEY}' AND eligible")
    assert md["eligible_without_caption"].value == 3
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "skip_lists_caption_coverage" and check.passed
    assert check.metadata["eligible_images"].value == eligible
    assert check.metadata["without_caption"].value == 3
    # Over the configured share (the default, 5 %), the ERROR check fails; the run is green
    # and the images stay skipped.
    assert 3 / eligible > 0.05
    result = _run(instance, lab_resource)
    assert result.success
    (check,) = result.get_asset_check_evaluations()
    assert not check.passed and check.severity.value == "ERROR"
    assert sorted(check.metadata["keys_without_caption"].value) == blank
    assert set(blank).isdisjoint(loader_keys(b.root))


def test_policy_change_reruns_only_skip_lists_with_new_decisions(instance, lab_resource, built):
    b = built
    default = build_skiplist_assets()[0]
    nsfw_only = SkipPolicyResource(excluded_classes=["nsfw"], skip_low_information=False)
    changed = build_skiplist_assets(nsfw_only)[0]
    cv = {next(iter(a.specs)).code_version for a in (default, changed)}
    assert len(cv) == 2 and all(v.startswith("skip_lists-v2-") for v in cv)
    spec = next(iter(default.specs))
    assert {d.asset_key for d in spec.deps} == {
        AssetKey("mds_shards"),
        AssetKey("caption_classes"),
        AssetKey("phash_clusters"),
        AssetKey("opt_out_lists"),  # lineage: every list feeds every batch's decision
        AssetKey("usage_policy"),  # lineage: the header policy file
    }
    assert default.partitions_def == BATCHES and spec.group_name == "skiplists"

    assert _run(instance, lab_resource).success
    before = _audit(b.store)
    assert before[b.text]["excluded"]

    # The policy sensor sees the partition as decided under another policy, once per state.
    def tick(policy):
        with build_sensor_context(
            instance=instance, resources={"lab": lab_resource, "skip_policy": policy}
        ) as ctx:
            return skip_policy_sensor(ctx)

    def quiet(result) -> str:
        assert isinstance(result, SensorResult) and not result.run_requests
        return result.skip_reason.skip_message

    assert quiet(tick(SkipPolicyResource())) == "none policy-stale"
    res = tick(nsfw_only)
    assert isinstance(res, SensorResult)
    assert [r.partition_key for r in res.run_requests] == [KEY]
    assert res.run_requests[0].asset_selection == [AssetKey("skip_lists")]
    assert nsfw_only.fingerprint() in res.run_requests[0].run_key
    # Requested once per stale state: not again while its run has not settled it.
    with build_sensor_context(
        instance=instance,
        cursor=res.cursor,
        resources={"lab": lab_resource, "skip_policy": nsfw_only},
    ) as ctx:
        assert quiet(skip_policy_sensor(ctx)) == "1 policy-stale partition(s), all requested"

    # Resource and built policy disagree: refused before anything is written.
    bad = _run(instance, lab_resource, policy=nsfw_only, built_with=SkipPolicyResource())
    assert not bad.success
    assert _audit(b.store) == before

    assert _run(instance, lab_resource, policy=nsfw_only).success
    after = _audit(b.store)
    # text is eligible again, so it is its cluster's training copy once more; heir is not.
    assert not after[b.text]["excluded"] and after[b.text]["first_excluded_at"] is None
    assert after[b.heir]["reasons"] == ["duplicate"] and after[b.heir]["duplicate_of"] == b.text
    assert after[b.nsfw]["first_excluded_at"] == before[b.nsfw]["first_excluded_at"]
    assert after[b.flat]["reasons"] == [] and before[b.flat]["reasons"] == ["low_information"]
    assert after[b.unclassified]["reasons"] == ["pending"]  # whatever the policy
    assert {r["policy_fingerprint"] for r in after.values()} == {nsfw_only.fingerprint()}
    skips = _sidecar_skips(b)
    assert b.text not in skips and b.flat not in skips and skips[b.heir] == ("duplicate",)
    assert quiet(tick(nsfw_only)) == "none policy-stale"


def _failure_text(result) -> str:
    event = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    return str(event.event_specific_data.error)


def test_missing_upstream_table_fails_clearly(instance, lab_resource):
    _build(instance, lab_resource, with_phash=False)
    before = {d: current_generation(d) for d in Path(lab_resource.shards_root).glob("mds/*/*/*")}
    result = _run(instance, lab_resource)
    assert not result.success
    text = _failure_text(result)
    assert "`phash_clusters` (materialise phash_clusters" in text
    assert before and {d: current_generation(d) for d in before} == before  # nothing changed


def test_stale_shard_samples_fail_clearly(instance, lab_resource, built):
    b = built
    rows = b.store.read_batch(SHARD_SAMPLES.name, KEY)
    digests = pa.array(["0" * 64] * rows.num_rows)
    rows = rows.set_column(rows.schema.get_field_index("dir_digest"), "dir_digest", digests)
    b.store.replace_partition(SHARD_SAMPLES, KEY, rows)
    files = _skiplist_files(b)
    result = _run(instance, lab_resource)
    assert not result.success
    assert "rerun mds_shards" in _failure_text(result)
    assert _skiplist_files(b) == files  # the first generation stays, untouched


def test_a_batch_without_shards_writes_an_empty_audit(instance, lab_resource, built):
    b = built
    b.store.replace_partition(SHARD_SAMPLES, KEY, SHARD_SAMPLES.schema.empty_table())
    for d in b.dirs():  # mds_shards removed the directories of an empty batch
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    result = _run(instance, lab_resource)
    assert result.success
    md = result.asset_materializations_for_node("skip_lists")[0].metadata
    assert md["samples"].value == 0 and md["sidecars"].value == 0
    assert _audit(b.store) == {}


def test_a_sample_written_without_caption_stays_skipped(instance, lab_resource, built):
    """shard_samples says the writer stored an empty caption (caption_fingerprint null): the
    sample is excluded as no_caption even though the captions table has one by now."""
    b = built
    assert _run(instance, lab_resource).success
    kept = next(k for k in b.keys if k not in _sidecar_skips(b))
    rows = b.store.read_batch(SHARD_SAMPLES.name, KEY).to_pylist()
    for r in rows:
        if r["key"] == kept:
            r["caption_fingerprint"] = None
    b.store.replace_partition(
        SHARD_SAMPLES, KEY, pa.Table.from_pylist(rows, schema=SHARD_SAMPLES.schema)
    )
    assert _run(instance, lab_resource).success
    assert _sidecar_skips(b)[kept] == ("no_caption",)
    assert _audit(b.store)[kept]["reasons"] == ["no_caption"]
    assert kept not in loader_keys(b.root)


RANGE_TAGS = ("dagster/asset_partition_range_start", "dagster/asset_partition_range_end")
EMPTY = "public-skimage.zz-empty"
STALE = "public-skimage.stale"


def _run_range(instance, lab_resource, first: str, last: str):
    policy = SkipPolicyResource()
    return materialize(
        build_skiplist_assets(policy),
        instance=instance,
        resources={"lab": lab_resource, "skip_policy": policy},
        tags=dict(zip(RANGE_TAGS, (first, last), strict=True)),
        raise_on_error=False,
    )


def _materialised(instance) -> dict[str, list]:
    """Partition -> its skip_lists materialisations' metadata, oldest first."""
    records = instance.fetch_materializations(AssetKey("skip_lists"), limit=100).records
    out: dict[str, list] = {}
    for r in reversed(records):
        out.setdefault(r.partition_key, []).append(r.asset_materialization.metadata)
    return out


def test_a_run_over_a_range_materialises_each_partition_on_its_own(instance, lab_resource, built):
    """The batched reruns of an opt-out: one run, each partition decided as its own run
    would and materialised with its own metadata and code version."""
    b = built
    instance.add_dynamic_partitions(BATCHES.name, [EMPTY])  # after KEY: the range KEY..EMPTY
    result = _run_range(instance, lab_resource, KEY, EMPTY)
    assert result.success
    events = {m.partition: m for m in result.asset_materializations_for_node("skip_lists")}
    assert set(events) == {KEY, EMPTY}
    assert events[KEY].metadata["samples"].value == len(b.keys)
    assert events[EMPTY].metadata["samples"].value == 0
    assert events[KEY].tags["dagster/code_version"].startswith("skip_lists-v2-")
    ranged = _sidecar_skips(b)
    digest = events[KEY].metadata["skiplist_digest"].value
    # The same partition alone: the same decisions, the same generation digest.
    single = _run(instance, lab_resource)
    assert single.success and _sidecar_skips(b) == ranged
    md = single.asset_materializations_for_node("skip_lists")[0].metadata
    assert md["skiplist_digest"].value == digest
    check = result.get_asset_check_evaluations()[0]
    assert check.passed and check.metadata["partitions_checked"].value == 2


def test_a_partition_failing_in_a_range_fails_alone(instance, lab_resource, built):
    """One partition's failure does not stop the others, which are recorded as
    materialised; the run fails and names it; its own skip-lists stay untouched."""
    b = built
    rows = b.store.read_batch(SHARD_SAMPLES.name, KEY)
    stale = rows.set_column(
        rows.schema.get_field_index("batch"), "batch", pa.array([STALE] * rows.num_rows)
    )
    stale = stale.set_column(
        stale.schema.get_field_index("dir_digest"),
        "dir_digest",
        pa.array(["0" * 64] * rows.num_rows),
    )
    b.store.replace_partition(SHARD_SAMPLES, STALE, stale)
    instance.add_dynamic_partitions(BATCHES.name, [STALE, EMPTY])  # order: KEY, STALE, EMPTY
    files = _skiplist_files(b)
    result = _run_range(instance, lab_resource, KEY, EMPTY)
    assert not result.success
    text = _failure_text(result)
    assert "failed for 1 of 3 partition(s)" in text and STALE in text
    assert f"expected mds/512/512x512/{STALE}" in text  # its own error, named
    done = _materialised(instance)
    assert set(done) == {KEY, EMPTY}  # each its own event; none for the failed one
    assert done[KEY][-1]["samples"].value == len(b.keys)
    assert _skiplist_files(b) != files  # KEY's new generation was published
    assert _audit(b.store) and STALE not in {
        r["batch"] for r in b.store.read(SKIP_AUDIT.name).to_pylist()
    }
