"""A published shard tree is readable by the project's loader only; an export is plain MDS.

Finding (issue 30): ``streaming.StreamingDataset(local=<bucket dir>)`` yielded every sample
of a published directory, an opted-out one included, and nothing warned. Now the writer's
``index.json`` carries a version plain streaming refuses, with an error naming
``prx_assets.loader`` (core/shards/published.py); the loader reads it and applies the
skip-lists; ``export_training_samples`` (``prx-assets export``) writes a plain tree of the
kept samples only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from prx_assets.core.shards.mds import MDSSample, partition_dir, write_partition_buckets
from prx_assets.core.shards.published import UnpublishedIndex
from prx_assets.core.skiplists.sidecars import (
    MANIFEST_BASENAME,
    SkipListCorrupt,
    current_generation,
    load_generation,
    write_partition_skiplists,
)
from prx_assets_tests.fixtures_files import tile_jpeg
from prx_assets_tests.kill_jobs import skips_from
from prx_assets_tests.streaming_memory import plain_streaming_dataset, streaming_memory_released

BATCH = "pub.b0"
TIER, SHAPE = 512, "16x24"
KEYS = [f"k{i:02d}" for i in range(12)]
OPTED_OUT = "k03"
KEPT = [k for k in KEYS if k != OPTED_OUT]
NAMES_LOADER = r"prx_assets\.loader"


@pytest.fixture
def published(tmp_path: Path) -> tuple[Path, Path]:
    """A directory as ``mds_shards`` publishes it (several shards), one sample opted out."""
    root = tmp_path / "shards"
    samples = [
        MDSSample(k, tile_jpeg(i), f"c {i}", 24, 16, TIER, SHAPE, "t", "cc0")
        for i, k in enumerate(KEYS)
    ]
    write_partition_buckets(
        root,
        BATCH,
        samples,
        skips_for=skips_from({OPTED_OUT: ["opt_out"]}),
        size_limit=4 * 900,
        hashes=("sha256",),
    )
    d = partition_dir(root, TIER, SHAPE, BATCH)
    assert len(json.loads((d / "index.json").read_bytes())["shards"]) >= 3
    return root, d


def _loader_keys(d: Path, **kwargs) -> list[str]:  # noqa: ANN003
    from prx_assets.loader import SkipListDataset

    ds = SkipListDataset(local=str(d), batch_size=1, shuffle=False, **kwargs)
    return [s["key"] for s in ds]


def test_plain_streaming_refuses_a_published_directory_naming_the_loader(published, tmp_path):
    from streaming import StreamingDataset

    root, d = published
    with streaming_memory_released():
        with pytest.raises(
            ValueError, match=f"Unsupported streaming data version: .*{NAMES_LOADER}"
        ):
            StreamingDataset(local=str(d), batch_size=1, shuffle=False)
        # Through a remote (here a path) and a local cache: the same refusal.
        with pytest.raises(ValueError, match=NAMES_LOADER):
            StreamingDataset(remote=str(d), local=str(tmp_path / "cache"), batch_size=1)
        # The project's loader reads it, without the opted-out sample.
        assert _loader_keys(d) == KEPT


def test_the_loader_refuses_a_plain_index(published):
    """A directory written before published indexes (or an export) is not read as
    screened data: the loader says to rerun mds_shards. Reading it unscreened on purpose
    still works."""
    from prx_assets.loader import ShapeBatchedLoader, discover_streams

    root, d = published
    index = json.loads((d / "index.json").read_bytes())
    index["version"] = 2  # what MDSWriter writes and mds_shards wrote before
    (d / "index.json").write_text(json.dumps(index, sort_keys=True))
    write_partition_skiplists(d, {})  # a generation for that very index
    with streaming_memory_released():
        with pytest.raises(UnpublishedIndex, match="rerun mds_shards"):
            _loader_keys(d)
        with pytest.raises(UnpublishedIndex, match="rerun mds_shards"):
            ShapeBatchedLoader(discover_streams(root), batch_size=1, num_canonical_nodes=1)
        with pytest.warns(UserWarning, match="WITHOUT skip-lists"):
            assert _loader_keys(d, skiplists="ignore-UNSAFE") == KEYS


def test_export_holds_exactly_the_kept_samples_and_plain_streaming_reads_it(published, tmp_path):

    from prx_assets.cli import main
    from prx_assets.loader import SkipListDataset
    from prx_assets.loader.export import EXPORT_MANIFEST, export_training_samples

    root, d = published
    out = tmp_path / "export"
    result = export_training_samples(root, out)
    assert (result.samples, result.kept_samples) == (len(KEYS), len(KEPT))
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    assert manifest["directories"] == [
        {
            "relpath": f"{TIER}/{SHAPE}/{BATCH}",
            "index_sha256": hashlib.sha256((d / "index.json").read_bytes()).hexdigest(),
            "generation": current_generation(d),
            "samples": len(KEYS),
            "kept_samples": len(KEPT),
        }
    ]
    exported = out / "mds" / str(TIER) / SHAPE / BATCH
    assert sorted(p.name for p in out.parent.iterdir()) == ["export", "shards"]  # no temp left
    with streaming_memory_released():
        plain = plain_streaming_dataset(local=str(exported), batch_size=1, shuffle=False)
        rows = [plain[i] for i in range(len(plain))]
        ours = SkipListDataset(local=str(d), batch_size=1, shuffle=False)
        want = [ours[i] for i in range(len(ours))]
    assert [r["key"] for r in rows] == KEPT  # the opted-out sample is absent
    for got, ref in zip(rows, want, strict=True):
        assert got == ref  # every column, byte for byte

    # The command line: the same export; an existing directory is never overwritten.
    assert main(["export", "--root", str(root), "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / EXPORT_MANIFEST).is_file()
    with pytest.raises(FileExistsError):
        export_training_samples(root, out)
    assert main(["export", "--root", str(root), "--out", str(out)]) == 2


def test_export_refuses_what_the_loader_refuses(published, tmp_path):
    """A tampered sidecar or a missing generation stops the export, and nothing appears."""
    from prx_assets.core.skiplists.sidecars import SkipListMissing
    from prx_assets.loader.export import export_training_samples

    root, d = published
    live = next(s for s in load_generation(d).skiplists.values() if s.indices)
    sidecar = Path(live.path)
    sidecar.write_bytes(sidecar.read_bytes().replace(b"[3]", b"[4]", 1))
    with pytest.raises(SkipListCorrupt):
        export_training_samples(root, tmp_path / "export")
    (d / MANIFEST_BASENAME).unlink()
    with pytest.raises(SkipListMissing):
        export_training_samples(root, tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
