"""The MDS tree and its skip-lists on a real S3-compatible server (moto on 127.0.0.1).

What is checked end to end through real HTTP: the object-store interface (atomic put,
listing, bounded reads, delete); ``mds_shards``' remote publication (a version prefix per
directory, the pointer last, byte-identical reruns, nothing left over); ``skip_lists``'
remote generations; that the official ``StreamingDataset`` refuses a published directory
(naming the loader) and reads an export of it; and that the project's
``SkipListDataset`` (over ``discover_streams``) reads the remote tree with its local cache,
honours the remote skip-lists, and refuses a remote directory whose generation is missing,
stale or partial.
"""

from __future__ import annotations

import json

import pytest

from prx_assets.core.shards.mds import MDSSample, write_partition_buckets
from prx_assets.core.shards.remote import (
    POINTER_BASENAME,
    RemoteShardTree,
    live_partitions,
    read_live,
)
from prx_assets.core.skiplists.sidecars import (
    MANIFEST_BASENAME,
    SkipListCorrupt,
    SkipListMissing,
    SkipListStale,
    publish_partition_generations,
)
from prx_assets.core.storage import LocalStore, ObjectTooLarge, StorageError, open_store
from prx_assets.loader import ShapeBatchedLoader, discover_streams
from prx_assets_tests.fixtures_files import tile_jpeg
from prx_assets_tests.kill_jobs import skips_from
from prx_assets_tests.s3.s3_calls import requests_of
from prx_assets_tests.streaming_memory import plain_streaming_dataset

BATCH = "s3.b0"
A, B = (512, "16x24"), (512, "24x16")


def _samples(plan: dict, caption: str = "c") -> list[MDSSample]:
    return [
        MDSSample(f"k{i:02d}", tile_jpeg(i), f"{caption} {i}", 24, 16, b[0], b[1], "t", "cc0")
        for b, keys in plan.items()
        for i in keys
    ]


def _publish(uri: str, samples: list[MDSSample], decisions: dict, hashes=()) -> None:  # noqa: ANN001
    with RemoteShardTree(uri, BATCH) as tree:
        write_partition_buckets(
            tree.local_root,
            BATCH,
            samples,
            skips_for=skips_from(decisions),
            size_limit=3 * 900,
            hashes=hashes,
        )
        tree.publish_shards()


def _loader_keys(uri: str, cache) -> list[str]:  # noqa: ANN001
    buckets = discover_streams(uri, cache_dir=cache)
    loader = ShapeBatchedLoader(buckets, batch_size=1, shuffle=False, num_canonical_nodes=1)
    return sorted(k for batch in loader for k in batch["key"])


def test_a_publish_lists_the_batch_once_and_removes_what_no_pointer_protects(s3_prefix):
    """Finding (stop 45, the S3 request log of an ``mds_shards`` step): a publish read
    every bucket prefix's pointer twice (live directories, then unpointed ones) and listed
    each published directory twice with a ``HEAD`` per object already there. Now: one
    listing per level of the tree and per bucket prefix, whatever the directories hold."""
    samples = _samples({A: range(0, 7), B: range(7, 12)})
    _publish(s3_prefix, samples, {})
    store = open_store(s3_prefix)
    before = {rel: read_live(store, f"mds/{rel}") for rel in live_partitions(s3_prefix)}
    # Left by killed runs: a first write of another directory (no pointer), a run's staged
    # shards under a live directory; and another batch's directory, which is not ours.
    store.put(f"mds/1024/16x24/{BATCH}/v-dead/shard.00000.mds", b"x" * 10)
    store.put(f"mds/512/16x24/{BATCH}/_staging/tok/piece.mds", b"x" * 10)
    store.put("mds/512/24x16/other.b9/v-x/index.json", b"{}")

    with RemoteShardTree(s3_prefix, BATCH) as tree:
        write_partition_buckets(
            tree.local_root, BATCH, samples, skips_for=skips_from({}), size_limit=3 * 900
        )
        with requests_of(tree.store) as calls:
            tree.publish_shards()

    assert {rel: read_live(store, f"mds/{rel}") for rel in live_partitions(s3_prefix)} == before
    left = store.list("mds")
    assert not [k for k in left if "v-dead" in k or "_staging" in k], left
    assert "mds/512/24x16/other.b9/v-x/index.json" in left  # another batch's: untouched
    ops = [op for op, _ in calls]
    assert "HeadObject" not in ops, calls  # sizes come from the listing
    # "mds", its two tiers, then the three bucket prefixes: one listing each.
    assert ops.count("ListObjectsV2") == 1 + 2 + 3, calls
    gets = [key for op, key in calls if op == "GetObject"]
    assert sorted(k.rsplit("/", 3)[-3] for k in gets) == ["16x24", "24x16"], gets  # pointers
    assert ops.count("DeleteObjects") == 2, calls  # the staged piece; the unpointed write


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_the_store_interface_on_s3_and_a_directory(kind, s3_prefix, tmp_path):
    store = open_store(s3_prefix if kind == "s3" else str(tmp_path / "store"))
    assert isinstance(store, LocalStore) == (kind == "local")
    assert store.get("a/b.json") is None and store.list("a") == []
    store.put("a/b.json", b"one")
    store.put("a/b.json", b"two")  # replaced whole
    store.put("a/c/d.bin", b"x" * 100)
    assert store.get("a/b.json") == b"two"
    assert store.list("a") == ["a/b.json", "a/c/d.bin"]
    assert store.children("a") == (["c"], ["b.json"])
    assert store.size("a/c/d.bin") == 100
    with pytest.raises(ObjectTooLarge):
        store.get("a/c/d.bin", max_bytes=99)  # refused, not truncated
    for bad in ("../x", "/abs", "a//b", ""):
        with pytest.raises(StorageError):
            store.put(bad, b"")
    assert store.delete(["a/b.json"]) == 1
    assert store.list("a") == ["a/c/d.bin"]


def test_mds_directories_publish_as_versions_behind_a_pointer(s3_server, s3_prefix, tmp_path):
    old = _samples({A: range(0, 7), B: range(7, 12)}, "old")
    _publish(s3_prefix, old, {"k02": ["opt_out"]})
    store = open_store(s3_prefix)
    lives = {rel: read_live(store, f"mds/{rel}") for rel in live_partitions(s3_prefix)}
    assert set(lives) == {f"512/16x24/{BATCH}", f"512/24x16/{BATCH}"}
    prefix = s3_prefix.split("/", 3)[3]
    objects = s3_server.objects(prefix)
    for rel, live in lives.items():
        names = {k.rsplit("/", 1)[-1] for k in objects if k.startswith(live.key_prefix + "/")}
        assert {"index.json", MANIFEST_BASENAME} <= names and len(names) >= 4
        # only the live version and its pointer exist for the directory
        assert {k for k in objects if k.startswith(f"mds/{rel}/")} == {
            f"mds/{rel}/{POINTER_BASENAME}",
            *(f"{live.key_prefix}/{n}" for n in names),
        }
    assert _loader_keys(s3_prefix, tmp_path / "c1") == sorted(s.key for s in old if s.key != "k02")

    # A rewrite: A changes (new version), B disappears; the old version is gone after.
    new = _samples({A: [*range(0, 5), 20]}, "new")
    _publish(s3_prefix, new, {"k03": ["duplicate"]})
    assert live_partitions(s3_prefix) == [f"512/16x24/{BATCH}"]
    after = s3_server.objects(prefix)
    assert not [k for k in after if k.startswith(f"mds/512/24x16/{BATCH}")]
    new_live = read_live(store, f"mds/512/16x24/{BATCH}")
    assert new_live.version != lives[f"512/16x24/{BATCH}"].version
    assert all(k.startswith(new_live.key_prefix) or k.endswith(POINTER_BASENAME) for k in after)
    assert _loader_keys(s3_prefix, tmp_path / "c1") == ["k00", "k01", "k02", "k04", "k20"]

    # A rerun with the same content writes byte-identical objects and nothing else.
    _publish(s3_prefix, new, {"k03": ["duplicate"]})
    assert s3_server.objects(prefix) == after


def test_plain_streaming_refuses_the_remote_version_the_loader_and_an_export_read_it(
    s3_prefix, tmp_path
):
    """Finding (issue 30): a plain ``StreamingDataset`` read every sample of a published
    directory, opted-out ones included. Through a remote and a cache it now stops at
    construction naming the loader; the loader, and an export made from the remote tree,
    yield the kept samples only."""
    from streaming import StreamingDataset

    from prx_assets.loader import SkipListDataset
    from prx_assets.loader.export import export_training_samples

    samples = _samples({A: range(0, 6)})
    _publish(s3_prefix, samples, {"k02": ["opt_out"]})
    kept = [s.key for s in samples if s.key != "k02"]
    live = read_live(open_store(s3_prefix), f"mds/512/16x24/{BATCH}")
    with pytest.raises(ValueError, match=r"prx_assets\.loader"):
        StreamingDataset(remote=live.uri, local=str(tmp_path / "plain"), shuffle=False)
    ds = SkipListDataset(remote=live.uri, local=str(tmp_path / "ours"), shuffle=False)
    assert sorted(ds[i]["key"] for i in range(len(ds))) == kept
    assert (tmp_path / "ours" / "index.json").is_file()  # streamed into the local cache

    out = export_training_samples(s3_prefix, tmp_path / "export", cache_dir=tmp_path / "c")
    assert [d.kept_samples for d in out.directories] == [len(kept)]
    plain = plain_streaming_dataset(
        local=str(tmp_path / "export" / "mds" / f"512/16x24/{BATCH}"), shuffle=False
    )
    assert sorted(plain[i]["key"] for i in range(len(plain))) == kept


def _restage(uri: str, skips: dict[str, dict[int, list[str]]] | None, rule=None) -> None:  # noqa: ANN001
    """``skip_lists``' remote write: pull, stage locally, push as one unit."""
    with RemoteShardTree(uri, BATCH) as tree:
        pulled = tree.pull_generations()
        order = sorted(pulled)
        from pathlib import Path

        by_dir = {Path(tree.local_root) / rel: rule(rel) if rule else {} for rel in order}
        publish_partition_generations(by_dir)
        tree.publish_skiplists(order)


def test_remote_skiplists_are_replaced_as_a_generation_and_honoured(s3_server, s3_prefix, tmp_path):
    samples = _samples({A: range(0, 6), B: range(6, 10)})
    _publish(s3_prefix, samples, {})
    assert _loader_keys(s3_prefix, tmp_path / "c") == [s.key for s in samples]

    def first_of_each_shard(rel: str) -> dict:
        return {"shard.00000.mds": {0: ["opt_out"]}}

    _restage(s3_prefix, None, first_of_each_shard)
    got = _loader_keys(s3_prefix, tmp_path / "c")
    assert got == sorted({s.key for s in samples} - {"k00", "k06"})
    prefix = s3_prefix.split("/", 3)[3]
    sidecars = [k for k in s3_server.objects(prefix) if k.endswith(".skip.json")]
    manifests = [k for k in s3_server.objects(prefix) if k.endswith(MANIFEST_BASENAME)]
    named = set()
    for m in manifests:
        body = json.loads(s3_server.objects(prefix)[m])
        named |= {m.rsplit("/", 1)[0] + "/" + e["sidecar"] for e in body["shards"]}
    assert set(sidecars) == named  # superseded sidecars swept, every named one present


def _live_key(s3_prefix: str, rel: str, name: str) -> str:
    live = read_live(open_store(s3_prefix), f"mds/{rel}")
    return f"{live.key_prefix}/{name}"


def test_the_loader_refuses_a_remote_directory_without_a_valid_generation(s3_prefix, tmp_path):
    samples = _samples({A: range(0, 6)})
    _publish(s3_prefix, samples, {"k01": ["opt_out"]})
    store = open_store(s3_prefix)
    rel = f"512/16x24/{BATCH}"
    manifest_key = _live_key(s3_prefix, rel, MANIFEST_BASENAME)
    manifest = store.get(manifest_key)
    live = read_live(store, f"mds/{rel}")

    # partial: a sidecar the manifest names is gone
    sidecar = json.loads(manifest)["shards"][0]["sidecar"]
    saved = store.get(f"{live.key_prefix}/{sidecar}")
    store.delete([f"{live.key_prefix}/{sidecar}"])
    with pytest.raises(SkipListCorrupt):
        _loader_keys(s3_prefix, tmp_path / "c1")
    store.put(f"{live.key_prefix}/{sidecar}", saved)

    # stale: a manifest written for another index.json
    other = _samples({A: range(30, 36)})
    _publish(s3_prefix + "-other", other, {})
    other_manifest = open_store(s3_prefix + "-other").get(
        _live_key(s3_prefix + "-other", rel, MANIFEST_BASENAME)
    )
    store.put(manifest_key, other_manifest)
    with pytest.raises(SkipListStale):
        _loader_keys(s3_prefix, tmp_path / "c2")

    # missing: never screened
    store.delete([manifest_key])
    with pytest.raises(SkipListMissing):
        _loader_keys(s3_prefix, tmp_path / "c3")

    store.put(manifest_key, manifest)
    assert _loader_keys(s3_prefix, tmp_path / "c4") == sorted(
        s.key for s in samples if s.key != "k01"
    )


def test_the_loader_builds_one_s3_client_per_process_and_a_new_one_per_endpoint(
    s3_server, s3_prefix, tmp_path, monkeypatch
):
    """Every index, manifest and sidecar of every remote directory goes through one S3
    client (one was built per file, each parsing botocore's service model); a changed endpoint gets its
    own, and an unpickled stream (a dataloader worker's copy) uses the process's."""
    import pickle

    from streaming.base.storage.download import S3Downloader

    from prx_assets.loader import dataset

    samples = _samples({A: range(0, 6), B: range(6, 12)})
    _publish(s3_prefix, samples, {"k03": ["opt_out"]})
    monkeypatch.setattr(dataset, "_DOWNLOADERS", {})
    built: list[S3Downloader] = []
    real = S3Downloader._create_s3_client

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN202 - a spy: the real client is built
        built.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(S3Downloader, "_create_s3_client", counting)
    buckets = discover_streams(s3_prefix, cache_dir=tmp_path / "c")
    assert len(buckets) == 2
    loader = ShapeBatchedLoader(buckets, batch_size=1, shuffle=False, num_canonical_nodes=1)
    keys = sorted(k for batch in loader for k in batch["key"])
    streams = [s for ds in loader.datasets.values() for s in ds.streams]
    assert len(streams) == 2
    assert keys == sorted(s.key for s in samples if s.key != "k03")
    assert len(built) == 1, f"{len(built)} S3 clients for 2 directories"
    shared = dataset.shared_downloader(streams[0].remote)
    assert all(s._downloader is shared for s in streams)
    copy = pickle.loads(pickle.dumps(streams[0]))
    assert copy._downloader is shared

    monkeypatch.setenv("S3_ENDPOINT_URL", s3_server.endpoint + "/")  # another endpoint
    assert dataset.shared_downloader(streams[0].remote) is not shared


def test_a_shard_object_that_is_not_the_indexed_one_is_never_used(s3_prefix, tmp_path):
    """Every shard copied from the remote must have the sha256 its loaded index records: an
    object rewritten in place (a remote that is not immutable, or corruption) is refused
    and its copy removed from the cache, so the old skip-lists never apply to its rows."""
    from prx_assets.core.shards.remote import resolve_live
    from prx_assets.core.shards.runner import SHARD_HASHES
    from prx_assets.loader import ShardsReplaced, SkipListDataset, SkipListStream

    samples = _samples({A: range(0, 9)})
    _publish(s3_prefix, samples, {"k04": ["opt_out"]}, hashes=SHARD_HASHES)  # as mds_shards does
    rel = f"512/16x24/{BATCH}"
    store = open_store(s3_prefix)
    live = read_live(store, f"mds/{rel}")
    index = json.loads(store.get(f"{live.key_prefix}/index.json"))
    names = [s["raw_data"]["basename"] for s in index["shards"]]
    assert len(names) >= 2 and all("sha256" in s["raw_data"]["hashes"] for s in index["shards"])
    cache = tmp_path / "cache"
    ds = SkipListDataset(
        streams=[SkipListStream(remote=resolve_live(f"{s3_prefix}/mds", rel), local=str(cache))],
        batch_size=1,
        num_canonical_nodes=1,
        shuffle=False,
    )
    # After construction, before any shard is fetched: the first shard's object now holds
    # the second's rows (the opted-out k04 would move to a position its skip-list keeps).
    store.put(f"{live.key_prefix}/{names[0]}", store.get(f"{live.key_prefix}/{names[1]}"))

    seen = []
    with pytest.raises(ShardsReplaced, match="sha256 differs"):
        for sample in ds:
            seen.append(sample["key"])
    assert "k04" not in seen
    assert not (cache / names[0]).exists()
