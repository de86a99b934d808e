"""A deployment whose bucket was never created stops at set-up with a sentence naming the
bucket and how to create it (never a raw ``NoSuchBucket`` deep in a step, never read as
"no object yet"); ``prx-assets make-buckets`` is that step."""

from __future__ import annotations

import uuid

import pytest

from prx_assets.core.storage import BucketMissing, open_store


def test_a_missing_bucket_is_refused_clearly_until_made(s3_server, capsys) -> None:
    from dagster import build_resources

    from prx_assets import cli
    from prx_assets.core.lab import Lab
    from prx_assets.defs.resources import LabResource

    bucket = f"prx-fresh-{uuid.uuid4().hex[:10]}"
    uri = f"s3://{bucket}/prx"
    says = rf"bucket '{bucket}' .* does not exist on {s3_server.endpoint}: create it first"
    with pytest.raises(BucketMissing, match=says):
        Lab(f"{uri}/lab")
    store = open_store(f"{uri}/shards")
    with pytest.raises(BucketMissing, match="prx-assets make-buckets"):
        store.put("a/b.json", b"{}")
    with pytest.raises(BucketMissing, match=f"aws s3 mb s3://{bucket} --endpoint-url"):
        store.get("a/b.json")  # not None: a missing bucket is not a missing object
    with pytest.raises(BucketMissing):
        store.list("a")
    resource = LabResource(
        data_root="unused", landing_dir=f"{uri}/landing", lab_uri=f"{uri}/lab", shards_uri=uri
    )
    with pytest.raises(Exception) as refused, build_resources({"lab": resource}):
        pass
    # Dagster reports a resource's set-up error as its cause.
    assert isinstance(refused.value.__cause__, BucketMissing), refused.value
    assert bucket in str(refused.value.__cause__)

    assert cli.main(["make-buckets", f"{uri}/lab", f"{uri}/shards"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{bucket}: created", f"{bucket}: exists"]
    Lab(f"{uri}/lab")
    store.put("a/b.json", b"{}")
    assert store.get("a/b.json") == b"{}"
    with build_resources({"lab": resource}) as built:
        assert built.lab.lab_root == f"{uri}/lab"
