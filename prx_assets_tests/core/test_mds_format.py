"""The hand-written MDS shard writer against mosaicml-streaming's own ``MDSWriter``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from streaming import LocalDataset, MDSWriter

from prx_assets.core.shards.mds import BASE_COLUMNS
from prx_assets.core.shards.mds_format import MDSShardWriter
from prx_assets.core.shards.render import MDS_EXTRA_COLUMNS

COLUMNS = {
    **BASE_COLUMNS,
    **MDS_EXTRA_COLUMNS,
    "aesthetic": "float32",
    "rank": "uint16",
    "tags": "json",
}


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        rows.append(
            {
                "image": rng.randbytes(rng.randint(1, 3000)),
                "caption": rng.choice(["", "a dog", "ünïcödé — 写真 📷", "x" * 500]),
                "key": f"k{i:06d}",
                "orig_width": rng.randint(1, 10_000),
                "orig_height": -rng.randint(0, 5),  # signed int64 round-trips
                "tier": rng.choice([512, 1024, 4096]),
                "shape": "1024x768",
                "source": "src",
                "license": "",
                "caption_backend": "vlm",
                "caption_model": "m",
                "caption_prompt_version": "v1",
                "caption_fingerprint": "f" * 64,
                "is_fallback_caption": rng.choice([0, 1, True]),
                "upscaled": 2**62,
                "aesthetic": rng.random() * 10,
                "rank": rng.randint(0, 65535),
                "tags": rng.choice([[], {"b": 1, "a": [1.5, "é"]}, None]),
            }
        )
    return rows


def _streaming_dir(out: Path, rows: list[dict], hashes: list[str], size_limit: int) -> None:
    writer = MDSWriter(
        out=str(out), columns=COLUMNS, compression=None, hashes=hashes, size_limit=size_limit
    )
    for row in rows:
        writer.write(row)
    writer.finish()


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize(
    ("n", "size_limit", "hashes"),
    [(1, 1 << 20, ["sha256"]), (200, 40_000, ["sha256"]), (57, 9_000, ["sha1", "xxh64"])],
)
def test_shards_and_index_are_byte_identical_to_mdswriter(
    tmp_path: Path, n: int, size_limit: int, hashes: list[str]
) -> None:
    rows = _rows(n, seed=n)
    _streaming_dir(tmp_path / "theirs", rows, hashes, size_limit)
    ours = MDSShardWriter(tmp_path / "ours", COLUMNS, hashes, size_limit)
    for row in rows:
        ours.write(row)
    entries = ours.finish(write_index=True)

    theirs = _files(tmp_path / "theirs")
    assert _files(tmp_path / "ours") == theirs
    assert entries == json.loads(theirs["index.json"])["shards"]
    if n > 1:
        assert len(entries) > 1  # the size limit cut shards where MDSWriter cuts them
    read = list(LocalDataset(local=str(tmp_path / "ours")))
    assert [r["key"] for r in read] == [r["key"] for r in rows]
    assert read[-1]["caption"] == rows[-1]["caption"]
    assert read[-1]["image"] == rows[-1]["image"]


def test_refuses_what_it_cannot_write_exactly(tmp_path: Path) -> None:
    writer = MDSShardWriter(tmp_path / "a", COLUMNS, ["sha256"], 4_000)
    big = _rows(1, seed=1)[0] | {"image": b"x" * 5_000}
    with pytest.raises(ValueError, match="more than the shard size limit"):
        writer.write(big)
    with pytest.raises(TypeError, match="'caption' must be a str"):
        writer.write(_rows(1, seed=2)[0] | {"caption": b"bytes"})
    with pytest.raises(ValueError, match="unsupported MDS encoding"):
        MDSShardWriter(tmp_path / "b", {"x": "pkl"}, ["sha256"], 4_000)
    with pytest.raises(ValueError, match="sorted"):
        MDSShardWriter(tmp_path / "c", COLUMNS, ["sha256", "md5"], 4_000)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "stray").write_bytes(b"")
    with pytest.raises(FileExistsError):
        MDSShardWriter(tmp_path / "d", COLUMNS, ["sha256"], 4_000)
    assert writer.finish() == []  # the refused rows left nothing behind


def test_a_piece_worker_never_imports_streaming(tmp_path: Path) -> None:
    """Why the writer exists: streaming imports torch (~10 s per fresh worker process)."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path\n"
        "from prx_assets.core.shards import pieces\n"
        "from prx_assets.core.shards.mds import MDSSample, write_piece_shards\n"
        "from prx_assets.core.shards.render import MDS_EXTRA_COLUMNS\n"
        "from prx_assets.core.shards.mds import BASE_COLUMNS\n"
        "cols = {**BASE_COLUMNS, **MDS_EXTRA_COLUMNS}\n"
        "extra = {k: (0 if v == 'int' else '') for k, v in MDS_EXTRA_COLUMNS.items()}\n"
        "s = MDSSample(key='a', image=b'jpeg', caption='c', orig_width=1, orig_height=1,"
        " tier=512, shape='512x512', source='s', license='l', extra=extra)\n"
        f"write_piece_shards(Path({str(tmp_path / 'p')!r}), [s], cols, 1 << 20, ['sha256'])\n"
        "assert 'streaming' not in sys.modules and 'torch' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
