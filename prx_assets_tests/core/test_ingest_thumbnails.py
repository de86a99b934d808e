"""One decode for ingest validation and pHash: the stored thumbnail is ``fast_thumbnail``'s.

Ingest validates each file from a decode at the pHash ``fast`` scale and stores the 32x32
thumbnail it makes from it; ``image_hashes`` then hashes that thumbnail instead of decoding
the image again. These tests prove the thumbnail is bit for bit what the hasher would have
made, that the hashes are the same either way, and that older tables still work.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from prx_assets.core.dedup.decisions import DedupSettings
from prx_assets.core.dedup.gallery import PREVIEW_PX
from prx_assets.core.dedup.phash import fast_thumbnail, thumbnail_from_bytes
from prx_assets.core.dedup.runner import BatchHashes
from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS, inspect_image
from prx_assets.core.ingest.runner import THUMBNAIL_VERSION, check_candidate, migrate_images_table
from prx_assets.core.lab import Lab
from prx_assets.core.tables import IMAGE_HASHES, IMAGES
from prx_assets.demo.jpegs import encoded
from prx_assets_tests.core.stage_inputs import DEMO_BATCH, ingest_demo_batch

PHOTOS = Path(__file__).resolve().parents[2] / "prx_assets" / "demo" / "photos"


def _inputs() -> list[bytes]:
    """The bundled files as they are, and 1.5-2.5 MP JPEGs of them: baseline, progressive,
    every orientation, greyscale."""
    out = [p.read_bytes() for p in sorted(PHOTOS.iterdir())]
    for i, name in enumerate(("chelsea.png", "rocket.jpg", "coins.png", "retina.jpg")):
        img = Image.open(PHOTOS / name).convert("RGB")
        s = ((1.5 + 0.3 * i) * 1e6 / (img.width * img.height)) ** 0.5
        big = img.resize((round(img.width * s) | 1, round(img.height * s)))
        for orientation in (1, 3, 6, 8):
            exif = Image.Exif()
            exif[0x0112] = orientation
            src = big.convert("L") if name == "coins.png" else big
            out.append(
                encoded(src, "JPEG", quality=90, progressive=orientation in (3, 8), exif=exif)
            )
    return out


def test_ingest_thumbnail_is_fast_thumbnail_bit_for_bit() -> None:
    for data in _inputs():
        _, (info, thumb, preview) = check_candidate((data, DEFAULT_MAX_PIXELS))
        assert info == inspect_image(data)  # what ingest records is unchanged
        assert thumb is not None
        assert np.array_equal(thumbnail_from_bytes(thumb), fast_thumbnail(data))
        # The gallery's preview: a small JPEG, oriented like the image (its aspect).
        small = Image.open(io.BytesIO(preview))
        assert small.format == "JPEG" and max(small.size) <= PREVIEW_PX
        assert abs(small.width / small.height - info.width / info.height) < 0.05


def test_validation_from_the_thumbnail_decode_still_refuses_truncation() -> None:
    data = _inputs()[-1]
    _, refused = check_candidate((data[: len(data) * 2 // 3], DEFAULT_MAX_PIXELS))
    assert refused[0] == "truncated"


def _hash_rows(lab: Lab) -> list[dict]:
    rows = lab.read_batch(IMAGE_HASHES.name, DEMO_BATCH).sort_by("key").to_pylist()
    assert rows
    return rows


def test_hashes_from_stored_thumbnails_equal_hashes_from_the_bytes(data_root: Path) -> None:
    lab = Lab(data_root / "lab")
    eligible = ingest_demo_batch(lab, data_root / "landing")
    stored = lab.read_batch(IMAGES.name, DEMO_BATCH, ["key", "phash_thumbnail_version"])
    assert set(stored.column("phash_thumbnail_version").to_pylist()) == {THUMBNAIL_VERSION}
    first = BatchHashes(lab, DEMO_BATCH, DedupSettings(), workers=1)
    out = first.run()
    # Every image is hashed, those under the size cutoff too (they never train).
    assert out.coverage.complete and out.hashed == out.to_hash == stored.num_rows
    assert out.to_hash - out.ineligible == len(eligible)
    assert first.bytes_read == 0  # no image bytes read: nothing decoded again
    from_thumbnails = _hash_rows(lab)

    # The same images without their thumbnails (as an older ingest wrote them): decoded.
    images = lab.read_batch(IMAGES.name, DEMO_BATCH)
    nulls = pa.nulls(images.num_rows, pa.binary())
    images = images.set_column(images.schema.get_field_index("phash_thumbnail"), "phash_thumbnail", nulls)  # fmt: skip
    lab.replace_partition(IMAGES, DEMO_BATCH, images)
    again = BatchHashes(lab, DEMO_BATCH, DedupSettings(), workers=1)
    again.run()
    assert again.bytes_read > 0
    assert _hash_rows(lab) == from_thumbnails


def test_an_images_table_of_the_older_spec_gains_the_columns(tmp_path: Path) -> None:
    lab = Lab(tmp_path / "lab")
    added = ["phash_thumbnail", "phash_thumbnail_version", "preview"]
    old = pa.schema([f for f in IMAGES.schema if f.name not in added])
    row = {f.name: None for f in old} | {"key": "k" * 64, "batch": "b.0"}
    import lance

    lance.write_dataset(pa.Table.from_pylist([row], schema=old), lab.uri(IMAGES.name))
    assert migrate_images_table(lab) == added
    assert migrate_images_table(lab) == []
    assert lab.dataset(IMAGES.name).schema.names == IMAGES.schema.names
    assert lab.read(IMAGES.name, ["key", "phash_thumbnail"]).to_pylist() == [
        {"key": "k" * 64, "phash_thumbnail": None}
    ]


def test_a_table_from_before_both_columns_gets_uncaptured_signals_never_null(
    tmp_path: Path,
) -> None:
    """Both migrations at once: the signal column must read "not captured" (pending), not
    null ("no opt-out signal"), whichever column the table lacked first."""
    from prx_assets.core.ingest.signals import UNCAPTURED

    lab = Lab(tmp_path / "lab")
    added = {"usage_signals", "phash_thumbnail", "phash_thumbnail_version", "preview"}
    old = pa.schema([f for f in IMAGES.schema if f.name not in added])
    row = {f.name: None for f in old} | {"key": "k" * 64, "batch": "b.0"}
    import lance

    lance.write_dataset(pa.Table.from_pylist([row], schema=old), lab.uri(IMAGES.name))
    assert sorted(migrate_images_table(lab)) == sorted(added)
    assert lab.dataset(IMAGES.name).schema.names == IMAGES.schema.names
    got = lab.read(IMAGES.name, ["usage_signals", "phash_thumbnail"]).to_pylist()
    assert got == [{"usage_signals": UNCAPTURED, "phash_thumbnail": None}]


@pytest.mark.parametrize("junk", [b"\x00" * 10, b""])
def test_a_malformed_stored_thumbnail_is_not_used(data_root: Path, junk: bytes) -> None:
    lab = Lab(data_root / "lab")
    ingest_demo_batch(lab, data_root / "landing")
    BatchHashes(lab, DEMO_BATCH, DedupSettings(), workers=1).run()
    good = _hash_rows(lab)
    images = lab.read_batch(IMAGES.name, DEMO_BATCH)
    col = pa.array([junk] * images.num_rows, pa.binary())
    images = images.set_column(images.schema.get_field_index("phash_thumbnail"), "phash_thumbnail", col)  # fmt: skip
    lab.replace_partition(IMAGES, DEMO_BATCH, images)
    run = BatchHashes(lab, DEMO_BATCH, DedupSettings(), workers=1)
    run.run()
    assert run.bytes_read > 0 and _hash_rows(lab) == good
