"""An opt-out naming a byte-identical copy ingest refused reaches the copy it kept.

A crawl serves one file under two URLs: a manifest batch lists both rows (different ``url``
and ``id``), ingest keeps the first and refuses the second as ``duplicate_bytes_in_batch``.
The same bytes train under the kept copy's name, so a list naming the refused copy's URL or
``source:id`` must exclude the kept one: a list recorded before the batch arrives (matched
from the partition's side by ``skip_lists``) and one arriving after (matched at intake, the
sensor then reruns the batch's ``skip_lists``). The audit of the refused copy's URL resolves
to the kept copy and its verdict; compliance sees the direct match. Real Dagster runs,
sensor ticks, skip-list sidecars and the training loader.
"""

from __future__ import annotations

import csv
import hashlib

import pytest
from dagster import instance_for_test
from PIL import Image

from prx_assets.core.audit import EXCLUDED, audit_image
from prx_assets.core.snapshots.compliance import compliance_report
from prx_assets.core.tables import OPT_OUTS, REJECTS
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.run_requests import QUIET
from prx_assets.demo.jpegs import PHOTO_DIR, jpeg_bytes
from prx_assets_tests.test_small_copy_opt_out import Platform

BATCH = "crawl.000"
KEPT_URL = "https://cdn-a.example/coffee.jpg"
COPY_URL = "https://mirror-b.example/img/7/coffee.jpg"  # the same file, served again


def _land_manifest(platform: Platform, coffee: bytes, bystander: bytes) -> None:
    """``landing/crawl/000.csv`` naming three files: the coffee photo twice (two URLs, two
    source ids, two paths, identical bytes) and a bystander."""
    source = platform.root / "landing" / "crawl"
    (source / "files").mkdir(parents=True)
    rows = [  # the mirror's response said X-Robots-Tag: noai; the first CDN's said nothing
        ("files/a.jpg", coffee, KEPT_URL, "id-a", ""),
        ("files/b.jpg", coffee, COPY_URL, "id-b", "noai"),
        ("files/c.jpg", bystander, "https://cdn-a.example/cat.jpg", "id-c", ""),
    ]
    with open(source / "000.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "url", "id", "alt_text", "x_robots_tag"])
        for path, data, url, sid, robots in rows:
            (source / path).write_bytes(data)
            w.writerow([path, url, sid, f"a photograph ({path})", robots])
    platform.instance.add_dynamic_partitions(BATCHES.name, [BATCH])
    job = platform.defs.resolve_job_def("batch_pipeline")
    result = job.execute_in_process(
        partition_key=BATCH, instance=platform.instance, run_config=QUIET, raise_on_error=False
    )
    assert result.success


@pytest.fixture
def platform(tmp_path, monkeypatch):
    monkeypatch.setenv("PRX_DATA_ROOT", str(tmp_path / "data"))
    with instance_for_test() as instance:
        yield Platform(tmp_path / "data", instance)


def _photo(name: str, size: tuple[int, int]) -> bytes:
    img = Image.open(PHOTO_DIR / name).convert("RGB").resize(size, Image.Resampling.LANCZOS)
    return jpeg_bytes(img, quality=90)


def test_lists_naming_a_refused_identical_copy_exclude_the_copy_kept(platform):
    p = platform
    coffee = _photo("coffee.png", (1200, 800))
    bystander = _photo("chelsea.png", (902, 600))
    kept = hashlib.sha256(coffee).hexdigest()

    # Before the batch exists: a list naming the copy that will be refused, by source:id.
    p.opt_out("early-by-source-id.txt", ["crawl:id-b"])
    assert all(r.startswith("opt_out_lists:") for r in p.settle("opt_out_sensor"))

    _land_manifest(p, coffee, bystander)
    (reject,) = p.lab.read(REJECTS.name, filter=f"batch = '{BATCH}'").to_pylist()
    assert (reject["reason"], reject["path"], reject["key"]) == (
        "duplicate_bytes_in_batch",
        "files/b.jpg",
        kept,
    )
    assert (reject["url"], reject["source_id"]) == (COPY_URL, "id-b")  # its names, kept
    assert p.key_of(BATCH, "a.jpg") == kept
    other = p.key_of(BATCH, "c.jpg")
    # Matched from the partition's side: the kept copy never reaches the loader. The refused
    # copy's own header reserves it too: the same bytes, whichever name was kept.
    row = p.audit(BATCH)[kept]
    assert row["excluded"] and {"opt_out", "reserved"} <= set(row["reasons"]), row
    assert any("noai" in s for s in row["reserved_signals"]), row
    assert p.trained_keys() == [other]

    # After: a list naming only the refused copy's URL matches the kept copy at intake.
    p.opt_out("late-by-url.txt", [COPY_URL])
    runs = p.settle("opt_out_sensor")
    assert f"skip_lists:{BATCH}" in runs
    matched = p.lab.read(OPT_OUTS.name, filter=f"identifier = '{COPY_URL}'").to_pylist()
    assert [(r["matched_batch"], r["matched_key"]) for r in matched] == [(BATCH, kept)]
    row = p.audit(BATCH)[kept]
    assert row["excluded"] and len(row["opt_out_list_ids"]) == 2, row
    assert p.audit(BATCH)[other]["excluded"] is False
    assert p.trained_keys() == [other]

    # compliance reaches the kept copy through the alias match.
    shards = str(p.root / "shards")
    report = compliance_report(p.lab, shards, "late-by-url.txt")
    assert [(i.batch, i.key, i.via) for i in report.images] == [(BATCH, kept, "direct")]
    assert report.verdict == "PASS", report.to_markdown()  # applied and holding

    # The audit of the refused copy's URL (and source:id) is the kept copy's verdict.
    for query in (COPY_URL, "crawl:id-b"):
        trail = audit_image(p.lab, query, shards_root=shards)
        assert trail.keys == [kept], query
        assert any("alias of a rejected byte-identical copy" in m for m in trail.matched_by)
        assert trail.status == EXCLUDED, trail.verdict
    trail = audit_image(p.lab, "crawl/files/b.jpg", p.root / "landing", shards_root=shards)
    assert trail.keys == [kept] and trail.status == EXCLUDED, trail.verdict
