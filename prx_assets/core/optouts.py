"""Opt-out lists: parse them, record them in the lab, and find the images they name.

Why a separate intake (not a Dagster asset): an opt-out list is a legal request that must
reach every affected shard quickly, but only those. As an upstream asset of ``skip_lists``
each new list would rerun every partition under eager automation; instead a sensor records
the list here, resolves which batches hold the named images (Lance scalar indexes on
``images.key``, ``images.url`` and ``images.source_id``) and requests ``skip_lists`` for those
partitions only. ``skip_lists`` then reads the ``opt_outs`` table at run time, matching from
the partition side, so a list received before a batch was ingested still applies to it.

Opt-out list formats
--------------------
Drop a file into ``<data_root>/optouts/`` (configurable). Write it under a temporary name
and rename it into place: names starting with ``.`` or ``_`` or ending in ``.tmp`` or
``.partial`` are ignored, as is any extension other than the three below.

- ``*.txt``: UTF-8, one identifier per line. Blank lines are ignored; ``#`` starts a comment
  at the start of a line or after whitespace (so ``#`` inside a URL is kept).
- ``*.csv``: UTF-8, comma-separated, with a header row. Recognised columns (header names are
  case-insensitive): ``identifier`` (kind detected per cell), ``key`` or ``sha256`` (content
  key), ``url`` or ``original_url``, ``source_id`` or ``sample_id`` (a source's own id, with
  an optional ``source`` column). Other columns (``requested_by``, ``note``, ...) are
  ignored. Every non-empty recognised cell is one identifier; each row needs at least one.
- ``*.parquet``: the same columns as CSV, string-typed; nulls are empty cells.

Identifier kinds (a bare identifier's kind is detected in this order):

- content key: the sha256 of the original file bytes, 64 hex digits (any case).
- URL: ``http://`` or ``https://`` with a host; matched exactly (after trimming whitespace)
  against the URL recorded at ingest.
- source id: ``source:id``: the image's source (``images.source``, e.g. ``internal-studio``)
  and that source's own id (``images.source_id``), split at the first ``:``. In CSV/parquet a
  ``source`` column may give the source separately (then the id may contain ``:``).

A file with any malformed entry is rejected as a whole (nothing of it is applied), with the
reason recorded in ``opt_out_lists`` (status ``rejected``); later lists are unaffected. Fix
the file and drop it again: a list is identified by its file name and the sha256 of its
bytes, so new content is a new list. Lists are additive: editing or deleting a file never
withdraws an opt-out already recorded.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import lance
import pyarrow as pa
import pyarrow.parquet as pq

from prx_assets.core.lab import Lab, TableSpec, in_list, sql_literal

KIND_KEY = "key"
KIND_URL = "url"
KIND_SOURCE_ID = "source_id"
KINDS: tuple[str, ...] = (KIND_KEY, KIND_URL, KIND_SOURCE_ID)
FORMATS: dict[str, str] = {".txt": "txt", ".csv": "csv", ".parquet": "parquet"}
STATUS_ACCEPTED = "accepted"
STATUS_REJECTED = "rejected"
LOOKUP_CHUNK = 512  # values per ``IN (...)`` probe: each is one scalar-index lookup
MAX_REPORTED = 5  # malformed entries quoted in a rejection reason

# Images are looked up by these columns; key is indexed by the images table spec already.
IMAGE_LOOKUP_INDEXES: tuple[tuple[str, str], ...] = (
    ("key", "BTREE"),
    ("url", "BTREE"),
    ("source_id", "BTREE"),
)

_KEY_RE = re.compile(r"^[0-9a-fA-F]{64}$")
_COMMENT_RE = re.compile(r"(^|\s)#.*$")
_COLUMN_KINDS: dict[str, str] = {
    "identifier": "identifier",
    "key": KIND_KEY,
    "sha256": KIND_KEY,
    "url": KIND_URL,
    "original_url": KIND_URL,
    "source_id": KIND_SOURCE_ID,
    "sample_id": KIND_SOURCE_ID,
}
_SOURCE_COLUMN = "source"

OPT_OUTS = TableSpec(
    name="opt_outs",
    schema=pa.schema(
        [
            pa.field("list_id", pa.string(), nullable=False),
            pa.field("identifier", pa.string(), nullable=False),  # canonical form (see kinds)
            pa.field("identifier_kind", pa.string(), nullable=False),  # key | url | source_id
            pa.field("received_at", pa.timestamp("us", tz="UTC"), nullable=False),
            # One row per image the identifier matched when the list arrived (null: none yet).
            pa.field("matched_key", pa.string()),
            pa.field("matched_batch", pa.string()),
        ]
    ),
    identity=("list_id", "identifier", "matched_batch", "matched_key"),
    indexes=(
        ("identifier", "BTREE"),
        ("list_id", "BTREE"),
        ("matched_key", "BTREE"),
        ("matched_batch", "BITMAP"),
    ),
)

OPT_OUT_LISTS = TableSpec(
    name="opt_out_lists",
    schema=pa.schema(
        [
            pa.field("list_id", pa.string(), nullable=False),  # "<file name>@<sha256[:16]>"
            pa.field("path", pa.string(), nullable=False),
            pa.field("format", pa.string()),
            pa.field("sha256", pa.string(), nullable=False),
            pa.field("status", pa.string(), nullable=False),  # accepted | rejected
            pa.field("reason", pa.string()),  # "<code>: <details>" when rejected
            pa.field("rows", pa.int64()),  # distinct identifiers in the list
            pa.field("matched_images", pa.int64()),  # (batch, key) pairs matched on arrival
            pa.field("batches", pa.list_(pa.string())),  # batches holding a match on arrival
            pa.field("received_at", pa.timestamp("us", tz="UTC"), nullable=False),
        ]
    ),
    identity=("list_id",),
    indexes=(("list_id", "BTREE"), ("status", "BITMAP")),
)


class OptOutListError(ValueError):
    """A list file that cannot be applied; ``code`` is a stable reason, the text the details."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def reason(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True, order=True)
class OptOutIdentifier:
    """One identifier in canonical form. ``value`` is what ``opt_outs.identifier`` stores:
    the lower-case key, the trimmed URL, or ``"<source>:<id>"``."""

    kind: str
    value: str
    source: str | None = None  # source-id kind only
    source_id: str | None = None


@dataclass(frozen=True)
class OptOutList:
    path: str
    format: str
    identifiers: tuple[OptOutIdentifier, ...]  # distinct, sorted


# --------------------------------------------------------------------------- identifiers


def content_key(text: str) -> OptOutIdentifier:
    if not _KEY_RE.match(text):
        raise ValueError(f"{text!r} is not a content key (64 hex digits of sha256)")
    return OptOutIdentifier(KIND_KEY, text.lower())


def url_identifier(text: str) -> OptOutIdentifier:
    if any(c.isspace() for c in text):
        raise ValueError(f"{text!r} is not a URL (contains whitespace)")
    try:
        parts = urlsplit(text)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid URL ({exc})") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{text!r} is not an http(s) URL with a host")
    return OptOutIdentifier(KIND_URL, text)


def source_identifier(source: str | None, sid: str) -> OptOutIdentifier:
    """``source:id`` (``source`` None) or a separate source; the id keeps any later ``:``."""
    if source is None:
        if ":" not in sid:
            raise ValueError(f"{sid!r} is a source id without its source: write 'source:id'")
        source, sid = sid.split(":", 1)
    source, sid = source.strip(), sid.strip()
    if not source or any(c.isspace() for c in source) or "/" in source:
        raise ValueError(f"source {source!r} must be a non-empty name without spaces or '/'")
    if not sid:
        raise ValueError(f"source id for source {source!r} is empty")
    if sid.startswith("//"):
        raise ValueError(f"'{source}:{sid}' looks like a URL; only http(s) URLs are accepted")
    return OptOutIdentifier(KIND_SOURCE_ID, f"{source}:{sid}", source, sid)


def parse_identifier(text: str) -> OptOutIdentifier:
    """Detect a bare identifier's kind: content key, http(s) URL, or ``source:id``."""
    text = text.strip()
    if not text:
        raise ValueError("empty identifier")
    if _KEY_RE.match(text):
        return content_key(text)
    scheme = text.split(":", 1)[0].lower()
    if scheme in ("http", "https"):
        return url_identifier(text)
    if ":" in text:
        return source_identifier(None, text)
    raise ValueError(
        f"{text!r} is not a content key (64 hex), an http(s) URL or a 'source:id' pair"
    )


def _by_kind(kind: str, text: str, source: str | None) -> OptOutIdentifier:
    if kind == "identifier":
        return parse_identifier(text)
    if kind == KIND_KEY:
        return content_key(text)
    if kind == KIND_URL:
        return url_identifier(text)
    return source_identifier(source, text)


# --------------------------------------------------------------------------- files


def is_candidate(name: str) -> bool:
    """A finished list file: a known extension, not hidden/private/temporary."""
    if name.startswith((".", "_")) or name.endswith((".tmp", ".partial")):
        return False
    return Path(name).suffix.lower() in FORMATS


def discover_lists(directory: str | Path) -> list[Path]:
    """Candidate list files directly in ``directory``, sorted by name (absent dir: none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and is_candidate(p.name))


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make_list_id(name: str, sha256: str) -> str:
    """A list is its file name plus its content hash: editing a file makes a new list."""
    return f"{name}@{sha256[:16]}"


def _decode(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise OptOutListError(
            "bad_encoding",
            f"{path} is not UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 1]!r})",
        ) from None


def _finish(path: str, fmt: str, found: list[OptOutIdentifier], bad: list[str]) -> OptOutList:
    if bad:
        shown = "; ".join(bad[:MAX_REPORTED])
        more = f" (and {len(bad) - MAX_REPORTED} more)" if len(bad) > MAX_REPORTED else ""
        raise OptOutListError(
            "bad_identifier",
            f"{path}: {len(bad)} malformed entr{'y' if len(bad) == 1 else 'ies'}: {shown}{more}",
        )
    if not found:
        raise OptOutListError("empty", f"{path} holds no identifiers")
    return OptOutList(path=path, format=fmt, identifiers=tuple(sorted(set(found))))


def parse_txt(data: bytes, path: str = "<txt>") -> OptOutList:
    found: list[OptOutIdentifier] = []
    bad: list[str] = []
    for lineno, line in enumerate(_decode(data, path).splitlines(), start=1):
        text = _COMMENT_RE.sub("", line).strip()
        if not text:
            continue
        try:
            found.append(parse_identifier(text))
        except ValueError as exc:
            bad.append(f"line {lineno}: {exc}")
    return _finish(path, "txt", found, bad)


def _column_roles(names: Sequence[str], path: str) -> tuple[dict[str, str], str | None]:
    """Column name -> kind for the recognised columns, and the source column if any."""
    roles: dict[str, str] = {}
    source_col = None
    seen: dict[str, str] = {}
    for name in names:
        norm = (name or "").strip().lower()
        if norm in seen:
            raise OptOutListError(
                "bad_header", f"{path}: columns {seen[norm]!r} and {name!r} are the same column"
            )
        seen[norm] = name
        if norm in _COLUMN_KINDS:
            roles[name] = _COLUMN_KINDS[norm]
        elif norm == _SOURCE_COLUMN:
            source_col = name
    if not roles:
        raise OptOutListError(
            "no_identifier_column",
            f"{path}: no identifier column in {list(names)}; expected one of "
            f"{sorted(_COLUMN_KINDS)}",
        )
    return roles, source_col


def _rows_to_identifiers(
    rows: Iterable[tuple[str, Mapping[str, Any]]],
    roles: Mapping[str, str],
    source_col: str | None,
) -> tuple[list[OptOutIdentifier], list[str]]:
    found: list[OptOutIdentifier] = []
    bad: list[str] = []
    for where, row in rows:
        source = row.get(source_col) if source_col else None
        source = source.strip() if isinstance(source, str) and source.strip() else None
        n = 0
        for column, kind in roles.items():
            cell = row.get(column)
            if cell is None or not str(cell).strip():
                continue
            n += 1
            try:
                found.append(_by_kind(kind, str(cell).strip(), source))
            except ValueError as exc:
                bad.append(f"{where}, column {column!r}: {exc}")
        if n == 0:
            bad.append(f"{where}: no identifier in any of {sorted(roles)}")
    return found, bad


def parse_csv(data: bytes, path: str = "<csv>") -> OptOutList:
    text = _decode(data, path)
    try:
        reader = csv.reader(io.StringIO(text, newline=""), strict=True)
        header = next(reader, None)
        if header is None:
            raise OptOutListError("empty", f"{path} is empty (a header row is required)")
        roles, source_col = _column_roles(header, path)
        rows: list[tuple[str, dict[str, str]]] = []
        bad_shape: list[str] = []
        for cells in reader:
            if not any(c.strip() for c in cells):
                continue  # blank line
            where = f"line {reader.line_num}"
            if len(cells) != len(header):
                bad_shape.append(f"{where}: {len(cells)} fields, the header has {len(header)}")
                continue
            rows.append((where, dict(zip(header, cells, strict=True))))
    except csv.Error as exc:
        raise OptOutListError("unreadable", f"{path}: not valid CSV ({exc})") from None
    found, bad = _rows_to_identifiers(rows, roles, source_col)
    return _finish(path, "csv", found, bad_shape + bad)


def parse_parquet(data: bytes, path: str = "<parquet>") -> OptOutList:
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise OptOutListError(
            "unreadable", f"{path}: not a readable parquet file ({exc})"
        ) from None
    roles, source_col = _column_roles(table.column_names, path)
    for name in [*roles, *([source_col] if source_col else [])]:
        typ = table.schema.field(name).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
            raise OptOutListError(
                "bad_column_type", f"{path}: column {name!r} is {typ}, identifiers must be strings"
            )
    wanted = [*roles, *([source_col] if source_col else [])]
    columns = {name: table.column(name).to_pylist() for name in wanted}
    rows = (
        (f"row {i + 1}", {name: values[i] for name, values in columns.items()})
        for i in range(table.num_rows)
    )
    found, bad = _rows_to_identifiers(rows, roles, source_col)
    return _finish(path, "parquet", found, bad)


def parse_list_bytes(data: bytes, name: str) -> OptOutList:
    """Parse list bytes by the file name's extension; ``OptOutListError`` when malformed."""
    fmt = FORMATS.get(Path(name).suffix.lower())
    if fmt is None:
        raise OptOutListError(
            "unsupported_format", f"{name}: unsupported extension (accepted: {sorted(FORMATS)})"
        )
    return {"txt": parse_txt, "csv": parse_csv, "parquet": parse_parquet}[fmt](data, name)


def parse_list_file(path: str | Path) -> OptOutList:
    path = Path(path)
    if Path(path.name).suffix.lower() not in FORMATS:
        return parse_list_bytes(b"", path.name)  # raises unsupported_format
    return parse_list_bytes(path.read_bytes(), str(path))


# --------------------------------------------------------------------------- Lance


def ensure_scalar_indexes(ds: lance.LanceDataset, indexes: Iterable[tuple[str, str]]) -> list[str]:
    """Create the missing scalar indexes of a non-empty table; the columns indexed now."""
    if ds.count_rows() == 0:
        return []
    have = {tuple(ix["fields"]) for ix in ds.list_indices()}
    created = []
    for column, kind in indexes:
        if (column,) in have:
            continue
        try:
            ds.create_scalar_index(column, kind)
        except (OSError, ValueError) as exc:
            if "already exists" not in str(exc):  # a concurrent creator is fine
                raise
        created.append(column)
    return created


def ensure_image_lookup_indexes(lab: Lab, images_table: str = "images") -> list[str]:
    """BTREE indexes on images.url/source_id (and key), so resolving a list is index probes.

    Lance scans fragments appended after an index was built, so results stay exact between
    rebuilds; the maintenance job folds new fragments into the indexes.
    """
    if not lab.exists(images_table):
        return []
    return ensure_scalar_indexes(lab.dataset(images_table), IMAGE_LOOKUP_INDEXES)


def match_filter(kind: str, values: Sequence[str]) -> str:
    """The ``images`` predicate for one chunk of identifiers of one kind (index-served)."""
    if kind == KIND_KEY:
        return in_list("key", values)
    if kind == KIND_URL:
        return in_list("url", values)
    if kind == KIND_SOURCE_ID:
        return in_list("source_id", values)
    raise ValueError(f"unknown identifier kind {kind!r}; expected one of {KINDS}")


def _chunks(items: Sequence[Any], size: int = LOOKUP_CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def resolve_identifiers(
    lab: Lab, identifiers: Sequence[OptOutIdentifier], images_table: str = "images"
) -> dict[OptOutIdentifier, list[tuple[str, str]]]:
    """Identifier -> sorted (batch, key) pairs of the images it names (empty: none yet)."""
    out: dict[OptOutIdentifier, list[tuple[str, str]]] = {i: [] for i in identifiers}
    if not identifiers or not lab.exists(images_table):
        return out
    ds = lab.dataset(images_table)
    for kind in KINDS:
        group = [i for i in identifiers if i.kind == kind]
        if kind == KIND_SOURCE_ID:
            by_value: dict[tuple[str | None, str], list[OptOutIdentifier]] = {}
            for i in group:
                by_value.setdefault((i.source, i.source_id or ""), []).append(i)
            probe = sorted({i.source_id or "" for i in group})
            columns = ["batch", "key", "source", "source_id"]
        else:
            by_value = {(None, i.value): [i] for i in group}
            probe = sorted(i.value for i in group)
            column = {KIND_KEY: "key", KIND_URL: "url"}[kind]
            columns = list(dict.fromkeys(["batch", "key", column]))
        for chunk in _chunks(probe):
            rows = ds.to_table(columns=columns, filter=match_filter(kind, chunk)).to_pylist()
            for r in rows:
                if kind == KIND_SOURCE_ID:
                    hits = by_value.get((r["source"], r["source_id"]), [])
                else:
                    hits = by_value.get((None, r[column]), [])
                for i in hits:
                    out[i].append((r["batch"], r["key"]))
    return {i: sorted(set(m)) for i, m in out.items()}


def opt_out_rows(
    list_id: str,
    matches: Mapping[OptOutIdentifier, Sequence[tuple[str, str]]],
    received_at: datetime,
) -> pa.Table:
    """``opt_outs`` rows: one per (identifier, matched image), or one with no match."""
    cols: dict[str, list[Any]] = {f.name: [] for f in OPT_OUTS.schema}
    for ident in sorted(matches):
        for batch, key in matches[ident] or [(None, None)]:
            cols["list_id"].append(list_id)
            cols["identifier"].append(ident.value)
            cols["identifier_kind"].append(ident.kind)
            cols["received_at"].append(received_at)
            cols["matched_key"].append(key)
            cols["matched_batch"].append(batch)
    return pa.table(cols, schema=OPT_OUTS.schema)


def replace_rows(lab: Lab, spec: TableSpec, column: str, value: str, rows: pa.Table) -> int:
    """Make ``rows`` exactly the rows of ``spec`` whose ``column`` is ``value``, in one commit.

    A full-replacement ``merge_insert``: a replay (a tick that died before its cursor moved)
    leaves the same rows, never duplicates. Returns the table version.
    """
    rows = rows.select(spec.schema.names).cast(spec.schema)
    others = set(rows.column(column).to_pylist()) - {value}
    if others:
        raise ValueError(f"rows for {column}={value!r} include other values {sorted(others)}")
    ds = lab.ensure(spec)
    (
        ds.merge_insert(list(spec.identity))
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .when_not_matched_by_source_delete(f"{column} = {sql_literal(value)}")
        .execute(rows)
    )
    ds = lab.dataset(spec.name)
    ensure_scalar_indexes(ds, spec.indexes)
    return lab.dataset(spec.name).version


def recorded_list(lab: Lab, list_id: str) -> dict[str, Any] | None:
    """The ``opt_out_lists`` row of a list already seen (a replay keeps its first arrival)."""
    rows = lab.read(OPT_OUT_LISTS.name, filter=f"list_id = {sql_literal(list_id)}").to_pylist()
    return rows[0] if rows else None


def list_row(
    list_id: str,
    path: str,
    sha256: str,
    received_at: datetime,
    *,
    fmt: str | None,
    error: OptOutListError | None = None,
    rows: int = 0,
    matched_images: int = 0,
    batches: Sequence[str] = (),
) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "list_id": list_id,
                "path": path,
                "format": fmt,
                "sha256": sha256,
                "status": STATUS_REJECTED if error else STATUS_ACCEPTED,
                "reason": error.reason if error else None,
                "rows": rows,
                "matched_images": matched_images,
                "batches": sorted(batches),
                "received_at": received_at,
            }
        ],
        schema=OPT_OUT_LISTS.schema,
    )


def sharded_batches(
    lab: Lab, pairs: Iterable[tuple[str, str]], shard_table: str = "shard_samples"
) -> set[str]:
    """Batches where at least one of these (batch, key) images is in an MDS shard."""
    wanted = set(pairs)
    if not wanted or not lab.exists(shard_table):
        return set()
    ds = lab.dataset(shard_table)
    keys = sorted({k for _, k in wanted})
    found: set[str] = set()
    for chunk in _chunks(keys):
        rows = ds.to_table(columns=["batch", "key"], filter=in_list("key", chunk))
        for b, k in zip(
            rows.column("batch").to_pylist(), rows.column("key").to_pylist(), strict=True
        ):
            if (b, k) in wanted:
                found.add(b)
    return found


def candidate_identifiers(images: pa.Table) -> dict[tuple[str, str], set[str]]:
    """(kind, canonical identifier) -> image keys, for ``images`` rows (key, url, source,
    source_id): every way an opt-out list could name these images."""
    out: dict[tuple[str, str], set[str]] = {}
    cols = {c: images.column(c).to_pylist() for c in ("key", "url", "source", "source_id")}
    for key, url, source, sid in zip(*cols.values(), strict=True):
        out.setdefault((KIND_KEY, key), set()).add(key)
        if url:
            out.setdefault((KIND_URL, url.strip()), set()).add(key)
        if source and sid:
            out.setdefault((KIND_SOURCE_ID, f"{source.strip()}:{sid.strip()}"), set()).add(key)
    return out


def opted_out_keys(lab: Lab, images: pa.Table) -> dict[str, tuple[str, ...]]:
    """Image key -> sorted ids of the accepted lists that name it, matched from the images'
    side (``identifier IN (...)`` probes on the ``opt_outs`` BTREE index). No table: none."""
    if images.num_rows == 0 or not lab.exists(OPT_OUTS.name):
        return {}
    candidates = candidate_identifiers(images)
    ds = lab.dataset(OPT_OUTS.name)
    hits: dict[str, set[str]] = {}
    values = sorted({v for _, v in candidates})
    for chunk in _chunks(values):
        rows = ds.to_table(
            columns=["list_id", "identifier", "identifier_kind"],
            filter=in_list("identifier", chunk),
        )
        for list_id, ident, kind in zip(
            *(rows.column(c).to_pylist() for c in ("list_id", "identifier", "identifier_kind")),
            strict=True,
        ):
            for key in candidates.get((kind, ident), ()):
                hits.setdefault(key, set()).add(list_id)
    return {k: tuple(sorted(v)) for k, v in sorted(hits.items())}
