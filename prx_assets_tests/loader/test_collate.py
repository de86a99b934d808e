"""ImageTextCollate + HFTextEncoder with tiny BERTs built offline (no hub access)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from prx_assets.core.ingest.decode import decode_rgb
from prx_assets.core.skiplists.sidecars import skiplist_digest
from prx_assets.loader import HFTextEncoder, ImageTextCollate, ShapeBatchedLoader, discover_streams
from prx_assets.loader.collate import jpeg_bytes
from prx_assets.loader.offline_encoder import build_offline_bert

from .conftest import WORDS, MdsRoot, write_partition


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("encoders")
    words = WORDS + [str(i) for i in range(10)]
    return {
        "d32": build_offline_bert(base / "d32", words, hidden_size=32),
        "d48": build_offline_bert(
            base / "d48", words, hidden_size=48, num_attention_heads=4, num_hidden_layers=2
        ),
    }


def _batches(m: MdsRoot, collate, num_workers: int = 0) -> list[dict]:
    loader = ShapeBatchedLoader(
        discover_streams(m.root),
        batch_size=4,
        num_canonical_nodes=1,
        collate_fn=collate,
        num_workers=num_workers,
    )
    return list(loader)


def test_collate_with_tiny_encoder_returns_the_documented_batch(mds_root: MdsRoot, encoder_dirs):
    encoder = HFTextEncoder.from_pretrained(encoder_dirs["d32"], max_length=12)
    batches = _batches(mds_root, ImageTextCollate(encoder), num_workers=2)
    assert len(batches) == 30
    for batch in batches:
        b = len(batch["key"])
        h, w = (int(v) for v in batch["key"][0].split("/")[1].split("x"))
        assert batch["image"].shape == (b, 3, h, w) and batch["image"].dtype == torch.float32
        assert -1.0 <= batch["image"].min() and batch["image"].max() <= 1.0
        assert batch["text_latents"].shape == (b, 12, 32)
        assert batch["attention_mask"].shape == (b, 12)
        assert len(batch["caption"]) == b
        # Real tokens are masked in, padding out (captions are 3 words + [CLS]/[SEP]).
        assert (batch["attention_mask"].sum(1) >= 5).all()
        assert (batch["attention_mask"][:, -1] == 0).all()


def test_image_tensor_is_the_decoded_jpeg(mds_root: MdsRoot):
    from prx_assets.loader import SkipListDataset

    ds = SkipListDataset(local=str(mds_root.dir("1/24x16/b0")), batch_size=2)
    samples = [ds[0], ds[1]]
    batch = ImageTextCollate(normalize=False)(samples)
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (2, 3, 24, 16)
    expected = np.asarray(decode_rgb(samples[1]["image"]))
    assert np.array_equal(batch["image"][1].permute(1, 2, 0).numpy(), expected)
    assert "text_latents" not in batch
    assert batch["key"] == [samples[0]["key"], samples[1]["key"]]


def test_mean_pooling_is_the_masked_mean(encoder_dirs):
    last = HFTextEncoder.from_pretrained(encoder_dirs["d32"], max_length=10)
    mean = HFTextEncoder(last.model, last.tokenizer, pooling="mean", max_length=10)
    captions = ["a red cat", "the dog on grass brick wall"]
    hidden, mask = last(captions)
    pooled, mask2 = mean(captions)
    assert pooled.shape == (2, 32) and torch.equal(mask, mask2)
    n = int(mask[0].sum())
    assert torch.allclose(pooled[0], hidden[0, :n].mean(0), atol=1e-5)
    with pytest.raises(ValueError, match="pooling"):
        HFTextEncoder(last.model, last.tokenizer, pooling="cls")  # type: ignore[arg-type]


def test_swapping_the_encoder_needs_no_data_change(mds_root: MdsRoot, encoder_dirs):
    dirs = [mds_root.dir(r) for r in sorted(mds_root.shards)]
    before = skiplist_digest(dirs), sorted(p.stat().st_mtime_ns for d in dirs for p in d.iterdir())
    small = HFTextEncoder.from_pretrained(encoder_dirs["d32"], max_length=8)
    bigger = HFTextEncoder.from_pretrained(encoder_dirs["d48"], max_length=16, pooling="mean")
    a = _batches(mds_root, ImageTextCollate(small))
    b = _batches(mds_root, ImageTextCollate(bigger))
    assert [x["key"] for x in a] == [x["key"] for x in b]
    assert a[0]["text_latents"].shape[1:] == (8, 32)
    assert b[0]["text_latents"].shape[1:] == (48,)
    after = skiplist_digest(dirs), sorted(p.stat().st_mtime_ns for d in dirs for p in d.iterdir())
    assert before == after


def test_jpeg_column_and_bad_batches(tmp_path: Path):
    from prx_assets.core.skiplists.sidecars import write_partition_skiplists
    from prx_assets.loader import SkipListDataset

    write_partition(tmp_path / "mds", "0", "8x8", "b0", 24, image_type="jpeg")
    write_partition_skiplists(tmp_path / "mds" / "0" / "8x8" / "b0", {})
    ds = SkipListDataset(local=str(tmp_path / "mds" / "0" / "8x8" / "b0"), batch_size=2)
    sample = ds[0]
    assert isinstance(sample["image"], Image.Image)  # streaming decodes 'jpeg' columns
    collate = ImageTextCollate()
    assert collate([sample, ds[1]])["image"].shape == (2, 3, 8, 8)

    other = dict(sample, image=jpeg_bytes(Image.new("RGB", (10, 8)), quality=90), key="odd")
    with pytest.raises(ValueError, match="mixes image shapes"):
        collate([sample, other])
    with pytest.raises(TypeError, match="expected bytes or an image"):
        collate([dict(sample, image=123)])
    with pytest.raises(ValueError, match="empty batch"):
        collate([])
    broken = dict(sample, image=io.BytesIO(jpeg_bytes(Image.new("RGB", (8, 8)))).read()[:40])
    with pytest.raises(Exception, match="truncated|corrupt"):
        collate([broken])


def test_building_the_offline_encoder_leaves_the_callers_rng_alone(tmp_path):
    # A trainer that builds the offline encoder must keep its own random stream: the seed
    # is the weights' only, and the same seed still gives the same weights.
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    first = build_offline_bert(tmp_path / "a", WORDS, hidden_size=32, seed=7)
    assert torch.equal(torch.rand(4), expected)
    second = build_offline_bert(tmp_path / "b", WORDS, hidden_size=32, seed=7)
    a = (Path(first) / "model.safetensors").read_bytes()
    assert a == (Path(second) / "model.safetensors").read_bytes()
