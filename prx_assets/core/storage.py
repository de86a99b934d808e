"""Object storage behind one small interface: a local directory or an S3-compatible bucket.

Why an interface: the shard tree, its skip-list generations and the landing zone may live
on any S3-compatible endpoint (AWS, MinIO, Ceph, R2, moto in the tests) while the writers
and readers keep one protocol. The protocol only needs what object stores guarantee:

- ``put(key, data)`` is atomic per object: a reader sees the previous bytes or the new
  bytes, never a part (S3's PUT; a local tmp + fsync + rename). There is no rename on S3,
  so multi-object units are published by writing every part first and one small object
  (an ``index.json``, a pointer, a manifest) last;
- ``list(prefix)`` and ``children(prefix)`` (one level, like a directory listing);
- ``delete(keys)``; ``get(key, max_bytes)`` is a bounded read (a larger object is refused,
  never read whole into memory); ``download(key, path)`` streams to a local file.

Keys are ``/``-separated and relative to the store's root URI. Where the endpoint, region
and credentials come from: the environment only (``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, or any other source boto3's default chain
reads). They are read when a client is built and never stored on an object that could be
logged or written into metadata: ``S3Settings`` holds the endpoint and region (not secret)
and its ``repr`` says so; :func:`lance_storage_options` is the one place secrets are copied,
into the dict Lance needs, and nothing prints that dict.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

DEFAULT_MAX_READ_BYTES = 64 << 20  # bounded reads: manifests, indexes, pointers, sidecars
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
REGION_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")
SECRET_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class StorageError(OSError):
    """An object-store operation that cannot be completed (or trusted)."""


class ObjectTooLarge(StorageError):
    """A bounded read found more bytes than the caller allows (refused, not truncated)."""


class BucketMissing(StorageError):
    """The bucket an ``s3://`` URI names does not exist on the endpoint: the platform never
    creates one by itself (a typo would otherwise start a new, empty data set)."""


_BUCKET_MISSING_CODES = ("NoSuchBucket",)


def bucket_missing_error(bucket: str, uri: str, endpoint: str | None) -> BucketMissing:
    where = f"on {endpoint}" if endpoint else "on AWS"
    flag = f" --endpoint-url {endpoint}" if endpoint else ""
    return BucketMissing(
        f"the bucket {bucket!r} of {uri[:200]!r} does not exist {where}: create it first "
        f"(`prx-assets make-buckets {uri[:200]}`, or `aws s3 mb s3://{bucket}{flag}`)"
    )


def is_remote(uri: str | os.PathLike[str]) -> bool:
    """True for object-store URIs (``s3://...``); local paths and ``file://`` are local."""
    scheme = urlparse(os.fspath(uri)).scheme
    return scheme not in ("", "file") and len(scheme) > 1  # "C:\\" is not a scheme


def join(uri: str, *parts: str) -> str:
    """``uri/part/...`` for URIs and local paths alike (no normalisation of ``..``)."""
    out = os.fspath(uri).rstrip("/")
    for p in parts:
        p = p.strip("/")
        if p:
            out = f"{out}/{p}"
    return out


@dataclass(frozen=True)
class S3Settings:
    """Where the S3-compatible endpoint is: read from the environment, no secret inside."""

    endpoint_url: str | None
    region: str | None

    @classmethod
    def from_env(cls) -> S3Settings:
        endpoint = next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)
        region = next((os.environ[v] for v in REGION_VARS if os.environ.get(v)), None)
        return cls(endpoint_url=endpoint, region=region)

    @property
    def allow_http(self) -> bool:
        return bool(self.endpoint_url and self.endpoint_url.startswith("http://"))


def lance_storage_options(uri: str) -> dict[str, str] | None:
    """Lance's ``storage_options`` for ``uri`` from the environment (None for local paths).

    Endpoint, ``allow_http`` (plain-HTTP endpoints such as MinIO or moto), region, and
    the credentials when the environment holds them (Lance's own environment lookup does
    not read ``AWS_ENDPOINT_URL``). The returned dict contains secrets: pass it to Lance,
    never log it or put it into metadata.
    """
    if not uri.startswith("s3://"):
        return None
    s = S3Settings.from_env()
    opts: dict[str, str] = {}
    if s.endpoint_url:
        opts["aws_endpoint"] = s.endpoint_url
    if s.allow_http:
        opts["allow_http"] = "true"
    if s.region:
        opts["aws_region"] = s.region
    for var in SECRET_VARS:
        if os.environ.get(var):
            opts[var.lower()] = os.environ[var]
    return opts


class ObjectStore(Protocol):
    """The operations the writers and readers need; keys are relative to ``uri``."""

    uri: str

    def put(self, key: str, data: bytes) -> None: ...
    def put_file(self, key: str, path: str | os.PathLike[str]) -> None: ...
    def get(self, key: str, max_bytes: int = DEFAULT_MAX_READ_BYTES) -> bytes | None: ...
    def download(self, key: str, path: str | os.PathLike[str]) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def list_sizes(self, prefix: str = "") -> dict[str, int]: ...
    def children(self, prefix: str = "") -> tuple[list[str], list[str]]: ...
    def delete(self, keys: Iterable[str]) -> int: ...
    def size(self, key: str) -> int | None: ...
    def copy(self, src: str, dst: str) -> None: ...


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"object key {key[:200]!r} is not a plain relative key")
    return key


class LocalStore:
    """A directory as an object store: atomic ``put`` by tmp + fsync + rename."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.put.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.put.tmp")
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def get(self, key: str, max_bytes: int = DEFAULT_MAX_READ_BYTES) -> bytes | None:
        try:
            with open(self._path(key), "rb") as fh:
                data = fh.read(max_bytes + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if len(data) > max_bytes:
            raise ObjectTooLarge(f"{self.uri}/{key}: more than {max_bytes} bytes")
        return data

    def download(self, key: str, path: str | os.PathLike[str]) -> bool:
        src = self._path(key)
        if not src.is_file():
            return False
        shutil.copyfile(src, path)
        return True

    def list(self, prefix: str = "") -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root)).replace(os.sep, "/")
            for p in base.rglob("*")
            if p.is_file()
        )

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Every file under ``prefix`` and its size (what a listing tells on S3)."""
        return {k: self._path(k).stat().st_size for k in self.list(prefix)}

    def children(self, prefix: str = "") -> tuple[list[str], list[str]]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return [], []
        entries = sorted(base.iterdir())
        return [p.name for p in entries if p.is_dir()], [p.name for p in entries if p.is_file()]

    def delete(self, keys: Iterable[str]) -> int:
        n = 0
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
                n += 1
        return n

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def copy(self, src: str, dst: str) -> None:
        """Copy object ``src`` to ``dst`` (atomic at ``dst``, as ``put_file``)."""
        self.put_file(dst, self._path(src))


_CLIENTS: dict[tuple[S3Settings, int], Any] = {}


def _s3_client(settings: S3Settings, pid: int) -> Any:
    """One boto3 client per endpoint and process (clients are thread-safe, slow to build;
    keyed by pid so a forked child never reuses its parent's connections). Credentials are
    resolved by boto3's default chain inside the client, never copied here."""
    key = (settings, pid)
    if key not in _CLIENTS:
        import boto3
        import botocore.session
        from botocore.config import Config

        core = botocore.session.get_session()
        # Timestamps stay the strings S3 sent: nothing here reads them, and parsing each
        # listed object's ``LastModified`` was most of a listing's CPU (bench_scaleout's
        # py-spy profile of a step staging a 400-object batch). The AWS CLI does the same.
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
        _CLIENTS[key] = boto3.session.Session(botocore_session=core).client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}),
        )
    return _CLIENTS[key]


class S3Store:
    """An ``s3://bucket/prefix`` on any S3-compatible endpoint (settings from the environment).

    ``put`` is one PUT (atomic per object on S3); listings page through
    ``list_objects_v2``; deletes go in batches of 1000. Errors other than "no such key"
    propagate (a reader must not mistake an unreachable endpoint for an absent object).
    """

    def __init__(self, uri: str) -> None:
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise StorageError(f"{uri[:200]!r} is not an s3://bucket[/prefix] URI")
        self.uri = uri.rstrip("/")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.settings = S3Settings.from_env()
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = _s3_client(self.settings, os.getpid())
        return self._client

    def __repr__(self) -> str:  # no credentials are held; say where, not how
        return f"S3Store({self.uri!r}, endpoint={self.settings.endpoint_url!r})"

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    @staticmethod
    def _code(exc: Exception) -> str:
        return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))

    def _missing(self, exc: Exception) -> bool:
        """A missing key (None/False for the caller); a missing bucket raises
        ``BucketMissing`` instead: it is a deployment step not done, not an absent object."""
        code = self._code(exc)
        if code in _BUCKET_MISSING_CODES:
            raise bucket_missing_error(self.bucket, self.uri, self.settings.endpoint_url) from None
        return code in ("404", "NoSuchKey", "NotFound")

    @contextlib.contextmanager
    def _bucket_errors(self) -> Iterator[None]:
        """``NoSuchBucket`` from any call becomes ``BucketMissing``, naming the bucket and
        how to create it; every other error propagates as it is."""
        from botocore.exceptions import ClientError

        try:
            yield
        except ClientError as exc:
            if self._code(exc) in _BUCKET_MISSING_CODES:
                raise bucket_missing_error(
                    self.bucket, self.uri, self.settings.endpoint_url
                ) from None
            raise

    def put(self, key: str, data: bytes) -> None:
        with self._bucket_errors():
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data))

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        # One PUT per file (shards are bounded by MDS's size_limit): atomic per object.
        with open(path, "rb") as fh, self._bucket_errors():
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=fh)

    def get(self, key: str, max_bytes: int = DEFAULT_MAX_READ_BYTES) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if self._missing(exc):
                return None
            raise
        body = obj["Body"]
        try:
            if int(obj.get("ContentLength") or 0) > max_bytes:
                raise ObjectTooLarge(f"{self.uri}/{key}: more than {max_bytes} bytes")
            data = body.read(max_bytes + 1)
        finally:
            body.close()
        if len(data) > max_bytes:
            raise ObjectTooLarge(f"{self.uri}/{key}: more than {max_bytes} bytes")
        return data

    def download(self, key: str, path: str | os.PathLike[str]) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.download_file(self.bucket, self._key(key), os.fspath(path))
        except ClientError as exc:
            if self._missing(exc):
                return False
            raise
        return True

    def _pages(self, prefix: str, delimiter: str | None) -> Iterator[dict]:
        full = (
            self._key(prefix.rstrip("/")) + "/"
            if prefix
            else (f"{self.prefix}/" * bool(self.prefix))
        )
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        with self._bucket_errors():
            yield from self.client.get_paginator("list_objects_v2").paginate(**kwargs)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(
            self._rel(o["Key"])
            for page in self._pages(prefix, None)
            for o in page.get("Contents", [])
        )

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` and its size, from the listing itself: no request
        per object (a ``HEAD`` each cost a landing batch ~2 round trips per image)."""
        return dict(
            sorted(
                (self._rel(o["Key"]), int(o["Size"]))
                for page in self._pages(prefix, None)
                for o in page.get("Contents", [])
            )
        )

    def children(self, prefix: str = "") -> tuple[list[str], list[str]]:
        dirs: list[str] = []
        files: list[str] = []
        for page in self._pages(prefix, "/"):
            dirs += [
                p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for p in page.get("CommonPrefixes", [])
            ]
            files += [o["Key"].rsplit("/", 1)[-1] for o in page.get("Contents", [])]
        return sorted(dirs), sorted(files)

    def delete(self, keys: Iterable[str]) -> int:
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), 1000):
            chunk = full[i : i + 1000]
            with self._bucket_errors():
                self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
                )
        return len(full)

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return int(
                self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
            )
        except ClientError as exc:
            if self._missing(exc):
                return None
            raise

    def copy(self, src: str, dst: str) -> None:
        """Copy object ``src`` to ``dst`` inside the bucket, server side (``CopyObject``: the
        bytes never pass through this process; one request, atomic at ``dst``; objects up
        to 5 GB, which bounds shards far above their ``size_limit``)."""
        with self._bucket_errors():
            self.client.copy_object(
                Bucket=self.bucket,
                Key=self._key(dst),
                CopySource={"Bucket": self.bucket, "Key": self._key(src)},
            )


def open_store(uri: str | os.PathLike[str]) -> LocalStore | S3Store:
    """The store for ``uri``: ``s3://`` on the environment's endpoint, else a local directory."""
    text = os.fspath(uri)
    if text.startswith("s3://"):
        return S3Store(text)
    if is_remote(text):
        raise StorageError(f"{text[:200]!r}: only local paths and s3:// URIs are supported")
    return LocalStore(text[len("file://") :] if text.startswith("file://") else text)


_BUCKETS_SEEN: set[tuple[S3Settings, str]] = set()


def check_bucket(uri: str | os.PathLike[str]) -> None:
    """Refuse an ``s3://`` URI whose bucket does not exist (``BucketMissing``, saying how to
    create it); local paths pass. One HEAD per endpoint and bucket per process: resources
    call it when they are set up, so a fresh deployment that skipped the bucket stops there
    with that sentence, not deep in a step with Lance's or boto3's raw ``NoSuchBucket``."""
    text = os.fspath(uri)
    if not text.startswith("s3://"):
        return
    store = S3Store(text)
    seen = (store.settings, store.bucket)
    if seen in _BUCKETS_SEEN:
        return
    from botocore.exceptions import ClientError

    try:
        store.client.head_bucket(Bucket=store.bucket)
    except ClientError as exc:
        if S3Store._code(exc) in ("404", "NoSuchBucket", "NotFound"):
            raise bucket_missing_error(store.bucket, text, store.settings.endpoint_url) from None
        raise
    _BUCKETS_SEEN.add(seen)


def make_bucket(uri: str | os.PathLike[str]) -> bool:
    """Create the bucket of an ``s3://`` URI on the environment's endpoint if it does not
    exist (True when created); the one place the platform creates a bucket, run by hand
    (``prx-assets make-buckets``) as a deployment step."""
    text = os.fspath(uri)
    store = S3Store(text)
    try:
        check_bucket(text)
        return False
    except BucketMissing:
        pass
    kwargs: dict[str, Any] = {"Bucket": store.bucket}
    region = store.settings.region
    if region and region != "us-east-1":  # us-east-1 takes no location constraint
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
    store.client.create_bucket(**kwargs)
    check_bucket(text)
    return True
