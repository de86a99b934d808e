"""Resize an image into its bucket shape, and encode the result as deterministic JPEG.

The reference is the naive pipeline: full decode, Lanczos to the cover size, crop
(``resize_plain``). The shard path (``resize_to_bucket``, default ``resample="lanczos"``)
gives the trainer the same picture up to a difference smaller than the q92 encode's own loss
(PSNR against the reference above PSNR of the q92 round trip, on >= 95 % of real photos:
``prx_assets_tests/core/test_resize.py``, benchmarks/bench_resize and bench_pipeline), at a
fraction of the cost. The filter is literal Lanczos-3; what is skipped is work whose pixels
the output never uses:

- JPEG sources (baseline or progressive, RGB or greyscale, one frame) are decoded by
  libjpeg-turbo (``simplejpeg``) at 1/8, 1/4, 1/2 or full size: the smallest of those that
  still holds ``DETAIL_MARGIN`` (2) x the bucket's cover size (``decode_divisor``), so
  Lanczos always reduces by >= 2x after a scaled IDCT. Never 5/8..7/8: those scaled
  IDCTs cost more than the full-size one (3.5 MP, one core: 10.9 / 13.0 / 15.9 ms against
  8.5 ms; 1/2 is 6.7 ms), so where one of them would be the smallest covering eighth the
  decode is full size and Lanczos takes the whole reduction. For progressive JPEGs the
  entropy decode dominates (25.6 ms full, 23.8 ms at 1/2): the same rule, little to win.
- Lanczos-3 is libvips' (``pyvips``: ``reduceh``/``reducev``, fixed-point SIMD, one thread
  per process, ``lanczos_vips``), in the stored frame of the JPEG, only the crop box
  computed (libvips is demand-driven), then the EXIF turn of the small result. Its sampling
  grid is put on Pillow's (``_padding``), so from a full decode it is within ~56 dB of the
  naive output; about 5x cheaper than Pillow's Lanczos over the same box. The same bytes
  with libvips' SIMD on or off (tested), so shards do not depend on the CPU's vector units.
  ``resample="lanczos-pillow"`` is the previous path (Pillow's Lanczos over the crop box
  from the smallest covering eighth): the reference, and what upscaled assignments use.
- Encoding is libjpeg-turbo's (``simplejpeg.encode_jpeg``): baseline, q92, 4:4:4, JFIF
  header only.
- Other formats (PNG, WebP, ...), CMYK or multi-frame JPEGs, and any JPEG libjpeg-turbo
  refuses in strict mode go through Pillow: the policy decode (``decode_rgb``; a JPEG drafted
  only when >= 2x its cover size), ``Image.reduce`` when still >= 2x (``DETAIL_MARGIN``), then
  the same Lanczos over the crop box.

What ingest recorded about the bytes (format, mode, orientation, frames: ``SourceFacts``) is
reused rather than re-probed; the JPEG header's own size is still checked against the
assignment and the pixel limit before any pixel is decoded, and EXIF orientation is applied
exactly as ``ImageOps.exif_transpose`` does (the partial last block column of a scaled decode
is kept outside the sampled box whichever way the image is turned).

``resample="bicubic-aa"`` (the former default) stays available: antialiased bicubic (Keys
a = -0.5, Pillow's BICUBIC) in torch's vectorised uint8 kernel, after the Pillow decode;
torch is imported only then. Its generic, AVX2 and AVX512 kernels give bit-identical pixels;
without AVX2 it is ~10x slower than with.

Determinism: same bytes in, same bytes out (libjpeg-turbo's accurate integer IDCT and fancy
upsampling, as Pillow uses; libvips' fixed-point Lanczos, SIMD or not; a fixed encoder).
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import simplejpeg
from PIL import Image

from prx_assets.core.ingest.decode import (
    DEFAULT_MAX_PIXELS,
    ORIENTATION_TRANSPOSE,
    DecodeRejected,
    decode_rgb,
    open_header,
    orientation_of,
    transpose_box,
)
from prx_assets.core.shards.buckets import Assignment

DETAIL_MARGIN = 2  # fast-path intermediates keep >= 2x the pixels of the resized target
RESAMPLE = "lanczos"  # the shard path's filter (see module doc)
# "lanczos": libvips' Lanczos-3 (JPEG sources, downsampling); "lanczos-pillow": Pillow's, the
# reference it is held to; "bicubic-aa": torch's antialiased bicubic (the former default).
RESAMPLE_CHOICES = ("lanczos", "lanczos-pillow", "bicubic-aa")
_LANCZOS = ("lanczos", "lanczos-pillow")
RESAMPLE_DESCRIPTION = (
    "literal Lanczos-3 (libvips, one core) over the crop box, from a libjpeg-turbo decode at "
    "1/8, 1/4, 1/2 or full size (the smallest covering the cover size) for JPEG sources; "
    "differs from the naive full decode + Lanczos by less than the q92 encode loss"
)
_SCALED_DECODE_MODES = ("RGB", "L")  # JPEG colour modes libjpeg-turbo turns into RGB itself
JPEG_QUALITY = 92
# 4:4:4 (no chroma subsampling). Why: bucket images are already at training resolution,
# so halving chroma would cost real colour detail at the pixels the model sees (coloured
# edges, text, thin lines). Measured on the colour demo photos at bucket size, q92: 4:2:0
# loses 1.3-4.4 dB PSNR against 4:4:4 for 20-30 % fewer bytes (greyscale: no PSNR change,
# ~8 % fewer bytes). Storage is cheap next to data quality. Encoding 4:4:4 is ~1.5x slower
# than 4:2:0, still small next to decode and Lanczos.
JPEG_SUBSAMPLING = "4:4:4"
_SIMPLEJPEG_SUBSAMPLING = {"4:4:4": "444", "4:2:0": "420"}
JPEG_SUBSAMPLING_REASON = (
    "4:4:4 (no chroma subsampling): bucket images are already at training resolution, so "
    "4:2:0 would halve colour detail at the pixels the model sees; measured on the demo "
    "photos at q92 it costs 1.3-4.4 dB PSNR for 20-30 % fewer bytes."
)
# optimize=True (per-image Huffman tables) saved ~4 % of bytes for ~2x the encode time:
# not worth it.
JPEG_OPTIMIZE = False

# libjpeg's standard quantisation tables (ITU T.81 Annex K), natural (row-major) order.
_STD_LUMA = (
    16, 11, 10, 16, 24, 40, 51, 61,
    12, 12, 14, 19, 26, 58, 60, 55,
    14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62,
    18, 22, 37, 56, 68, 109, 103, 77,
    24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101,
    72, 92, 95, 98, 112, 100, 103, 99,
)  # fmt: skip
_STD_CHROMA = (
    17, 18, 24, 47, 99, 99, 99, 99,
    18, 21, 26, 66, 99, 99, 99, 99,
    24, 26, 56, 99, 99, 99, 99, 99,
    47, 66, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99,
)  # fmt: skip


def _check_assignment(img_size: tuple[int, int], factor: int, assignment: Assignment) -> None:
    w, h = assignment.source_size
    expected = (math.ceil(w / factor), math.ceil(h / factor))
    if img_size != expected:
        raise AssignmentMismatch(
            f"assignment is for a {w}x{h} image but the bytes decode to "
            f"{img_size[0]}x{img_size[1]} (at 1/{factor} scale, expected "
            f"{expected[0]}x{expected[1]})"
        )


def _source_box(assignment: Assignment) -> tuple[float, float, float, float]:
    """The crop box mapped back to source pixels (per-axis scale, as resize() uses)."""
    w, h = assignment.source_size
    rw, rh = assignment.resize_size
    sx, sy = rw / w, rh / h
    left, top, right, bottom = assignment.crop_box
    return (left / sx, top / sy, right / sx, bottom / sy)


def _reduce_factor(box_w: float, box_h: float, target: tuple[int, int]) -> int:
    """Largest integer k with the reduced box still >= DETAIL_MARGIN x target on both axes."""
    tw, th = target
    return max(1, int(min(box_w / (DETAIL_MARGIN * tw), box_h / (DETAIL_MARGIN * th))))


def resize_plain(
    data: bytes, assignment: Assignment, max_pixels: int = DEFAULT_MAX_PIXELS
) -> Image.Image:
    """Reference path: full decode, Lanczos to ``resize_size``, crop ``crop_box``."""
    img = decode_rgb(data, max_pixels)
    _check_assignment(img.size, 1, assignment)
    resized = img.resize(assignment.resize_size, Image.Resampling.LANCZOS)
    return resized.crop(assignment.crop_box)


@dataclass(frozen=True)
class PreparedSource:
    """A source decoded and pre-reduced by the fast path, and the crop box in its pixels.

    ``draft_factor`` (1, 2, 4, 8: JPEG DCT scaling) and ``reduce_factor`` (box reduce)
    record how much of the full-size work was skipped.
    """

    image: Image.Image
    box: tuple[float, float, float, float]
    draft_factor: int
    reduce_factor: int


def prepare_fast(
    data: bytes, assignment: Assignment, max_pixels: int = DEFAULT_MAX_PIXELS
) -> PreparedSource:
    """Decode with JPEG draft and ``Image.reduce``, each keeping >= 2x the target size."""
    target = (assignment.shape.width, assignment.shape.height)
    rw, rh = assignment.resize_size
    img = decode_rgb(data, max_pixels, draft_size=(DETAIL_MARGIN * rw, DETAIL_MARGIN * rh))
    w, h = assignment.source_size
    # DCT scaling divides by 1, 2, 4 or 8 with ceil rounding; recover which one was used.
    factor = max(1, round(min(w / img.width, h / img.height)))
    _check_assignment(img.size, factor, assignment)
    left, top, right, bottom = (v / factor for v in _source_box(assignment))
    k = _reduce_factor(right - left, bottom - top, target)
    if k > 1:
        img = img.reduce(k)
        left, top, right, bottom = left / k, top / k, right / k, bottom / k
    return PreparedSource(img, (left, top, right, bottom), factor, k)


@lru_cache(maxsize=1)
def _torch() -> Any:
    # Imported on first use: a few seconds, and only the shard path needs it.
    import torch

    # torch warns once per process that a read-only array (what Pillow exports, and we
    # never write) becomes a tensor; spend that one warning here, silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))
    return torch


def _bicubic_aa(img: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """Antialiased bicubic resize of an RGB image to ``size`` (w, h), as an HxWx3 view.

    The output is written channels-last (HWC) through the op's ``out=`` form: the public
    ``interpolate`` returns NCHW, and turning that back into HWC pixels costs a transposing
    copy as long as the resize itself. Same values either way (checked in the tests); the
    public call is the fallback if a torch release drops the op overload.
    """
    torch = _torch()
    x = torch.from_numpy(np.asarray(img)).permute(2, 0, 1).unsqueeze(0)  # NCHW view of HWC
    w, h = size
    with torch.inference_mode():
        out = torch.empty((1, h, w, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
        try:
            torch.ops.aten._upsample_bicubic2d_aa.out(x, [h, w], False, None, None, out=out)
        except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - torch drift
            out = torch.nn.functional.interpolate(
                x, size=(h, w), mode="bicubic", antialias=True, align_corners=False
            )
    return out[0].permute(1, 2, 0).numpy()


@dataclass(frozen=True)
class SourceFacts:
    """What ingest recorded about a source's bytes (``images`` row): no need to re-probe."""

    format: str
    mode: str
    orientation: int = 1
    n_frames: int = 1

    @classmethod
    def probe(cls, data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> SourceFacts:
        """The same facts read from the bytes' header (when no ingest record is at hand)."""
        img = open_header(data, max_pixels)
        try:
            return cls(
                format=img.format or "UNKNOWN",
                mode=img.mode,
                orientation=orientation_of(img),
                n_frames=int(getattr(img, "n_frames", 1) or 1),
            )
        finally:
            img.close()

    @property
    def scaled_decode(self) -> bool:
        """Whether libjpeg-turbo decodes these bytes itself (one-frame RGB/grey JPEG)."""
        return self.format == "JPEG" and self.mode in _SCALED_DECODE_MODES and self.n_frames == 1


class AssignmentMismatch(ValueError):
    """The bytes are not the size their assignment was computed for."""


_POWER_OF_TWO_SCALES = (8, 4, 2, 1)  # DCT scale divisors decoded: 1/8, 1/4, 1/2, full
# libjpeg-turbo's 5/8, 6/8 and 7/8 IDCTs are slower than its full-size one (3.5 MP baseline,
# one core: 11.2 / 13.3 / 16.3 ms against 8.3 ms for 8/8; 1/2 is 5.0 ms): a source whose
# smallest covering eighth is one of those is decoded at full size instead, and Lanczos
# takes the extra reduction (libvips: a few ms more, less than the slow IDCT costs).
_VIPS_PHASE_SEARCH = 256  # right-edge padding tried to put vips' sampling grid on Pillow's


def decode_divisor(size: tuple[int, int], cover: tuple[int, int]) -> int:
    """The largest of 8, 4, 2, 1 with ``size / divisor`` still >= ``DETAIL_MARGIN`` x
    ``cover`` on both axes (exact: the decoded pixels stand for ``size / divisor``); 1 when
    none is.

    Why the margin (the Pillow path's rule too): a scaled IDCT is a weak low-pass (1/8 is
    the DC average of each block); with Lanczos then reducing by less than 2x, its aliasing
    stays in the output. Measured on 24 MP native-detail mosaics into the 512 tiers: the
    smallest covering scale left 0.1-0.4 dB below the q92 loss's margin, one scale larger
    11.6-11.9 dB.
    """
    (w, h), (cw, ch) = size, cover
    m = DETAIL_MARGIN
    return next(f for f in _POWER_OF_TWO_SCALES if f == 1 or (w >= m * cw * f and h >= m * ch * f))


def _inverse(method: Image.Transpose | None) -> Image.Transpose | None:
    T = Image.Transpose
    return {T.ROTATE_90: T.ROTATE_270, T.ROTATE_270: T.ROTATE_90}.get(method, method)  # type: ignore[arg-type]


@lru_cache(maxsize=1)
def _vips() -> Any:
    """pyvips, set up for one core per process: parallelism comes from the worker pool.

    Imported on first use, inside the process (or pool worker) that renders, never in a
    forkserver before it forks; the operation cache is off (every image is new).
    """
    os.environ["VIPS_CONCURRENCY"] = "1"  # read when libvips starts, i.e. at this import
    import pyvips

    pyvips.concurrency_set(1)
    pyvips.cache_set_max(0)
    return pyvips


def _padding(extent: int, scale: float) -> int:
    """Columns (rows) of edge padding that put libvips' output grid on Pillow's.

    libvips' reduce maps output pixel ``i`` to input ``(i + 0.5) / scale + d`` with
    ``d = (n - rint(n * scale) / scale) / 2`` for an input of ``n`` pixels (it centres the
    rounding of the output size); Pillow's ``resize`` (and the naive resize) has ``d = 0``.
    Padding the far edge by ``p`` pixels changes only ``d``: the ``p`` that makes
    ``(n + p) * scale`` nearest an integer makes ``d`` negligible (below libvips' own 1/64
    phase steps on the images measured). The padding is read only by the outputs at that
    edge, like the edge extension it replaces there.
    """
    x = (extent + np.arange(_VIPS_PHASE_SEARCH, dtype=np.float64)) * scale
    misfit = np.abs(x - np.rint(x))
    # The first padding within float noise of the best (0 when the grid already fits).
    return int(np.flatnonzero(misfit <= misfit.min() + 1e-9)[0])


def lanczos_vips(
    arr: np.ndarray,
    valid: tuple[float, float],
    resize_size: tuple[int, int],
    box: tuple[int, int, int, int],
) -> np.ndarray:
    """Lanczos-3 of ``arr`` (HxWx3 uint8) scaled so that ``valid`` (w, h from the top-left
    corner) becomes ``resize_size``, cropped to the integer ``box`` of that: libvips'
    reduceh/reducev on one core, only the box computed (libvips is demand-driven).

    The same sampling as Pillow's ``resize(resize_size)`` then ``crop(box)`` (per-axis
    scale, pixel centres, grid aligned by ``_padding``); libvips extends edges by copying
    where Pillow renormalises the kernel, so the outermost output pixels differ slightly.
    Downsampling only (``scale <= 1`` on both axes).
    """
    vips = _vips()
    h, w, bands = arr.shape
    sx, sy = resize_size[0] / valid[0], resize_size[1] / valid[1]
    if sx > 1 or sy > 1:
        raise ValueError(f"lanczos_vips downsamples only, got scale {sx:.4f} x {sy:.4f}")
    img = vips.Image.new_from_memory(np.ascontiguousarray(arr).data, w, h, bands, "uchar")
    px, py = _padding(w, sx), _padding(h, sy)
    if px or py:
        img = img.embed(0, 0, w + px, h + py, extend="copy")
    out = img.resize(sx, vscale=sy, kernel="lanczos3", gap=0.0)
    left, top, right, bottom = box
    out = out.crop(left, top, right - left, bottom - top)
    return np.ndarray(
        buffer=out.write_to_memory(), dtype=np.uint8, shape=(out.height, out.width, bands)
    )


def _checked_jpeg_header(
    data: bytes, assignment: Assignment, orientation: int, max_pixels: int
) -> tuple[int, int, Image.Transpose | None, bool]:
    """The JPEG's stored size, its EXIF turn and whether it swaps the sides, checked
    before any pixel is decoded: against the pixel limit (``DecodeRejected``) and against
    the size the assignment was made for (``AssignmentMismatch``)."""
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    if width * height > max_pixels:
        raise DecodeRejected(
            "decompression_bomb",
            f"{width}x{height} = {width * height} px exceeds the limit of {max_pixels} px",
        )
    method = ORIENTATION_TRANSPOSE.get(orientation)
    turned = orientation in (5, 6, 7, 8)
    oriented = (height, width) if turned else (width, height)
    if oriented != assignment.source_size:
        w, h = assignment.source_size
        raise AssignmentMismatch(
            f"assignment is for a {w}x{h} image but the bytes decode to "
            f"{oriented[0]}x{oriented[1]} (after orientation {orientation})"
        )
    return width, height, method, turned


def _scaled_jpeg_vips(
    data: bytes, assignment: Assignment, orientation: int, max_pixels: int
) -> np.ndarray:
    """A JPEG decoded at 1/8, 1/4, 1/2 or full size (``decode_divisor``), Lanczos-3 by
    libvips in the stored (unturned) frame, then turned by its EXIF orientation.

    Raises ``ValueError`` (libjpeg-turbo in strict mode, or a size that disagrees with the
    assignment) and ``DecodeRejected`` (pixel limit).
    """
    width, height, method, turned = _checked_jpeg_header(data, assignment, orientation, max_pixels)
    rw, rh = assignment.resize_size
    stored_resize = (rh, rw) if turned else (rw, rh)  # the resize in the stored frame
    f = decode_divisor((width, height), stored_resize)
    arr = simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_width=-(-width // f), min_height=-(-height // f)
    )
    dh, dw = arr.shape[:2]
    if (dw, dh) != (-(-width // f), -(-height // f)):
        raise ValueError(f"{width}x{height} decoded to {dw}x{dh}, not at 1/{f}")
    # The stored-frame crop box: the oriented one turned back (the canvas is resize_size).
    stored_box = transpose_box(assignment.crop_box, (rw, rh), _inverse(method))
    box = tuple(int(round(v)) for v in stored_box)
    out = lanczos_vips(arr, (width / f, height / f), stored_resize, box)  # type: ignore[arg-type]
    return np.ascontiguousarray(_turn(out, method))


def _turn(arr: np.ndarray, method: Image.Transpose | None) -> np.ndarray:
    """``Image.transpose(method)`` on an HxWxC array (a view; same pixels as Pillow's)."""
    T = Image.Transpose
    if method is None:
        return arr
    return {
        T.FLIP_LEFT_RIGHT: lambda a: a[:, ::-1],
        T.FLIP_TOP_BOTTOM: lambda a: a[::-1],
        T.ROTATE_180: lambda a: a[::-1, ::-1],
        T.ROTATE_90: lambda a: np.rot90(a, 1),
        T.ROTATE_270: lambda a: np.rot90(a, -1),
        T.TRANSPOSE: lambda a: a.transpose(1, 0, 2),
        T.TRANSVERSE: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],
    }[method](arr)


def _scaled_jpeg(
    data: bytes, assignment: Assignment, orientation: int, max_pixels: int
) -> tuple[Image.Image, tuple[float, float, float, float]]:
    """Decode a JPEG at the smallest eighth covering ``resize_size``; the crop box in it.

    The Pillow path (``resample="lanczos-pillow"``, the reference the libvips path is held
    to, and the fallback for upscales). Returns the oriented RGB image and the float box of
    the crop in its pixels. Raises ``ValueError`` (from libjpeg-turbo in strict mode, or for
    a size that disagrees with the assignment) and ``DecodeRejected`` (pixel limit).
    """
    width, height, method, turned = _checked_jpeg_header(data, assignment, orientation, max_pixels)
    rw, rh = assignment.resize_size
    if turned:
        rw, rh = rh, rw
    # min_factor=1: never an IDCT upscale; an upscaled assignment decodes at full size.
    arr = simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_width=min(rw, width), min_height=min(rh, height)
    )
    dh, dw = arr.shape[:2]
    eighths = next(
        (m for m in range(1, 9) if (-(-width * m // 8), -(-height * m // 8)) == (dw, dh)), None
    )
    if eighths is None:
        raise ValueError(f"{width}x{height} decoded to {dw}x{dh}: not a scale in eighths")
    img = Image.fromarray(arr, "RGB")
    # The scaled image stands for width * m/8 source-equivalent columns; the last block
    # column is partial. Where that exact region lands after orientation bounds the box.
    valid = (0.0, 0.0, width * eighths / 8, height * eighths / 8)
    if method is not None:
        valid = transpose_box(valid, (dw, dh), method)
        img = img.transpose(method)
    x0, y0, x1, y1 = valid
    ow, oh = assignment.source_size
    sx, sy = (x1 - x0) / ow, (y1 - y0) / oh
    left, top, right, bottom = _source_box(assignment)
    return img, (x0 + left * sx, y0 + top * sy, x0 + right * sx, y0 + bottom * sy)


def resize_to_bucket(
    data: bytes,
    assignment: Assignment,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    resample: str = RESAMPLE,
    facts: SourceFacts | None = None,
) -> Image.Image:
    """Decode ``data`` and return an RGB image of exactly the bucket's (width, height).

    ``resample="lanczos"`` (default): literal Lanczos over the crop box, from the scaled JPEG
    decode (see the module doc) or, for other sources, from Pillow's decode after draft/reduce
    at >= 2x. ``"bicubic-aa"``: Pillow decode; when no draft/reduce applied, torch's bicubic
    to ``resize_size`` then the crop (the reference geometry); after draft/reduce Lanczos over
    the crop box, since bicubic's softness would add to those prefilters'. ``facts``: what
    ingest recorded about the bytes (probed from the header when None).
    """
    out = _to_bucket(data, assignment, max_pixels, resample, facts)
    return out if isinstance(out, Image.Image) else Image.fromarray(out, "RGB")


def _to_bucket(
    data: bytes,
    assignment: Assignment,
    max_pixels: int,
    resample: str,
    facts: SourceFacts | None,
) -> Image.Image | np.ndarray:
    """``resize_to_bucket``'s pixels: an HxWx3 array from the libvips path (no Pillow
    image made only to be encoded), a Pillow image from the others."""
    if resample not in RESAMPLE_CHOICES:
        raise ValueError(f"resample must be one of {RESAMPLE_CHOICES}, got {resample!r}")
    target = (assignment.shape.width, assignment.shape.height)
    if resample in _LANCZOS:
        facts = facts if facts is not None else SourceFacts.probe(data, max_pixels)
        if facts.scaled_decode:
            try:
                if resample == "lanczos" and not assignment.upscaled:
                    return _scaled_jpeg_vips(data, assignment, facts.orientation, max_pixels)
                img, box = _scaled_jpeg(data, assignment, facts.orientation, max_pixels)
            except AssignmentMismatch:
                raise
            except ValueError:
                # libjpeg-turbo's strict mode refuses what Pillow tolerates (e.g. extraneous
                # bytes before a marker): the policy decode below decides, as at ingest.
                pass
            else:
                return img.resize(target, Image.Resampling.LANCZOS, box=box)
    src = prepare_fast(data, assignment, max_pixels)
    if resample in _LANCZOS or src.draft_factor * src.reduce_factor > 1:
        return src.image.resize(target, Image.Resampling.LANCZOS, box=src.box)
    out = _bicubic_aa(src.image, assignment.resize_size)
    left, top, right, bottom = assignment.crop_box
    return Image.fromarray(np.ascontiguousarray(out[top:bottom, left:right]), "RGB")


def render_jpeg(
    data: bytes,
    assignment: Assignment,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    resample: str = RESAMPLE,
    facts: SourceFacts | None = None,
) -> bytes:
    """Source bytes to the bucket's training JPEG: ``resize_to_bucket`` then ``encode_jpeg``."""
    return encode_jpeg(_to_bucket(data, assignment, max_pixels, resample, facts))


def encode_jpeg(img: Image.Image | np.ndarray, quality: int = JPEG_QUALITY) -> bytes:
    """Baseline JPEG at ``quality``, 4:4:4, by libjpeg-turbo; same pixels give same bytes.

    Only the JFIF header is written: no EXIF, ICC profile, comment or timestamp, so a rerun
    is byte-identical and no source metadata (GPS, camera serials) leaks into shards.
    Standard (Annex K) tables scaled by libjpeg's quality rule, accurate integer DCT,
    standard Huffman tables (``JPEG_OPTIMIZE`` off).
    """
    if isinstance(img, np.ndarray):
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            raise ValueError(f"encode_jpeg expects HxWx3 uint8 pixels, got {img.dtype} {img.shape}")
        pixels = np.ascontiguousarray(img)
    elif img.mode != "RGB":
        raise ValueError(f"encode_jpeg expects an RGB image, got mode {img.mode}")
    else:
        pixels = np.asarray(img)
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
    return simplejpeg.encode_jpeg(
        pixels,
        quality=quality,
        colorspace="RGB",
        colorsubsampling=_SIMPLEJPEG_SUBSAMPLING[JPEG_SUBSAMPLING],
        fastdct=False,
    )


def jpeg_quality_tables(data: bytes) -> dict[int, tuple[int, ...]]:
    """The quantisation tables of a JPEG, in natural (row-major) order, by table id."""
    try:
        img = Image.open(io.BytesIO(data), formats=["JPEG"])
    except Exception as exc:  # noqa: BLE001 - any failure means: not a JPEG we can read
        raise ValueError(f"not a JPEG: {type(exc).__name__}: {exc}") from None
    tables = getattr(img, "quantization", None)
    if not tables:
        raise ValueError("JPEG has no quantisation tables")
    out = {int(i): tuple(int(v) for v in t) for i, t in tables.items()}
    for i, t in out.items():
        if len(t) != 64:
            raise ValueError(f"quantisation table {i} has {len(t)} entries, not 64")
    return out


def libjpeg_table(base: tuple[int, ...], quality: int) -> tuple[int, ...]:
    """libjpeg's ``jpeg_set_quality`` scaling of a base table (baseline: clamp to 1..255)."""
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality
    return tuple(min(255, max(1, (v * scale + 50) // 100)) for v in base)


def estimate_jpeg_quality(data: bytes) -> int:
    """The libjpeg quality whose standard tables are closest to this file's (exact if libjpeg).

    Compares table 0 with the luma table and table 1 (if any) with the chroma table.
    """
    tables = jpeg_quality_tables(data)
    if 0 not in tables:
        raise ValueError("JPEG has no luma quantisation table (id 0)")

    def error(q: int) -> int:
        err = sum(abs(a - b) for a, b in zip(tables[0], libjpeg_table(_STD_LUMA, q), strict=True))
        if 1 in tables:
            err += sum(
                abs(a - b) for a, b in zip(tables[1], libjpeg_table(_STD_CHROMA, q), strict=True)
            )
        return err

    return min(range(1, 101), key=lambda q: (error(q), -q))


def psnr(a: Image.Image, b: Image.Image) -> float:
    """Peak signal-to-noise ratio in dB between two same-size 8-bit images (inf if equal)."""
    if a.size != b.size or a.mode != b.mode:
        raise ValueError(f"cannot compare {a.mode} {a.size} with {b.mode} {b.size}")
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)
