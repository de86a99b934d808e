"""The demo with every URI on ``s3://`` (moto on 127.0.0.1), and no secret anywhere it writes.

The landing zone, the Lance lab and the shard tree all live in the bucket
(``PRX_LANDING_URI`` / ``PRX_LAB_URI`` / ``PRX_SHARDS_URI``); only the Dagster instance and
the opt-out folder are local. The demo's own checks run (the landing sensor lists the
remote prefix, every stage, dedup settling, the training loop over the remote tree through
``StreamingDataset`` that verifies no skipped sample appears), then: maintenance works on
the remote lab (compaction, index refresh, cleanup), and the access key and secret appear
in nothing the run produced: its console output and logs, the Dagster event log and
metadata, and every object in the bucket.
"""

from __future__ import annotations

from dagster import DagsterInstance

from prx_assets.core.lab import Lab
from prx_assets.core.shards.remote import live_partitions
from prx_assets.core.tables import LAB_TABLES
from prx_assets.demo.runner import run_demo
from prx_assets_tests.s3.conftest import ACCESS_KEY, SECRET_KEY


def test_the_demo_runs_with_every_uri_on_s3_and_leaks_no_secret(
    s3_server, s3_prefix, tmp_path, monkeypatch, capfd, caplog
):
    monkeypatch.setenv("PRX_LANDING_URI", f"{s3_prefix}/landing")
    monkeypatch.setenv("PRX_LAB_URI", f"{s3_prefix}/lab")
    monkeypatch.setenv("PRX_SHARDS_URI", f"{s3_prefix}/shards")
    data_root = tmp_path / "data"
    data_root.mkdir()
    with DagsterInstance.ephemeral() as instance:
        assert run_demo(data_root, instance, size="small") == 0
        out = capfd.readouterr()
        assert "no skipped sample appeared" in out.out
        events = [repr(e) for run in instance.get_runs() for e in instance.all_logs(run.run_id)]
    assert events and any(f"{s3_prefix}/lab" in e for e in events)  # metadata names the URI

    # Everything the pipeline wrote is in the bucket.
    lab = Lab(f"{s3_prefix}/lab")
    assert lab.count("images") > 0 and lab.count("skip_audit") > 0
    assert live_partitions(f"{s3_prefix}/shards")
    assert not (data_root / "lab").exists() and not (data_root / "shards").exists()

    # Maintenance on the remote lab: compaction, index refresh, version cleanup, orphans.
    from datetime import timedelta

    for spec in LAB_TABLES:
        if lab.exists(spec.name):
            report = lab.maintain(spec, retention=timedelta(0), orphan_min_age=timedelta(0))
            assert report["rows"] == lab.count(spec.name)
            assert report["fragments_after"] <= max(1, report["fragments_before"])

    prefix = s3_prefix.split("/", 3)[3]
    objects = s3_server.objects(prefix)
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert secret not in out.out and secret not in out.err
        assert secret not in caplog.text
        assert not [e for e in events if secret in e]
        assert not [k for k, body in objects.items() if secret.encode() in body]
