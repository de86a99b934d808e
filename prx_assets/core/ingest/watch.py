"""Find the new batches of a local landing zone in O(what changed), not O(what landed).

Why: the landing sensor ticks every 30 s, and ``discover_batches`` stats every entry of every
source (~50 us each): 0.5 s per idle tick at 10,000 batches, ~5 s at 100,000. A deployment
keeps every batch it ever landed, so the cost of doing nothing grew without bound.

How, and why it cannot miss a batch:

- A directory's mtime changes whenever an entry is created, removed or renamed in it. A
  source directory whose mtime equals the one recorded at a listing that saw all of it has
  no new entry: it is not listed again. A listing is recorded as *settled* only when the
  directory's mtime was at least ``SETTLE_S`` old when the listing began, so an entry made
  in the same clock tick as the recorded mtime (coarse timestamps) is always re-listed.
- A folder batch completes when its ``_SUCCESS`` marker appears *inside* it, which does not
  touch the source directory: every folder seen without its marker is kept as *pending* and
  checked (one stat) on every tick until it completes or disappears. At most
  ``MAX_PENDING`` are kept per source; a source with more is never settled (listed every
  tick, as before).
- In a listed source, an entry whose partition key is already known (``is_known``) costs its
  name only; only unknown entries are stat-ed. Two entries that map to one key make the
  source fall back to ``discover_batches``' exact rule (which refuses the pair by name).
- Anything unexpected (the recorded state unreadable, a source that cannot be listed) is an
  error for the caller, never "nothing new".

Object storage has no directory mtime: ``s3://`` landing zones are listed in full
(``remote_landing.discover_landing``), one LIST per 1,000 entries.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prx_assets.core.ingest.sources import (
    READY_MARKER,
    BatchError,
    BatchRef,
    _ignored,
    _ref,
    _source_defaults,
    batch_key,
    discover_batches,
    file_chunk,
)
from prx_assets.core.text import printable_name

SETTLE_S = 2.0  # a directory changed more recently than this is listed again next time
MAX_PENDING = 10_000  # incomplete folders remembered per source
MAX_SOURCES = 100_000  # sources remembered (a damaged state must not grow without bound)


class WatchStateError(ValueError):
    """The recorded watch state cannot be read: the caller must not assume nothing changed."""


@dataclass
class WatchState:
    """What the last scan saw: per source, the mtime of a settled listing and its pending
    (incomplete) folder names. Plain data, stored in the sensor's cursor."""

    settled: dict[str, int] = field(default_factory=dict)  # source name -> mtime_ns
    pending: dict[str, list[str]] = field(default_factory=dict)  # source -> folder names

    def to_json(self) -> dict:
        return {"settled": self.settled, "pending": self.pending}

    @classmethod
    def from_json(cls, data: object) -> WatchState:
        if not isinstance(data, dict):
            raise WatchStateError("watch state is not an object")
        settled, pending = data.get("settled", {}), data.get("pending", {})
        if not isinstance(settled, dict) or not isinstance(pending, dict):
            raise WatchStateError("watch state fields are not objects")
        if len(settled) > MAX_SOURCES or len(pending) > MAX_SOURCES:
            raise WatchStateError("watch state names too many sources")
        for name, mtime in settled.items():
            if not isinstance(name, str) or type(mtime) is not int:
                raise WatchStateError("watch state: a settled entry is not name -> int")
        for name, names in pending.items():
            if (
                not isinstance(name, str)
                or not isinstance(names, list)
                or len(names) > MAX_PENDING
                or not all(isinstance(n, str) for n in names)
            ):
                raise WatchStateError("watch state: a pending entry is not name -> [names]")
        return cls(dict(settled), {k: list(v) for k, v in pending.items()})


@dataclass(frozen=True)
class LandingScan:
    """One scan: the complete batches not known yet, the state for the next scan, and what
    it cost (for the sensor's log)."""

    new: list[BatchRef]
    state: WatchState
    listed_sources: int
    skipped_sources: int
    entries_listed: int


@functools.lru_cache(maxsize=4096)
def _prefix(source: str) -> str:
    return batch_key(source, "")


_PLAIN = re.compile(r"[A-Za-z0-9_\-]+")  # a chunk name batch_key keeps as it is


def _key_of(source: str, name: str, is_dir: bool) -> tuple[str, str, str] | None:
    """(key, chunk, kind) an entry would have as a batch (folders: if complete), or None.

    The common plain name skips ``printable_name`` and the key's substitution (the same
    key, ~3x less CPU: a changed source of 100,000 entries is listed per tick)."""
    if _ignored(name):
        return None
    named = (name, "folder") if is_dir else file_chunk(name)
    if named is None:
        return None
    chunk, kind = named
    if _PLAIN.fullmatch(chunk):
        return _prefix(source) + chunk, chunk, kind
    return batch_key(source, printable_name(chunk)), chunk, kind


def _list_source(
    source_dir: Path, is_known: Callable[[str], bool]
) -> tuple[list[BatchRef], list[str], int]:
    """New complete batches of one source, its incomplete folders, and entries listed."""
    source = printable_name(source_dir.name)
    candidates: dict[str, tuple[str, str, str]] = {}  # key -> (entry name, chunk, kind)
    listed = 0
    with os.scandir(source_dir) as it:
        for entry in it:
            listed += 1
            found = _key_of(source, entry.name, entry.is_dir(follow_symlinks=True))
            if found is None:
                continue
            key, chunk, kind = found
            if key in candidates:  # two entries, one key: the exact rule decides (refuses)
                return _exact(source_dir, is_known), _incomplete(source_dir), listed
            candidates[key] = (entry.name, chunk, kind)
    new, pending = [], []
    defaults: dict[str, str] | None = None
    for key in sorted(candidates):
        name, chunk, kind = candidates[key]
        if kind == "folder" and not (source_dir / name / READY_MARKER).exists():
            pending.append(name)
            continue
        if is_known(key):
            continue
        if defaults is None:
            defaults = _source_defaults(source_dir)
        new.append(_ref(source_dir, source_dir / name, chunk, kind, defaults))
    return new, pending, listed


def _exact(source_dir: Path, is_known: Callable[[str], bool]) -> list[BatchRef]:
    """``discover_batches``' answer for one source (raises on a key taken twice)."""
    own = [r for r in discover_batches(source_dir.parent) if r.path.parent == source_dir]
    return [r for r in own if not is_known(r.key)]


def _completed(
    source_dir: Path, folders: list[str], is_known: Callable[[str], bool]
) -> list[BatchRef]:
    """Refs of pending folders that got their marker. One whose key is already known was
    either registered by hand or collides with another entry's key: the exact rule tells
    (it refuses a collision by name), so a completed folder is never dropped unexplained."""
    source = printable_name(source_dir.name)
    defaults = _source_defaults(source_dir)
    out = []
    for folder in folders:
        found = _key_of(source, folder, True)
        if found is None:
            continue
        if is_known(found[0]):
            _exact(source_dir, is_known)  # raises BatchError on a collision
            continue
        out.append(_ref(source_dir, source_dir / folder, found[1], "folder", defaults))
    return out


def _incomplete(source_dir: Path) -> list[str]:
    with os.scandir(source_dir) as it:
        return sorted(
            e.name
            for e in it
            if not _ignored(e.name)
            and e.is_dir(follow_symlinks=True)
            and not (Path(e.path) / READY_MARKER).exists()
        )


def scan_landing(landing: Path, state: WatchState, is_known: Callable[[str], bool]) -> LandingScan:
    """The complete batches of ``landing`` whose key ``is_known`` denies, listing only the
    sources that changed since ``state`` (and re-checking their pending folders)."""
    started = time.time()
    new: list[BatchRef] = []
    next_state = WatchState()
    listed = skipped = entries = 0
    if not landing.is_dir():
        return LandingScan([], next_state, 0, 0, 0)
    with os.scandir(landing) as it:
        sources = sorted(
            (e for e in it if e.is_dir(follow_symlinks=True) and not _ignored(e.name)),
            key=lambda e: e.name,
        )
    stems = [batch_key(printable_name(e.name), "") for e in sources]
    if len(set(stems)) != len(stems):  # two sources, one key stem: the exact rule refuses
        every = [r for r in discover_batches(landing) if not is_known(r.key)]
        return LandingScan(every, next_state, len(sources), 0, 0)
    for entry in sources:
        source_dir = Path(entry.path)
        mtime = entry.stat(follow_symlinks=True).st_mtime_ns
        name = entry.name
        if state.settled.get(name) == mtime:
            skipped += 1
            completed, still = [], []
            for folder in state.pending.get(name, []):
                path = source_dir / folder
                if (path / READY_MARKER).exists():
                    completed.append(folder)
                elif path.is_dir():
                    still.append(folder)
            if completed:
                new.extend(_completed(source_dir, completed, is_known))
            next_state.settled[name] = mtime
            if still:
                next_state.pending[name] = still
            continue
        listed += 1
        found_new, pending, count = _list_source(source_dir, is_known)
        entries += count
        new.extend(found_new)
        if started - mtime / 1e9 >= SETTLE_S and len(pending) <= MAX_PENDING:
            next_state.settled[name] = mtime
            if pending:
                next_state.pending[name] = pending
    new.sort(key=lambda r: r.key)
    for a, b in zip(new, new[1:], strict=False):
        if a.key == b.key:  # two sources whose names map to one key
            raise BatchError(
                f"two landing entries map to partition {a.key!r}: "
                f"{printable_name(os.fsencode(a.path))} and {printable_name(os.fsencode(b.path))}"
                "; rename one"
            )
    return LandingScan(new, next_state, listed, skipped, entries)


def encode_state(state: WatchState) -> str:
    return json.dumps(state.to_json(), separators=(",", ":"), sort_keys=True)


def decode_state(text: str) -> WatchState:
    try:
        return WatchState.from_json(json.loads(text))
    except (ValueError, RecursionError) as exc:
        raise WatchStateError(f"watch state unreadable: {exc}") from None
