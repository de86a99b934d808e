"""Write MDS shard files (mosaicml-streaming's ``mds`` format) without importing streaming.

Why hand-written: ``import streaming`` imports torch, ~10 s of CPU in every fresh process.
Each shard-piece worker (``core/shards/pieces.py``) is such a process, and paid it on its
first piece: the demo's shard step went from 36 s to 107 s. The format is small and
fixed (streaming 0.13, index version 2), and only its plain encodings are supported
(``bytes``, ``str``, ``int``, ``json`` and the numpy scalars); anything else is refused. ``prx_assets_tests/core/
test_mds_format.py`` checks that the files and index entries are byte-identical to
``streaming.MDSWriter``'s for the same samples, limits and hashes, and streaming's own
reader reads them.

Layout of one shard (little-endian): ``num_samples: u32``, ``offsets: u32 × (n+1)``
(from the start of the file), the JSON config (key-sorted), then the samples. A sample is
the ``u32`` sizes of its variable-size columns followed by every column's bytes, columns
in name order; an ``int`` is 8 bytes (``int64``), a numpy scalar its own size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "mds"
INDEX_VERSION = 2  # streaming's index.json "version"
INDEX_NAME = "index.json"
EXTRA_BYTES_PER_SAMPLE = 4  # the sample's offset (MDSWriter.extra_bytes_per_sample)
_SCALARS = (
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64",
)  # fmt: skip
_FIXED_SIZES: dict[str, int | None] = {
    "bytes": None,
    "str": None,
    "json": None,
    "int": 8,
    **{name: np.dtype(name).itemsize for name in _SCALARS},
}
_INT64 = struct.Struct("<q")
_MAX_SIZE_LIMIT = 1 << 32  # offsets are u32


def _hash_function(algo: str) -> Callable[[bytes], Any]:
    """streaming's hash names: hashlib's algorithms and xxhash's."""
    if algo in hashlib.algorithms_guaranteed and not algo.startswith("shake_"):
        return getattr(hashlib, algo)
    try:
        import xxhash
    except ImportError:  # pragma: no cover - xxhash ships with streaming
        xxhash = None
    if xxhash is not None and algo in xxhash.algorithms_available:
        return getattr(xxhash, algo)
    raise ValueError(f"unsupported shard hash algorithm {algo!r}")


class MDSShardWriter:
    """Encode rows into ``shard.NNNNN.mds`` files in ``out`` exactly as ``MDSWriter`` would
    (no compression), starting a new shard where MDSWriter starts one.

    Unlike MDSWriter it refuses a row too large for a whole shard (``ValueError``), as it
    encodes it, instead of starting a shard for it; and it writes ``index.json`` only when
    asked (``finish(write_index=True)``), since piece workers hand their entries to the
    step instead.
    """

    def __init__(
        self,
        out: Path,
        columns: Mapping[str, str],
        hashes: Sequence[str],
        size_limit: int,
    ) -> None:
        if not 0 < size_limit < _MAX_SIZE_LIMIT:
            raise ValueError(f"size_limit must be in (0, 2**32), got {size_limit}")
        hashes = list(hashes)
        if hashes != sorted(hashes):
            raise ValueError(f"shard hashes must be sorted, got {hashes}")
        self._hashers = [(a, _hash_function(a)) for a in hashes]
        self.names = sorted(columns)
        for name in self.names:
            if columns[name] not in _FIXED_SIZES:
                raise ValueError(
                    f"column {name!r}: unsupported MDS encoding {columns[name]!r} "
                    f"(supported: {sorted(_FIXED_SIZES)})"
                )
        self._encodings = [columns[n] for n in self.names]
        self.size_limit = size_limit
        self.config: dict[str, Any] = {
            "version": INDEX_VERSION,
            "format": FORMAT,
            "compression": None,
            "hashes": hashes,
            "size_limit": size_limit,
            "column_names": list(self.names),
            "column_encodings": list(self._encodings),
            "column_sizes": [_FIXED_SIZES[e] for e in self._encodings],
        }
        self._config_data = json.dumps(self.config, sort_keys=True).encode("utf-8")
        self._extra_per_shard = 4 + 4 + len(self._config_data)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        if any(self.out.iterdir()):
            raise FileExistsError(f"{self.out} is not empty")
        self.shards: list[dict[str, Any]] = []
        self._samples: list[bytes] = []
        self._shard_size = self._extra_per_shard

    def encode(self, row: Mapping[str, Any]) -> bytes:
        """One row as MDS sample bytes (the types are checked, as MDSWriter checks them)."""
        sizes: list[int] = []
        data: list[bytes] = []
        for name, encoding in zip(self.names, self._encodings, strict=True):
            value = row[name]
            if encoding == "int":
                if not isinstance(value, int):
                    raise TypeError(f"column {name!r} must be an int, got {type(value)}")
                data.append(_INT64.pack(value))
                continue
            if encoding in _SCALARS:  # as streaming's Scalar: the numpy value's bytes
                data.append(np.dtype(encoding).type(value).tobytes())
                continue
            if encoding == "json":  # as streaming's JSON: json.dumps, unsorted
                if isinstance(value, np.ndarray):
                    value = value.tolist()
                datum = json.dumps(value).encode("utf-8")
            elif encoding == "str":
                if not isinstance(value, str):
                    raise TypeError(f"column {name!r} must be a str, got {type(value)}")
                datum = value.encode("utf-8")
            else:
                if not isinstance(value, bytes):
                    raise TypeError(f"column {name!r} must be bytes, got {type(value)}")
                datum = value
            sizes.append(len(datum))
            data.append(datum)
        return struct.pack(f"<{len(sizes)}I", *sizes) + b"".join(data)

    def write(self, row: Mapping[str, Any]) -> None:
        """Add a row; the current shard is written first when the row would overflow it."""
        sample = self.encode(row)
        size = len(sample) + EXTRA_BYTES_PER_SAMPLE
        if size + self._extra_per_shard > self.size_limit:
            raise ValueError(
                f"sample {row.get('key')!r} encodes to {len(sample)} bytes, more than "
                f"the shard size limit {self.size_limit}"
            )
        if self.size_limit < self._shard_size + size:
            self._flush()
        self._samples.append(sample)
        self._shard_size += size

    def finish(self, write_index: bool = False) -> list[dict[str, Any]]:
        """Write the last shard (and ``index.json`` if asked); every shard's index entry."""
        if self._samples:
            self._flush()
        if write_index:
            text = json.dumps({"version": INDEX_VERSION, "shards": self.shards}, sort_keys=True)
            (self.out / INDEX_NAME).write_text(text)
        return self.shards

    def _flush(self) -> None:
        samples = self._samples
        n = len(samples)
        head = 4 + 4 * (n + 1) + len(self._config_data)
        offsets = [head]
        for s in samples:
            offsets.append(offsets[-1] + len(s))
        data = b"".join([struct.pack(f"<I{n + 1}I", n, *offsets), self._config_data, *samples])
        name = f"shard.{len(self.shards):05}.{FORMAT}"
        with open(self.out / name, "wb") as fh:
            fh.write(data)
        raw = {
            "basename": name,
            "bytes": len(data),
            "hashes": {algo: fn(data).hexdigest() for algo, fn in self._hashers},
        }
        self.shards.append({"samples": n, "raw_data": raw, "zip_data": None, **self.config})
        self._samples = []
        self._shard_size = self._extra_per_shard
