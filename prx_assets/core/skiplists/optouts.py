"""Opt-out list files: which files are lists, their identity, and parsing them within caps.

The parsing half of the opt-out intake (:mod:`prx_assets.core.skiplists.intake` records a
parsed list; :mod:`prx_assets.core.skiplists.matching` finds the images it names). Nothing
here touches the lab.

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

Withdrawals (CSV and parquet): an ``action`` column, ``add`` (or empty, or ``opt_out``) or
``withdraw``; every identifier of a row takes its row's action. A withdrawal is how a
registry's delta says an owner took back an earlier opt-out: it cancels the opt-outs of the
same identifier from *earlier* lists of the *same source*, and only for a source configured
with ``allow_withdrawals`` (any other list holding one is rejected, fail closed). Within one
list, an identifier both added and withdrawn is an opt-out.

Identifier kinds and their canonical forms: :mod:`prx_assets.core.skiplists.identifiers`.

Size: a list file is read as a stream of entries (``ListReader``), never whole, and the
intake writes it a chunk at a time, so a registry dump of 10^8 identifiers is taken in
bounded memory (``bench_optout_registry``). There is no size limit unless the list's source
sets one (``OptOutResource.sources[].max_list_bytes``, or ``max_list_bytes`` for lists no
source matches): a file over it is rejected as ``too_large`` by its size, before a byte is
parsed (for parquet the uncompressed identifier columns count too). A txt/CSV line or a
parquet cell over ``DEFAULT_MAX_LINE_BYTES`` (64 KiB; ``max_line_bytes``) rejects the list
as ``entry_too_long`` without being held whole. Every rejection reason quotes at most 200
characters of an entry and counts the rest (``text.quote_bounded``).

Malformed entries: by default (fail closed) a file with any malformed entry is rejected as
a whole (nothing of it is applied), with the reason (the first few entries, with their
lines, and the count) recorded in ``opt_out_lists`` (status ``rejected``); later lists are
unaffected. A source whose registry says its valid entries stand on their own may set
``on_malformed: record``: each malformed entry is then recorded with its line in
``opt_out_problems`` (the first 10,000; the list's ``malformed`` column counts them all)
and the rest of the list applies. A structural problem (not UTF-8, no identifier column, a
line over the limit) rejects the list under either policy. Fix the file and drop it again:
a list is identified by its file name and the sha256 of its bytes, so new content is a new
list. Lists are additive: editing or deleting a file never withdraws an opt-out already
recorded; a registry's delta of additions is just another list (its intake costs the
delta, not the registry).
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_assets.core.skiplists.identifiers import (
    KIND_KEY,
    KIND_SOURCE_ID,
    KIND_URL,
    OptOutIdentifier,
    identifier_of_kind,
    parse_identifier,
)
from prx_assets.core.text import bound_text, printable_name, quote_bounded, read_lines

FORMATS: dict[str, str] = {".txt": "txt", ".csv": "csv", ".parquet": "parquet"}
MAX_REPORTED = 5  # malformed entries quoted in a rejection reason
DEFAULT_MAX_LIST_BYTES = 64 * 1024 * 1024  # whole-list parsing (parse_list_file)'s default cap
DEFAULT_MAX_LINE_BYTES = 64 * 1024  # one txt/CSV line, one parquet cell
PARQUET_BATCH_ROWS = 4096

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
_ACTION_COLUMN = "action"
ACTION_ADD = "add"
ACTION_WITHDRAW = "withdraw"
DEFAULT_SOURCE = "default"  # the source of lists no configured source matches
_ACTIONS = {"": ACTION_ADD, "add": ACTION_ADD, "opt_out": ACTION_ADD, "withdraw": ACTION_WITHDRAW}


class OptOutListError(ValueError):
    """A list file that cannot be applied; ``code`` is a stable reason, the text the details.

    The details are bounded (``text.bound_text``): whatever a file holds, its rejection
    reason, its ``opt_out_lists`` row and its log line stay small.
    """

    def __init__(self, code: str, message: str) -> None:
        message = bound_text(message)
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def reason(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class OptOutList:
    """One parsed opt-out list: its file, its format and the distinct identifiers it names."""

    path: str
    format: str
    identifiers: tuple[OptOutIdentifier, ...]  # distinct, sorted: the opt-outs
    withdrawals: tuple[OptOutIdentifier, ...] = ()  # distinct, sorted (none named above)


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


def _open_list(path: str | Path) -> BinaryIO:
    """Open a list file for reading; a FIFO or directory swapped in is refused, not waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OptOutListError(
                "not_a_file", f"{printable_name(os.fsencode(path))} is not a regular file"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read in 1 MiB blocks (any size, bounded memory)."""
    h = hashlib.sha256()
    with _open_list(path) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make_list_id(name: str, sha256: str) -> str:
    """A list is its file name plus its content hash: editing a file makes a new list.

    The name is written by the printable rule (``text.printable_name``), so a name that is
    not UTF-8 or holds control characters still makes a valid, loggable id."""
    return f"{printable_name(name)}@{sha256[:16]}"


class _Problems:
    """Malformed entries of a list: the first ``MAX_REPORTED`` quoted, the rest counted."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.count = 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.shown) < MAX_REPORTED:
            self.shown.append(bound_text(message, 400))

    def error(self, path: str) -> OptOutListError:
        shown = "; ".join(self.shown)
        more = f" (and {self.count - len(self.shown)} more)" if self.count > len(self.shown) else ""
        return OptOutListError(
            "bad_identifier",
            f"{path}: {self.count} malformed entr{'y' if self.count == 1 else 'ies'}: "
            f"{shown}{more}",
        )


@dataclass(frozen=True)
class Entry:
    """One entry of a list as read: an identifier, or why the entry is malformed.

    ``where`` says where it is in the file (``line 12``, ``row 7``), so a malformed entry is
    reported, and recorded, with its position."""

    where: str
    identifier: OptOutIdentifier | None
    problem: str | None = None  # bounded; set exactly when ``identifier`` is None
    action: str = ACTION_ADD  # ACTION_WITHDRAW: a withdrawal (CSV/parquet ``action`` column)


def _bad(where: str, message: str) -> Entry:
    return Entry(where, None, bound_text(f"{where}: {message}", 400))


def _collect(path: str, fmt: str, entries: Iterable[Entry]) -> OptOutList:
    """A whole (small) list: every entry held, malformed ones rejecting it."""
    found: set[OptOutIdentifier] = set()
    withdrawn: set[OptOutIdentifier] = set()
    bad = _Problems()
    for entry in entries:
        if entry.identifier is None:
            bad.add(entry.problem or entry.where)
        elif entry.action == ACTION_WITHDRAW:
            withdrawn.add(entry.identifier)
        else:
            found.add(entry.identifier)
    if bad.count:
        raise bad.error(path)
    if not found and not withdrawn:
        raise OptOutListError("empty", f"{path} holds no identifiers")
    return OptOutList(
        path=path,
        format=fmt,
        identifiers=tuple(sorted(found)),
        withdrawals=tuple(sorted(withdrawn - found)),  # in one list, the opt-out wins
    )


def _text_lines(stream: BinaryIO, path: str, max_line_bytes: int) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 stream, a BOM dropped; a line over the cap or bytes that
    are not UTF-8 reject the list (bounded reason, the line never held whole)."""
    for line in read_lines(stream, max_line_bytes):
        data = line.data
        if line.number == 1 and data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        if line.truncated:
            start = data.decode("utf-8", "replace")
            raise OptOutListError(
                "entry_too_long",
                f"{path}: line {line.number} is {line.total_chars:,} characters, over the "
                f"{max_line_bytes:,}-byte line limit: "
                f"{quote_bounded(start, total=line.total_chars)}",
            )
        try:
            yield line.number, data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise OptOutListError(
                "bad_encoding",
                f"{path} is not UTF-8 (line {line.number}, byte {exc.start} of the line: "
                f"{data[exc.start : exc.start + 1]!r})",
            ) from None


def txt_entries(
    stream: BinaryIO, path: str = "<txt>", max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> Iterator[Entry]:
    """The entries of a txt list, one per non-blank line, as they are read."""
    for lineno, line in _text_lines(stream, path, max_line_bytes):
        text = _COMMENT_RE.sub("", line).strip()
        if not text:
            continue
        try:
            yield Entry(f"line {lineno}", parse_identifier(text))
        except ValueError as exc:
            yield _bad(f"line {lineno}", str(exc))


def parse_txt(
    data: bytes | BinaryIO, path: str = "<txt>", max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> OptOutList:
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
    return _collect(path, "txt", txt_entries(stream, path, max_line_bytes))


def _column_roles(names: Sequence[str], path: str) -> tuple[dict[str, str], str | None, str | None]:
    """Column name -> kind for the recognised columns, and the source and action columns."""
    roles: dict[str, str] = {}
    source_col = action_col = None
    seen: dict[str, str] = {}
    for name in names:
        norm = (name or "").strip().lower()
        if norm in seen:
            raise OptOutListError(
                "bad_header",
                f"{path}: columns {quote_bounded(seen[norm])} and {quote_bounded(name)} are "
                "the same column",
            )
        seen[norm] = name
        if norm in _COLUMN_KINDS:
            roles[name] = _COLUMN_KINDS[norm]
        elif norm == _SOURCE_COLUMN:
            source_col = name
        elif norm == _ACTION_COLUMN:
            action_col = name
    if not roles:
        shown = ", ".join(quote_bounded(n, 60) for n in list(names)[:20])
        more = f" and {len(names) - 20} more" if len(names) > 20 else ""
        raise OptOutListError(
            "no_identifier_column",
            f"{path}: no identifier column in [{shown}{more}]; expected one of "
            f"{sorted(_COLUMN_KINDS)}",
        )
    return roles, source_col, action_col


def _row_entries(
    where: str,
    row: Mapping[str, Any],
    roles: Mapping[str, str],
    source_col: str | None,
    action_col: str | None = None,
) -> Iterator[Entry]:
    source = row.get(source_col) if source_col else None
    source = source.strip() if isinstance(source, str) and source.strip() else None
    raw_action = row.get(action_col) if action_col else None
    action = _ACTIONS.get(str(raw_action or "").strip().lower())
    if action is None:
        yield _bad(
            where,
            f"action {quote_bounded(str(raw_action), 60)} is not one of "
            f"{sorted(a for a in _ACTIONS if a)}",
        )
        return
    n = 0
    for column, kind in roles.items():
        cell = row.get(column)
        if cell is None or not str(cell).strip():
            continue
        n += 1
        try:
            yield Entry(where, identifier_of_kind(kind, str(cell).strip(), source), None, action)
        except ValueError as exc:
            problem = f"{where}, column {quote_bounded(column, 60)}: {exc}"
            yield Entry(where, None, bound_text(problem, 400))
    if n == 0:
        yield _bad(where, f"no identifier in any of {sorted(roles)}")


def csv_entries(
    stream: BinaryIO, path: str = "<csv>", max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> Iterator[Entry]:
    """The entries of a CSV list (one per identifier cell), as they are read."""
    lines = (text + "\n" for _, text in _text_lines(stream, path, max_line_bytes))
    try:
        reader = csv.reader(lines, strict=True)
        header = next(reader, None)
        if header is None:
            raise OptOutListError("empty", f"{path} is empty (a header row is required)")
        roles, source_col, action_col = _column_roles(header, path)
        for cells in reader:
            if not any(c.strip() for c in cells):
                continue  # blank line
            where = f"line {reader.line_num}"
            if len(cells) != len(header):
                yield _bad(where, f"{len(cells)} fields, the header has {len(header)}")
                continue
            row = dict(zip(header, cells, strict=True))
            yield from _row_entries(where, row, roles, source_col, action_col)
    except csv.Error as exc:
        raise OptOutListError("unreadable", f"{path}: not valid CSV ({exc})") from None


def parse_csv(
    data: bytes | BinaryIO, path: str = "<csv>", max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> OptOutList:
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
    return _collect(path, "csv", csv_entries(stream, path, max_line_bytes))


def parquet_entries(
    data: bytes | BinaryIO,
    path: str = "<parquet>",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_list_bytes: int | None = DEFAULT_MAX_LIST_BYTES,
) -> Iterator[Entry]:
    """Parquet in record batches. Besides the file's own size, the uncompressed size of its
    identifier columns must stay under ``max_list_bytes`` when there is a limit (a
    compressed column is read whole page by page), and no cell may be longer than
    ``max_line_bytes``."""
    source = pa.BufferReader(data) if isinstance(data, bytes | bytearray) else data
    try:
        pf = pq.ParquetFile(source)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise OptOutListError(
            "unreadable", f"{path}: not a readable parquet file ({exc})"
        ) from None
    roles, source_col, action_col = _column_roles(schema.names, path)
    wanted = [*roles, *(c for c in (source_col, action_col) if c)]
    for name in wanted:
        typ = schema.field(name).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
            raise OptOutListError(
                "bad_column_type",
                f"{path}: column {quote_bounded(name, 60)} is {typ}, identifiers must be strings",
            )
    meta = pf.metadata
    positions = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
    unpacked = sum(
        meta.row_group(g).column(positions[name]).total_uncompressed_size
        for g in range(meta.num_row_groups)
        for name in wanted
        if name in positions
    )
    if max_list_bytes is not None and unpacked > max_list_bytes:
        raise OptOutListError(
            "too_large",
            f"{path}: its identifier columns hold {unpacked:,} bytes uncompressed, over the "
            f"{max_list_bytes:,}-byte limit; split the list",
        )
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted):
            for name in wanted:
                col = batch.column(name)
                if pa.types.is_null(col.type) or col.null_count == len(col):
                    continue
                longest = pc.max(pc.binary_length(col)).as_py() or 0
                if longest > max_line_bytes:
                    raise OptOutListError(
                        "entry_too_long",
                        f"{path}: column {quote_bounded(name, 60)} holds a cell of {longest:,} "
                        f"bytes, over the {max_line_bytes:,}-byte entry limit",
                    )
            columns = {name: batch.column(name).to_pylist() for name in wanted}
            for i in range(batch.num_rows):
                row += 1
                cells = {name: values[i] for name, values in columns.items()}
                yield from _row_entries(f"row {row}", cells, roles, source_col, action_col)
    except (pa.ArrowException, OSError, ValueError) as exc:
        if isinstance(exc, OptOutListError):
            raise
        raise OptOutListError(
            "unreadable", f"{path}: not a readable parquet file ({exc})"
        ) from None


def parse_parquet(
    data: bytes | BinaryIO,
    path: str = "<parquet>",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_list_bytes: int | None = DEFAULT_MAX_LIST_BYTES,
) -> OptOutList:
    return _collect(path, "parquet", parquet_entries(data, path, max_line_bytes, max_list_bytes))


def _too_large(path: str, size: int, max_list_bytes: int) -> OptOutListError:
    return OptOutListError(
        "too_large",
        f"{path} is {size:,} bytes, over the {max_list_bytes:,}-byte limit for one list; "
        "split it into smaller lists",
    )


def _entries(
    fmt: str, stream: BinaryIO, path: str, max_list_bytes: int | None, max_line_bytes: int
) -> Iterator[Entry]:
    if fmt == "txt":
        return txt_entries(stream, path, max_line_bytes)
    if fmt == "csv":
        return csv_entries(stream, path, max_line_bytes)
    return parquet_entries(stream, path, max_line_bytes, max_list_bytes)


def _format_of(name: str) -> str:
    fmt = FORMATS.get(Path(name).suffix.lower())
    if fmt is None:
        raise OptOutListError(
            "unsupported_format",
            f"{printable_name(name)}: unsupported extension (accepted: {sorted(FORMATS)})",
        )
    return fmt


def parse_list_bytes(
    data: bytes,
    name: str,
    *,
    max_list_bytes: int | None = DEFAULT_MAX_LIST_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> OptOutList:
    """Parse list bytes by the file name's extension; ``OptOutListError`` when malformed."""
    fmt = _format_of(name)
    if max_list_bytes is not None and len(data) > max_list_bytes:
        raise _too_large(printable_name(name), len(data), max_list_bytes)
    shown = printable_name(name)
    return _collect(
        shown, fmt, _entries(fmt, io.BytesIO(data), shown, max_list_bytes, max_line_bytes)
    )


class _HashingReader(io.RawIOBase):
    """A read-only view of a file that hashes what is read and refuses reading past ``limit``
    (a file that grows while parsed)."""

    def __init__(self, fh: BinaryIO, limit: int) -> None:
        super().__init__()
        self._fh = fh
        self._limit = limit
        self.sha = hashlib.sha256()
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._fh.readinto(buffer)
        if n:
            self.read_bytes += n
            if self.read_bytes > self._limit:
                raise OptOutListError("changed", "the file grew while it was read")
            self.sha.update(memoryview(buffer)[:n])
        return n or 0

    def finish(self) -> str:
        while self.readinto(bytearray(1 << 20)):
            pass
        return self.sha.hexdigest()


class ListReader:
    """A list file read as a stream of entries, in bounded memory whatever its size.

    ``with ListReader(path) as reader: for entry in reader.entries(): ...`` then
    ``reader.digest()``: the sha256 of every byte of the file, read to its end (the bytes
    the entries came from; a file rewritten in place while read hashes differently, and a
    file that grows while read is refused as ``changed``). ``max_list_bytes`` (None: no
    limit, the default of a streamed intake) refuses a larger file by its size before a
    byte is parsed; lines (and parquet cells) over ``max_line_bytes`` reject the list without
    being held whole. Structural problems (encoding, header, a too-long line) raise
    ``OptOutListError``; a malformed entry is an ``Entry`` with its ``problem``, for the
    caller's policy to reject the list or record it and go on.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_list_bytes: int | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        self.path = Path(path)
        self.shown = printable_name(os.fsencode(self.path))
        self.format = _format_of(self.path.name)
        self.max_list_bytes = max_list_bytes
        self.max_line_bytes = max_line_bytes
        self._fh: BinaryIO | None = None
        self._reader: _HashingReader | None = None
        self._stream: io.BufferedReader | None = None  # txt/CSV: what entries read through
        self._digest: str | None = None

    def __enter__(self) -> ListReader:
        try:
            fh = _open_list(self.path)
        except OSError as exc:
            raise OptOutListError(
                "unreadable", f"{self.shown}: cannot be opened ({exc.strerror})"
            ) from None
        try:
            size = os.fstat(fh.fileno()).st_size
            if self.max_list_bytes is not None and size > self.max_list_bytes:
                raise _too_large(self.shown, size, self.max_list_bytes)
            self.size = size
            self._reader = _HashingReader(fh, size)
            if self.format == "parquet":  # random access: hash it whole first, then parse
                self._digest = self._reader.finish()
                fh.seek(0)
        except BaseException:
            fh.close()
            raise
        self._fh = fh
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            self._fh.close()

    def entries(self) -> Iterator[Entry]:
        assert self._fh is not None and self._reader is not None, "use ListReader in a with"
        if self.format == "parquet":
            yield from parquet_entries(
                self._fh, self.shown, self.max_line_bytes, self.max_list_bytes
            )
            return
        self._stream = io.BufferedReader(self._reader, 1 << 16)
        yield from _entries(
            self.format, self._stream, self.shown, self.max_list_bytes, self.max_line_bytes
        )

    def digest(self) -> str:
        """The sha256 of the whole file (call once the entries are read)."""
        if self._digest is None:
            assert self._reader is not None
            if self._stream is not None:
                while self._stream.read(1 << 20):  # the rest (nothing, at EOF): hash covers it all
                    pass
            self._digest = self._reader.finish()
        return self._digest


def parse_list_file(
    path: str | Path,
    *,
    max_list_bytes: int | None = DEFAULT_MAX_LIST_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    expected_sha256: str | None = None,
) -> OptOutList:
    """Parse a (small) list file whole: every identifier held, any malformed entry
    rejecting it (the intake streams instead: ``ListReader``).

    ``expected_sha256``: the hash its list id was made from; different bytes (the file was
    rewritten in place) reject the list as ``changed`` rather than record other content.
    """
    with ListReader(path, max_list_bytes=max_list_bytes, max_line_bytes=max_line_bytes) as r:
        parsed = _collect(r.shown, r.format, r.entries())
        digest = r.digest()
    check_digest(r.shown, digest, expected_sha256)
    return parsed


def check_digest(shown: str, digest: str, expected_sha256: str | None) -> None:
    """Refuse bytes other than the ones a list id was made from (rewritten in place)."""
    if expected_sha256 is not None and digest != expected_sha256:
        raise OptOutListError(
            "changed",
            f"{shown} changed while it was read (sha256 {digest[:16]}, "
            f"expected {expected_sha256[:16]}); its new content is read as a new list",
        )
