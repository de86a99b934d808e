"""Skip-list sidecars: round trip, validation, tamper detection, digest semantics."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
from pathlib import Path

import pytest
from PIL import Image

from prx_assets.core.skiplists import (
    REASON_CODES,
    SkipList,
    SkipListCorrupt,
    SkipListError,
    SkipListVersionError,
    canonical_json,
    load_skiplists,
    partition_counts,
    read_index_shards,
    read_skiplist,
    sidecar_path,
    skiplist_digest,
    write_partition_skiplists,
    write_skiplist,
)

PHOTO = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos" / "china.jpg"


def _partition(path: Path, n: int = 30) -> list[tuple[str, int]]:
    """A real MDS partition (tiny JPEGs) with several shards."""
    import io

    from streaming import MDSWriter

    img = Image.open(PHOTO).convert("RGB").resize((12, 8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=80)
    data = buf.getvalue()
    columns = {"image": "bytes", "caption": "str", "key": "str"}
    with MDSWriter(out=str(path), columns=columns, size_limit=7 * (len(data) + 60)) as w:
        for i in range(n):
            w.write({"image": data, "caption": f"caption {i}", "key": f"k{i}"})
    shards = read_index_shards(path)
    assert len(shards) >= 3
    return shards


@pytest.fixture
def part(tmp_path: Path) -> tuple[Path, list[tuple[str, int]]]:
    d = tmp_path / "mds" / "0" / "8x12" / "b0"
    return d, _partition(d)


def test_round_trip_sorts_and_dedups_reasons(part):
    d, shards = part
    name, n = shards[0]
    path = write_skiplist(d, name, {5: ["quality", "opt_out", "quality"], 1: "duplicate"})
    assert path == sidecar_path(d, name) == d / f"{name}.skip.json"
    sl = read_skiplist(path)
    assert sl.shard == name
    assert sl.indices == (1, 5)
    assert sl.reasons == (("duplicate",), ("opt_out", "quality"))
    assert sl.as_mapping() == {1: ("duplicate",), 5: ("opt_out", "quality")}
    assert list(sl.keep_indices(n)) == [i for i in range(n) if i not in (1, 5)]
    # Exactly the documented payload, hashed over its canonical JSON.
    obj = json.loads(path.read_bytes())
    assert set(obj) == {"format", "version", "shard", "indices", "reasons", "sha256"}
    payload = {k: v for k, v in obj.items() if k != "sha256"}
    assert obj["sha256"] == hashlib.sha256(canonical_json(payload)).hexdigest()
    assert not [p for p in os.listdir(d) if p.endswith(".tmp")]


def test_rewrite_replaces_atomically_and_empty_sidecar_is_valid(part):
    d, shards = part
    name, n = shards[1]
    write_skiplist(d, name, {0: ["quality"]})
    write_skiplist(d, name, {})
    sl = read_skiplist(sidecar_path(d, name))
    assert sl.indices == () and len(sl.keep_indices(n)) == n
    assert sorted(os.listdir(d)).count(f"{name}.skip.json") == 1


@pytest.mark.parametrize(
    ("skips", "message"),
    [
        ({0: ["spam"]}, "unknown reason"),
        ({0: []}, "no reason code"),
        ({-1: ["quality"]}, "non-negative int"),
        ({True: ["quality"]}, "non-negative int"),
        ({"3": ["quality"]}, "non-negative int"),
        ({10_000: ["quality"]}, "out of range"),
    ],
)
def test_write_rejects_bad_skips(part, skips, message):
    d, shards = part
    with pytest.raises(SkipListError, match=message):
        write_skiplist(d, shards[0][0], skips)
    assert not sidecar_path(d, shards[0][0]).exists()


@pytest.mark.parametrize("name", ["../shard.00000.mds", "sub/shard.00000.mds", "", "x.skip.json"])
def test_write_rejects_bad_shard_names(part, name):
    with pytest.raises(SkipListError):
        write_skiplist(part[0], name, {0: ["quality"]})


def test_write_rejects_shard_not_in_index(part):
    with pytest.raises(SkipListError, match="not a shard of"):
        write_skiplist(part[0], "shard.99999.mds", {0: ["quality"]})


def _rewrite(path: Path, mutate, rehash: bool) -> None:
    obj = json.loads(path.read_bytes())
    mutate(obj)
    if rehash:
        payload = {k: v for k, v in obj.items() if k != "sha256"}
        obj["sha256"] = hashlib.sha256(canonical_json(payload)).hexdigest()
    path.write_bytes(json.dumps(obj).encode())


def test_tampering_is_detected(part):
    d, shards = part
    name = shards[0][0]
    path = write_skiplist(d, name, {2: ["class_nsfw"], 4: ["opt_out"]})
    original = path.read_bytes()

    _rewrite(path, lambda o: o["indices"].pop(), rehash=False)  # un-skip an opt-out by hand
    with pytest.raises(SkipListCorrupt, match="content hash mismatch"):
        read_skiplist(path)

    path.write_bytes(original[: len(original) // 2])  # truncated copy
    with pytest.raises(SkipListCorrupt, match="not valid JSON"):
        read_skiplist(path)

    path.write_bytes(original)
    _rewrite(path, lambda o: o.update(version=2), rehash=True)
    with pytest.raises(SkipListVersionError, match="version 2"):
        read_skiplist(path)

    path.write_bytes(original)
    _rewrite(path, lambda o: o.update(indices=[4, 2]), rehash=True)  # valid hash, bad schema
    with pytest.raises(SkipListCorrupt, match="strictly increasing"):
        read_skiplist(path)

    path.write_bytes(original)
    _rewrite(path, lambda o: o.update(extra=1), rehash=True)
    with pytest.raises(SkipListCorrupt, match="schema"):
        read_skiplist(path)

    # A valid sidecar copied onto another shard's name.
    other = sidecar_path(d, shards[1][0])
    other.write_bytes(original)
    with pytest.raises(SkipListCorrupt, match="belongs to shard"):
        read_skiplist(other)


def test_load_skiplists_missing_is_explicitly_empty_and_orphans_fail(part):
    d, shards = part
    write_skiplist(d, shards[0][0], {0: ["duplicate"]})
    loaded = load_skiplists(d)
    assert list(loaded) == [name for name, _ in shards]
    assert loaded[shards[0][0]].indices == (0,)
    missing = loaded[shards[1][0]]
    assert missing == SkipList.empty(shards[1][0]) and missing.path is None

    (d / "shard.00077.mds.skip.json").write_bytes(b"{}")
    with pytest.raises(SkipListError, match="not in index.json"):
        load_skiplists(d)


def test_digest_identifies_the_filtered_sample_space(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    sa, sb = _partition(a), _partition(b, n=24)
    base = skiplist_digest([a, b])
    assert len(base) == 64

    # Empty sidecars (screened, nothing skipped) are the same as missing ones.
    write_partition_skiplists(a, {})
    assert sorted(p.name for p in a.glob("*.skip.json")) == [f"{n}.skip.json" for n, _ in sa]
    assert skiplist_digest([a, b]) == base

    write_skiplist(a, sa[1][0], {3: ["duplicate"]})
    one = skiplist_digest([a, b])
    assert one != base
    write_skiplist(a, sa[1][0], {3: ["quality", "opt_out"]})  # relabel only
    assert skiplist_digest([a, b]) == one
    write_skiplist(a, sa[1][0], {4: ["duplicate"]})  # another index
    assert skiplist_digest([a, b]) != one
    write_skiplist(a, sa[1][0], {})
    write_skiplist(a, sa[2][0], {3: ["duplicate"]})  # same index, other shard
    assert skiplist_digest([a, b]) not in (base, one)
    assert skiplist_digest([b, a]) != skiplist_digest([a, b])  # stream order matters
    with pytest.raises(TypeError):
        skiplist_digest(str(a))  # type: ignore[arg-type]
    assert sb


def test_property_random_skips_round_trip_and_counts(part):
    d, shards = part
    rng = random.Random(7)
    for _ in range(5):
        plan = {}
        for name, n in shards:
            chosen = rng.sample(range(n), rng.randrange(0, n + 1))
            plan[name] = {i: rng.sample(REASON_CODES, rng.randrange(1, 4)) for i in chosen}
        write_partition_skiplists(d, plan)
        loaded = load_skiplists(d)
        for name, n in shards:
            assert loaded[name].indices == tuple(sorted(plan[name]))
            kept = set(loaded[name].keep_indices(n).tolist())
            assert kept == set(range(n)) - set(plan[name])
        counts = partition_counts(d)
        assert counts.samples == sum(n for _, n in shards)
        assert counts.kept_samples == counts.samples - sum(len(p) for p in plan.values())
        assert counts.kept_shards == sum(1 for name, n in shards if len(plan[name]) < n)


def test_write_partition_rejects_unknown_shards(part):
    with pytest.raises(SkipListError, match="not shards of"):
        write_partition_skiplists(part[0], {"shard.12345.mds": {0: ["quality"]}})


def test_index_errors_are_clear(tmp_path):
    with pytest.raises(SkipListError, match="not an MDS partition"):
        read_index_shards(tmp_path)
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(SkipListError, match="not valid JSON"):
        read_index_shards(tmp_path)


# -- findings of issue 10: a directory's sidecar set changes as one unit -------------------


def _killed_after_replaces(n: int, fn) -> int:  # noqa: ANN001
    """Run ``fn`` in a forked child that is SIGKILLed right after its ``n``-th ``os.replace``.

    A fork, so the child starts with everything imported; SIGKILL, so no ``finally`` or
    atexit handler runs: what the directory holds afterwards is what a crash leaves.
    """
    pid = os.fork()
    if pid == 0:  # child
        try:
            done = [0]
            real_replace = os.replace

            def replace(src, dst):  # noqa: ANN001, ANN202
                real_replace(src, dst)
                done[0] += 1
                if done[0] >= n:
                    os.kill(os.getpid(), signal.SIGKILL)

            os.replace = replace
            fn()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _view(d: Path) -> dict[str, tuple[int, ...]]:
    return {name: sl.indices for name, sl in load_skiplists(d).items()}


def test_a_killed_rewrite_leaves_the_old_or_the_new_set_never_a_mix(part):
    """Finding: killed part-way, a directory held some old-policy and some new-policy
    sidecars (neither decision set)."""
    d, shards = part
    old = {name: {0: ["duplicate"]} for name, _ in shards}
    new = {name: {1: ["opt_out"], 2: ["quality"]} for name, _ in shards}
    write_partition_skiplists(d, new)
    new_view = _view(d)
    write_partition_skiplists(d, old)
    old_view = _view(d)
    assert old_view != new_view
    seen = []
    for n in range(1, len(shards) + 2):
        code = _killed_after_replaces(n, lambda: write_partition_skiplists(d, new))
        view = _view(d)
        assert view in (old_view, new_view), f"killed after {n} renames: a mix {view}"
        seen.append((code, view == new_view))
        write_partition_skiplists(d, old)  # the next write repairs and starts from old
    assert (-signal.SIGKILL, False) in seen  # some kills landed before the switch ...
    assert (-signal.SIGKILL, True) in seen  # ... and one right after it


def test_stray_temporaries_are_swept_by_the_next_write(part):
    """Finding: ``.skip.json.*.tmp`` files of killed writers were never removed."""
    d, shards = part
    stray = d / f".{shards[0][0]}.skip.json.4242.0badc0de.tmp"
    stray.write_bytes(b'{"format": "prx-skip')  # what a writer killed mid-write leaves
    write_partition_skiplists(d, {})
    assert not stray.exists()
    assert not [p for p in os.listdir(d) if p.endswith(".tmp")]
