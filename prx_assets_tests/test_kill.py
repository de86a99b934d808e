"""kill -9 during every writer that training depends on, then check what readers see.

Writers: ``mds_shards`` (shard directories + their first skip-list generation),
``skip_lists`` (a partition's new generations, then one manifest flip per directory) and
``raw_images`` (Lance ``Lab.replace_partition`` of ``images`` then ``rejects``). Each trial
starts from a known *old* state, runs the writer towards a known *new* state in a child
process, and kills it with SIGKILL: from inside, at a named crashpoint
(``PRX_CRASH_AT=<point>:<n>``, ``core/crashpoints.py``), or from outside when a watched
file appears. Then, in this process:

- every directory a reader can see holds a complete skip-list generation, and is exactly
  the old or exactly the new version of that directory (shards, index and generation);
- the default loader (``discover_streams`` -> ``ShapeBatchedLoader``, real
  ``StreamingDataset``) yields exactly the samples those versions keep: none that their
  decisions exclude, and never one excluded in both;
- Lance shows a batch's old rows or its new rows, never a mix, never none;
- a rerun of the writer restores byte-identical files (shards, index, sidecars, manifest)
  and identical Lance rows, and leaves no temporary behind.

Children are forked from a forkserver that preloaded the writers (``kill_jobs.py``), so a
trial costs a fork, not an interpreter start. Linux only (SIGKILL, fork).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from PIL import Image

from prx_assets.core.crashpoints import CRASHPOINTS, parse_spec
from prx_assets.core.shards.mds import MDSSample, recover_partition
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    MANIFEST_BASENAME,
    RETENTION_ENV,
    load_generation,
    read_index_shards,
)
from prx_assets.demo.jpegs import encoded
from prx_assets_tests import kill_jobs
from prx_assets_tests.forkservers import forkserver_preloading

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL + forkserver: Linux")

PHOTOS = Path(__file__).resolve().parents[1] / "prx_assets" / "demo" / "photos"
BATCH = "kill.b0"
KILLED = -signal.SIGKILL
TRIAL_TIMEOUT_S = 120.0


# -- the harness -------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _no_sidecar_retention():
    """The trials kill writers inside their sweeps (``skiplists.stale_removed``), which
    delete superseded sidecars only without the retention: 0 here, set before the
    forkserver starts so every trial and rerun runs the same way."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RETENTION_ENV, "0")
        yield


@pytest.fixture(scope="module")
def forkserver(_no_sidecar_retention):  # noqa: ARG001 - ordering: env before the server
    """A forkserver context whose server has imported every writer (see kill_jobs)."""
    with forkserver_preloading(["prx_assets_tests.kill_jobs"]) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Where the trials write: tmpfs when there is one. SIGKILL keeps the page cache, so
    what a kill leaves is the same on tmpfs as on disk (power loss is another test), and a
    shared disk's fsync latency would otherwise dominate the run time."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="prx-kill-", dir=shm))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path_factory.mktemp("kill")


@dataclass
class Trial:
    crash_at: str | None
    exitcode: int | None


def run_trial(
    ctx,  # noqa: ANN001 - a multiprocessing context
    job: str,
    kwargs: dict[str, Any],
    crash_at: str | None = None,
    kill_when: Callable[[], bool] | None = None,
) -> Trial:
    """Run ``job`` in a child; killed by its crashpoint or, with ``kill_when``, from here."""
    if crash_at is not None:
        assert parse_spec(crash_at)[0] in CRASHPOINTS
    proc = ctx.Process(target=kill_jobs.run_job, args=(job, crash_at, kwargs))
    proc.start()
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    if kill_when is not None:
        while proc.is_alive() and time.monotonic() < deadline:
            if kill_when():
                os.kill(proc.pid, signal.SIGKILL)  # kill -9 from outside
                break
            time.sleep(0.0005)
    proc.join(max(0.0, deadline - time.monotonic()))
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"{job} ({crash_at}) hung for {TRIAL_TIMEOUT_S}s")
    trial = Trial(crash_at, proc.exitcode)
    proc.close()
    return trial


def appears(root: Path, predicate: Callable[[str], bool]) -> Callable[[], bool]:
    """A watcher: true once any path under ``root`` has a name satisfying ``predicate``."""

    def seen() -> bool:
        for _dirpath, dirnames, filenames in os.walk(root):
            if any(predicate(n) for n in (*dirnames, *filenames)):
                return True
        return False

    return seen


def tree_files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path (hidden temporaries included)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def hidden_entries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*"))


def visible_dirs(shards_root: Path) -> list[str]:
    """``mds/<tier>/<H>x<W>/<batch>`` directories a reader can see (as discover does)."""
    return sorted(
        str(p.relative_to(shards_root))
        for p in shards_root.glob("mds/*/*/*")
        if p.is_dir() and not p.name.startswith(".") and (p / INDEX_BASENAME).is_file()
    )


def default_loader_keys(ctx, shards_root: Path) -> list[str]:  # noqa: ANN001
    """What training would read: the project loader with its defaults (in a child)."""
    out = shards_root.parent / f".loader-keys-{os.getpid()}.json"
    trial = run_trial(ctx, "loader_keys", {"shards_root": str(shards_root), "out": str(out)})
    assert trial.exitcode == 0, f"the loader process died ({trial.exitcode})"
    result = json.loads(out.read_text())
    out.unlink()
    if "error" in result:
        raise AssertionError(f"the default loader failed:\n{result['error']}")
    return result["keys"]


@dataclass(frozen=True)
class DirVersion:
    """One complete version of a directory: its bytes and the keys its generation keeps."""

    index: bytes
    manifest: bytes
    kept: tuple[str, ...]


def raw_keys(d: Path) -> list[str]:
    """Every sample key of a directory in index order, ignoring skip-lists (MDS reader)."""
    from streaming.base.format import reader_from_json

    index = json.loads((d / INDEX_BASENAME).read_bytes())
    keys = []
    for info in index["shards"]:
        reader = reader_from_json(str(d), None, info)
        keys += [reader.get_item(i)["key"] for i in range(reader.samples)]
    return keys


def versions(shards_root: Path) -> dict[str, DirVersion]:
    """Each visible directory's version, its kept keys computed from the sidecars directly."""
    out = {}
    for rel in visible_dirs(shards_root):
        d = shards_root / rel
        out[rel] = DirVersion(
            (d / INDEX_BASENAME).read_bytes(),
            (d / MANIFEST_BASENAME).read_bytes(),
            kept_keys(d, load_generation(d)),
        )
    return out


def kept_keys(d: Path, generation: Any) -> tuple[str, ...]:
    """The keys of directory ``d`` its skip-list ``generation`` keeps, in index order."""
    keys, kept, start = raw_keys(d), [], 0
    for name, n in read_index_shards(d):
        skipped = set(generation.skiplists[name].indices)
        kept += [k for i, k in enumerate(keys[start : start + n]) if i not in skipped]
        start += n
    return tuple(kept)


def moved_away_dirs(shards_root: Path) -> list[str]:
    """``mds/<tier>/<H>x<W>/<batch>`` of directories a write renamed to ``.<batch>.old``
    and did not put back (no ``<batch>`` beside it)."""
    out = []
    for p in shards_root.glob("mds/*/*/.*.old"):
        batch = p.name[1 : -len(".old")]
        if not (p.parent / batch).exists():
            out.append(str((p.parent / batch).relative_to(shards_root)))
    return sorted(out)


def check_readers(
    ctx,  # noqa: ANN001 - the forkserver context
    shards_root: Path,
    old: Mapping[str, DirVersion],
    new: Mapping[str, DirVersion],
    never: set[str],
) -> dict[str, bool]:
    """After a kill: old-or-new per directory, each complete; the loader agrees exactly.

    Never fewer directories silently: while a directory is moved away and not back, the
    loader refuses, naming it; then the sweep every write starts with
    (``recover_partition``) puts it back or finishes its replacement, and the loader reads
    old-or-new again. Otherwise every directory both versions have is visible, and one only
    the old version has is gone only once every directory of the new version is in place.

    Returns, per visible directory, whether it is on its new version.
    """
    moved = moved_away_dirs(shards_root)
    if moved:
        with pytest.raises(AssertionError) as refused:
            default_loader_keys(ctx, shards_root)
        assert "DirectoryMovedAway" in str(refused.value), refused.value
        for rel in moved:
            assert repr(rel) in str(refused.value)
        for batch in sorted({rel.rsplit("/", 1)[1] for rel in moved}):
            recover_partition(shards_root, batch)  # what the next write does first
        assert moved_away_dirs(shards_root) == []
    visible = set(visible_dirs(shards_root))
    assert set(old) & set(new) <= visible, f"{sorted(set(old) & set(new) - visible)} vanished"
    if set(old) - set(new) - visible:  # a directory the new version drops is gone ...
        assert set(new) <= visible  # ... only after every new one is in place
    expected: Counter[str] = Counter()
    on_new = {}
    for rel in visible_dirs(shards_root):
        d = shards_root / rel
        load_generation(d)  # a complete, verified generation (raises otherwise)
        now = ((d / INDEX_BASENAME).read_bytes(), (d / MANIFEST_BASENAME).read_bytes())
        match = [v for v in (old.get(rel), new.get(rel)) if v and (v.index, v.manifest) == now]
        assert match, f"{rel}: neither its old nor its new version (a mix, or unknown)"
        expected.update(match[0].kept)
        on_new[rel] = match[-1] is new.get(rel)
    yielded = Counter(default_loader_keys(ctx, shards_root))
    assert yielded == expected
    assert not set(yielded) & never, "a sample excluded before and after was yielded"
    return on_new


@pytest.fixture(scope="module")
def tiles() -> list[bytes]:
    """Small real JPEGs cut from the demo photos."""
    rng = random.Random(10)
    photos = [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.png"))[:6]]
    out = []
    for i in range(48):
        img = photos[i % len(photos)]
        x, y = rng.randrange(img.width - 96), rng.randrange(img.height - 96)
        out.append(encoded(img.crop((x, y, x + 96, y + 96)).resize((24, 16)), "JPEG", quality=85))
    return out


def _sample(key: str, image: bytes, bucket: tuple[int, str], caption: str) -> MDSSample:
    return MDSSample(
        key=key,
        image=image,
        caption=caption,
        orig_width=96,
        orig_height=96,
        tier=bucket[0],
        shape=bucket[1],
        source="kill-test",
        license="cc0",
    )


def assert_enough_kills(trials: Sequence[Trial], at_least: int = 20) -> None:
    killed = [t for t in trials if t.exitcode == KILLED]
    assert all(t.exitcode in (KILLED, 0) for t in trials), [t for t in trials]
    assert all(t.exitcode == KILLED for t in trials if t.crash_at), [
        t for t in trials if t.crash_at and t.exitcode != KILLED
    ]
    assert len(killed) >= at_least, f"only {len(killed)} trials were killed"


# -- mds_shards' writer -----------------------------------------------------------------------

X, Y, Z, W = (512, "16x24"), (512, "24x16"), (1024, "16x32"), (1024, "32x16")
SIZE_LIMIT = 3 * 1400  # about three tiles per shard: several shards per directory
NEVER = {"k03", "k14"}  # opted out in both versions


@dataclass
class ShardStates:
    old_samples: list[MDSSample]
    new_samples: list[MDSSample]
    old_decisions: dict[str, list[str]]
    new_decisions: dict[str, list[str]]
    old_tree: Path
    new_tree: Path
    old: dict[str, DirVersion]
    new: dict[str, DirVersion]


@pytest.fixture(scope="module")
def shard_states(workdir: Path, tiles) -> ShardStates:
    """Old: buckets X, Y, Z; new: X and Y rewritten (keys added, dropped, recaptioned and
    redecided), Z gone, W new. Both written uninterruptedly as references."""
    base = workdir / "mds-states"
    old_plan = {X: range(0, 9), Y: range(9, 17), Z: range(17, 22)}
    new_plan = {X: [*range(1, 9), 30, 31], Y: range(9, 19), W: range(22, 28)}

    def samples(plan, caption: str) -> list[MDSSample]:
        return [
            _sample(f"k{i:02d}", tiles[i], bucket, f"{caption} {i}")
            for bucket, keys in plan.items()
            for i in keys
        ]

    state = ShardStates(
        old_samples=samples(old_plan, "old"),
        new_samples=samples(new_plan, "new"),
        old_decisions={"k03": ["opt_out"], "k14": ["opt_out"], "k05": ["duplicate"]},
        new_decisions={
            "k03": ["opt_out"],
            "k14": ["opt_out"],
            "k06": ["class_text"],
            "k10": ["no_caption"],
            "k24": ["duplicate"],
        },
        old_tree=base / "old",
        new_tree=base / "new",
        old={},
        new={},
    )
    kill_jobs.write_shards(
        str(state.old_tree), BATCH, state.old_samples, state.old_decisions, SIZE_LIMIT
    )
    shutil.copytree(state.old_tree, state.new_tree)
    kill_jobs.write_shards(
        str(state.new_tree), BATCH, state.new_samples, state.new_decisions, SIZE_LIMIT
    )
    # The same state written from scratch is byte-identical (content-addressed, no clock).
    fresh = base / "fresh"
    kill_jobs.write_shards(str(fresh), BATCH, state.new_samples, state.new_decisions, SIZE_LIMIT)
    assert tree_files(fresh) == tree_files(state.new_tree)
    state.old, state.new = versions(state.old_tree), versions(state.new_tree)
    assert set(state.old) == {f"mds/{t}/{s}/{BATCH}" for t, s in (X, Y, Z)}
    assert set(state.new) == {f"mds/{t}/{s}/{BATCH}" for t, s in (X, Y, W)}
    for rel in set(state.old) & set(state.new):
        assert state.old[rel].index != state.new[rel].index  # every shared bucket changes
    for version, decisions in ((state.old, state.old_decisions), (state.new, state.new_decisions)):
        kept = {k for v in version.values() for k in v.kept}
        written = {
            s.key for s in (state.old_samples if version is state.old else state.new_samples)
        }
        assert kept == written - set(decisions)  # the references are right
    return state


MDS_CRASHES = [
    "mds.sample_written:1",
    "mds.sample_written:7",
    "mds.sample_written:15",
    "mds.sample_written:26",
    "mds.tmp_written:1",
    "mds.tmp_written:2",
    "mds.tmp_written:3",
    "skiplists.sidecar_written:1",
    "skiplists.sidecar_written:5",
    "skiplists.manifest_staged:2",
    "skiplists.manifest_published:3",
    "mds.tmp_screened:1",
    "mds.tmp_screened:2",
    "mds.tmp_screened:3",
    "mds.old_moved_away:1",
    "mds.old_moved_away:2",
    "mds.dir_in_place:1",
    "mds.dir_in_place:2",
    "mds.dir_in_place:3",
    "mds.stale_dir_moved_away:1",
    "mds.old_condemned:1",  # a rewritten directory's previous version, half deleted
    "mds.old_condemned:3",  # the dropped directory, renamed away and half deleted
]


def test_kill_mds_writer(forkserver, shard_states: ShardStates, workdir: Path):
    s = shard_states
    root = workdir / "trial-mds"
    reference = tree_files(s.new_tree)
    watchers = [
        appears(root, lambda n: n == f".{BATCH}.tmp"),  # inside a temporary directory
        appears(root, lambda n: n == f".{BATCH}.old"),  # between the two renames
        appears(root, lambda n: n.startswith(".skiplists.json.")),  # a manifest being staged
    ]
    trials = []
    plan = [(c, None) for c in MDS_CRASHES] + [(None, w) for w in watchers]
    for crash_at, watch in plan:
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(s.old_tree, root)
        kwargs = {
            "root": str(root),
            "batch": BATCH,
            "samples": s.new_samples,
            "decisions": s.new_decisions,
            "size_limit": SIZE_LIMIT,
        }
        trials.append(run_trial(forkserver, "write_shards", kwargs, crash_at, watch))
        check_readers(forkserver, root, s.old, s.new, NEVER)
        # The rerun (what the next materialisation does) restores the new state exactly.
        kill_jobs.write_shards(str(root), BATCH, s.new_samples, s.new_decisions, SIZE_LIMIT)
        assert tree_files(root) == reference, f"rerun after {crash_at} differs"
        assert hidden_entries(root) == []
    assert_enough_kills(trials)


# -- skip_lists' writer -----------------------------------------------------------------------


@dataclass
class SkipStates:
    old_tree: Path
    new_tree: Path
    new_skips: dict[str, dict[str, dict[int, list[str]]]]  # directory (in the trial) -> skips
    old: dict[str, DirVersion]
    new: dict[str, DirVersion]
    written: int  # sidecar files the new generations add
    swept: int  # sidecar files they supersede


def _skips_by_dir(root: Path, rule: Callable[[str, int], list[str]]) -> dict:
    """Per directory under ``root``: {shard: {index: reasons}} from ``rule(key, index)``."""
    out = {}
    for rel in visible_dirs(root):
        d = root / rel
        keys, start, shards = raw_keys(d), 0, {}
        for name, n in read_index_shards(d):
            for i, key in enumerate(keys[start : start + n]):
                if reasons := rule(key, i):
                    shards.setdefault(name, {})[i] = reasons
            start += n
        out[rel] = shards
    return out


@pytest.fixture(scope="module")
def skip_states(workdir: Path, shard_states: ShardStates) -> SkipStates:
    """The new shard tree; old generation: the first sample of every shard skipped; new:
    the second one instead. Both keep the ``NEVER`` keys out."""
    base = workdir / "skip-states"
    old_tree, new_tree = base / "old", base / "new"
    shutil.copytree(shard_states.new_tree, old_tree)

    def old_rule(key: str, i: int) -> list[str]:
        return ["opt_out"] if key in NEVER else (["duplicate"] if i == 0 else [])

    def new_rule(key: str, i: int) -> list[str]:
        return ["opt_out"] if key in NEVER else (["class_nsfw"] if i == 1 else [])

    old_skips = _skips_by_dir(old_tree, old_rule)
    kill_jobs.refresh_skiplists({str(old_tree / r): s for r, s in old_skips.items()})
    shutil.copytree(old_tree, new_tree)
    new_skips = _skips_by_dir(new_tree, new_rule)
    kill_jobs.refresh_skiplists({str(new_tree / r): s for r, s in new_skips.items()})
    old_files, new_files = set(tree_files(old_tree)), set(tree_files(new_tree))
    state = SkipStates(
        old_tree=old_tree,
        new_tree=new_tree,
        new_skips=new_skips,
        old=versions(old_tree),
        new=versions(new_tree),
        written=len({f for f in new_files - old_files if f.endswith(".skip.json")}),
        swept=len({f for f in old_files - new_files if f.endswith(".skip.json")}),
    )
    assert state.written >= 6 and state.swept >= 6
    assert all(state.old[r].manifest != state.new[r].manifest for r in state.old)
    return state


def test_kill_skiplists_writer(forkserver, skip_states: SkipStates, workdir: Path):
    s = skip_states
    root = workdir / "trial-skiplists"
    dirs = len(s.old)
    reference = tree_files(s.new_tree)
    crashes = [
        *(f"skiplists.sidecar_written:{n}" for n in range(1, s.written + 1)),
        *(f"skiplists.generation_written:{n}" for n in range(1, dirs + 1)),
        *(f"skiplists.manifest_staged:{n}" for n in range(1, dirs + 1)),
        *(f"skiplists.manifest_published:{n}" for n in range(1, dirs + 1)),  # between flips
        *(f"skiplists.stale_removed:{n}" for n in sorted({1, 2, 3, s.swept // 2, s.swept})),
    ]
    watchers = [
        appears(root, lambda n: n.startswith(".skiplists.json.")),  # a manifest being staged
        appears(root, lambda n: n.endswith(".skip.json") and n.startswith(".")),  # a sidecar
    ]
    trials = []
    for crash_at, watch in [(c, None) for c in crashes] + [(None, w) for w in watchers]:
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(s.old_tree, root)
        skips = {str(root / rel): shards for rel, shards in s.new_skips.items()}
        trials.append(
            run_trial(forkserver, "refresh_skiplists", {"skips_by_dir": skips}, crash_at, watch)
        )
        on_new = check_readers(forkserver, root, s.old, s.new, NEVER)
        flags = [on_new[rel] for rel in s.new_skips]  # in publishing order
        assert flags == sorted(flags, reverse=True), f"flipped out of order: {flags}"
        point, n = parse_spec(crash_at) if crash_at else (None, 0)
        if point in ("skiplists.sidecar_written", "skiplists.generation_written"):
            assert not any(flags), "a manifest flipped before every generation was staged"
        elif point in ("skiplists.manifest_staged", "skiplists.manifest_published"):
            assert sum(flags) == n - (point == "skiplists.manifest_staged"), (crash_at, flags)
        kill_jobs.refresh_skiplists(skips)  # the rerun
        assert tree_files(root) == reference, f"rerun after {crash_at} differs"
        assert hidden_entries(root) == []
    assert_enough_kills(trials)


# -- raw_images' writes (Lance) ---------------------------------------------------------------

LANCE_BATCHES = ("src.c0", "src.c1", "src.c2")


@dataclass
class LanceStates:
    old_lab: Path
    landing_new: Path
    old_rows: dict[tuple[str, str], list[dict]]  # (table, batch) -> rows
    new_rows: dict[tuple[str, str], list[dict]]


def _write_landing(landing: Path, tiles: list[bytes], offset: int) -> None:
    """Three folder batches: tiles, a truncated file and a byte-identical copy (rejects)."""
    for b, batch in enumerate(LANCE_BATCHES):
        folder = landing / "src" / batch.split(".")[1]
        folder.mkdir(parents=True)
        picked = tiles[b * 12 + offset : b * 12 + offset + 10]
        for i, data in enumerate(picked):
            (folder / f"img{offset + i:02d}.jpg").write_bytes(data)
        (folder / f"broken{offset}.jpg").write_bytes(picked[0][: len(picked[0]) // 2])
        (folder / f"copy{offset}.jpg").write_bytes(picked[1])
        (folder / "_SUCCESS").write_bytes(b"")


def lance_rows(lab_root: Path) -> dict[tuple[str, str], list[dict]]:
    from prx_assets.core.lab import Lab
    from prx_assets.core.tables import IMAGES, REJECTS

    lab = Lab(lab_root)
    out = {}
    for spec in (IMAGES, REJECTS):
        for batch in LANCE_BATCHES:
            rows = lab.read_batch(spec.name, batch).to_pylist()
            out[(spec.name, batch)] = sorted(rows, key=lambda r: [str(r[c]) for c in spec.identity])
    return out


@pytest.fixture(scope="module")
def lance_states(workdir: Path, tiles) -> LanceStates:
    base = workdir / "lance-states"
    landing_old, landing_new = base / "landing-old", base / "landing-new"
    _write_landing(landing_old, tiles, 0)
    _write_landing(landing_new, tiles, 2)
    old_lab, new_lab = base / "lab-old", base / "lab-new"
    for batch in LANCE_BATCHES:
        kill_jobs.ingest_batch(str(old_lab), str(landing_old), batch, 4)
    shutil.copytree(old_lab, new_lab)
    for batch in LANCE_BATCHES:
        kill_jobs.ingest_batch(str(new_lab), str(landing_new), batch, 4)
    state = LanceStates(old_lab, landing_new, lance_rows(old_lab), lance_rows(new_lab))
    for key in state.old_rows:
        assert state.old_rows[key] and state.old_rows[key] != state.new_rows[key]
    return state


def test_kill_lance_partition_replacement(forkserver, lance_states: LanceStates, workdir: Path):
    s = lance_states
    lab = workdir / "trial-lab"
    # Crashpoint -> which tables must show the new rows afterwards (the others the old).
    expect = {
        "lab.fragment_batch:1": set(),  # images: the first record batch streamed
        "lab.fragment_batch:3": set(),  # images: the last one
        "lab.fragments_written:1": set(),  # images' fragments complete, not committed
        "lab.committed:1": {"images"},  # images committed, rejects not started
        "lab.fragment_batch:4": {"images"},  # rejects' record batch
        "lab.fragments_written:2": {"images"},
        "lab.committed:2": {"images", "rejects"},  # both committed, indexes not refreshed
    }
    crashes = [(batch, crash) for batch in LANCE_BATCHES for crash in expect]

    def new_data_file() -> Callable[[], bool]:
        before = set(os.listdir(lab / "images.lance" / "data"))
        return lambda: bool(set(os.listdir(lab / "images.lance" / "data")) - before)

    plan: list[tuple[str, str | None, bool]] = [(b, c, False) for b, c in crashes]
    plan += [(LANCE_BATCHES[0], None, True), (LANCE_BATCHES[2], None, True)]
    trials = []
    for batch, crash_at, watch in plan:
        shutil.rmtree(lab, ignore_errors=True)
        shutil.copytree(s.old_lab, lab)
        kwargs = {
            "lab_root": str(lab),
            "landing": str(s.landing_new),
            "batch": batch,
            "rows_per_record_batch": 4,
        }
        trials.append(
            run_trial(
                forkserver, "ingest_batch", kwargs, crash_at, new_data_file() if watch else None
            )
        )
        rows = lance_rows(lab)
        for (table, b), now in rows.items():
            allowed = [s.old_rows[(table, b)]] + ([s.new_rows[(table, b)]] if b == batch else [])
            assert now in allowed, f"{table}/{b} after {crash_at}: neither old nor new rows"
            if crash_at is not None and b == batch:  # and exactly where the kill landed
                want = s.new_rows if table in expect[crash_at] else s.old_rows
                assert now == want[(table, b)], f"{table}/{b} after {crash_at}"
        kill_jobs.ingest_batch(str(lab), str(s.landing_new), batch, 4)  # the rerun
        rows = lance_rows(lab)
        for (table, b), now in rows.items():
            expected = s.new_rows if b == batch else s.old_rows
            assert now == expected[(table, b)], f"{table}/{b}: rerun after {crash_at} differs"
    assert_enough_kills(trials)


# -- real Dagster runs: materialize(mds_shards) and materialize(skip_lists) ---------------------

DEMO_BATCH = "public-skimage.000"
PIPELINE_CONFIG = {"ops": {"mds_shards": {"config": {"shard_size_limit": 600_000}}}}
SNAPSHOT_PARTS = ("lab", "shards")


def _materialize_here(data_root: Path, assets: list, policy=None) -> None:  # noqa: ANN001
    from dagster import DagsterInstance, materialize

    from prx_assets.defs.partitions import BATCHES
    from prx_assets.defs.resources import LabResource
    from prx_assets.defs.skiplists.config import SkipPolicyResource

    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(BATCHES.name, [DEMO_BATCH])
        result = materialize(
            assets,
            partition_key=DEMO_BATCH,
            instance=instance,
            resources={
                "lab": LabResource(data_root=str(data_root)),
                "skip_policy": policy or SkipPolicyResource(),
            },
            run_config=PIPELINE_CONFIG if any(a.key.path == ["mds_shards"] for a in assets) else {},
        )
    assert result.success


def _snapshot(data_root: Path, dest: Path) -> Path:
    for part in SNAPSHOT_PARTS:
        shutil.copytree(data_root / part, dest / part)
    return dest


def _restore(snapshot: Path, data_root: Path) -> None:
    for part in SNAPSHOT_PARTS:
        shutil.rmtree(data_root / part, ignore_errors=True)
        shutil.copytree(snapshot / part, data_root / part)


def _lab_rows(data_root: Path, table: str, drop: tuple[str, ...] = ()) -> list[dict]:
    from prx_assets.core.lab import Lab

    rows = Lab(data_root / "lab").read_batch(table, DEMO_BATCH).to_pylist()
    return sorted(({k: v for k, v in r.items() if k not in drop} for r in rows), key=str)


@dataclass
class PipelineStates:
    mds_old: Path  # shards under decisions A, the lab already at decisions B
    mds_new: Path  # after mds_shards under B
    skip_old: Path  # mds_new plus an opt-out list (decisions C)
    skip_new: Path  # after skip_lists under C
    relax_old: Path  # skip_new with the list withdrawn (decisions D: the policy relaxes)
    relax_new: Path  # after skip_lists under D
    never: set[str]  # excluded under A, B, C and D


def _caption_rows(keys: list[str], version: str) -> pa.Table:
    from prx_assets.core.tables import CAPTIONS

    when = datetime(2024, 1, 1, tzinfo=UTC)
    rows = [
        {
            "key": k,
            "batch": DEMO_BATCH,
            "caption": f"{version} caption of {k[:10]}",
            "is_fallback": True,
            "backend": "alt_text",
            "model_id": "",
            "prompt_version": "",
            "backend_fingerprint": "fp-test",
            "created_at": when,
        }
        for k in keys
    ]
    return pa.Table.from_pylist(rows, schema=CAPTIONS.schema)


def _list_rows(lab_root: Path, list_id: str) -> dict[str, list]:
    from prx_assets.core.lab import Lab

    lab = Lab(lab_root)
    out = {}
    for table, cols in (
        ("opt_outs", ["identifier", "matched_batch", "matched_key"]),
        ("opt_out_lists", ["status", "rows", "matched_images"]),
    ):
        rows = lab.read(table, cols, f"list_id = '{list_id}'") if lab.exists(table) else None
        out[table] = sorted(map(str, rows.to_pylist())) if rows is not None else []
    return out


def test_kill_streamed_opt_out_intake(forkserver, workdir: Path):
    """A list taken in as 3 chunks, killed mid-stream, between its fragments and its commit,
    after the opt_outs commit, and from outside when its first data file appears: its rows
    are all there or none (never a part of the list), and the rerun records exactly what
    an uninterrupted intake does."""
    from prx_assets.core.lab import Lab
    from prx_assets.core.skiplists.intake import ListIntake
    from prx_assets.core.skiplists.optouts import file_sha256, make_list_id
    from prx_assets_tests.core.skip_world import World, key_of

    base = workdir / "intake"
    shutil.rmtree(base, ignore_errors=True)
    world = World(Lab(base / "pristine"))
    names = [f"img{i}" for i in range(6)]
    for i, name in enumerate(names):
        world.image(name, f"src.{i % 2}")
    world.commit()
    drop = base / "optouts"
    drop.mkdir()
    lines = [key_of(n) for n in names] + ["c" * 64, "https://example.org/none.jpg"]
    (drop / "registry.txt").write_text("\n".join(lines) + "\n")
    list_id = make_list_id("registry.txt", file_sha256(drop / "registry.txt"))
    reference = base / "reference"
    shutil.copytree(base / "pristine", reference)
    ListIntake(Lab(reference), drop, list_id, chunk_entries=3).run()
    want = _list_rows(reference, list_id)
    assert len(want["opt_outs"]) == 8 and "accepted" in want["opt_out_lists"][0]
    lab = base / "trial"

    def first_data_file() -> Callable[[], bool]:
        return appears(lab / "opt_outs.lance" / "data", lambda n: n.endswith(".lance"))

    plan = [
        ("lab.fragments_written:1", None),  # opt_outs' fragments all written, not committed
        ("lab.committed:1", None),  # opt_outs committed, opt_out_lists not yet
        (None, first_data_file),  # kill -9 from outside, at the first data file
    ]
    for crash_at, watch in plan:
        shutil.rmtree(lab, ignore_errors=True)
        shutil.copytree(base / "pristine", lab)
        kwargs = {
            "lab_root": str(lab),
            "directory": str(drop),
            "list_id": list_id,
            "chunk_entries": 3,
        }
        trial = run_trial(forkserver, "take_in_list", kwargs, crash_at, watch() if watch else None)
        after = _list_rows(lab, list_id)
        if trial.exitcode == 0:  # the watcher lost the race: the intake finished whole
            assert crash_at is None and after == want
            continue
        assert after["opt_outs"] in ([], want["opt_outs"]), f"{crash_at}: a part of the list"
        assert after["opt_out_lists"] == [], f"{crash_at}: recorded before its rows committed"
        kill_jobs.take_in_list(**kwargs)  # the rerun
        assert _list_rows(lab, list_id) == want, f"after {crash_at or 'watcher'} and a rerun"


@pytest.fixture(scope="module")
def pipeline_states(workdir: Path, demo_source) -> PipelineStates:
    """The demo batch through every stage, by real materialisations, to four states."""
    from prx_assets.core.lab import Lab
    from prx_assets.core.skiplists.identifiers import content_key
    from prx_assets.core.skiplists.intake import opt_out_rows
    from prx_assets.core.tables import CAPTIONS, OPT_OUTS, RESOLUTION
    from prx_assets.defs.ingest.assets import raw_images
    from prx_assets.defs.resolution.assets import resolution_profile
    from prx_assets.defs.shards.assets import bucket_assignments, mds_shards
    from prx_assets.defs.skiplists.assets import build_skiplist_assets
    from prx_assets_tests.facts import plant_decision_facts

    landing, _ = demo_source
    root = workdir / "pipeline"
    shutil.copytree(landing, root / "landing", symlinks=True)
    _materialize_here(root, [raw_images, resolution_profile])
    lab = Lab(root / "lab")
    eligible = sorted(
        r["key"] for r in lab.read_batch(RESOLUTION.name, DEMO_BATCH).to_pylist() if r["eligible"]
    )
    assert len(eligible) >= 8
    uncaptioned, text, dup, keeper, nsfw, *rest = eligible
    captioned = [k for k in eligible if k != uncaptioned]
    # A: one text image, one duplicate, one without a caption; every other fact known.
    lab.replace_partition(CAPTIONS, DEMO_BATCH, _caption_rows(captioned, "first"))
    facts = {"copies": {dup: keeper}}
    plant_decision_facts(lab, DEMO_BATCH, eligible, labels={text: "text"}, **facts)
    _materialize_here(root, [bucket_assignments, mds_shards])
    _materialize_here(root, build_skiplist_assets())
    # B: every caption rewritten (every directory's shards change), one more class excluded.
    lab.replace_partition(CAPTIONS, DEMO_BATCH, _caption_rows(captioned, "second"))
    plant_decision_facts(lab, DEMO_BATCH, eligible, labels={text: "text", nsfw: "nsfw"}, **facts)
    mds_old = _snapshot(root, workdir / "mds-old")
    _materialize_here(root, [mds_shards])
    mds_new = _snapshot(root, workdir / "mds-new")
    # C: an opt-out list naming images in two different directories.
    where = {r["key"]: r["relative_dir"] for r in _lab_rows(root, "shard_samples")}
    first, second = rest[0], next(k for k in rest if where[k] != where[rest[0]])
    ids = {content_key(first): [], content_key(second): []}
    when = datetime(2024, 1, 2, tzinfo=UTC)
    lab.replace_rows(OPT_OUTS, "list_id", "kill.txt@1", opt_out_rows("kill.txt@1", ids, when))
    skip_old = _snapshot(root, workdir / "skip-old")
    _materialize_here(root, build_skiplist_assets())
    skip_new = _snapshot(root, workdir / "skip-new")
    # D: the list withdrawn; the two images it named train again.
    lab.replace_rows(OPT_OUTS, "list_id", "kill.txt@1", opt_out_rows("kill.txt@1", {}, when))
    relax_old = _snapshot(root, workdir / "relax-old")
    _materialize_here(root, build_skiplist_assets())
    relax_new = _snapshot(root, workdir / "relax-new")
    shutil.rmtree(root / "landing")
    return PipelineStates(
        mds_old, mds_new, skip_old, skip_new, relax_old, relax_new, {uncaptioned, text, dup}
    )


def test_kill_materialize_mds_shards(forkserver, pipeline_states: PipelineStates, workdir: Path):
    s = pipeline_states
    root = workdir / "trial-pipeline"
    old, new = versions(s.mds_old / "shards"), versions(s.mds_new / "shards")
    assert set(old) == set(new) and sum(old[r].index != new[r].index for r in old) >= 2
    assert sum(len(v.kept) for v in new.values()) >= 4  # decided: most samples train
    reference = tree_files(s.mds_new / "shards")
    rows = _lab_rows(s.mds_new, "shard_samples")
    crashes = [
        "mds.sample_written:2",  # rendering into the first temporary directory
        "skiplists.sidecar_written:1",  # its first generation half written
        "mds.tmp_screened:1",
        "mds.old_moved_away:1",  # between the two renames
        "mds.dir_in_place:2",  # some directories new, the rest old
        "lab.fragments_written:1",  # every directory new, shard_samples not committed
    ]
    trials = []
    for crash_at in crashes:
        _restore(s.mds_old, root)
        kwargs = {
            "asset": "mds_shards",
            "data_root": str(root),
            "batch": DEMO_BATCH,
            "policy": {},
            "run_config": PIPELINE_CONFIG,
        }
        trials.append(run_trial(forkserver, "materialize_asset", kwargs, crash_at))
        check_readers(forkserver, root / "shards", old, new, s.never)
        check_audit_agrees(root, undecided_ok=True)
        from prx_assets.defs.shards.assets import mds_shards

        _materialize_here(root, [mds_shards])  # the rerun: a real materialisation again
        assert tree_files(root / "shards") == reference, f"rerun after {crash_at} differs"
        assert _lab_rows(root, "shard_samples") == rows
        assert hidden_entries(root / "shards") == []
        check_audit_agrees(root)  # settled: every verdict in or out again
    assert_enough_kills(trials, at_least=len(crashes))


def check_audit_agrees(data_root: Path, undecided_ok: bool = False) -> int:
    """Every image of the batch: its audit verdict says "in training" only when the loader
    yields it, and "not in training" / "never sharded" only when it does not (the visible
    generations keep it; ``check_readers`` proved the loader agrees with them); the
    browser's cards likewise. ``undecided_ok``: while the lab and the tree are apart (a
    killed ``mds_shards``), "undecided" is the true answer, never in or out. Returns how many
    verdicts said ``skip_audit`` lags the files (where the table alone would have been wrong).
    """
    from prx_assets.browser.queries import Filters, LabQueries
    from prx_assets.core.audit import EXCLUDED, IN_TRAINING, NEVER_SHARDED, audit_image
    from prx_assets.core.lab import Lab

    shards = data_root / "shards"
    trained: set[str] = set()
    for rel in visible_dirs(shards):
        trained.update(kept_keys(shards / rel, load_generation(shards / rel)))
    lab = Lab(data_root / "lab")
    keys = [r["key"] for r in _lab_rows(data_root, "images")]
    lagging = 0
    for key in keys:
        trail = audit_image(lab, key, shards_root=str(shards))
        (copy,) = [c for c in trail.copies if c.batch == DEMO_BATCH]
        if copy.status == IN_TRAINING:
            assert key in trained, copy.line
        elif copy.status in (EXCLUDED, NEVER_SHARDED):
            assert key not in trained, copy.line
        else:
            assert undecided_ok, copy.line
        lagging += "skip_audit does not record this decision yet" in copy.line
    browser = LabQueries(lab, refresh_s=0, shards_root=str(shards))
    hits = browser.browse(Filters(batches=(DEMO_BATCH,)), limit=200).hits
    cards = {h["key"]: h for h in hits}
    assert set(cards) == set(keys)
    for key, card in cards.items():
        if "excluded" not in card:
            continue  # no skip decision recorded: the card claims nothing
        if not card["excluded"]:  # shown as kept: it trains
            assert key in trained, card
        elif key in trained:  # it trains: only "undecided" may say otherwise
            assert undecided_ok and any("undecided" in r for r in card["reasons"]), card
    return lagging


@pytest.mark.parametrize("direction", ["tighten", "relax"])
def test_kill_materialize_skip_lists(
    forkserver, pipeline_states: PipelineStates, workdir: Path, direction: str
):
    """A list arrives (tighten) or is withdrawn (relax); after every kill the loader sees
    each directory old or new, and the audit agrees with it sample by sample."""
    from prx_assets.defs.skiplists.assets import build_skiplist_assets

    s = pipeline_states
    before, after = (
        (s.skip_old, s.skip_new) if direction == "tighten" else (s.relax_old, s.relax_new)
    )
    root = workdir / f"trial-pipeline-skip-{direction}"
    old, new = versions(before / "shards"), versions(after / "shards")
    changed = [r for r in old if old[r].manifest != new[r].manifest]
    assert len(changed) == 2
    kept = [sum(len(v.kept) for v in x.values()) for x in (old, new)]
    assert (kept[1] < kept[0]) == (direction == "tighten") and kept[0] != kept[1]
    reference = tree_files(after / "shards")
    stamps = ("decided_at", "first_excluded_at", "reason_since")  # wall-clock by design
    audits = [_lab_rows(p, "skip_audit", stamps) for p in (before, after)]
    assert audits[0] != audits[1]
    crashes = [
        "skiplists.sidecar_written:1",  # a new generation half staged
        "skiplists.manifest_published:1",  # between the two directories' flips
        "skiplists.stale_removed:1",
        "lab.fragments_written:1",  # both generations live, skip_audit not committed
        "lab.committed:1",
    ]
    trials, lagged = [], []
    for crash_at in crashes:
        _restore(before, root)
        kwargs = {
            "asset": "skip_lists",
            "data_root": str(root),
            "batch": DEMO_BATCH,
            "policy": {},
            "run_config": {},
        }
        trials.append(run_trial(forkserver, "materialize_asset", kwargs, crash_at))
        check_readers(forkserver, root / "shards", old, new, s.never)
        assert _lab_rows(root, "skip_audit", stamps) in audits  # the old or the new audit
        if check_audit_agrees(root):
            lagged.append(crash_at)
        _materialize_here(root, build_skiplist_assets())  # the rerun
        assert tree_files(root / "shards") == reference, f"rerun after {crash_at} differs"
        assert _lab_rows(root, "skip_audit", stamps) == audits[1]
        assert check_audit_agrees(root) == 0
    assert_enough_kills(trials, at_least=len(crashes))
    # The kills between the flips and the audit's commit left skip_audit behind the files:
    # there a verdict read from the table alone would have contradicted the loader.
    assert "lab.fragments_written:1" in lagged, lagged


# -- snapshot create ---------------------------------------------------------------------------

SNAPSHOT_CRASHES = ["snapshots.pinned:2", "snapshots.file_written:1", "snapshots.recorded:1"]


def test_kill_snapshot_create(pipeline_states: PipelineStates, workdir: Path):
    """A snapshot the loader can open is always one ``snapshot list`` (the lab row, which
    compliance and retirement read too) shows: a kill before the row leaves one that
    neither sees, a kill after it one that is listed but that the loader still refuses,
    naming the rerun; the rerun completes it to what an unkilled run makes."""
    from prx_assets.core.lab import Lab
    from prx_assets.core.snapshots.manifest import SnapshotError
    from prx_assets.core.snapshots.runner import create_snapshot, list_snapshots
    from prx_assets.loader.discover import discover_streams

    root = workdir / "trial-snapshot"
    _restore(pipeline_states.skip_new, root)
    lab, shards = Lab(root / "lab"), root / "shards"
    reference = create_snapshot(lab, shards, "reference").manifest
    frozen = [d.as_dict() for d in reference.directories]
    trials = []
    # Its own server: the materialisations behind pipeline_states started the worker pool's
    # (core/workers.py), whose children would import every writer afresh (seconds each).
    with forkserver_preloading(["prx_assets_tests.kill_jobs"]) as ctx:
        for i, crash_at in enumerate(SNAPSHOT_CRASHES):
            name = f"killed-{i}"
            kwargs = {"lab_root": str(root / "lab"), "shards_root": str(shards), "name": name}
            trials.append(run_trial(ctx, "make_snapshot", kwargs, crash_at))
            listed = name in {r["snapshot_id"] for r in list_snapshots(lab)}
            try:
                discover_streams(shards, snapshot=name)
                refusal = None
            except SnapshotError as exc:
                refusal = str(exc)
            assert refusal is not None or listed, f"{crash_at}: the loader opens an unlisted one"
            assert listed == (crash_at == "snapshots.recorded:1"), crash_at
            if crash_at != "snapshots.pinned:2":  # its manifest is staged, not published
                assert refusal and f"rerun `snapshot create {name}`" in refusal, refusal
            out = create_snapshot(lab, shards, name)  # the rerun
            assert out.created == (crash_at == "snapshots.pinned:2")
            assert [d.as_dict() for d in out.manifest.directories] == frozen
            assert name in {r["snapshot_id"] for r in list_snapshots(lab)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fully skipped directories are left out
                streams = discover_streams(shards, snapshot=name)
            assert sum(b.counts.kept_samples for b in streams) == reference.kept_samples
            assert hidden_entries(shards / "snapshots") == []
    assert_enough_kills(trials, at_least=len(SNAPSHOT_CRASHES))
