"""Perceptual hash (pHash) for near-duplicate removal, in two versioned modes.

Both modes follow imagehash's pHash definition: greyscale, Lanczos to 32x32, 2-D DCT-II
(scipy.fftpack, unnormalised), the top-left 8x8 block, bit = coefficient > median, bits in
row-major order with element [0, 0] as the most significant bit (so ``f"{h:016x}"`` equals
``str(imagehash.phash(img))``). Images are decoded by ``prx_assets.core.ingest.decode`` (EXIF
orientation, RGB policy): we hash what training sees.

- ``reference``: bit-identical to ``imagehash.phash`` on the policy-decoded full image.
  Slow; it is the yardstick.
- ``fast`` (pipeline default): JPEGs are decoded by libjpeg's DCT scaling at the smallest
  scale keeping both sides >= ``FAST_DRAFT_TARGET`` px (entropy decoding is then the whole
  cost; for progressive JPEGs decoded at 1/8 the AC scans of full-resolution components are
  dropped first, which is exact because 1/8 output is the DC alone - tested bit for bit);
  the Lanczos step reads the exact float box of the source inside the scaled decode
  (libjpeg's last block column covers only W mod s pixels); images still much larger are
  box-reduced to >= ``FAST_REDUCE_TARGET`` px first; the DCT of a whole batch is one matrix
  product with a precomputed 1024x64 basis. One deliberate difference: the 32x32 thumbnail
  stays float32 instead of being rounded to uint8. That rounding adds noise of std ~18 DCT
  units, the size of the median gap on ~15% of photos, which is why their reference hash flips
  under a mere re-encode; without it, fast finds more planted duplicates than reference.
  Exact agreement with reference is therefore capped by the reference's own noise (an ideal
  float Lanczos from full resolution agrees on ~83% of varied photos); tests and
  ``benchmarks/bench_phash.py`` measure it instead of assuming it.

Ties: symmetry and flat regions make coefficients exactly equal to the median (a mirror-
symmetric image has 32 exactly-zero odd-frequency coefficients). The reference then decides
the bit by FFT rounding noise (~1e-10), which no other implementation reproduces. ``fast``
sets a bit only when the coefficient exceeds the median by more than ``TIE_TOLERANCE`` (0.01
scipy units; one grey level in one pixel moves a coefficient by up to 4, float32 thumbnail
noise is <= 2e-3), so exact ties give 0 on every machine and BLAS. (Resampling keeps exact
symmetry except where ``reduce`` leaves a partial edge block.)

Low information: a near-flat image has almost no AC energy, so its bits are noise and
unrelated flat images collide. ``ac_energy`` is the RMS, in grey levels, of the 8x8-lowpass
thumbnail around its mean (Parseval on the orthonormal DCT); the lowest demo photo (brick
texture) has ~2.0, blank or JPEG-noisy frames < 0.5. Below the threshold a result is flagged
``low_information`` and clustering never merges it on the hash alone.

Every result carries ``mode`` and ``version``: changing either algorithm must bump
``_VERSIONS`` so hashes from different definitions are never compared silently.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import scipy.fftpack
from PIL import Image

from prx_assets.core.ingest.decode import (
    ALLOWED_FORMATS,
    ORIENTATION_TRANSPOSE,
    DecodeRejected,
    decode_rgb,
    transpose_box,
)

PHASH_MODES: tuple[str, ...] = ("reference", "fast")
_VERSIONS = {"reference": "reference-v1", "fast": "fast-v1"}

HASH_SIZE = 8
THUMB_SIZE = 32  # HASH_SIZE * imagehash's highfreq_factor (4)
FAST_DRAFT_TARGET = 128
FAST_REDUCE_TARGET = 128
TIE_TOLERANCE = 0.01
DEFAULT_LOW_INFO_THRESHOLD = 1.0  # grey levels RMS of the 8x8-lowpass thumbnail
DEFAULT_BATCH = 1024
_ORIENTATION_TAG = 0x0112


def phash_version(mode: str) -> str:
    """The version string stored next to every hash of ``mode``."""
    _check_mode(mode)
    return _VERSIONS[mode]


def _check_mode(mode: str) -> None:
    if mode not in PHASH_MODES:
        raise ValueError(f"unknown pHash mode {mode!r}; expected one of {PHASH_MODES}")


@dataclass(frozen=True)
class HashResult:
    """One image's pHash plus what decides whether it may be merged on the hash alone."""

    hash: int  # unsigned 64-bit
    ac_energy: float
    low_information: bool
    mode: str
    version: str

    @property
    def hex(self) -> str:
        return f"{self.hash:016x}"

    @property
    def signed(self) -> int:
        """The same 64 bits as a signed int64 (for Arrow/Lance int64 columns)."""
        return hash_to_int64(self.hash)


# ---------------------------------------------------------------------------------------------
# Storage helpers


def hash_to_int64(h: int) -> int:
    """Reinterpret an unsigned 64-bit hash as signed int64 (bit pattern unchanged)."""
    if not 0 <= h < 1 << 64:
        raise ValueError(f"hash {h} is not an unsigned 64-bit value")
    return h - (1 << 64) if h >= 1 << 63 else h


def int64_to_hash(v: int) -> int:
    """Inverse of ``hash_to_int64``."""
    if not -(1 << 63) <= v < 1 << 63:
        raise ValueError(f"{v} is not a signed 64-bit value")
    return v + (1 << 64) if v < 0 else v


def hashes_to_uint64(hashes: Iterable[int] | np.ndarray) -> np.ndarray:
    """Hashes (Python ints, or an int64/uint64 array) as a uint64 array, bits unchanged."""
    if isinstance(hashes, np.ndarray):
        if hashes.dtype == np.uint64:
            return hashes
        if hashes.dtype == np.int64:
            return hashes.view(np.uint64)
        raise TypeError(f"hash arrays must be uint64 or int64, got {hashes.dtype}")
    return np.fromiter((int(h) for h in hashes), dtype=np.uint64)


def hamming(a: int, b: int) -> int:
    return (int(a) ^ int(b)).bit_count()


# ---------------------------------------------------------------------------------------------
# Reference


def _reference_block(img: Image.Image) -> np.ndarray:
    # Exactly imagehash.phash's steps (imagehash 4.3.2), so the bits match.
    small = img.convert("L").resize((THUMB_SIZE, THUMB_SIZE), Image.Resampling.LANCZOS)
    pixels = np.asarray(small)
    dct = scipy.fftpack.dct(scipy.fftpack.dct(pixels, axis=0), axis=1)
    return dct[:HASH_SIZE, :HASH_SIZE]


def phash_reference(img: Image.Image) -> int:
    """``imagehash.phash(img)`` as an unsigned 64-bit int, bit for bit."""
    block = _reference_block(img)
    bits = block > np.median(block)
    return _pack_bits(bits.reshape(1, 64))[0].item()


def _pack_bits(bits: np.ndarray) -> np.ndarray:
    """(B, 64) bool, element 0 most significant -> (B,) uint64."""
    packed = np.packbits(bits, axis=1, bitorder="big")  # (B, 8) bytes, big-endian order
    return packed.view(">u8").reshape(-1).astype(np.uint64)


# ---------------------------------------------------------------------------------------------
# Batched DCT


def _dct_matrix() -> np.ndarray:
    """(1024, 64) matrix K with thumb.reshape(1024) @ K == scipy 2-D DCT-II top-left 8x8."""
    n = np.arange(THUMB_SIZE)
    k = np.arange(HASH_SIZE)
    d = 2.0 * np.cos(np.pi * k[:, None] * (2 * n[None, :] + 1) / (2 * THUMB_SIZE))  # (8, 32)
    # c[k, l] = sum_{n, m} d[k, n] x[n, m] d[l, m]
    return np.einsum("kn,lm->nmkl", d, d).reshape(THUMB_SIZE * THUMB_SIZE, HASH_SIZE * HASH_SIZE)


_DCT = _dct_matrix()
# Orthonormal scaling of scipy's unnormalised DCT-II, per axis: sqrt(1/4N) for k=0, else sqrt(1/2N).
_ORTHO = np.full(HASH_SIZE, np.sqrt(1.0 / (2 * THUMB_SIZE)))
_ORTHO[0] = np.sqrt(1.0 / (4 * THUMB_SIZE))
_AC_WEIGHT = np.outer(_ORTHO, _ORTHO).reshape(64) ** 2 / (THUMB_SIZE * THUMB_SIZE)
_AC_WEIGHT[0] = 0.0


def _ac_energy(blocks: np.ndarray) -> np.ndarray:
    """(B, 64) unnormalised DCT blocks -> RMS grey levels of the lowpass thumbnail's AC part."""
    return np.sqrt((blocks * blocks) @ _AC_WEIGHT)


def hash_thumbnails(thumbs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hash a stack of 32x32 greyscale thumbnails at once.

    Returns (uint64 hashes, float64 ac_energy). Ties within ``TIE_TOLERANCE`` of the median
    count as "not above" (see the module docstring).
    """
    thumbs = np.asarray(thumbs)
    if thumbs.ndim != 3 or thumbs.shape[1:] != (THUMB_SIZE, THUMB_SIZE):
        raise ValueError(f"expected (B, {THUMB_SIZE}, {THUMB_SIZE}) thumbnails, got {thumbs.shape}")
    flat = thumbs.reshape(len(thumbs), THUMB_SIZE * THUMB_SIZE).astype(np.float64)
    blocks = flat @ _DCT
    middle = np.partition(blocks, (31, 32), axis=1)  # np.median's value, without its overhead
    med = (middle[:, 31:32] + middle[:, 32:33]) / 2
    bits = blocks > med + TIE_TOLERANCE
    return _pack_bits(bits), _ac_energy(blocks)


# ---------------------------------------------------------------------------------------------
# Decoding to thumbnails


def fast_thumbnail(
    data: bytes,
    draft_target: int = FAST_DRAFT_TARGET,
    reduce_target: int = FAST_REDUCE_TARGET,
) -> np.ndarray:
    """Policy-decode ``data`` at reduced scale and return the 32x32 float32 luma thumbnail."""
    if draft_target < THUMB_SIZE or reduce_target < THUMB_SIZE:
        raise ValueError(
            f"draft_target and reduce_target must be >= {THUMB_SIZE}, "
            f"got {draft_target} and {reduce_target}"
        )
    data = progressive_dc_scans(data, draft_target) or data
    img = decode_rgb(data, draft_size=(draft_target, draft_target))
    return _thumbnail_of(img.convert("L"), _valid_box(data, img.size), reduce_target)


FAST_THUMBNAIL_BYTES = THUMB_SIZE * THUMB_SIZE * 4  # float32, little-endian


def fast_thumbnail_of_decoded(data: bytes, img: Image.Image) -> np.ndarray:
    """``fast_thumbnail(data)`` from ``decode_rgb(data, draft_size=(FAST_DRAFT_TARGET,) * 2)``.

    For a caller that already holds that decode (ingest validates from it): the same steps,
    so the same float32 thumbnail, bit for bit (tested); for progressive JPEGs too, since the
    DC-scan cut ``fast_thumbnail`` decodes is exact at the 1/8 scale it applies to.
    """
    return _thumbnail_of(img.convert("L"), _valid_box(data, img.size), FAST_REDUCE_TARGET)


def thumbnail_to_bytes(thumb: np.ndarray) -> bytes:
    """A 32x32 float32 thumbnail as stored (``images.phash_thumbnail``)."""
    return np.ascontiguousarray(thumb, dtype="<f4").tobytes()


def thumbnail_from_bytes(raw: bytes) -> np.ndarray:
    """The stored thumbnail back as a 32x32 float32 array (exactly the values stored)."""
    if len(raw) != FAST_THUMBNAIL_BYTES:
        raise ValueError(f"a stored thumbnail has {FAST_THUMBNAIL_BYTES} bytes, not {len(raw)}")
    return np.frombuffer(raw, dtype="<f4").reshape(THUMB_SIZE, THUMB_SIZE)


# The next marker after entropy-coded data: 0xFF not followed by a stuffed 0x00, a restart
# marker (RSTn, inside the scan) or another 0xFF (fill).
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_SOF_PROGRESSIVE_HUFFMAN = 0xC2


def progressive_dc_scans(data: bytes, draft_target: int = FAST_DRAFT_TARGET) -> bytes | None:
    """A progressive JPEG cut down to its DC scans, when it will be decoded at 1/8 scale.

    At 1/8 DCT scale libjpeg outputs each block's DC coefficient alone, so the AC scans
    (~90% of a progressive file, and of its decode time) cannot change a single output pixel:
    dropping them is exact (tested bit for bit), not an approximation. Every other segment
    (tables, EXIF) is kept in order, so orientation and colour policy are unchanged.

    Returns None, meaning "decode ``data`` as it is", for anything else: baseline or
    arithmetic-coded JPEGs, MPO, images small enough to decode above 1/8 scale, and any
    stream that does not parse to its EOI (truncation is then reported by the real decode).
    """
    if not data.startswith(b"\xff\xd8"):
        return None
    out = [data[:2]]
    pos, n = 2, len(data)
    progressive = False
    while True:
        if pos + 2 > n or data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xD9:  # EOI
            break
        if pos + 4 > n:
            return None
        end = pos + 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if end > n:
            return None
        if marker in _SOF:
            if marker != _SOF_PROGRESSIVE_HUFFMAN or end < pos + 9:
                return None
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            if min(width // draft_target, height // draft_target) < 8:  # Pillow's draft rule
                return None
            nf = data[pos + 9] if pos + 9 < n else 0
            if nf == 0 or end != pos + 10 + 3 * nf:
                return None
            components = [
                (data[pos + 10 + 3 * i], data[pos + 11 + 3 * i] >> 4, data[pos + 11 + 3 * i] & 15)
                for i in range(nf)
            ]
            if any(h == 0 or v == 0 for _, h, v in components):
                return None
            hmax = max(h for _, h, _ in components)
            vmax = max(v for _, _, v in components)
            # libjpeg decodes subsampled components at a larger IDCT size (2x2 for 4:2:0
            # chroma) to spare the upsampling: those need their AC scans (small ones).
            subsampled = {c for c, h, v in components if (h, v) != (hmax, vmax)}
            full = [c for c in components if c[0] not in subsampled]
            progressive = True
        elif marker == 0xE2 and data[pos + 4 : pos + 8] == b"MPF\x00":
            return None  # MPO: frame offsets would point past the cut stream
        elif marker == 0xDA:  # SOS: header, then entropy-coded data up to the next marker
            ns = data[pos + 4] if pos + 4 < n else 0
            if not progressive or end != pos + 8 + 2 * ns:
                return None
            following = _NEXT_MARKER.search(data, end)
            if following is None:
                return None
            scan_components = {data[pos + 5 + 2 * i] for i in range(ns)}
            if data[pos + 5 + 2 * ns] == 0 or scan_components & subsampled:
                out.append(data[pos : following.start()])  # DC, or a subsampled component
            pos = following.start()
            continue
        out.append(data[pos:end])
        pos = end
    if not progressive:
        return None
    out.append(_zero_ac_scans(width, height, full, hmax, vmax))
    out.append(b"\xff\xd9")
    return b"".join(out)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# An AC Huffman table with the 15 end-of-band-run symbols EOB0..EOB14 (0x00, 0x10, .., 0xE0),
# all 4-bit codes: code r for EOBr.
_EOB_TABLE_ID = 3
_EOB_DHT = (
    b"\xff\xc4"
    + (2 + 1 + 16 + 15).to_bytes(2, "big")
    + bytes([0x10 | _EOB_TABLE_ID])
    + bytes([0, 0, 0, 15] + [0] * 12)
    + bytes(r << 4 for r in range(15))
)
_NO_RESTARTS = b"\xff\xdd\x00\x04\x00\x00"


def _zero_ac_scans(
    width: int, height: int, components: list[tuple[int, int, int]], hmax: int, vmax: int
) -> bytes:
    """One AC scan per component declaring every AC coefficient exactly 0.

    Why: with only DC scans, libjpeg-turbo's block smoothing treats the AC as unknown and
    re-estimates (and changes) the DC values; once AC is known - as zero - it leaves them alone,
    and the 1/8-scale output equals that of the full file. Each scan is a few bytes of
    end-of-band runs (EOBr: 2**r + r extra bits blocks, at most 32767 per run).
    """
    parts = [_EOB_DHT, _NO_RESTARTS]
    for cid, h, v in components:
        blocks = _ceil_div(_ceil_div(width * h, hmax), 8) * _ceil_div(
            _ceil_div(height * v, vmax), 8
        )
        bits = []
        while blocks:
            run = min(blocks, (1 << 15) - 1)
            r = run.bit_length() - 1
            bits.append(format(r, "04b") + (format(run - (1 << r), f"0{r}b") if r else ""))
            blocks -= run
        stream = "".join(bits)
        stream += "1" * (-len(stream) % 8)  # pad with 1-bits, as the standard asks
        entropy = int(stream, 2).to_bytes(len(stream) // 8, "big").replace(b"\xff", b"\xff\x00")
        header = bytes([0xFF, 0xDA, 0, 8, 1, cid, _EOB_TABLE_ID, 1, 63, 0])
        parts += [header, entropy]
    return b"".join(parts)


# exif_transpose's methods by EXIF orientation, and where a box lands under them.
_TRANSPOSE = ORIENTATION_TRANSPOSE
_transpose_box = transpose_box


def _valid_box(data: bytes, out_size: tuple[int, int]) -> tuple[float, float, float, float]:
    """The region of a DCT-scaled decode that maps exactly onto the full image.

    libjpeg's 1/s output has ceil(W/s) columns; the last one stands for only W mod s source
    columns, so resampling the whole output would stretch the picture by up to a pixel
    (measured: it costs several points of agreement with the reference). Lanczos reads
    this float box instead, which is what Pillow does after its own ``draft``/``reduce``.
    """
    cw, ch = out_size
    full = (0.0, 0.0, float(cw), float(ch))
    if not data.startswith(b"\xff\xd8"):  # only JPEG (and MPO) decodes are DCT-scaled
        return full
    header = Image.open(io.BytesIO(data), formats=list(ALLOWED_FORMATS))
    w, h = header.size
    if (cw, ch) == (w, h) or (cw, ch) == (h, w):
        return full
    method = _TRANSPOSE.get(header.getexif().get(_ORIENTATION_TAG, 1))
    transposed = method in (
        Image.Transpose.TRANSPOSE,
        Image.Transpose.TRANSVERSE,
        Image.Transpose.ROTATE_90,
        Image.Transpose.ROTATE_270,
    )
    dw, dh = (ch, cw) if transposed else (cw, ch)  # decoded size before orientation
    for scale in (2, 4, 8):
        if (-(-w // scale), -(-h // scale)) == (dw, dh):
            return _transpose_box((0.0, 0.0, w / scale, h / scale), (dw, dh), method)
    return full  # not a plain DCT scaling after all: at worst a sub-pixel misalignment


def _thumbnail_of(
    grey: Image.Image, box: tuple[float, float, float, float], reduce_target: int
) -> np.ndarray:
    """32x32 float32 Lanczos thumbnail of ``box``, in [0, 255], box-reduced first if large.

    After ``reduce`` the box is scaled, not snapped: cropping to whole blocks instead (to keep
    mirror symmetry exact) shifted the picture by up to one reduced pixel and cost ~8 points
    of agreement with the reference on varied photos.
    """
    fx = max(1, int(box[2] - box[0]) // reduce_target)
    fy = max(1, int(box[3] - box[1]) // reduce_target)
    if fx > 1 or fy > 1:
        grey = grey.reduce((fx, fy))
        box = (box[0] / fx, box[1] / fy, box[2] / fx, box[3] / fy)
    grey = grey.convert("F").resize((THUMB_SIZE, THUMB_SIZE), Image.Resampling.LANCZOS, box=box)
    # Saturate Lanczos overshoot like the reference's uint8 output does (without rounding):
    # on upscaled tiny images the overshoot is large and changes many bits.
    return np.clip(np.asarray(grey), 0.0, 255.0)


def _results(
    hashes: np.ndarray, energy: np.ndarray, mode: str, threshold: float
) -> list[HashResult]:
    version = _VERSIONS[mode]
    return [
        HashResult(int(h), float(e), bool(e < threshold), mode, version)
        for h, e in zip(hashes.tolist(), energy.tolist(), strict=True)
    ]


def fast_thumbnail_task(data: bytes) -> np.ndarray | tuple[str, str]:
    """``fast_thumbnail(data)``, or the policy's (reason, detail) refusal: a pool task."""
    try:
        return fast_thumbnail(data)
    except DecodeRejected as exc:
        return exc.reason, exc.detail


def hash_results(
    thumbs: list[np.ndarray], low_info_threshold: float = DEFAULT_LOW_INFO_THRESHOLD
) -> list[HashResult]:
    """``fast`` results of a stack of thumbnails (one batched DCT), in order."""
    if not thumbs:
        return []
    return _results(*hash_thumbnails(np.stack(thumbs)), "fast", low_info_threshold)


def phash_bytes(
    data: bytes, mode: str = "fast", low_info_threshold: float = DEFAULT_LOW_INFO_THRESHOLD
) -> HashResult:
    """pHash of encoded image bytes, decoded by the project's policy (orientation, RGB)."""
    return phash_many([data], mode=mode, low_info_threshold=low_info_threshold)[0]


def phash_many(
    datas: Iterable[bytes],
    mode: str = "fast",
    low_info_threshold: float = DEFAULT_LOW_INFO_THRESHOLD,
    batch_size: int = DEFAULT_BATCH,
) -> list[HashResult]:
    """pHash many encoded images; ``fast`` runs one DCT matrix product per ``batch_size``.

    Undecodable input raises ``DecodeRejected`` (ingest has already filtered it out).
    """
    _check_mode(mode)
    if low_info_threshold < 0:
        raise ValueError(f"low_info_threshold must be >= 0, got {low_info_threshold}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out: list[HashResult] = []
    if mode == "reference":
        for data in datas:
            block = _reference_block(decode_rgb(data)).reshape(1, 64)
            bits = block > np.median(block)
            out += _results(_pack_bits(bits), _ac_energy(block), mode, low_info_threshold)
        return out
    thumbs: list[np.ndarray] = []
    for data in datas:
        thumbs.append(fast_thumbnail(data))
        if len(thumbs) == batch_size:
            out += _results(*hash_thumbnails(np.stack(thumbs)), mode, low_info_threshold)
            thumbs.clear()
    if thumbs:
        out += _results(*hash_thumbnails(np.stack(thumbs)), mode, low_info_threshold)
    return out
