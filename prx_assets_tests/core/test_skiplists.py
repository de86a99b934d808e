"""Skip-list sidecars: round trip, validation, tamper detection, digest semantics."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from PIL import Image

from prx_assets.core.skiplists.sidecars import (
    DEFAULT_RETENTION_S,
    MANIFEST_BASENAME,
    REASON_CODES,
    RETENTION_ENV,
    SKIPLIST_FORMAT,
    SKIPLIST_VERSION,
    ManifestEntry,
    SkipListCorrupt,
    SkipListError,
    SkipListMissing,
    SkipListStale,
    SkipListVersionError,
    canonical_json,
    current_generation,
    digest_generations,
    load_generation,
    load_skiplists,
    parse_skiplist,
    partition_counts,
    publish_generation,
    publish_partition_skiplists,
    read_index_shards,
    read_skiplist,
    skiplist_digest,
    stage_generation,
    sweep,
    update_skiplists,
    verify_sidecar,
    write_partition_skiplists,
)
from prx_assets.demo.jpegs import encoded

PHOTO = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos" / "china.jpg"


def _partition(path: Path, n: int = 30, caption: str = "caption") -> list[tuple[str, int]]:
    """A real MDS partition (tiny JPEGs) with several shards."""
    from streaming import MDSWriter

    data = encoded(Image.open(PHOTO).convert("RGB").resize((12, 8)), "JPEG", quality=80)
    columns = {"image": "bytes", "caption": "str", "key": "str"}
    with MDSWriter(out=str(path), columns=columns, size_limit=7 * (len(data) + 60)) as w:
        for i in range(n):
            w.write({"image": data, "caption": f"{caption} {i}", "key": f"k{i}"})
    shards = read_index_shards(path)
    assert len(shards) >= 3
    return shards


@pytest.fixture
def part(tmp_path: Path) -> tuple[Path, list[tuple[str, int]]]:
    d = tmp_path / "mds" / "0" / "8x12" / "b0"
    return d, _partition(d)


def _files(d: Path) -> dict[str, bytes]:
    """Every skip-list file of a directory (sidecars and manifest), by name."""
    return {
        p.name: p.read_bytes()
        for p in sorted(d.iterdir())
        if p.name.endswith(".skip.json") or p.name == MANIFEST_BASENAME
    }


def test_round_trip_sorts_and_dedups_reasons(part):
    d, shards = part
    name, n = shards[0]
    generation = write_partition_skiplists(
        d, {name: {5: ["quality", "opt_out", "quality"], 1: "duplicate"}}
    )
    live = load_generation(d)
    assert live.generation == generation == current_generation(d)
    assert list(live.skiplists) == [s for s, _ in shards]  # every shard, index order
    sl = live.skiplists[name]
    assert sl.shard == name
    assert sl.indices == (1, 5)
    assert sl.reasons == (("duplicate",), ("opt_out", "quality"))
    assert sl.as_mapping() == {1: ("duplicate",), 5: ("opt_out", "quality")}
    assert list(sl.keep_indices(n)) == [i for i in range(n) if i not in (1, 5)]
    assert all(live.skiplists[s].indices == () for s, _ in shards[1:])  # screened, kept
    # Exactly the documented sidecar payload, hashed over its canonical JSON, under its
    # content-addressed name.
    entry = live.manifest.entries[0]
    path = d / entry.sidecar
    raw = path.read_bytes()
    assert entry.sidecar == f"{name}.{hashlib.sha256(raw).hexdigest()[:16]}.skip.json"
    assert read_skiplist(path) == sl
    obj = json.loads(raw)
    assert set(obj) == {"format", "version", "shard", "indices", "reasons", "sha256"}
    payload = {k: v for k, v in obj.items() if k != "sha256"}
    assert obj["sha256"] == hashlib.sha256(canonical_json(payload)).hexdigest()
    # And the documented manifest: written for this index.json, one entry per shard.
    manifest = json.loads((d / MANIFEST_BASENAME).read_bytes())
    assert set(manifest) == {"format", "version", "index_sha256", "shards", "sha256"}
    assert manifest["format"] == "prx-skiplist-manifest" and manifest["version"] == 2
    assert manifest["index_sha256"] == hashlib.sha256((d / "index.json").read_bytes()).hexdigest()
    assert [e["shard"] for e in manifest["shards"]] == [s for s, _ in shards]
    # Version 2: each shard's sample count and skip count, as the index and sidecars say.
    assert [(e["samples"], e["skipped"]) for e in manifest["shards"]] == [
        (n, len(live.skiplists[s])) for s, n in shards
    ]
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    assert manifest["sha256"] == hashlib.sha256(canonical_json(body)).hexdigest() == generation
    assert not [p for p in os.listdir(d) if p.endswith(".tmp")]


def test_generations_are_content_addressed_and_reruns_byte_identical(part):
    d, shards = part
    first = {shards[1][0]: {0: ["quality"]}}
    write_partition_skiplists(d, first)
    before = _files(d)
    mtimes = {n: (d / n).stat().st_mtime_ns for n in before}
    # The same decisions again: the same files, untouched (nothing rewritten).
    write_partition_skiplists(d, first)
    assert _files(d) == before
    assert {n: (d / n).stat().st_mtime_ns for n in before} == mtimes
    # New decisions: the changed shard gets a new file, the others keep theirs (same
    # content, same name); the superseded file outlives the flip for the retention (a job
    # built on it reads it when it reaches the shard), then goes: one sidecar per shard.
    write_partition_skiplists(d, {})
    (superseded,) = {n for n in before if n.startswith(shards[1][0] + ".")}
    assert (d / superseded).is_file() and superseded not in load_generation(d).manifest.sidecars
    assert sweep(d, retention_s=0) == [superseded]
    after = _files(d)
    changed = {n for n in before if n.startswith(shards[1][0] + ".")}
    assert len(changed) == 1 and not changed & set(after)
    assert set(before) - changed - {MANIFEST_BASENAME} < set(after)
    assert len(after) == len(shards) + 1 and after[MANIFEST_BASENAME] != before[MANIFEST_BASENAME]
    assert all(sl.indices == () for sl in load_skiplists(d).values())
    # Going back gives byte-identical files to the first time.
    write_partition_skiplists(d, first)
    sweep(d, retention_s=0)
    assert _files(d) == before


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
def test_write_rejects_bad_skips_before_writing_anything(part, skips, message):
    d, shards = part
    with pytest.raises(SkipListError, match=message):
        write_partition_skiplists(d, {shards[0][0]: skips})
    assert _files(d) == {}


@pytest.mark.parametrize(
    "name", ["../shard.00000.mds", "sub/shard.00000.mds", "", "x.skip.json", "shard.99999.mds"]
)
def test_write_rejects_shards_not_in_the_index(part, name):
    with pytest.raises(SkipListError, match="not shards of"):
        write_partition_skiplists(part[0], {name: {0: ["quality"]}})
    assert _files(part[0]) == {}


def _rewrite(path: Path, mutate, rehash: bool) -> None:
    obj = json.loads(path.read_bytes())
    mutate(obj)
    if rehash:
        payload = {k: v for k, v in obj.items() if k != "sha256"}
        obj["sha256"] = hashlib.sha256(canonical_json(payload)).hexdigest()
    path.write_bytes(json.dumps(obj).encode())


def test_tampering_with_a_sidecar_is_detected(part):
    d, shards = part
    name = shards[0][0]
    write_partition_skiplists(d, {name: {2: ["class_nsfw"], 4: ["opt_out"]}})
    path = d / load_generation(d).manifest.entries[0].sidecar
    original = path.read_bytes()

    _rewrite(path, lambda o: o["indices"].pop(), rehash=False)  # un-skip an opt-out by hand
    with pytest.raises(SkipListCorrupt, match="content hash mismatch"):
        parse_skiplist(path.read_bytes(), str(path))
    with pytest.raises(SkipListCorrupt, match="does not match the hash in its name"):
        read_skiplist(path)
    with pytest.raises(SkipListCorrupt, match="differs from the manifest"):
        load_skiplists(d)
    _rewrite(path, lambda o: None, rehash=True)  # a consistent forgery: the manifest pins bytes
    with pytest.raises(SkipListCorrupt, match="differs from the manifest"):
        load_skiplists(d)

    path.write_bytes(original[: len(original) // 2])  # truncated copy
    with pytest.raises(SkipListCorrupt, match="not valid JSON"):
        parse_skiplist(path.read_bytes(), str(path))

    path.write_bytes(original)
    _rewrite(path, lambda o: o.update(version=2), rehash=True)
    with pytest.raises(SkipListVersionError, match="version 2"):
        parse_skiplist(path.read_bytes(), str(path))

    path.write_bytes(original)
    _rewrite(path, lambda o: o.update(indices=[4, 2]), rehash=True)  # valid hash, bad schema
    with pytest.raises(SkipListCorrupt, match="strictly increasing"):
        parse_skiplist(path.read_bytes(), str(path))

    path.write_bytes(original)
    _rewrite(path, lambda o: o.update(extra=1), rehash=True)
    with pytest.raises(SkipListCorrupt, match="schema"):
        parse_skiplist(path.read_bytes(), str(path))

    # A valid sidecar of one shard presented as another's.
    with pytest.raises(SkipListCorrupt, match="belongs to shard"):
        parse_skiplist(original, "copy", expected_shard=shards[1][0])
    path.write_bytes(original)
    assert load_skiplists(d)[name].indices == (2, 4)


def test_the_manifest_is_the_only_way_in(part, tmp_path):
    d, shards = part
    with pytest.raises(SkipListMissing, match="never screened"):
        load_skiplists(d)  # no generation yet: unscreened, not "nothing skipped"
    assert current_generation(d) is None
    write_partition_skiplists(d, {shards[0][0]: {0: ["duplicate"]}})
    # Files no manifest names are not read (a planted "skip nothing" changes nothing) ...
    (d / f"{shards[0][0]}.skip.json").write_bytes(b"{}")
    assert load_skiplists(d)[shards[0][0]].indices == (0,)
    # ... and the next write sweeps them.
    write_partition_skiplists(d, {shards[0][0]: {0: ["duplicate"]}})
    assert not (d / f"{shards[0][0]}.skip.json").exists()
    # A manifest for another index.json (the same shard names) is refused.
    other = tmp_path / "other"
    _partition(other, caption="other")
    write_partition_skiplists(other, {})
    (d / MANIFEST_BASENAME).write_bytes((other / MANIFEST_BASENAME).read_bytes())
    with pytest.raises(SkipListStale, match="another index.json"):
        load_skiplists(d)
    # A self-consistent manifest with a shard dropped is refused.
    write_partition_skiplists(d, {})
    _rewrite(d / MANIFEST_BASENAME, lambda o: o["shards"].pop(), rehash=True)
    with pytest.raises(SkipListCorrupt, match="not index.json's"):
        load_skiplists(d)
    _rewrite(d / MANIFEST_BASENAME, lambda o: o.update(version=9), rehash=True)
    with pytest.raises(SkipListVersionError, match="manifest format version 9"):
        load_skiplists(d)


def test_digest_identifies_the_generations_read(tmp_path):
    """The digest is over each directory's generation (the manifest's self-hash: index and
    every sidecar's bytes), so it is known without reading a sidecar; any new generation
    changes it, a relabel too (a resume then needs allow_skiplist_change=True)."""
    a, b = tmp_path / "a", tmp_path / "b"
    sa, sb = _partition(a), _partition(b, n=24)
    write_partition_skiplists(a, {})
    write_partition_skiplists(b, {})
    base = skiplist_digest([a, b])
    assert len(base) == 64
    assert base == digest_generations([current_generation(a), current_generation(b)])

    update_skiplists(a, {sa[1][0]: {3: ["duplicate"]}})
    one = skiplist_digest([a, b])
    assert one != base
    write_partition_skiplists(a, {sa[1][0]: {3: ["duplicate"]}})  # the same decisions again
    assert skiplist_digest([a, b]) == one
    update_skiplists(a, {sa[1][0]: {3: ["quality", "opt_out"]}})  # relabel only
    relabelled = skiplist_digest([a, b])
    assert relabelled not in (base, one)
    update_skiplists(a, {sa[1][0]: {4: ["duplicate"]}})  # another index
    assert skiplist_digest([a, b]) not in (base, one, relabelled)
    update_skiplists(a, {sa[1][0]: {3: ["duplicate"]}})  # back: the same generation as `one`
    assert skiplist_digest([a, b]) == one
    assert skiplist_digest([b, a]) != skiplist_digest([a, b])  # stream order matters
    assert digest_generations([None]) != digest_generations([current_generation(a)])
    with pytest.raises(TypeError):
        skiplist_digest(str(a))  # type: ignore[arg-type]
    # A damaged sidecar has no digest: the offline tool verifies the whole generation.
    live = load_generation(a).manifest.entries[1]
    (a / live.sidecar).write_bytes(b"{}")
    with pytest.raises(SkipListCorrupt):
        skiplist_digest([a, b])
    assert sb


def test_a_superseded_generation_outlives_its_flip_for_the_retention(part, monkeypatch):
    """Its sidecars' retention starts when it is superseded (``publish_generation`` touches
    them before the flip), not when they were written; stray names and temporaries do not
    wait; the setting is read from the environment and refused when not a number."""
    monkeypatch.delenv(RETENTION_ENV, raising=False)
    d, shards = part
    write_partition_skiplists(d, {shards[1][0]: {0: ["quality"]}})
    old = d / load_generation(d).manifest.entries[1].sidecar
    os.utime(old, (1_000_000, 1_000_000))  # written long ago
    stray = d / f"{shards[0][0]}.skip.json"  # a name no manifest can hold
    stray.write_bytes(b"{}")
    write_partition_skiplists(d, {})
    assert old.is_file() and not stray.exists()
    assert time.time() - old.stat().st_mtime < 3600  # the flip started its retention
    assert sweep(d) == []
    later = time.time() + DEFAULT_RETENTION_S + 60
    assert sweep(d, now=later) == [old.name]
    assert load_generation(d).skiplists[shards[1][0]].indices == ()  # the live one stays
    monkeypatch.setenv(RETENTION_ENV, "0")
    write_partition_skiplists(d, {shards[1][0]: {1: ["quality"]}})
    write_partition_skiplists(d, {})  # superseded and swept at once
    assert len([p for p in os.listdir(d) if p.endswith(".skip.json")]) == len(shards)
    monkeypatch.setenv(RETENTION_ENV, "a week")
    with pytest.raises(ValueError, match="PRX_SKIPLIST_RETENTION_S"):
        sweep(d)


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


def test_a_partition_is_staged_whole_before_any_manifest_flips(tmp_path):
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    for d in dirs:
        _partition(d)
    first = read_index_shards(dirs[0])[0][0]
    for d in dirs:
        write_partition_skiplists(d, {first: {0: ["opt_out"]}})
    before = {d: current_generation(d) for d in dirs}
    bad = {d: {} for d in dirs}  # new decisions for the first two, then an invalid one
    bad[dirs[2]] = {"shard.77777.mds": {0: ["opt_out"]}}
    with pytest.raises(SkipListError, match="not shards of"):
        publish_partition_skiplists(bad)
    assert {d: current_generation(d) for d in dirs} == before  # nothing flipped
    assert all(load_skiplists(d)[first].indices == (0,) for d in dirs)
    out = publish_partition_skiplists({d: {} for d in dirs})
    assert list(out) == [str(d) for d in dirs]
    assert all(current_generation(d) == out[str(d)] != before[d] for d in dirs)
    assert all(load_skiplists(d)[first].indices == () for d in dirs)
    # A directory rewritten between staging and publishing is refused, not mislabelled.
    staged = stage_generation(dirs[0], {})
    rewritten = tmp_path / "rewritten"
    _partition(rewritten, caption="rewritten")
    os.replace(rewritten / "index.json", dirs[0] / "index.json")  # as if mds_shards ran
    with pytest.raises(SkipListStale, match="rewritten"):
        publish_generation(staged)


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


def test_a_killed_rewrite_leaves_the_old_or_the_new_set_never_a_mix(part, monkeypatch):
    """Finding: killed part-way, a directory held some old-policy and some new-policy
    sidecars (neither decision set). Without retention, so every rewrite writes its files."""
    monkeypatch.setenv(RETENTION_ENV, "0")
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


@pytest.mark.parametrize(
    "indices, reasons",
    [
        ([3, 3], [["opt_out"], ["opt_out"]]),  # not strictly increasing
        ([True], [["opt_out"]]),  # a bool is not an index
        ([-1], [["opt_out"]]),
        ([1.0], [["opt_out"]]),
        ([1], [["quality", "opt_out"]]),  # reasons unsorted
        ([1], [["opt_out", "opt_out"]]),
        ([1], [[]]),
        ([1], [["made_up"]]),
        ([1], ["opt_out"]),  # a string, not a list of codes
        ([1, 2], [["opt_out"]]),
        ([1], [None]),
        ([1], [[1]]),  # a code is a string
        ([1], [[["opt_out"]]]),  # a list inside a reason list (unhashable)
        ([1, 2], [["opt_out"], {"opt_out": 1}]),  # an object after a good list
        ([1, 2, 3], [["opt_out"], ["opt_out"], ["quality", "duplicate"]]),  # the last one
    ],
)
def test_a_malformed_sidecar_is_refused_even_when_its_manifest_vouches_for_it(indices, reasons):
    """The loader skips the self-hash recomputation for bytes whose sha256 a verified
    manifest names, never the structural checks: a writer bug the manifest committed to
    still fails closed."""
    body = {"format": SKIPLIST_FORMAT, "version": SKIPLIST_VERSION, "shard": "shard.00000.mds"}
    body.update({"indices": indices, "reasons": reasons})
    body["sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    data = canonical_json(body)
    entry = ManifestEntry(
        shard="shard.00000.mds",
        sidecar="shard.00000.mds.x.skip.json",
        sha256=hashlib.sha256(data).hexdigest(),
        samples=10,
        skipped=len(indices),
    )
    with pytest.raises(SkipListCorrupt):
        verify_sidecar(entry, data, "test", 10)


def test_a_bad_reason_list_is_named_with_the_first_index_that_has_it():
    """Reason lists are checked once per distinct list: the error still names where the
    first bad one is, as a reader of the sidecar would find it."""
    indices = [2, 5, 9, 11]
    reasons = [["opt_out"], ["made_up"], ["duplicate"], ["made_up"]]
    body = {"format": SKIPLIST_FORMAT, "version": SKIPLIST_VERSION, "shard": "shard.00000.mds"}
    body.update({"indices": indices, "reasons": reasons})
    body["sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    with pytest.raises(SkipListCorrupt, match=r"\['made_up'\] for index 5$"):
        parse_skiplist(canonical_json(body), "test", expected_shard="shard.00000.mds")
    body["reasons"] = [["opt_out"], ["opt_out"], [["x"]], "y"]
    body["sha256"] = hashlib.sha256(
        canonical_json({k: v for k, v in body.items() if k != "sha256"})
    ).hexdigest()
    with pytest.raises(SkipListCorrupt, match=r"\[\['x'\]\] for index 9$"):
        parse_skiplist(canonical_json(body), "test", expected_shard="shard.00000.mds")
