"""Reading ingest batches: folders, tar/WebDataset archives and parquet/CSV manifests.

A *batch* is one entry of the landing zone, ``<landing>/<source>/<chunk>``:

- ``<chunk>/``            a folder of images; complete once it holds a ``_SUCCESS`` file
- ``<chunk>.tar``         a tar or WebDataset archive (``.tar``, ``.tar.gz``, ``.tgz``)
- ``<chunk>.parquet``     a manifest of paths (also ``.csv``)

Entries whose name starts with ``.`` or ``_`` or ends in ``.tmp``/``.partial`` are
ignored, so producers write under a temporary name and rename when done.

Per-sample metadata comes from WebDataset-style sidecars (``name.txt`` = alt text,
``name.json`` with ``url``/``license``/``source``/``id``/``alt_text``) in folders and
archives, or from manifest columns. ``<landing>/<source>/_source.json`` may give
source-wide defaults (``license``, ``visibility``). The partition key of a batch is
``<source>.<chunk>``.

Nothing is extracted to disk: archive members are read into memory, and members that
would escape a target directory (absolute paths, ``..``, links, devices) are rejected
by name, as is anything over the member size limit.
"""

from __future__ import annotations

import csv
import json
import os
import posixpath
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pyarrow.parquet as pq

IMAGE_EXTENSIONS = {
    ".jpg",
    ".jpeg",
    ".jpe",
    ".png",
    ".webp",
    ".tif",
    ".tiff",
    ".bmp",
    ".gif",
    ".mpo",
}
SIDECAR_EXTENSIONS = {".txt", ".json", ".caption", ".cls"}
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
MANIFEST_SUFFIXES = (".parquet", ".csv")
READY_MARKER = "_SUCCESS"
SOURCE_DEFAULTS_FILE = "_source.json"
DEFAULT_MAX_MEMBER_BYTES = 512 * 1024 * 1024
_KEY_SAFE = re.compile(r"[^A-Za-z0-9_\-]+")
MANIFEST_COLUMNS = {
    "path": ("path", "file", "filepath", "image_path"),
    "alt_text": ("alt_text", "alt", "caption", "text"),
    "source": ("source",),
    "license": ("license", "licence"),
    "url": ("url", "original_url"),
    "source_id": ("id", "source_id", "sample_id"),
}


class BatchError(Exception):
    """A batch that cannot be read at all (as opposed to a bad file inside it)."""


@dataclass
class Candidate:
    """One input file of a batch: bytes to decode, or the reason there are none."""

    path: str
    data: bytes | None
    alt_text: str | None = None
    source: str | None = None
    license: str | None = None
    url: str | None = None
    source_id: str | None = None
    error: tuple[str, str] | None = None  # (reason, detail) when unreadable


@dataclass(frozen=True)
class BatchRef:
    key: str
    source: str
    chunk: str
    path: Path
    kind: str  # folder | archive | manifest
    defaults: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


def _ignored(name: str) -> bool:
    return name.startswith((".", "_")) or name.endswith((".tmp", ".partial"))


def _chunk_name(entry: Path) -> tuple[str, str] | None:
    name = entry.name
    if entry.is_dir():
        return (name, "folder") if (entry / READY_MARKER).exists() else None
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], "archive"
    for suffix in MANIFEST_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], "manifest"
    return None


def batch_key(source: str, chunk: str) -> str:
    """Partition key for a batch; stable, and safe in paths and Lance filters."""
    return f"{_KEY_SAFE.sub('-', source)}.{_KEY_SAFE.sub('-', chunk)}"


def _source_defaults(source_dir: Path) -> dict[str, str]:
    f = source_dir / SOURCE_DEFAULTS_FILE
    if not f.exists():
        return {}
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise BatchError(f"{f}: unreadable source defaults: {exc}") from exc
    return {k: str(v) for k, v in data.items() if isinstance(v, str | int | float)}


def discover_batches(landing: Path) -> list[BatchRef]:
    """Every complete batch in the landing zone, sorted by key."""
    found: dict[str, BatchRef] = {}
    if not landing.is_dir():
        return []
    for source_dir in sorted(p for p in landing.iterdir() if p.is_dir()):
        if _ignored(source_dir.name):
            continue
        defaults = _source_defaults(source_dir)
        for entry in sorted(source_dir.iterdir()):
            if _ignored(entry.name):
                continue
            named = _chunk_name(entry)
            if named is None:
                continue
            chunk, kind = named
            key = batch_key(source_dir.name, chunk)
            if key in found:
                raise BatchError(
                    f"two landing entries map to partition {key!r}: "
                    f"{found[key].path} and {entry}; rename one"
                )
            found[key] = BatchRef(key, source_dir.name, chunk, entry, kind, defaults)
    return [found[k] for k in sorted(found)]


def resolve_batch(landing: Path, key: str) -> BatchRef:
    for ref in discover_batches(landing):
        if ref.key == key:
            return ref
    raise BatchError(f"no complete batch for partition {key!r} under {landing}")


def describe_batch(path: Path, landing: Path) -> BatchRef:
    """A BatchRef for an explicit landing path (used when registering by hand)."""
    path = path.resolve()
    landing = landing.resolve()
    if path.parent.parent != landing:
        raise BatchError(f"{path} is not a <landing>/<source>/<chunk> entry of {landing}")
    named = _chunk_name(path)
    if named is None:
        raise BatchError(
            f"{path} is not a batch: expected a folder with {READY_MARKER}, "
            f"an archive ({', '.join(ARCHIVE_SUFFIXES)}) or a manifest "
            f"({', '.join(MANIFEST_SUFFIXES)})"
        )
    chunk, kind = named
    return BatchRef(
        batch_key(path.parent.name, chunk),
        path.parent.name,
        chunk,
        path,
        kind,
        _source_defaults(path.parent),
    )


def _sidecar_fields(sidecars: dict[str, bytes]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for ext in (".txt", ".caption"):
        if ext in sidecars:
            out["alt_text"] = sidecars[ext].decode("utf-8", "replace").strip() or None
    if ".json" in sidecars:
        try:
            meta = json.loads(sidecars[".json"])
        except ValueError:
            meta = {}
        if isinstance(meta, dict):
            for col, names in MANIFEST_COLUMNS.items():
                for name in names:
                    if name in meta and meta[name] is not None and col != "path":
                        out.setdefault(col, str(meta[name]))
                        break
    return out


def _split_ext(name: str) -> tuple[str, str]:
    """WebDataset grouping: the key is everything before the first dot of the basename."""
    directory, base = posixpath.split(name)
    if "." not in base:
        return name, ""
    stem, ext = base.split(".", 1)
    return posixpath.join(directory, stem), "." + ext.lower()


def _with_defaults(c: Candidate, ref: BatchRef) -> Candidate:
    c.source = c.source or ref.defaults.get("source") or ref.source
    c.license = c.license or ref.defaults.get("license")
    return c


def _iter_folder(ref: BatchRef) -> Iterator[Candidate]:
    groups: dict[str, dict[str, Path]] = {}
    for root, dirs, files in os.walk(ref.path, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name == READY_MARKER or name.startswith("."):
                continue
            full = Path(root) / name
            rel = full.relative_to(ref.path).as_posix()
            stem, ext = _split_ext(rel)
            groups.setdefault(stem, {})[ext] = full
    for stem in sorted(groups):
        members = groups[stem]
        sidecars = {
            ext: p.read_bytes()
            for ext, p in members.items()
            if ext in SIDECAR_EXTENSIONS and p.is_file() and not p.is_symlink()
        }
        fields = _sidecar_fields(sidecars)
        for ext, p in sorted(members.items()):
            if ext in SIDECAR_EXTENSIONS:
                continue
            rel = p.relative_to(ref.path).as_posix()
            if p.is_symlink():
                yield _with_defaults(
                    Candidate(rel, None, error=("unsafe_path", "symbolic links are not followed")),
                    ref,
                )
                continue
            c = Candidate(rel, p.read_bytes(), **fields)
            if ext not in IMAGE_EXTENSIONS:
                c.error = ("unsupported_extension", f"{ext or '(none)'} is not an image extension")
                c.data = None
            yield _with_defaults(c, ref)


def unsafe_member_reason(member: tarfile.TarInfo, max_bytes: int) -> str | None:
    """Why an archive member must not be read, or None when it is safe."""
    name = member.name
    pure = PurePosixPath(name)
    if name.startswith("/") or pure.is_absolute() or re.match(r"^[A-Za-z]:", name):
        return f"absolute path {name!r}"
    if ".." in pure.parts:
        return f"path traversal {name!r}"
    if member.issym() or member.islnk():
        return f"link member {name!r} -> {member.linkname!r}"
    if member.isdev() or member.isfifo():
        return f"device or fifo member {name!r}"
    if member.size > max_bytes:
        return f"member {name!r} is {member.size} bytes, over the {max_bytes}-byte limit"
    return None


def _archive_group(
    ref: BatchRef, members: dict[str, tuple[tarfile.TarInfo, bytes | None, str | None]]
) -> Iterator[Candidate]:
    sidecars = {
        ext: data
        for ext, (_, data, bad) in members.items()
        if ext in SIDECAR_EXTENSIONS and data is not None and bad is None
    }
    fields = _sidecar_fields(sidecars)
    for ext, (member, data, bad) in sorted(members.items()):
        if ext in SIDECAR_EXTENSIONS and bad is None:
            continue
        if bad is not None:
            yield _with_defaults(Candidate(member.name, None, error=("unsafe_path", bad)), ref)
            continue
        c = Candidate(member.name, data, **fields)
        if ext not in IMAGE_EXTENSIONS:
            c.error = ("unsupported_extension", f"{ext or '(none)'} is not an image extension")
            c.data = None
        yield _with_defaults(c, ref)


def _iter_archive(ref: BatchRef, max_member_bytes: int) -> Iterator[Candidate]:
    """Stream an archive: WebDataset keeps a sample's files adjacent, so one group is held."""
    try:
        tar = tarfile.open(ref.path, mode="r:*")
    except (tarfile.TarError, OSError) as exc:
        raise BatchError(f"{ref.path}: not a readable tar archive: {exc}") from exc
    current: str | None = None
    group: dict[str, tuple[tarfile.TarInfo, bytes | None, str | None]] = {}
    with tar:
        try:
            for member in tar:
                if member.isdir():
                    continue
                stem, ext = _split_ext(member.name)
                if stem != current and group:
                    yield from _archive_group(ref, group)
                    group = {}
                current = stem
                bad = unsafe_member_reason(member, max_member_bytes)
                data = None
                if bad is None and member.isfile():
                    f = tar.extractfile(member)
                    data = f.read() if f is not None else None
                group[ext] = (member, data, bad)
        except (tarfile.TarError, OSError, EOFError) as exc:
            # A damaged archive: keep what was read, record the damage once.
            if group:
                yield from _archive_group(ref, group)
                group = {}
            yield _with_defaults(
                Candidate(ref.path.name, None, error=("corrupt_archive", f"archive: {exc}")), ref
            )
    if group:
        yield from _archive_group(ref, group)


def _manifest_rows(path: Path) -> list[dict[str, str | None]]:
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except Exception as exc:  # noqa: BLE001
            raise BatchError(f"{path}: unreadable parquet manifest: {exc}") from exc
        rows = table.to_pylist()
    else:
        try:
            with path.open(newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise BatchError(f"{path}: unreadable CSV manifest: {exc}") from exc
    if not rows:
        return []
    columns = {c.lower(): c for c in rows[0].keys()}
    mapping: dict[str, str] = {}
    for field_name, names in MANIFEST_COLUMNS.items():
        for name in names:
            if name in columns:
                mapping[field_name] = columns[name]
                break
    if "path" not in mapping:
        raise BatchError(
            f"{path}: manifest has no path column (expected one of "
            f"{', '.join(MANIFEST_COLUMNS['path'])}; found {', '.join(columns.values())})"
        )
    out = []
    for row in rows:
        out.append(
            {
                k: (None if row.get(col) in (None, "") else str(row.get(col)))
                for k, col in mapping.items()
            }
        )
    return out


def _iter_manifest(ref: BatchRef) -> Iterator[Candidate]:
    base = ref.path.parent.resolve()
    for row in _manifest_rows(ref.path):
        rel = row.pop("path")
        if rel is None:
            yield _with_defaults(
                Candidate("", None, error=("missing_path", "empty path cell")), ref
            )
            continue
        target = (base / rel).resolve()
        fields = {k: v for k, v in row.items() if v is not None}
        if base not in target.parents:
            yield _with_defaults(
                Candidate(
                    rel,
                    None,
                    error=("unsafe_path", f"{rel!r} resolves outside the source folder {base}"),
                    **fields,
                ),
                ref,
            )
            continue
        if not target.is_file():
            yield _with_defaults(
                Candidate(rel, None, error=("missing_file", f"{rel!r} does not exist"), **fields),
                ref,
            )
            continue
        yield _with_defaults(Candidate(rel, target.read_bytes(), **fields), ref)


def iter_candidates(
    ref: BatchRef, max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES
) -> Iterator[Candidate]:
    """Every input file of a batch, in a deterministic order, readable or not."""
    if ref.kind == "folder":
        yield from _iter_folder(ref)
    elif ref.kind == "archive":
        yield from _iter_archive(ref, max_member_bytes)
    elif ref.kind == "manifest":
        yield from _iter_manifest(ref)
    else:
        raise BatchError(f"unknown batch kind {ref.kind!r}")
