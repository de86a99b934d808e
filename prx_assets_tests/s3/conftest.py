"""A real S3-compatible server on 127.0.0.1 for the object-storage tests (moto, standalone).

Started once per session in a thread of the test process (real HTTP, a free port), with a
bucket. The environment the platform reads (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
credentials, ``S3_ENDPOINT_URL`` for streaming's downloader) is set for the session and
restored after. The credentials are distinctive strings, so a test can prove none of them
reaches metadata, logs or objects. Each test gets its own prefix (``s3_prefix``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from prx_assets_tests.forkservers import _stop_forkserver

BUCKET = "prx-test"
ACCESS_KEY = "AKIAPRXTESTKEY0SECRET"
SECRET_KEY = "prx-secret-9b7f3c2e-never-logged"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        """What a deployment sets (and what child processes get)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "S3_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }

    def client(self):  # noqa: ANN201 - a boto3 S3 client
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint)

    def objects(self, prefix: str) -> dict[str, bytes]:
        """Every object under ``s3://bucket/prefix/`` by key relative to it."""
        c = self.client()
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix.rstrip("/") + "/"
        ):
            for o in page.get("Contents", []):
                body = c.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
                out[o["Key"][len(prefix.rstrip("/")) + 1 :]] = body
        return out

    def copy_prefix(self, src: str, dest: str) -> None:
        c = self.client()
        self.delete_prefix(dest)
        for page in c.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=src.rstrip("/") + "/"
        ):
            for o in page.get("Contents", []):
                rel = o["Key"][len(src.rstrip("/")) + 1 :]
                c.copy_object(
                    Bucket=self.bucket,
                    Key=f"{dest.rstrip('/')}/{rel}",
                    CopySource={"Bucket": self.bucket, "Key": o["Key"]},
                )

    def delete_prefix(self, prefix: str) -> None:
        c = self.client()
        for page in c.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix.rstrip("/") + "/"
        ):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                c.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    info = S3Server(endpoint=f"http://{host}:{port}", bucket=BUCKET)
    saved = {k: os.environ.get(k) for k in info.env}
    os.environ.update(info.env)
    # A process pool's workers fork from one forkserver per process, which keeps the
    # environment of its first start: restart it so workers that read the lab themselves
    # (shard pieces, ingest on S3) see this server's endpoint and keys.
    _stop_forkserver()
    try:
        info.client().create_bucket(Bucket=BUCKET)
        yield info
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _stop_forkserver()
        server.stop()


@pytest.fixture
def s3_prefix(s3_server: S3Server) -> str:
    """A fresh ``s3://bucket/<unique>`` for one test."""
    return f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
