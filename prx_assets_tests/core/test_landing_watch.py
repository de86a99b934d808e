"""The landing watch finds exactly what a full discovery finds, listing only what changed."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from prx_assets.core.ingest.sources import READY_MARKER, BatchError, discover_batches
from prx_assets.core.ingest.watch import (
    LandingScan,
    WatchState,
    WatchStateError,
    scan_landing,
)


def _age(path: Path, seconds: float = 60.0) -> None:
    """Make a directory look settled: its mtime well before now."""
    t = time.time_ns() - int(seconds * 1e9)
    os.utime(path, ns=(t, t))


def _folder(source: Path, name: str, complete: bool = True) -> Path:
    d = source / name
    d.mkdir()
    (d / "a.jpg").write_bytes(b"x")
    if complete:
        (d / READY_MARKER).touch()
    return d


class Registry:
    """What a sensor would have registered: every key a scan returned."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.state = WatchState()

    def tick(self, landing: Path) -> LandingScan:
        scan = scan_landing(landing, self.state, self.keys.__contains__)
        self.keys |= {r.key for r in scan.new}
        self.state = scan.state
        return scan


def test_an_unchanged_source_is_not_listed_and_a_new_entry_is_found(tmp_path: Path):
    src = tmp_path / "web"
    src.mkdir()
    for i in range(50):
        (src / f"{i:03d}.tar").write_bytes(b"")
    _age(src)
    reg = Registry()
    first = reg.tick(tmp_path)
    assert len(first.new) == 50 and first.listed_sources == 1
    idle = reg.tick(tmp_path)
    assert idle.new == [] and idle.listed_sources == 0 and idle.entries_listed == 0
    (src / "050.tar").write_bytes(b"")  # the kernel moves the source's mtime
    found = reg.tick(tmp_path)
    assert [r.key for r in found.new] == ["web.050"] and found.listed_sources == 1


def test_a_recently_changed_source_is_listed_again(tmp_path: Path):
    """A listing of a directory changed within SETTLE_S is not trusted as complete: an
    entry made in the same timestamp tick would otherwise never be seen."""
    src = tmp_path / "web"
    src.mkdir()
    (src / "000.tar").write_bytes(b"")
    reg = Registry()
    reg.tick(tmp_path)  # mtime is fresh: not settled
    again = reg.tick(tmp_path)
    assert again.listed_sources == 1
    t = os.stat(src).st_mtime_ns
    (src / "001.tar").write_bytes(b"")
    os.utime(src, ns=(t, t))  # a coarse clock: the new entry did not move the mtime
    assert [r.key for r in reg.tick(tmp_path).new] == ["web.001"]


def test_a_pending_folder_is_found_when_it_completes_without_listing(tmp_path: Path):
    src = tmp_path / "studio"
    src.mkdir()
    late = _folder(src, "007", complete=False)
    _folder(src, "006")
    _age(src)
    reg = Registry()
    assert [r.key for r in reg.tick(tmp_path).new] == ["studio.006"]
    assert reg.state.pending == {"studio": ["007"]}
    (late / READY_MARKER).touch()  # inside the folder: the source's mtime does not move
    scan = reg.tick(tmp_path)
    assert [r.key for r in scan.new] == ["studio.007"] and scan.listed_sources == 0
    assert reg.state.pending == {}


def test_two_entries_for_one_key_are_refused_by_name(tmp_path: Path):
    src = tmp_path / "web"
    src.mkdir()
    (src / "a-b.tar").write_bytes(b"")
    _age(src)
    reg = Registry()
    reg.tick(tmp_path)
    (src / "a b.tar").write_bytes(b"")
    with pytest.raises(BatchError, match="two landing entries map to partition"):
        reg.tick(tmp_path)


def test_a_completed_folder_colliding_with_a_registered_key_is_refused(tmp_path: Path):
    src = tmp_path / "web"
    src.mkdir()
    (src / "x-y.tar").write_bytes(b"")
    pending = _folder(src, "x y", complete=False)
    _age(src)
    reg = Registry()
    assert [r.key for r in reg.tick(tmp_path).new] == ["web.x-y"]
    (pending / READY_MARKER).touch()
    with pytest.raises(BatchError, match="two landing entries map to partition"):
        reg.tick(tmp_path)


def test_two_sources_with_one_key_stem_are_refused(tmp_path: Path):
    for name in ("a-b", "a b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "001.tar").write_bytes(b"")
    with pytest.raises(BatchError, match="two landing entries map to partition"):
        Registry().tick(tmp_path)


@pytest.mark.parametrize(
    "state",
    [
        [],
        {"settled": []},
        {"settled": {"a": "1"}},
        {"pending": {"a": "b"}},
        {"pending": {"a": [1]}},
    ],
)
def test_a_damaged_state_is_an_error_not_nothing_new(state):
    with pytest.raises(WatchStateError):
        WatchState.from_json(state)


def test_random_changes_find_exactly_what_full_discovery_finds(tmp_path: Path):
    """Against the O(N) rule it replaces: over many ticks of arrivals, completions, removals
    and ageing, the set of batches registered equals discover_batches' at every tick."""
    rng = random.Random(7)
    sources = [tmp_path / s for s in ("laion", "coyo", "studio")]
    for s in sources:
        s.mkdir()
    reg, n, ever = Registry(), 0, set()
    incomplete: list[Path] = []
    for _ in range(40):
        for _ in range(rng.randint(0, 4)):
            s, n = rng.choice(sources), n + 1
            roll = rng.random()
            if roll < 0.4:
                (s / f"{n:05d}.tar").write_bytes(b"")
            elif roll < 0.6:
                (s / f"{n:05d}.csv").write_text("path\n")
            else:
                incomplete.append(_folder(s, f"{n:05d}", complete=False))
        if incomplete and rng.random() < 0.5:
            (incomplete.pop(rng.randrange(len(incomplete))) / READY_MARKER).touch()
        if rng.random() < 0.3:
            victim = rng.choice(sources)
            files = sorted(p for p in victim.iterdir() if p.is_file())
            if files:
                files[0].unlink()
        if rng.random() < 0.5:
            _age(rng.choice(sources))
        reg.tick(tmp_path)
        ever |= {r.key for r in discover_batches(tmp_path)}
        assert reg.keys == ever  # every batch the full rule sees, and nothing else
