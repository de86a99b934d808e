"""Skip-lists: the only way a sample leaves training once its shard is written.

MDS shards are immutable (rewriting one would invalidate every cache, every checkpoint's
notion of "sample N" and every digest), so opt-outs, duplicates, classifier verdicts and
quality rejections are recorded *beside* the shards of a bucket x batch directory, as one
*generation* of skip-lists: a sidecar per shard plus a manifest naming them::

    <dir>/index.json, <dir>/shard.00003.mds            # written once, never touched again
    <dir>/shard.00003.mds.<sha16>.skip.json            # one sidecar per shard, per content
    <dir>/skiplists.json                               # the manifest: the live generation

A generation is published by one atomic rename of ``skiplists.json``; that is the only
commit step ("write the files, then publish one small pointer", which works the same on
object storage: upload the sidecars, then put the manifest last). Readers go through the
manifest only, so they see the complete previous generation or the complete new one, never
a mix; files the manifest does not name are ignored by readers and swept by writers: a
superseded generation's sidecars once ``PRX_SKIPLIST_RETENTION_S`` (default 7 days) has passed
since it was superseded, because the loader verifies a shard's sidecar when it first reads the
shard and a job built on that generation must still find it (``DEFAULT_RETENTION_S``).

Sidecar payload (format ``prx-skiplist`` version 1, unchanged)::

    {"format": "prx-skiplist", "version": 1, "shard": "shard.00003.mds",
     "indices": [4, 17], "reasons": [["duplicate"], ["opt_out", "quality"]],
     "sha256": "<hex of the canonical JSON of every other key>"}

Its file name is ``<shard>.<first 16 hex of sha256(file bytes)>.skip.json``: content
addressed, so a new generation never overwrites a file the live manifest names, a shard
whose skips did not change keeps its file, and a rerun with the same decisions produces
byte-identical files (and writes nothing).

Manifest payload (format ``prx-skiplist-manifest`` version 2)::

    {"format": "prx-skiplist-manifest", "version": 2,
     "index_sha256": "<sha256 of index.json's bytes>",
     "shards": [{"shard": "shard.00000.mds",
                 "sidecar": "shard.00000.mds.<sha16>.skip.json",
                 "sha256": "<sha256 of the sidecar file>",
                 "samples": 412, "skipped": 17}, ...],   # index.json order
     "sha256": "<hex of the canonical JSON of every other key>"}

Version 2 adds each shard's sample count and how many of them its sidecar skips, so a
directory's counts (what loader discovery needs to lay out its streams) come from this one
small file. They are claims, checked wherever the files they summarise are read: ``samples``
against ``index.json`` (``check_manifest_matches_index``), ``skipped`` against the sidecar
(``verify_sidecar``); a mismatch is ``SkipListCorrupt``. Version 1 manifests (no counts) are
still read; writers write version 2.

What a reader checks (``load_generation``; the loader does the same on fetched bytes):
the manifest's format, version and self-hash; that it was written for *this* ``index.json``
(its sha256) and lists exactly its shards in order; each sidecar's sha256, schema, shard
name and index range. Anything missing or not matching is an error (fail closed): a
directory without a manifest is unscreened, not "nothing skipped". The ``generation`` of a
directory is its manifest's self-hash.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import operator
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prx_assets.core.crashpoints import crashpoint
from prx_assets.core.durable import atomic_write_bytes, canonical_json, fsync_path
from prx_assets.core.snapshots.pins import PinError, directory_lock, pinned_sidecars

SKIPLIST_FORMAT = "prx-skiplist"
SKIPLIST_VERSION = 1
SIDECAR_SUFFIX = ".skip.json"
MANIFEST_BASENAME = "skiplists.json"
MANIFEST_FORMAT = "prx-skiplist-manifest"
MANIFEST_VERSION = 2  # what writers write
MANIFEST_VERSIONS_READ = (1, 2)  # 1: without per-shard counts
INDEX_BASENAME = "index.json"
REASON_CODES: tuple[str, ...] = (
    "opt_out",
    "reserved",  # a machine-readable opt-out signal captured at ingest (usage_signals)
    "duplicate",
    "class_text",
    "class_nsfw",
    "quality",
    "low_information",
    "no_caption",
    "pending",  # a decision it depends on is not known yet: skipped until it is
)
_DIGEST_FORMAT = "prx-skiplist-digest/2"  # /1 digested the skipped indices
_NAME_HASH_CHARS = 16
_SIDECAR_RE = re.compile(
    r"^(?P<shard>.+)\.(?P<hash>[0-9a-f]{16})" + re.escape(SIDECAR_SUFFIX) + "$"
)
# What ``atomic_write_bytes`` leaves when killed: ".<target>.<pid>.<8 hex>.tmp".
_TMP_RE = re.compile(r"^\.(?P<target>.+)\.\d+\.[0-9a-f]{8}\.tmp$")
_READ_ATTEMPTS = 3  # a generation switched (and swept) while being read: read it again
# How long a superseded generation's sidecars outlive it (seconds). The loader verifies a
# shard's sidecar when it first reads the shard, not when the dataset is built, so a
# training job built on generation G still reads G's sidecars after G is superseded: they
# stay this long after the flip (``publish_generation`` touches them), then a sweep deletes
# them. A job still reading G after that stops at its next new shard (fail closed).
RETENTION_ENV = "PRX_SKIPLIST_RETENTION_S"
DEFAULT_RETENTION_S = 7 * 24 * 3600.0


def superseded_retention_s() -> float:
    """The retention in force: ``PRX_SKIPLIST_RETENTION_S`` when set (0: sweep at once)."""
    raw = os.environ.get(RETENTION_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_RETENTION_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{RETENTION_ENV}={raw[:40]!r} is not a number of seconds") from None
    if not value >= 0:
        raise ValueError(f"{RETENTION_ENV}={raw[:40]!r} must be >= 0")
    return value


class SkipListError(ValueError):
    """Base class: skip-list input that cannot be trusted or written."""


class SkipListCorrupt(SkipListError):
    """A sidecar or manifest that is not what was written: bad JSON, schema, hash or name."""


class SkipListVersionError(SkipListError):
    """A sidecar or manifest written in a format version this code does not read."""


class SkipListMissing(SkipListError):
    """No skip-list manifest: the directory was never screened (fail closed)."""


class SkipListStale(SkipListError):
    """A manifest written for another ``index.json``: it does not describe these shards."""


@dataclass(frozen=True)
class SkipList:
    """The skip set of one shard; ``path`` names where it was read from."""

    shard: str
    indices: tuple[int, ...]
    reasons: tuple[tuple[str, ...], ...]
    path: str | None = None

    @classmethod
    def empty(cls, shard: str) -> SkipList:
        return cls(shard=shard, indices=(), reasons=())

    def __len__(self) -> int:
        return len(self.indices)

    def as_mapping(self) -> dict[int, tuple[str, ...]]:
        return dict(zip(self.indices, self.reasons, strict=True))

    def check_range(self, num_samples: int) -> None:
        """Raise ``SkipListError`` unless every index is a sample of a ``num_samples``-sample
        shard. One comparison: parsed indices are strictly increasing and non-negative."""
        if self.indices and self.indices[-1] >= num_samples:
            raise SkipListError(
                f"skip-list for {self.shard} names index {self.indices[-1]} but the shard "
                f"has only {num_samples} samples (sidecar written for another shard?)"
            )

    def keep_indices(self, num_samples: int) -> np.ndarray:
        """Indices of the shard that survive, in shard order (int64)."""
        self.check_range(num_samples)
        mask = np.ones(num_samples, dtype=bool)
        if self.indices:
            mask[np.asarray(self.indices, dtype=np.int64)] = False
        return np.flatnonzero(mask).astype(np.int64)


@dataclass(frozen=True)
class ManifestEntry:
    """One shard of a skip-list generation: the shard, its sidecar and the sidecar's digest.

    ``samples``/``skipped``: the shard's sample count and its sidecar's skip count (manifest
    version 2; None when read from a version 1 manifest).
    """

    shard: str
    sidecar: str
    sha256: str
    samples: int | None = None
    skipped: int | None = None


@dataclass(frozen=True)
class Manifest:
    """A parsed, self-consistent manifest (not yet checked against an index)."""

    index_sha256: str
    entries: tuple[ManifestEntry, ...]
    sha256: str  # the self-hash: this generation's identity

    @property
    def generation(self) -> str:
        return self.sha256

    @property
    def sidecars(self) -> frozenset[str]:
        return frozenset(e.sidecar for e in self.entries)

    @property
    def has_counts(self) -> bool:
        """Whether every entry states its counts (a version 2 manifest)."""
        return all(e.samples is not None and e.skipped is not None for e in self.entries)


@dataclass(frozen=True)
class Generation:
    """The live skip-lists of one directory: its manifest and every shard's skip set."""

    directory: str
    manifest: Manifest
    skiplists: dict[str, SkipList]  # index.json order

    @property
    def generation(self) -> str:
        return self.manifest.generation


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sidecar_name(shard_basename: str, data: bytes) -> str:
    """The content-addressed file name of the sidecar ``data`` of ``shard_basename``."""
    _check_basename(shard_basename)
    return f"{shard_basename}.{_sha256(data)[:_NAME_HASH_CHARS]}{SIDECAR_SUFFIX}"


def _check_basename(shard_basename: str) -> None:
    if (
        not isinstance(shard_basename, str)
        or not shard_basename
        or shard_basename != os.path.basename(shard_basename)
        or shard_basename in (".", "..")
        or shard_basename.startswith(".")
    ):
        raise SkipListError(f"shard must be a plain file name, got {shard_basename!r}")
    if shard_basename.endswith(SIDECAR_SUFFIX) or shard_basename == MANIFEST_BASENAME:
        raise SkipListError(f"{shard_basename!r} is a skip-list name, not a shard name")


def read_index(partition_dir: str | os.PathLike[str]) -> tuple[bytes, list[tuple[str, int]]]:
    """``index.json``'s bytes, and (raw shard basename, sample count) per shard in order."""
    path = Path(partition_dir) / INDEX_BASENAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SkipListError(
            f"no {INDEX_BASENAME} in {partition_dir}: not an MDS partition"
        ) from None
    return raw, parse_index(raw, str(path))


def parse_index(raw: bytes, source: str) -> list[tuple[str, int]]:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SkipListError(f"{source} is not valid JSON: {exc}") from None
    try:
        return [(info["raw_data"]["basename"], int(info["samples"])) for info in obj["shards"]]
    except (KeyError, TypeError) as exc:
        raise SkipListError(f"{source} is not a streaming index (missing {exc})") from None


def read_index_shards(partition_dir: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """(raw shard basename, sample count) for each shard of an MDS partition, in index order."""
    return read_index(partition_dir)[1]


def _normalise(skips: Mapping[int, Iterable[str]]) -> tuple[list[int], list[list[str]]]:
    for index in skips:
        if isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
            raise SkipListError(f"skip index must be a non-negative int, got {index!r}")
    indices: list[int] = []
    reasons: list[list[str]] = []
    for index in sorted(skips, key=int):
        raw = skips[index]
        codes = [raw] if isinstance(raw, str) else list(raw)
        unknown = sorted({c for c in codes if c not in REASON_CODES}, key=str)
        if unknown:
            raise SkipListError(
                f"unknown reason code(s) {unknown} for index {index}; allowed: {REASON_CODES}"
            )
        if not codes:
            raise SkipListError(f"index {index} has no reason code; every skip needs one")
        indices.append(int(index))
        reasons.append(sorted(set(codes)))
    return indices, reasons


def _with_hash(payload: dict[str, object]) -> bytes:
    payload = dict(payload)
    payload["sha256"] = _sha256(canonical_json(payload))
    return canonical_json(payload) + b"\n"


def encode_skiplist(shard_basename: str, skips: Mapping[int, Iterable[str]]) -> bytes:
    """The exact bytes of a sidecar (payload + its sha256)."""
    _check_basename(shard_basename)
    indices, reasons = _normalise(skips)
    return _with_hash(
        {
            "format": SKIPLIST_FORMAT,
            "version": SKIPLIST_VERSION,
            "shard": shard_basename,
            "indices": indices,
            "reasons": reasons,
        }
    )


def encode_manifest(index_sha256: str, entries: Sequence[ManifestEntry]) -> bytes:
    """The exact bytes of a (version 2) manifest (payload + its sha256)."""
    shards = []
    for e in entries:
        if e.samples is None or e.skipped is None:
            raise SkipListError(f"manifest entry for {e.shard!r} lacks its counts")
        shards.append(
            {
                "shard": e.shard,
                "sidecar": e.sidecar,
                "sha256": e.sha256,
                "samples": int(e.samples),
                "skipped": int(e.skipped),
            }
        )
    return _with_hash(
        {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "index_sha256": index_sha256,
            "shards": shards,
        }
    )


def _count(value: object) -> int | None:
    """A non-negative int from JSON (bools refused), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _load_json(data: bytes, source: str, what: str) -> dict:
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SkipListCorrupt(
            f"{source}: not valid JSON ({exc}); truncated or overwritten?"
        ) from None
    if not isinstance(obj, dict):
        raise SkipListCorrupt(f"{source}: not a {what}")
    return obj


_SELF_HASH_KEY = b',"sha256":"'


def _check_self_hash(obj: dict, source: str, what: str, data: bytes | None = None) -> str:
    """``obj``'s ``sha256``, checked to be the hash of the canonical JSON of its other keys.

    With the file's ``data``: writers write exactly ``canonical_json`` of the whole object
    and a newline, in which the self-hash is the first ``,"sha256":"`` (keys are sorted;
    a quote inside a string is escaped), so those bytes without that member are the
    canonical JSON hashed: one sha256 of a slice instead of re-encoding the object (half of
    a manifest's parse, which discovery pays per directory). Bytes laid out otherwise take
    the re-encoding path, which decides.
    """
    claimed = obj["sha256"]
    if data is not None and isinstance(claimed, str):
        at = data.find(_SELF_HASH_KEY)
        end = at + len(_SELF_HASH_KEY) + len(claimed) + 1
        if at >= 0 and data[at + len(_SELF_HASH_KEY) : end] == claimed.encode() + b'"':
            body = data[:at] + data[end:]
            if body.endswith(b"\n"):
                body = body[:-1]
            if _sha256(body) == claimed:
                return claimed
    actual = _sha256(canonical_json({k: v for k, v in obj.items() if k != "sha256"}))
    if claimed != actual:
        raise SkipListCorrupt(
            f"{source}: content hash mismatch (stored {str(claimed)[:12]}…, computed "
            f"{actual[:12]}…): the {what} was edited or damaged after it was written"
        )
    return actual


@functools.lru_cache(maxsize=4096)
def _valid_reasons(codes: tuple) -> bool:
    """A reason list as the writer makes it: non-empty, known codes, sorted, no repeats
    (cached: a tree uses a handful of distinct lists)."""
    return (
        bool(codes)
        and all(type(c) is str and c in REASON_CODES for c in codes)
        and list(codes) == sorted(set(codes))
    )


def parse_skiplist(
    data: bytes,
    source: str,
    expected_shard: str | None = None,
    *,
    digest_verified: bool = False,
) -> SkipList:
    """Validate sidecar bytes (version, schema, hash, shard name); ``source`` names it in errors.

    ``digest_verified``: the caller has checked these bytes' sha256 against a verified
    manifest's entry, which was computed over the very bytes the writer wrote (self-hash
    included): recomputing the self-hash from canonical JSON cannot then fail and is
    skipped. Every structural check still runs.
    """
    obj = _load_json(data, source, f"{SKIPLIST_FORMAT} sidecar")
    if obj.get("format") != SKIPLIST_FORMAT:
        raise SkipListCorrupt(f"{source}: not a {SKIPLIST_FORMAT} sidecar")
    version = obj.get("version")
    if version != SKIPLIST_VERSION:
        raise SkipListVersionError(
            f"{source}: sidecar format version {version!r}, this reader understands "
            f"version {SKIPLIST_VERSION} only"
        )
    expected_keys = {"format", "version", "shard", "indices", "reasons", "sha256"}
    if set(obj) != expected_keys:
        raise SkipListCorrupt(
            f"{source}: keys {sorted(obj)} differ from the v{SKIPLIST_VERSION} schema "
            f"{sorted(expected_keys)}"
        )
    if not digest_verified:
        _check_self_hash(obj, source, "sidecar")
    shard, indices, reasons = obj["shard"], obj["indices"], obj["reasons"]
    if not isinstance(shard, str) or not isinstance(indices, list) or not isinstance(reasons, list):
        raise SkipListCorrupt(f"{source}: shard/indices/reasons have the wrong types")
    if expected_shard is not None and shard != expected_shard:
        raise SkipListCorrupt(
            f"{source}: sidecar belongs to shard {shard!r}, named for {expected_shard!r}"
        )
    if len(indices) != len(reasons):
        raise SkipListCorrupt(f"{source}: {len(indices)} indices but {len(reasons)} reason lists")
    # Exact types first (a bool is not an index), then the order of the ints, both in C
    # loops (map): 3 us per 143-skip sidecar where numpy's asarray + diff took 9.
    if not set(map(type, indices)) <= {int} or (
        indices
        and (
            indices[0] < 0
            or indices[-1] >= 2**63
            or not all(map(operator.lt, indices, indices[1:]))
        )
    ):
        raise SkipListCorrupt(f"{source}: indices must be strictly increasing non-negative ints")
    # Each distinct reason list is checked once (a sidecar holds a handful of distinct
    # lists and hundreds of skips; the loader parses one sidecar per shard it builds).
    keys, distinct = _reason_keys(reasons)
    if keys is not None:
        wrong = [k for k in distinct if not _valid_reasons(k)]
        if not wrong:
            return SkipList(shard=shard, indices=tuple(indices), reasons=keys, path=source)
        at = min(keys.index(k) for k in wrong)  # the first one, as a reader would name it
    else:
        at = next(i for i, c in enumerate(reasons) if _reason_keys([c])[0] is None)
    raise SkipListCorrupt(f"{source}: bad reason list {reasons[at]!r} for index {indices[at]}")


def _reason_keys(reasons: list) -> tuple[tuple[tuple, ...] | None, set[tuple]]:
    """Each reason list as a tuple, and the distinct ones; (None, empty) when one is not a
    list of hashable items (JSON gives lists of scalars, or something else to refuse)."""
    if not set(map(type, reasons)) <= {list}:
        return None, set()
    keys = tuple(map(tuple, reasons))
    try:
        return keys, set(keys)
    except TypeError:  # a list or object inside a reason list
        return None, set()


def read_skiplist(path: str | os.PathLike[str]) -> SkipList:
    """Read and validate one sidecar file; its name must be its content's."""
    path = Path(path)
    data = path.read_bytes()
    m = _SIDECAR_RE.match(path.name)
    if m is None:
        raise SkipListCorrupt(f"{path}: not a sidecar name (<shard>.<sha16>{SIDECAR_SUFFIX})")
    if _sha256(data)[:_NAME_HASH_CHARS] != m.group("hash"):
        raise SkipListCorrupt(f"{path}: content does not match the hash in its name")
    return parse_skiplist(data, str(path), expected_shard=m.group("shard"))


_MANIFEST_KEYS = frozenset({"format", "version", "index_sha256", "shards", "sha256"})
_ENTRY_KEYS_V1 = frozenset({"shard", "sidecar", "sha256"})
_ENTRY_KEYS_V2 = _ENTRY_KEYS_V1 | {"samples", "skipped"}


def parse_manifest(data: bytes, source: str) -> Manifest:
    """Validate manifest bytes on their own (format, version, schema, self-hash, names)."""
    obj = _load_json(data, source, f"{MANIFEST_FORMAT} manifest")
    if obj.get("format") != MANIFEST_FORMAT:
        raise SkipListCorrupt(f"{source}: not a {MANIFEST_FORMAT} manifest")
    version = obj.get("version")
    if isinstance(version, bool) or version not in MANIFEST_VERSIONS_READ:
        raise SkipListVersionError(
            f"{source}: manifest format version {version!r}, this reader understands "
            f"versions {list(MANIFEST_VERSIONS_READ)} only"
        )
    if obj.keys() != _MANIFEST_KEYS:
        raise SkipListCorrupt(
            f"{source}: keys {sorted(obj)} differ from the manifest v{version} "
            f"schema {sorted(_MANIFEST_KEYS)}"
        )
    entry_keys = _ENTRY_KEYS_V2 if version >= 2 else _ENTRY_KEYS_V1
    own = _check_self_hash(obj, source, "manifest", data)
    shards = obj["shards"]
    if not isinstance(obj["index_sha256"], str) or not isinstance(shards, list):
        raise SkipListCorrupt(f"{source}: index_sha256/shards have the wrong types")
    entries = []
    for item in shards:
        if not isinstance(item, dict) or item.keys() != entry_keys:
            raise SkipListCorrupt(f"{source}: bad shard entry {str(item)[:200]!r}")
        shard, sidecar, sha = item["shard"], item["sidecar"], item["sha256"]
        try:
            _check_basename(shard)
        except SkipListError as exc:
            raise SkipListCorrupt(f"{source}: {exc}") from None
        m = _SIDECAR_RE.match(sidecar) if isinstance(sidecar, str) else None
        if (
            m is None
            or m.group("shard") != shard
            or not isinstance(sha, str)
            or not sha.startswith(m.group("hash"))
            or len(sha) != 64
        ):
            raise SkipListCorrupt(f"{source}: entry for {shard!r} names sidecar {sidecar!r}")
        samples = skipped = None
        if version >= 2:
            samples, skipped = _count(item["samples"]), _count(item["skipped"])
            if samples is None or skipped is None or skipped > samples:
                raise SkipListCorrupt(
                    f"{source}: entry for {shard!r} has bad counts (samples "
                    f"{str(item['samples'])[:20]}, skipped {str(item['skipped'])[:20]})"
                )
        entries.append(ManifestEntry(shard, sidecar, sha, samples, skipped))
    if len({e.shard for e in entries}) != len(entries):
        raise SkipListCorrupt(f"{source}: a shard is listed twice")
    return Manifest(index_sha256=obj["index_sha256"], entries=tuple(entries), sha256=own)


def check_manifest_matches_index(
    manifest: Manifest, index_raw: bytes, source: str
) -> list[tuple[str, int]]:
    """Raise ``SkipListStale`` unless ``manifest`` was written for exactly this index (and
    ``SkipListCorrupt`` unless it lists its shards); the index's (shard, samples)."""
    check_manifest_written_for(manifest, index_raw, source)
    shards = parse_index(index_raw, source)
    check_manifest_lists_shards(manifest, shards, source)
    return shards


def check_manifest_written_for(manifest: Manifest, index_raw: bytes, source: str) -> None:
    """Raise ``SkipListStale`` unless ``manifest`` names this ``index.json`` (its sha256)."""
    if _sha256(index_raw) != manifest.index_sha256:
        raise SkipListStale(
            f"{source} was written for another index.json (sha256 "
            f"{manifest.index_sha256[:12]}…, this one {_sha256(index_raw)[:12]}…): the "
            "directory was rewritten after its skip-lists, or the manifest was copied here"
        )


def check_manifest_lists_shards(
    manifest: Manifest, shards: Sequence[tuple[str, int]], source: str
) -> None:
    """Raise ``SkipListCorrupt`` unless the manifest lists exactly these (shard, samples), in
    order (sample counts checked where the manifest states them)."""
    if [name for name, _ in shards] != [e.shard for e in manifest.entries]:
        raise SkipListCorrupt(f"{source}: the shards it lists are not index.json's")
    for entry, (name, samples) in zip(manifest.entries, shards, strict=True):
        if entry.samples is not None and entry.samples != samples:
            raise SkipListCorrupt(
                f"{source}: says {name} holds {entry.samples} samples, index.json {samples}"
            )


@functools.lru_cache(maxsize=65536)
def _empty_sidecar_sha256(shard_basename: str) -> str:
    """sha256 of the sidecar that skips nothing in ``shard_basename`` (its only encoding)."""
    return _sha256(encode_skiplist(shard_basename, {}))


def known_empty(entry: ManifestEntry) -> bool:
    """Whether a verified manifest's entry names the canonical empty sidecar of its shard:
    its sha256 fixes the file's bytes to the one encoding that skips nothing, so what it
    skips (nothing) is known without reading it. Most shards of a screened tree are so."""
    return entry.skipped == 0 and entry.sha256 == _empty_sidecar_sha256(entry.shard)


def verify_sidecar(entry: ManifestEntry, data: bytes, source: str, samples: int) -> SkipList:
    """A sidecar's bytes checked against its manifest entry and its shard's size."""
    if _sha256(data) != entry.sha256:
        raise SkipListCorrupt(
            f"{source}: sha256 differs from the manifest's: edited or damaged after it was written"
        )
    if known_empty(entry):
        # These bytes are the canonical empty sidecar of this shard (their sha256 says so):
        # nothing to parse, nothing skipped.
        return SkipList(shard=entry.shard, indices=(), reasons=(), path=source)
    skiplist = parse_skiplist(data, source, expected_shard=entry.shard, digest_verified=True)
    skiplist.check_range(samples)
    if entry.skipped is not None and entry.skipped != len(skiplist):
        raise SkipListCorrupt(
            f"{source}: skips {len(skiplist)} samples, its manifest says {entry.skipped}"
        )
    return skiplist


# -- reading ---------------------------------------------------------------------------------


def _read_manifest_bytes(d: Path) -> bytes:
    try:
        return (d / MANIFEST_BASENAME).read_bytes()
    except FileNotFoundError:
        raise SkipListMissing(
            f"{d}: no skip-list manifest ({MANIFEST_BASENAME}); the directory was never "
            "screened (materialise skip_lists for its batch), so none of its samples may "
            "be trained on"
        ) from None


def load_generation(partition_dir: str | os.PathLike[str]) -> Generation:
    """The live generation of a directory, fully verified (see the module docstring)."""
    d = Path(partition_dir)
    for attempt in range(_READ_ATTEMPTS):
        data = _read_manifest_bytes(d)
        source = str(d / MANIFEST_BASENAME)
        manifest = parse_manifest(data, source)
        index_raw, _ = read_index(d)
        shards = check_manifest_matches_index(manifest, index_raw, source)
        out: dict[str, SkipList] = {}
        try:
            for entry, (_, samples) in zip(manifest.entries, shards, strict=True):
                path = d / entry.sidecar
                out[entry.shard] = verify_sidecar(entry, path.read_bytes(), str(path), samples)
        except FileNotFoundError as exc:
            # A writer may have published a new generation and swept ours meanwhile.
            if attempt + 1 < _READ_ATTEMPTS and _read_manifest_bytes(d) != data:
                continue
            raise SkipListCorrupt(f"{source} names {exc.filename}, which does not exist") from None
        return Generation(str(d), manifest, out)
    raise AssertionError("unreachable")


def load_skiplists(partition_dir: str | os.PathLike[str]) -> dict[str, SkipList]:
    """Skip set of every shard in ``index.json`` order, from the live generation."""
    return load_generation(partition_dir).skiplists


def current_generation(partition_dir: str | os.PathLike[str]) -> str | None:
    """The live generation's id (manifest self-hash), None when there is no manifest."""
    try:
        data = _read_manifest_bytes(Path(partition_dir))
    except SkipListMissing:
        return None
    return parse_manifest(data, str(Path(partition_dir) / MANIFEST_BASENAME)).generation


# -- writing ---------------------------------------------------------------------------------


def _is_ours(entry: str) -> bool:
    """Sidecars (any generation, and v1's ``<shard>.skip.json``) and our temporaries."""
    if entry.endswith(SIDECAR_SUFFIX) and not entry.startswith("."):
        return True
    m = _TMP_RE.match(entry)
    return m is not None and (
        m.group("target").endswith(SIDECAR_SUFFIX) or m.group("target") == MANIFEST_BASENAME
    )


def sweep(
    partition_dir: str | os.PathLike[str],
    keep: Iterable[str] = (),
    *,
    retention_s: float | None = None,
    now: float | None = None,
) -> list[str]:
    """Delete skip-list files no one may read: sidecars not in ``keep``, not named by the
    live manifest and not modified within ``retention_s`` (default
    ``superseded_retention_s()``: a superseded generation's sidecars are touched when it is
    superseded, so running jobs built on it can still verify them), and temporaries left by
    killed writers. Returns the names removed."""
    d = Path(partition_dir)
    protected = set(keep)
    try:
        protected |= parse_manifest(_read_manifest_bytes(d), str(d)).sidecars
    except SkipListError:
        pass  # no readable live generation: nothing on disk is protected by one
    retention = superseded_retention_s() if retention_s is None else retention_s
    cutoff = (time.time() if now is None else now) - retention
    removed = []
    # Sidecars a live training snapshot pins are kept (core/snapshots/pins.py); the lock
    # keeps a snapshot from pinning a generation while it is being swept.
    with directory_lock(d):
        try:
            protected |= pinned_sidecars(d)
        except PinError:
            return []  # an unreadable pin could name anything: delete nothing
        for entry in sorted(os.listdir(d)):
            if entry in protected or not _is_ours(entry):
                continue
            # Temporaries and names no manifest can name go at once.
            if retention > 0 and _SIDECAR_RE.match(entry) is not None:
                try:
                    if os.stat(d / entry).st_mtime > cutoff:
                        continue  # superseded (or staged) recently: a job may still read it
                except FileNotFoundError:
                    continue
            try:
                (d / entry).unlink()
            except FileNotFoundError:
                continue
            removed.append(entry)
            crashpoint("skiplists.stale_removed")
    if removed:
        fsync_path(d)
    return removed


def _retain_superseded(d: Path, current: bytes | None, new: frozenset[str]) -> None:
    """Start the retention of the sidecars the live generation names and ``new`` does not:
    their mtime becomes now, before the flip, so no sweep between the flip and a running
    job's first read of them deletes them (see ``DEFAULT_RETENTION_S``)."""
    if current is None:
        return
    try:
        old = parse_manifest(current, str(d / MANIFEST_BASENAME)).sidecars
    except SkipListError:
        return  # an unreadable live generation: no job can have been built on it
    for name in sorted(old - new):
        with contextlib.suppress(FileNotFoundError):
            os.utime(d / name)


@dataclass(frozen=True)
class StagedGeneration:
    """A generation whose sidecars are durable on disk but not yet published."""

    directory: Path
    index_sha256: str
    manifest_bytes: bytes
    sidecars: frozenset[str]
    # (shard, skipped indices) in index.json order: what the sidecars hold, kept so a
    # writer can count and digest its generation without reading its files back.
    skip_sets: tuple[tuple[str, tuple[int, ...]], ...] = ()


def stage_generation(
    partition_dir: str | os.PathLike[str],
    skips_by_shard: Mapping[str, Mapping[int, Iterable[str]]],
) -> StagedGeneration:
    """Write (without publishing) one generation: a sidecar for *every* shard of the index.

    Shards absent from ``skips_by_shard`` get an empty sidecar (screened, nothing skipped);
    shards named there but not in ``index.json``, bad reason codes and out-of-range indices
    are errors, raised before anything is written. Files of the live generation are never
    touched (new content has new names); stale files are swept first.
    """
    d = Path(partition_dir)
    index_raw, shards = read_index(d)
    sizes = dict(shards)
    unknown = sorted(set(skips_by_shard) - set(sizes))
    if unknown:
        raise SkipListError(f"not shards of {d}: {unknown}")
    entries: list[ManifestEntry] = []
    files: dict[str, bytes] = {}
    skip_sets: list[tuple[str, tuple[int, ...]]] = []
    for name, samples in shards:
        skips = skips_by_shard.get(name, {})
        data = encode_skiplist(name, skips)
        skip_sets.append((name, tuple(sorted(int(i) for i in skips))))
        if skips and max(int(i) for i in skips) >= samples:
            raise SkipListError(
                f"index {max(int(i) for i in skips)} is out of range for {name}, which holds "
                f"{samples} samples"
            )
        fname = sidecar_name(name, data)
        entries.append(ManifestEntry(name, fname, _sha256(data), samples, len(skips)))
        files[fname] = data
    sweep(d, keep=files)
    for fname, data in files.items():
        path = d / fname
        if path.is_file() and path.read_bytes() == data:
            continue  # the same content already durable under its content name
        atomic_write_bytes(path, data)
        crashpoint("skiplists.sidecar_written")
    fsync_path(d)
    crashpoint("skiplists.generation_written")
    index_sha = _sha256(index_raw)
    return StagedGeneration(
        d, index_sha, encode_manifest(index_sha, entries), frozenset(files), tuple(skip_sets)
    )


def publish_generation(staged: StagedGeneration) -> str:
    """Make a staged generation live (one rename), then sweep what it superseded.

    Refuses when ``index.json`` changed since staging (the directory was rewritten): the
    manifest would describe other shards. Returns the generation id.
    """
    d = staged.directory
    index_raw, _ = read_index(d)
    if _sha256(index_raw) != staged.index_sha256:
        raise SkipListStale(f"{d} was rewritten while its skip-lists were being written")
    path = d / MANIFEST_BASENAME
    current = path.read_bytes() if path.is_file() else None
    if current != staged.manifest_bytes:
        _retain_superseded(d, current, staged.sidecars)
        atomic_write_bytes(
            path,
            staged.manifest_bytes,
            before_rename=lambda: crashpoint("skiplists.manifest_staged"),
        )
        crashpoint("skiplists.manifest_published")
    sweep(d, keep=staged.sidecars)
    return parse_manifest(staged.manifest_bytes, str(path)).generation


def write_partition_skiplists(
    partition_dir: str | os.PathLike[str],
    skips_by_shard: Mapping[str, Mapping[int, Iterable[str]]],
) -> str:
    """Stage and publish one directory's generation (see ``stage_generation``); its id."""
    return publish_generation(stage_generation(partition_dir, skips_by_shard))


@dataclass(frozen=True)
class PublishedGeneration:
    """A generation this process just made live, described from what it wrote."""

    directory: Path
    generation: str
    index_sha256: str  # the index.json it was written for
    skip_sets: tuple[tuple[str, tuple[int, ...]], ...]  # (shard, skipped indices), in order

    @property
    def shards(self) -> int:
        return len(self.skip_sets)


def publish_partition_generations(
    skips_by_dir: Mapping[str | os.PathLike[str], Mapping[str, Mapping[int, Iterable[str]]]],
) -> list[PublishedGeneration]:
    """Refresh several directories (one batch's buckets): every generation's files are
    written before the first manifest flips, then the manifests flip one by one.

    A crash while staging leaves every directory on its previous generation; a crash
    between flips leaves each directory on a complete previous or complete new generation.
    Returns one :class:`PublishedGeneration` per directory, in the order given.
    """
    staged = [stage_generation(d, skips) for d, skips in skips_by_dir.items()]
    return [
        PublishedGeneration(s.directory, publish_generation(s), s.index_sha256, s.skip_sets)
        for s in staged
    ]


def publish_partition_skiplists(
    skips_by_dir: Mapping[str | os.PathLike[str], Mapping[str, Mapping[int, Iterable[str]]]],
) -> dict[str, str]:
    """:func:`publish_partition_generations`, as directory -> generation id."""
    return {str(p.directory): p.generation for p in publish_partition_generations(skips_by_dir)}


def update_skiplists(
    partition_dir: str | os.PathLike[str],
    changes: Mapping[str, Mapping[int, Iterable[str]]],
) -> str:
    """Publish a new generation: the live one with the shards in ``changes`` replaced.

    For tools and tests that change a few shards; there must be a live generation to start
    from (a directory never screened stays unscreened until a full set is written).
    """
    current = load_generation(partition_dir)
    skips = {
        name: {i: list(r) for i, r in sl.as_mapping().items()}
        for name, sl in current.skiplists.items()
    }
    skips.update({name: dict(s) for name, s in changes.items()})
    return write_partition_skiplists(partition_dir, skips)


# -- digests and counts ----------------------------------------------------------------------


def digest_generations(generations: Sequence[str | None]) -> str:
    """One sha256 over the skip-list generation of each directory, in order: the identity of
    the filtered sample space a loader reads (what a checkpoint is taken against, what the
    ranks of a job must agree on).

    A generation is its manifest's self-hash, which covers the ``index.json`` it was written
    for and every sidecar's sha256: two loaders with the same digest skip exactly the same
    samples, and the digest is known from the manifests alone, so building a dataset need
    not read a sidecar. It is finer than the skipped indices: a new generation that only
    relabels reasons changes it too (a resume then needs ``allow_skiplist_change=True``).
    ``None`` for a directory read without skip-lists (unscreened): it digests differently
    from any screened one, so a checkpoint never moves between the two silently.
    """
    body = ["unscreened" if g is None else str(g) for g in generations]
    return _sha256(canonical_json({"format": _DIGEST_FORMAT, "generations": body}))


def published_digest(published: Sequence[PublishedGeneration]) -> str:
    """:func:`skiplist_digest` of directories this process just published, in the order
    given, from what it wrote (equal to reading them back: the files are that content)."""
    return digest_generations([p.generation for p in published])


def skiplist_digest(dirs: Sequence[str | os.PathLike[str]]) -> str:
    """Digest of the live generations of these directories, in the order given, each fully
    verified (``load_generation``): the loader's ``skiplist_digest`` over the same tree."""
    if isinstance(dirs, str | os.PathLike):
        raise TypeError("skiplist_digest takes a sequence of partition directories")
    return digest_generations([load_generation(d).generation for d in dirs])


@dataclass(frozen=True)
class PartitionCounts:
    """Sizes of one partition before and after its skip-lists."""

    samples: int
    kept_samples: int
    shards: int
    kept_shards: int


def manifest_counts(manifest: Manifest) -> PartitionCounts | None:
    """A directory's counts as its (version 2) manifest states them; None for version 1.

    Claims, not proof: whoever reads the shards checks them (``check_manifest_lists_shards``,
    ``verify_sidecar``), so a wrong count stops that reader instead of changing what it yields.
    """
    samples = kept_samples = kept_shards = 0
    for e in manifest.entries:  # one pass: discovery counts every directory this way
        if e.samples is None or e.skipped is None:
            return None
        samples += e.samples
        kept_samples += e.samples - e.skipped
        kept_shards += e.samples > e.skipped
    return PartitionCounts(samples, kept_samples, len(manifest.entries), kept_shards)


def partition_counts(partition_dir: str | os.PathLike[str]) -> PartitionCounts:
    """Counts after the live generation's skips (``SkipListMissing`` when unscreened)."""
    shards = read_index_shards(partition_dir)
    skiplists = load_skiplists(partition_dir)
    kept = [n - len(skiplists[name]) for name, n in shards]
    return PartitionCounts(
        samples=sum(n for _, n in shards),
        kept_samples=sum(kept),
        shards=len(shards),
        kept_shards=sum(1 for k in kept if k > 0),
    )


def unscreened_partition_counts(partition_dir: str | os.PathLike[str]) -> PartitionCounts:
    """Counts as if nothing were skipped: only for reading without skip-lists on purpose."""
    shards = read_index_shards(partition_dir)
    n = sum(s for _, s in shards)
    return PartitionCounts(samples=n, kept_samples=n, shards=len(shards), kept_shards=len(shards))
