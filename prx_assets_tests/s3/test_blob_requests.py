"""Blobs on object storage cost one request each way: a store is a HEAD and one PutObject
(never a multipart upload), a read is one GET; a missing blob, an altered one and a store
that cannot be reached are told apart."""

from __future__ import annotations

import hashlib

import pytest

from prx_assets.core.lab.blobs import BlobError, BlobStore, BlobUnavailable
from prx_assets_tests.s3.s3_calls import requests_of


def test_a_blob_is_stored_with_one_put_and_read_with_one_get(s3_prefix, s3_server):
    store = BlobStore(f"{s3_prefix}/lab")
    data = b"\xff\xd8" + bytes(range(256)) * 300  # ~77 KB: pyarrow made this multipart
    ref = hashlib.sha256(data).hexdigest()
    objects = store._objects()
    with requests_of(objects) as calls:
        assert store.put("images", data) == (ref, len(data))
    assert [op for op, _ in calls] == ["HeadObject", "PutObject"]
    with requests_of(objects) as calls:
        assert store.put("images", data) == (ref, 0)  # there whole already: nothing written
        assert store.get("images", ref) == data
    assert [op for op, _ in calls] == ["HeadObject", "GetObject"]
    bucket, key = s3_server.bucket, f"{s3_prefix.split('/', 3)[3]}/lab/_blobs/images"
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]
    assert [o["Size"] for o in listed] == [len(data)]
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_missing_altered_and_unreachable_blobs_are_told_apart(s3_prefix, s3_server, monkeypatch):
    store = BlobStore(f"{s3_prefix}/lab")
    data = b"a picture"
    ref, _ = store.put("images", data)
    absent = hashlib.sha256(b"never stored").hexdigest()
    with pytest.raises(BlobError, match="missing") as missing:
        store.get("images", absent)
    assert not isinstance(missing.value, BlobUnavailable)  # absent, not storage trouble

    bucket, base = s3_server.bucket, s3_prefix.split("/", 3)[3]
    key = f"{base}/lab/_blobs/images/{ref[:2]}/{ref[2:4]}/{ref}"
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=b"another picture")
    with pytest.raises(BlobError, match="does not match its address"):
        store.get("images", ref)
    # A torn or replaced value of another size is written again whole.
    assert store.put("images", data) == (ref, len(data))
    assert store.get("images", ref) == data

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    down = BlobStore(f"{s3_prefix}/lab")
    with pytest.raises(BlobUnavailable, match="could not be read"):
        down.get("images", ref)
    with pytest.raises(OSError, match="not stored"):
        down.put("images", b"a new picture")
