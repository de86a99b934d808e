"""A small lab with every table the skip decisions read, filled row by row for a test.

Images are declared with the facts that matter to a skip decision (pHash, size, caption,
class label, flatness, URL, whether it was written to a shard); :meth:`World.commit` writes
real Lance tables and decides the clusters with the real dedup code (every batch against
the corpus, repeated until no stored decision changes, as the dedup sensor would).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa

from prx_assets.core.dedup.corpus import gather_corpus
from prx_assets.core.dedup.decisions import DedupSettings, plan_batch
from prx_assets.core.lab import Lab
from prx_assets.core.skiplists.identifiers import parse_identifier
from prx_assets.core.skiplists.intake import opt_out_rows
from prx_assets.core.skiplists.policy import SampleRef, samples_from_rows
from prx_assets.core.tables import (
    CAPTION_CLASSES,
    CAPTIONS,
    IMAGE_HASHES,
    IMAGES,
    OPT_OUTS,
    PHASH_CLUSTERS,
    RESOLUTION,
    SHARD_SAMPLES,
)

T0 = datetime(2024, 1, 1, tzinfo=UTC)
CAPTIONER = "alt_text-test"
SETTINGS = DedupSettings()
FLAT = 0.1  # AC energy under the default low-information threshold (1.0)


def key_of(name: str) -> str:
    """A content key (64 hex digits) per test image name."""
    return hashlib.sha256(name.encode()).hexdigest()


@dataclass
class Img:
    name: str
    batch: str
    phash: int
    pixels: int
    file_size: int
    caption: str | None
    has_caption_row: bool
    label: str | None
    ac_energy: float
    url: str | None
    sharded: bool
    hashed: bool
    eligible: bool = True  # resolution's verdict: False for a copy under the size cutoff

    @property
    def key(self) -> str:
        return key_of(self.name)


class World:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.images: dict[str, Img] = {}

    def image(
        self,
        name: str,
        batch: str,
        *,
        phash: int | None = None,
        pixels: int = 800 * 600,
        file_size: int = 100_000,
        caption: str | None = "A photo of a red boat on a lake.",
        has_caption_row: bool = True,
        label: str | None = "visual",
        ac_energy: float = 40.0,
        url: str | None = None,
        sharded: bool = True,
        hashed: bool = True,
        eligible: bool = True,
    ) -> str:
        """Declare one image; ``phash`` None gives it a hash of its own. Returns its key."""
        if phash is None:
            phash = int(key_of(name)[:15], 16)  # distinct per name, fits int64
        self.images[name] = Img(
            name,
            batch,
            phash,
            pixels,
            file_size,
            caption,
            has_caption_row,
            label,
            ac_energy,
            url,
            sharded,
            hashed,
            eligible,
        )
        return key_of(name)

    def batches(self) -> list[str]:
        return sorted({i.batch for i in self.images.values()})

    def _of(self, batch: str) -> list[Img]:
        return sorted((i for i in self.images.values() if i.batch == batch), key=lambda i: i.key)

    def commit(self, tables: tuple[str, ...] = ("all",)) -> None:
        every = "all" in tables
        for batch in self.batches():
            imgs = self._of(batch)
            if every or IMAGES.name in tables:
                self._write(IMAGES, batch, [self._image_row(i) for i in imgs])
                self._write(RESOLUTION, batch, [self._resolution_row(i) for i in imgs])
            if every or CAPTIONS.name in tables:
                rows = [self._caption_row(i) for i in imgs if i.has_caption_row]
                self._write(CAPTIONS, batch, rows)
            if every or CAPTION_CLASSES.name in tables:
                rows = [self._class_row(i) for i in imgs if i.label is not None]
                self._write(CAPTION_CLASSES, batch, rows)
            if every or IMAGE_HASHES.name in tables:
                self._write(IMAGE_HASHES, batch, [self._hash_row(i) for i in imgs if i.hashed])
            if every or SHARD_SAMPLES.name in tables:
                rows = [i for i in imgs if i.sharded]
                self._write(
                    SHARD_SAMPLES, batch, [self._shard_row(i, n) for n, i in enumerate(rows)]
                )
        if every or PHASH_CLUSTERS.name in tables:
            self.decide_clusters()

    def decide_clusters(self, batches: list[str] | None = None) -> None:
        """Decide each batch against the corpus until no stored decision of another changes."""
        for _ in range(4):
            changed = False
            for batch in batches or self.batches():
                gathered = gather_corpus(self.lab, batch, SETTINGS)
                plan = plan_batch(batch, gathered.corpus, gathered.stored, SETTINGS)
                self.lab.replace_partition(PHASH_CLUSTERS, batch, plan.rows)
                changed |= bool(plan.changes)
            if not changed:
                return
        raise AssertionError("dedup decisions did not settle")

    def samples(self, batch: str) -> list[SampleRef]:
        rows = self.lab.read_batch(SHARD_SAMPLES.name, batch).to_pylist()
        return samples_from_rows(rows)

    def opt_out(self, list_id: str, identifiers: list[str]) -> None:
        ids = [parse_identifier(i) for i in identifiers]
        self.lab.replace_rows(
            OPT_OUTS,
            "list_id",
            list_id,
            opt_out_rows(list_id, dict.fromkeys(ids, []), T0),
        )

    # ------------------------------------------------------------------ rows

    def _write(self, spec, batch: str, rows: list[dict]) -> None:
        self.lab.replace_partition(spec, batch, pa.Table.from_pylist(rows, schema=spec.schema))

    @staticmethod
    def _image_row(i: Img) -> dict:
        return {
            "key": i.key,
            "batch": i.batch,
            "source": "test",
            "source_id": i.name,
            "url": i.url,
            "alt_text": i.caption,
            "path": f"{i.name}.jpg",
            "width": 800,  # the keeper rule reads pixels from image_hashes
            "height": 600,
            "file_size": i.file_size,
            "image": b"",
        }

    @staticmethod
    def _resolution_row(i: Img) -> dict:
        return {"key": i.key, "batch": i.batch, "eligible": i.eligible, "max_tier": 512}

    @staticmethod
    def _caption_row(i: Img) -> dict:
        return {
            "key": i.key,
            "batch": i.batch,
            "caption": i.caption,
            "is_fallback": True,
            "backend": "alt_text",
            "backend_fingerprint": CAPTIONER,
            "created_at": T0,
        }

    @staticmethod
    def _class_row(i: Img) -> dict:
        return {
            "key": i.key,
            "batch": i.batch,
            "label": i.label,
            "caption_fingerprint": CAPTIONER,
            "created_at": T0,
        }

    @staticmethod
    def _hash_row(i: Img) -> dict:
        return {
            "key": i.key,
            "batch": i.batch,
            "phash": i.phash,
            "phash_mode": SETTINGS.phash_mode,
            "phash_version": SETTINGS.phash_version,
            "ac_energy": i.ac_energy,
            "low_information": i.ac_energy < SETTINGS.low_info_threshold,
            "pixels": i.pixels,
            "file_size": i.file_size,
        }

    @staticmethod
    def _shard_row(i: Img, n: int) -> dict:
        rel = f"mds/512/512x512/{i.batch}"
        return {
            "key": i.key,
            "batch": i.batch,
            "tier": 512,
            "shape": "512x512",
            "relative_dir": rel,
            "shard": f"shard.{n // 4:05d}.mds",
            "index_in_shard": n % 4,
            "sample_index": n,
            "dir_digest": "0" * 64,
        }
