"""Near-duplicate look-ups through indexes: a pHash's four 16-bit bands, each a BTREE.

Why: with ``radius`` > 0, ``phash_clusters`` needs every corpus hash joined to a batch's by
a chain of steps within the radius. Reading every distinct hash of the corpus for every
batch (``corpus_hashes``) made one 10k-hash batch against 10^6 hashes cost 13 s CPU and
0.9 GB at radius 4, against 0.9 s at radius 0, and it grows with the corpus.

How: two 64-bit hashes within Hamming distance 3 agree exactly on at least one of four
16-bit bands (pigeonhole: 3 differing bits touch at most 3 bands). ``image_hashes`` stores
the bands as indexed columns (filled by the lab store on every write: ``TableSpec.derive``),
so each round of the closure reads only the rows sharing a band with the frontier, checks
their distance, and continues from the new ones: the cost follows the batch's candidates.
Radii above ``INDEXED_MAX_RADIUS`` are not covered by four bands; they keep the scan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

BANDS = 4
BAND_BITS = 16
BAND_COLUMNS = tuple(f"phash_band{i}" for i in range(BANDS))
INDEXED_MAX_RADIUS = BANDS - 1


def band_values(hashes: np.ndarray | Sequence[int]) -> np.ndarray:
    """(n, 4) int32: band i = bits ``63 - 16 i`` .. ``48 - 16 i`` of each 64-bit hash."""
    h = np.asarray(hashes).astype(np.int64).view(np.uint64)
    out = np.empty((len(h), BANDS), dtype=np.int32)
    for i in range(BANDS):
        shift = np.uint64(BAND_BITS * (BANDS - 1 - i))
        out[:, i] = ((h >> shift) & np.uint64(0xFFFF)).astype(np.int32)
    return out


def with_bands(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with its band columns computed from ``phash`` (null where it is null)."""
    phash = batch.column("phash")
    valid = np.asarray(phash.is_valid())
    values = phash.fill_null(0).to_numpy(zero_copy_only=False)
    bands = band_values(values)
    arrays = []
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        if name in BAND_COLUMNS:
            i = BAND_COLUMNS.index(name)
            column = pa.array(bands[:, i], pa.int32(), mask=~valid)
        arrays.append(column)
    return pa.RecordBatch.from_arrays(arrays, schema=batch.schema)
