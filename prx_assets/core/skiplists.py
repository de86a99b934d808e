"""Skip-list sidecars: the only way a sample leaves training once its shard is written.

MDS shards are immutable (rewriting one would invalidate every cache, every checkpoint's
notion of "sample N" and every digest), so opt-outs, duplicates, classifier verdicts and
quality rejections are recorded *beside* the shard, one sidecar per shard:

    <partition>/shard.00003.mds            # written once, never touched again
    <partition>/shard.00003.mds.skip.json  # rewritten atomically whenever skips change

Sidecar payload (format version 1)::

    {"format": "prx-skiplist", "version": 1, "shard": "shard.00003.mds",
     "indices": [4, 17], "reasons": [["duplicate"], ["opt_out", "quality"]],
     "sha256": "<hex of the canonical JSON of every other key>"}

- ``indices`` are 0-based within the shard, strictly increasing; ``reasons[i]`` is the
  sorted, de-duplicated list of reason codes of ``indices[i]`` (at least one, from
  ``REASON_CODES``).
- ``sha256`` covers the canonical JSON (sorted keys, no whitespace, ASCII) of the payload
  without itself, so a hand edit, a truncated copy or a sidecar renamed onto another shard
  is caught by ``read_skiplist`` with a ``SkipListCorrupt`` error instead of silently
  training on the wrong sample set.
- The shard is named by its *raw* basename (``index.json``'s ``raw_data.basename``), which
  is also the name streaming uses for the decompressed shard.

No skips: a missing sidecar and a sidecar with no indices mean exactly the same thing (an
empty skip set); ``load_skiplists`` returns an empty ``SkipList`` with ``path=None`` for the
former, and ``skiplist_digest`` hashes both identically, so writing empty sidecars for every
screened shard (``write_partition_skiplists`` does) never changes a digest. What the digest
identifies is the *filtered sample space* (which indices of which shards are gone), not the
bytes of the files, so relabelling a skip's reasons does not block a resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SKIPLIST_FORMAT = "prx-skiplist"
SKIPLIST_VERSION = 1
SIDECAR_SUFFIX = ".skip.json"
INDEX_BASENAME = "index.json"
REASON_CODES: tuple[str, ...] = (
    "opt_out",
    "duplicate",
    "class_text",
    "class_nsfw",
    "quality",
    "low_information",
    "no_caption",
    "pending",  # a decision it depends on is not known yet: skipped until it is
)
_DIGEST_FORMAT = "prx-skiplist-digest/1"


class SkipListError(ValueError):
    """Base class: skip-list input that cannot be trusted or written."""


class SkipListCorrupt(SkipListError):
    """A sidecar that is not what was written: bad JSON, schema, hash or shard name."""


class SkipListVersionError(SkipListError):
    """A sidecar written in a format version this code does not read."""


@dataclass(frozen=True)
class SkipList:
    """The skip set of one shard. ``path`` is None when no sidecar exists (empty set)."""

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

    def keep_indices(self, num_samples: int) -> np.ndarray:
        """Indices of the shard that survive, in shard order (int64)."""
        if self.indices and self.indices[-1] >= num_samples:
            raise SkipListError(
                f"skip-list for {self.shard} names index {self.indices[-1]} but the shard "
                f"has only {num_samples} samples (sidecar written for another shard?)"
            )
        mask = np.ones(num_samples, dtype=bool)
        if self.indices:
            mask[np.asarray(self.indices, dtype=np.int64)] = False
        return np.flatnonzero(mask).astype(np.int64)


def canonical_json(obj: object) -> bytes:
    """The byte form every hash in this module is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sidecar_name(shard_basename: str) -> str:
    return shard_basename + SIDECAR_SUFFIX


def sidecar_path(partition_dir: str | os.PathLike[str], shard_basename: str) -> Path:
    return Path(partition_dir) / sidecar_name(shard_basename)


def _check_basename(shard_basename: str) -> None:
    if (
        not shard_basename
        or shard_basename != os.path.basename(shard_basename)
        or shard_basename in (".", "..")
    ):
        raise SkipListError(f"shard must be a plain file name, got {shard_basename!r}")
    if shard_basename.endswith(SIDECAR_SUFFIX):
        raise SkipListError(f"{shard_basename!r} is a sidecar name, not a shard name")


def read_index_shards(partition_dir: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """(raw shard basename, sample count) for each shard of an MDS partition, in index order."""
    path = Path(partition_dir) / INDEX_BASENAME
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise SkipListError(
            f"no {INDEX_BASENAME} in {partition_dir}: not an MDS partition"
        ) from None
    except json.JSONDecodeError as exc:
        raise SkipListError(f"{path} is not valid JSON: {exc}") from None
    try:
        return [(info["raw_data"]["basename"], int(info["samples"])) for info in obj["shards"]]
    except (KeyError, TypeError) as exc:
        raise SkipListError(f"{path} is not a streaming index (missing {exc})") from None


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


def _payload(shard: str, indices: list[int], reasons: list[list[str]]) -> dict[str, object]:
    return {
        "format": SKIPLIST_FORMAT,
        "version": SKIPLIST_VERSION,
        "shard": shard,
        "indices": indices,
        "reasons": reasons,
    }


def encode_skiplist(shard_basename: str, skips: Mapping[int, Iterable[str]]) -> bytes:
    """The exact bytes of a sidecar (payload + its sha256)."""
    _check_basename(shard_basename)
    indices, reasons = _normalise(skips)
    payload = _payload(shard_basename, indices, reasons)
    payload["sha256"] = hashlib.sha256(canonical_json(payload)).hexdigest()
    return canonical_json(payload) + b"\n"


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """tmp + fsync + rename (+ fsync of the directory): readers see old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_skiplist(
    partition_dir: str | os.PathLike[str],
    shard_basename: str,
    skips: Mapping[int, Iterable[str]],
) -> Path:
    """Write (replace) the sidecar of one shard; an empty mapping writes an empty sidecar.

    When the partition's ``index.json`` is present the shard must be listed there and every
    index must be inside it, so a skip-list can never point past its shard.
    """
    _check_basename(shard_basename)
    data = encode_skiplist(shard_basename, skips)
    if (Path(partition_dir) / INDEX_BASENAME).exists():
        sizes = dict(read_index_shards(partition_dir))
        if shard_basename not in sizes:
            raise SkipListError(
                f"{shard_basename} is not a shard of {partition_dir} (index.json lists "
                f"{sorted(sizes)[:5]}{'...' if len(sizes) > 5 else ''})"
            )
        if skips and max(int(i) for i in skips) >= sizes[shard_basename]:
            raise SkipListError(
                f"index {max(int(i) for i in skips)} is out of range for {shard_basename}, "
                f"which holds {sizes[shard_basename]} samples"
            )
    path = sidecar_path(partition_dir, shard_basename)
    atomic_write_bytes(path, data)
    return path


def write_partition_skiplists(
    partition_dir: str | os.PathLike[str],
    skips_by_shard: Mapping[str, Mapping[int, Iterable[str]]],
) -> list[Path]:
    """Write one sidecar for *every* shard of the partition (empty where nothing is skipped).

    A complete set of sidecars shows the partition was screened; shards named in
    ``skips_by_shard`` but absent from ``index.json`` are an error.
    """
    shards = [name for name, _ in read_index_shards(partition_dir)]
    unknown = sorted(set(skips_by_shard) - set(shards))
    if unknown:
        raise SkipListError(f"not shards of {partition_dir}: {unknown}")
    return [write_skiplist(partition_dir, s, skips_by_shard.get(s, {})) for s in shards]


def parse_skiplist(data: bytes, source: str, expected_shard: str | None = None) -> SkipList:
    """Validate sidecar bytes (version, schema, hash, shard name); ``source`` names it in errors."""
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SkipListCorrupt(
            f"{source}: not valid JSON ({exc}); truncated or overwritten?"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != SKIPLIST_FORMAT:
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
    claimed = obj["sha256"]
    payload = {k: v for k, v in obj.items() if k != "sha256"}
    actual = hashlib.sha256(canonical_json(payload)).hexdigest()
    if claimed != actual:
        raise SkipListCorrupt(
            f"{source}: content hash mismatch (stored {str(claimed)[:12]}…, computed "
            f"{actual[:12]}…): the sidecar was edited or damaged after it was written"
        )
    shard, indices, reasons = obj["shard"], obj["indices"], obj["reasons"]
    if not isinstance(shard, str) or not isinstance(indices, list) or not isinstance(reasons, list):
        raise SkipListCorrupt(f"{source}: shard/indices/reasons have the wrong types")
    if expected_shard is not None and shard != expected_shard:
        raise SkipListCorrupt(
            f"{source}: sidecar belongs to shard {shard!r}, found beside {expected_shard!r}"
        )
    if len(indices) != len(reasons):
        raise SkipListCorrupt(f"{source}: {len(indices)} indices but {len(reasons)} reason lists")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices) or any(
        b <= a for a, b in zip(indices, indices[1:], strict=False)
    ):
        raise SkipListCorrupt(f"{source}: indices must be strictly increasing non-negative ints")
    for index, codes in zip(indices, reasons, strict=True):
        if (
            not isinstance(codes, list)
            or not codes
            or any(c not in REASON_CODES for c in codes)
            or codes != sorted(set(codes))
        ):
            raise SkipListCorrupt(f"{source}: bad reason list {codes!r} for index {index}")
    return SkipList(
        shard=shard,
        indices=tuple(indices),
        reasons=tuple(tuple(c) for c in reasons),
        path=source,
    )


def read_skiplist(path: str | os.PathLike[str]) -> SkipList:
    """Read and validate one sidecar file (see ``parse_skiplist`` for what is checked)."""
    path = Path(path)
    name = path.name
    expected = name[: -len(SIDECAR_SUFFIX)] if name.endswith(SIDECAR_SUFFIX) else None
    return parse_skiplist(path.read_bytes(), str(path), expected_shard=expected)


def load_skiplists(partition_dir: str | os.PathLike[str]) -> dict[str, SkipList]:
    """Skip set of every shard in ``index.json`` order; a missing sidecar is an empty SkipList.

    A sidecar whose shard is not in the index is an error: it is either stale or was copied
    into the wrong partition, and both mean the skip-lists do not describe these shards.
    """
    shards = read_index_shards(partition_dir)
    names = {name for name, _ in shards}
    for entry in os.listdir(partition_dir):
        if entry.endswith(SIDECAR_SUFFIX) and entry[: -len(SIDECAR_SUFFIX)] not in names:
            raise SkipListError(
                f"{Path(partition_dir) / entry}: sidecar for a shard that is not in index.json"
            )
    out: dict[str, SkipList] = {}
    for name, samples in shards:
        path = sidecar_path(partition_dir, name)
        skiplist = read_skiplist(path) if path.exists() else SkipList.empty(name)
        skiplist.keep_indices(samples)  # validates range against the shard
        out[name] = skiplist
    return out


def digest_skip_sets(partitions: Sequence[Sequence[tuple[str, Sequence[int]]]]) -> str:
    """One sha256 over (shard name, skipped indices) of each shard of each partition, in order.

    Shared by ``skiplist_digest`` (files on disk) and the loader (sidecars it fetched), so a
    training job and an offline tool agree on the digest of the same skip-lists.
    """
    body = [[[name, [int(i) for i in indices]] for name, indices in part] for part in partitions]
    return hashlib.sha256(
        canonical_json({"format": _DIGEST_FORMAT, "partitions": body})
    ).hexdigest()


def skiplist_digest(dirs: Sequence[str | os.PathLike[str]]) -> str:
    """Digest of the filtered sample space of these partitions, in the order given.

    A missing sidecar counts as an empty skip set (explicitly: the shard still appears in
    the digest with no indices), so adding empty sidecars does not change the digest while
    adding, removing or moving a single skipped index does.
    """
    if isinstance(dirs, str | os.PathLike):
        raise TypeError("skiplist_digest takes a sequence of partition directories")
    parts = []
    for d in dirs:
        skiplists = load_skiplists(d)
        parts.append([(name, s.indices) for name, s in skiplists.items()])
    return digest_skip_sets(parts)


@dataclass(frozen=True)
class PartitionCounts:
    """Sizes of one partition before and after its skip-lists."""

    samples: int
    kept_samples: int
    shards: int
    kept_shards: int


def partition_counts(partition_dir: str | os.PathLike[str]) -> PartitionCounts:
    shards = read_index_shards(partition_dir)
    skiplists = load_skiplists(partition_dir)
    kept = [n - len(skiplists[name]) for name, n in shards]
    return PartitionCounts(
        samples=sum(n for _, n in shards),
        kept_samples=sum(kept),
        shards=len(shards),
        kept_shards=sum(1 for k in kept if k > 0),
    )
