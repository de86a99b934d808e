"""kill -9 during ``mds_shards``' and ``skip_lists``' writes to S3 (moto on 127.0.0.1).

The local kill tests (``test_kill.py``) against object storage: each trial copies a known
*old* remote tree to a fresh prefix, runs the writer towards a known *new* one in a forked
child, and SIGKILLs it at a crashpoint of the local staging or of the upload path
(``storage.*``: an object uploaded, a version complete before its pointer, a pointer put,
a generation's sidecars all uploaded before any manifest, a manifest put between flips, a
stale pointer or object removed). Then, in this process:

- every directory a reader can see (one with a pointer) is exactly its old or its new
  version, with a complete, verified skip-list generation for its own ``index.json``;
- the default loader over the ``s3://`` tree (``discover_streams`` with a cache ->
  ``ShapeBatchedLoader``, real ``StreamingDataset``) yields exactly what those versions
  keep, and never a sample excluded in both;
- a rerun leaves the remote byte-identical to an uninterrupted write, nothing left over.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from prx_assets.core.crashpoints import CRASHPOINTS, parse_spec
from prx_assets.core.shards.remote import live_partitions, mirror_version, read_live
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    MANIFEST_BASENAME,
    load_generation,
    read_index_shards,
)
from prx_assets.core.storage import open_store
from prx_assets_tests.forkservers import forkserver_preloading
from prx_assets_tests.s3 import kill_jobs_s3
from prx_assets_tests.test_kill import NEVER, W, X, Y, Z, _sample, kept_keys, raw_keys, tiles  # noqa: F401

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL + forkserver: Linux")

BATCH = "kill.s3"
KILLED = -signal.SIGKILL
SIZE_LIMIT = 3 * 1400
TRIAL_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def forkserver():
    with forkserver_preloading(
        ["prx_assets_tests.kill_jobs", "prx_assets_tests.s3.kill_jobs_s3"]
    ) as ctx:
        yield ctx


def run_trial(ctx, s3_server, job: str, kwargs: dict, crash_at: str | None = None) -> int:  # noqa: ANN001
    if crash_at is not None:
        assert parse_spec(crash_at)[0] in CRASHPOINTS
    proc = ctx.Process(
        target=kill_jobs_s3.run_job, args=(job, crash_at, {**kwargs, "env": s3_server.env})
    )
    proc.start()
    proc.join(TRIAL_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"{job} ({crash_at}) hung for {TRIAL_TIMEOUT_S}s")
    code = proc.exitcode
    proc.close()
    return code


@dataclass(frozen=True)
class Version:
    index: bytes
    manifest: bytes
    kept: tuple[str, ...]


def versions(uri: str, scratch: Path) -> dict[str, Version]:
    """Each visible remote directory: its live version's bytes and the keys it keeps,
    computed from a verified local copy of exactly that version."""
    store = open_store(f"{uri}/mds")
    out = {}
    for rel in live_partitions(uri):
        live = read_live(store, rel)
        d = mirror_version(live, store, Path(tempfile.mkdtemp(dir=scratch)))
        generation = load_generation(d)  # complete and verified, or this raises
        out[rel] = Version(
            (d / INDEX_BASENAME).read_bytes(),
            (d / MANIFEST_BASENAME).read_bytes(),
            kept_keys(d, generation),
        )
    return out


def loader_keys(ctx, s3_server, uri: str, scratch: Path) -> list[str]:  # noqa: ANN001
    out = scratch / f"keys-{time.monotonic_ns()}.json"
    cache = tempfile.mkdtemp(dir=scratch)
    code = run_trial(
        ctx, s3_server, "loader_keys_s3", {"uri": uri, "cache": cache, "out": str(out)}
    )
    assert code == 0, f"the loader process died ({code})"
    result = json.loads(out.read_text())
    assert "error" not in result, f"the default loader failed:\n{result.get('error')}"
    return result["keys"]


def check_readers(ctx, s3_server, uri, old, new, scratch) -> dict[str, bool]:  # noqa: ANN001
    expected: Counter[str] = Counter()
    on_new = {}
    for rel, now in versions(uri, scratch).items():
        match = [
            v
            for v in (old.get(rel), new.get(rel))
            if v and (v.index, v.manifest) == (now.index, now.manifest)
        ]
        assert match, f"{rel}: neither its old nor its new version (a mix, or unknown)"
        expected.update(match[0].kept)
        on_new[rel] = match[-1] is new.get(rel)
    yielded = Counter(loader_keys(ctx, s3_server, uri, scratch))
    assert yielded == expected
    assert not set(yielded) & NEVER, "a sample excluded before and after was yielded"
    return on_new


def _key(uri: str) -> str:
    return uri.split("/", 3)[3]


@dataclass
class States:
    old_uri: str
    new_uri: str
    old: dict[str, Version]
    new: dict[str, Version]


def _samples(images, plan: dict, caption: str) -> list:  # noqa: ANN001
    return [
        _sample(f"k{i:02d}", images[i], b, f"{caption} {i}")
        for b, keys in plan.items()
        for i in keys
    ]


OLD_DECISIONS = {"k03": ["opt_out"], "k14": ["opt_out"], "k05": ["duplicate"]}
NEW_DECISIONS = {
    "k03": ["opt_out"],
    "k14": ["opt_out"],
    "k06": ["class_text"],
    "k24": ["duplicate"],
}


@pytest.fixture(scope="module")
def mds_states(s3_server, tiles, tmp_path_factory) -> States:  # noqa: F811
    base = f"s3://{s3_server.bucket}/kill-mds-{os.getpid()}"
    old_plan = {X: range(0, 9), Y: range(9, 17), Z: range(17, 22)}
    new_plan = {X: [*range(1, 9), 30, 31], Y: range(9, 19), W: range(22, 28)}
    old_s, new_s = _samples(tiles, old_plan, "old"), _samples(tiles, new_plan, "new")
    kill_jobs_s3.write_shards_s3(f"{base}/old", BATCH, old_s, OLD_DECISIONS, SIZE_LIMIT)
    s3_server.copy_prefix(_key(f"{base}/old"), _key(f"{base}/new"))
    kill_jobs_s3.write_shards_s3(f"{base}/new", BATCH, new_s, NEW_DECISIONS, SIZE_LIMIT)
    scratch = tmp_path_factory.mktemp("mds-states")
    state = States(
        f"{base}/old",
        f"{base}/new",
        versions(f"{base}/old", scratch),
        versions(f"{base}/new", scratch),
    )
    state.samples = new_s  # type: ignore[attr-defined]
    assert set(state.old) == {f"{t}/{s}/{BATCH}" for t, s in (X, Y, Z)}
    assert set(state.new) == {f"{t}/{s}/{BATCH}" for t, s in (X, Y, W)}
    return state


# Every point once, and the first and last of the repeated ones: the middle ones
# (object_uploaded:4, pointer_published:2) were dropped for the suite's 15 minutes; they
# checked the same property at one more intermediate state.
MDS_CRASHES = [
    "mds.sample_written:7",  # still staging locally: the remote is untouched
    "storage.object_uploaded:1",
    "storage.object_uploaded:9",
    "storage.shards_uploaded:1",  # a version complete, its pointer not put
    "storage.shards_uploaded:3",
    "storage.pointer_published:1",
    "storage.pointer_published:3",
    "storage.stale_removed:1",
    "storage.stale_pointer_removed:1",  # Z invisible, its objects still there
]


def test_kill_mds_writer_on_s3(forkserver, s3_server, mds_states: States, tmp_path):
    s = mds_states
    trial_uri = f"s3://{s3_server.bucket}/kill-mds-trial-{os.getpid()}"
    reference = s3_server.objects(_key(s.new_uri))
    codes = []
    for crash_at in MDS_CRASHES:
        s3_server.copy_prefix(_key(s.old_uri), _key(trial_uri))
        kwargs = {
            "uri": trial_uri,
            "batch": BATCH,
            "samples": s.samples,
            "decisions": NEW_DECISIONS,
            "size_limit": SIZE_LIMIT,
        }
        codes.append(run_trial(forkserver, s3_server, "write_shards_s3", kwargs, crash_at))
        check_readers(forkserver, s3_server, trial_uri, s.old, s.new, tmp_path)
        kill_jobs_s3.write_shards_s3(trial_uri, BATCH, s.samples, NEW_DECISIONS, SIZE_LIMIT)
        assert s3_server.objects(_key(trial_uri)) == reference, f"rerun after {crash_at} differs"
    assert codes == [KILLED] * len(MDS_CRASHES), list(zip(MDS_CRASHES, codes, strict=True))


def _rule_skips(d: Path, rule) -> dict:  # noqa: ANN001
    keys, start, shards = raw_keys(d), 0, {}
    for name, n in read_index_shards(d):
        for i, key in enumerate(keys[start : start + n]):
            if reasons := rule(key, i):
                shards.setdefault(name, {})[i] = reasons
        start += n
    return shards


@pytest.fixture(scope="module")
def skip_states(s3_server, mds_states: States, tmp_path_factory) -> States:
    base = f"s3://{s3_server.bucket}/kill-skip-{os.getpid()}"
    scratch = tmp_path_factory.mktemp("skip-states")
    s3_server.copy_prefix(_key(mds_states.new_uri), _key(f"{base}/old"))

    def skips(uri: str, rule) -> dict:  # noqa: ANN001
        store = open_store(f"{uri}/mds")
        out = {}
        for rel in live_partitions(uri):
            d = mirror_version(read_live(store, rel), store, Path(tempfile.mkdtemp(dir=scratch)))
            out[f"mds/{rel}"] = _rule_skips(d, rule)
        return out

    def old_rule(key: str, i: int) -> list[str]:
        return ["opt_out"] if key in NEVER else (["duplicate"] if i == 0 else [])

    def new_rule(key: str, i: int) -> list[str]:
        return ["opt_out"] if key in NEVER else (["class_nsfw"] if i == 1 else [])

    kill_jobs_s3.refresh_skiplists_s3(f"{base}/old", BATCH, skips(f"{base}/old", old_rule))
    s3_server.copy_prefix(_key(f"{base}/old"), _key(f"{base}/new"))
    new_skips = skips(f"{base}/new", new_rule)
    kill_jobs_s3.refresh_skiplists_s3(f"{base}/new", BATCH, new_skips)
    state = States(
        f"{base}/old",
        f"{base}/new",
        versions(f"{base}/old", scratch),
        versions(f"{base}/new", scratch),
    )
    state.skips = new_skips  # type: ignore[attr-defined]
    assert all(state.old[r].manifest != state.new[r].manifest for r in state.old)
    assert all(state.old[r].index == state.new[r].index for r in state.old)
    return state


def test_kill_skiplists_writer_on_s3(forkserver, s3_server, skip_states: States, tmp_path):
    s = skip_states
    dirs = len(s.old)
    trial_uri = f"s3://{s3_server.bucket}/kill-skip-trial-{os.getpid()}"
    reference = s3_server.objects(_key(s.new_uri))
    crashes = [
        "skiplists.sidecar_written:2",  # staging in the local mirror: remote untouched
        "storage.object_uploaded:1",
        "storage.object_uploaded:4",
        *(f"storage.generation_staged:{n}" for n in range(1, dirs + 1)),
        *(f"storage.manifest_put:{n}" for n in range(1, dirs + 1)),  # between flips
        "storage.stale_removed:1",
    ]
    codes = []
    for crash_at in crashes:
        s3_server.copy_prefix(_key(s.old_uri), _key(trial_uri))
        kwargs = {"uri": trial_uri, "batch": BATCH, "skips_by_rel": s.skips}
        codes.append(run_trial(forkserver, s3_server, "refresh_skiplists_s3", kwargs, crash_at))
        on_new = check_readers(forkserver, s3_server, trial_uri, s.old, s.new, tmp_path)
        flags = [on_new[rel] for rel in sorted(on_new)]  # publishing order
        point, n = parse_spec(crash_at)
        if point in (
            "skiplists.sidecar_written",
            "storage.object_uploaded",
            "storage.generation_staged",
        ):
            assert not any(flags), (
                f"a manifest flipped before every generation was uploaded ({crash_at})"
            )
        elif point == "storage.manifest_put":
            assert flags == [i < n for i in range(dirs)], (crash_at, flags)
        kill_jobs_s3.refresh_skiplists_s3(trial_uri, BATCH, s.skips)
        assert s3_server.objects(_key(trial_uri)) == reference, f"rerun after {crash_at} differs"
    assert codes == [KILLED] * len(crashes), list(zip(crashes, codes, strict=True))
