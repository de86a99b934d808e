"""Resize an image into its bucket shape, and encode the result as deterministic JPEG.

The reference is the naive pipeline: full decode, Lanczos to the cover size, crop
(``resize_plain``). The shard path (``render_jpeg``, default ``resample="lanczos"``) gives
the trainer the same picture up to a difference smaller than the q92 encode's own loss (PSNR
against the reference above PSNR of the q92 round trip, on >= 95 % of real photos:
``prx_assets_tests/core/test_resize.py``, benchmarks/bench_resize and bench_pipeline), at a
fraction of the cost. Its planes are the encoder's 8-bit YCbCr input, a rounding the naive
pipeline meets only inside its encoder, so on very smooth large photos (q92 loss above
~50 dB) that comparison mostly measures the rounding; there, bench_resize compares the
decoded shards themselves against an exact Lanczos. The filter is literal Lanczos-3; what is
skipped is work whose pixels the output never uses:

- JPEG sources (baseline or progressive, one frame, 8-bit YCbCr or greyscale) never become
  RGB. libjpeg-turbo decodes them to their own planes (``_planes.decode``: no chroma
  upsampling, no colour conversion) at 1/8, 1/4, 1/2 or full size: the smallest of those that
  still holds ``DETAIL_MARGIN`` (2) x the bucket's cover size (``decode_divisor``), so
  Lanczos always reduces by >= 2x after a scaled IDCT. Never 5/8..7/8: those scaled IDCTs
  cost more than the full-size one, so where one of them would be the smallest covering
  eighth the decode is full size and Lanczos takes the whole reduction.
- Each plane is resampled straight into the bucket from its own grid (``_planes.resample``:
  Pillow's Lanczos-3 sampling, 14-bit fixed point, AVX2 where the CPU has it and the same
  bytes without), only the crop box computed, in the stored frame of the JPEG, then turned
  by its EXIF orientation. Luma is the naive path's sampling (within 2 levels of Pillow's
  Lanczos on the Y plane). The chroma of a 4:2:0 (4:2:2) file is resampled from its half-size
  grid with libjpeg's triangle upsampling folded into the Lanczos kernel: the naive decode's
  upsampled chroma, resized, without ever making the full-size plane (within 2 levels of it).
  A 4:2:0 photo's two chroma planes are read from a quarter of the samples RGB would hold.
- The planes are encoded as they are (``_planes.encode``): baseline, q92, 4:4:4, JFIF header
  only, libjpeg-turbo's accurate DCT; no colour conversion.
- Other sources (PNG, WebP, ...), CMYK or RGB-coded or multi-frame JPEGs, and any JPEG
  libjpeg-turbo refuses in strict mode (corrupt data it would only warn about) go through
  Pillow: the policy decode (``decode_rgb``; a JPEG drafted only when >= 2x its cover size),
  ``Image.reduce`` when still >= 2x (``DETAIL_MARGIN``), then Pillow's Lanczos over the crop
  box, encoded from RGB by libjpeg-turbo (``simplejpeg``) with the same settings.
  ``resample="lanczos-pillow"`` sends JPEGs through Pillow's Lanczos too (from the smallest
  covering eighth of an RGB decode): the reference the planes are held to.

What ingest recorded about the bytes (format, mode, orientation, frames: ``SourceFacts``) is
reused rather than re-probed; the JPEG header's own size is still checked against the
assignment and the pixel limit before any pixel is decoded, and EXIF orientation is applied
exactly as ``ImageOps.exif_transpose`` does.

``resample="bicubic-aa"`` (the former default) stays available: antialiased bicubic (Keys
a = -0.5, Pillow's BICUBIC) in torch's vectorised uint8 kernel, after the Pillow decode;
torch is imported only then. Its generic, AVX2 and AVX512 kernels give bit-identical pixels;
without AVX2 it is ~10x slower than with.

Determinism: same bytes in, same bytes out (libjpeg-turbo's accurate integer IDCT and DCT;
fixed-point resampling whose SIMD and portable code agree; a fixed encoder). The planes
extension is built against the system's libjpeg-turbo (``PLANES_LIBJPEG``, recorded in the
shards' metadata).
"""

from __future__ import annotations

import io
import math
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
from prx_assets.core.shards import _planes
from prx_assets.core.shards.buckets import Assignment

DETAIL_MARGIN = 2  # fast-path intermediates keep >= 2x the pixels of the resized target
RESAMPLE = "lanczos"  # the shard path's filter (see module doc)
# "lanczos": Lanczos-3 on the JPEG's own planes (other sources: Pillow's); "lanczos-pillow":
# Pillow's from an RGB decode, the reference; "bicubic-aa": torch's antialiased bicubic.
RESAMPLE_CHOICES = ("lanczos", "lanczos-pillow", "bicubic-aa")
_LANCZOS = ("lanczos", "lanczos-pillow")
PLANES_LIBJPEG = f"libjpeg-turbo {_planes.LIBJPEG_TURBO_VERSION}"  # what the planes use
# The resampler's AVX2 code where the CPU has it; False runs its portable code, which gives
# the same bytes (tests switch it to check exactly that).
PLANES_SIMD = True
RESAMPLE_DESCRIPTION = (
    "literal Lanczos-3 over the crop box on the JPEG's own Y, Cb and Cr planes (subsampled "
    "chroma with libjpeg's upsampling folded into its kernel), from a libjpeg-turbo raw decode "
    "at 1/8, 1/4, 1/2 or full size, encoded 4:4:4 from the planes (no colour conversion); "
    "other sources: Pillow's "
    f"Lanczos-3 from RGB; {PLANES_LIBJPEG}; differs from the naive full decode + Lanczos by "
    "less than the q92 encode loss"
)
_SCALED_DECODE_MODES = ("RGB", "L")  # JPEG colour modes that decode as planes or to RGB
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
# takes the extra reduction.


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


@dataclass(frozen=True)
class Planes:
    """A bucket image as the three 8-bit planes a JPEG stores (Y, Cb, Cr; JFIF's full-range
    BT.601), each height x width: what the planar path renders and ``_planes.encode`` takes."""

    y: np.ndarray
    cb: np.ndarray
    cr: np.ndarray

    @property
    def size(self) -> tuple[int, int]:
        h, w = self.y.shape
        return w, h

    def to_rgb(self) -> Image.Image:
        """The RGB picture a JPEG decoder shows for these planes (Pillow's YCbCr -> RGB)."""
        return Image.merge(
            "YCbCr",
            [Image.fromarray(np.ascontiguousarray(p), "L") for p in (self.y, self.cb, self.cr)],
        ).convert("RGB")


def _planar_jpeg(data: bytes, assignment: Assignment, orientation: int, max_pixels: int) -> Planes:
    """A one-frame YCbCr or greyscale JPEG, decoded to its planes at 1/8, 1/4, 1/2 or full
    size (``decode_divisor``), each plane Lanczos-3 resampled from its own grid into the
    bucket in the stored (unturned) frame, then turned by its EXIF orientation.

    Raises ``ValueError`` (another colour space, libjpeg-turbo refusing the data in strict
    mode, or a size that disagrees with the assignment) and ``DecodeRejected`` (pixel limit).
    """
    width, height, method, turned = _checked_jpeg_header(data, assignment, orientation, max_pixels)
    rw, rh = assignment.resize_size
    stored_resize = (rh, rw) if turned else (rw, rh)  # the resize in the stored frame
    f = decode_divisor((width, height), stored_resize)
    kind, dw, dh, planes = _planes.decode(data, f, max_pixels)
    if (dw, dh) != (-(-width // f), -(-height // f)):
        raise ValueError(f"{width}x{height} decoded to {dw}x{dh}, not at 1/{f}")
    # The stored-frame crop box: the oriented one turned back (the canvas is resize_size).
    stored_box = transpose_box(assignment.crop_box, (rw, rh), _inverse(method))
    box = tuple(int(round(v)) for v in stored_box)
    return resample_planes(kind, planes, stored_resize, box, method)  # type: ignore[arg-type]


def resample_planes(
    kind: str,
    planes: list[tuple],
    resize_size: tuple[int, int],
    box: tuple[int, int, int, int],
    method: Image.Transpose | None = None,
) -> Planes:
    """``_planes.decode``'s planes, each Lanczos-3 resampled so the image becomes
    ``resize_size``, cropped to ``box`` (both in the stored frame), then turned by
    ``method``; a greyscale JPEG gets neutral chroma."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    out = []
    luma_w, luma_h = planes[0][3], planes[0][4]
    for pixels, pw, ph, valid_w, valid_h, stride in planes:
        # Chroma stored at 1/2 (1/4) of the luma's pixels is upsampled as libjpeg would, in
        # the same kernel as the Lanczos (see _planes.resample).
        upsample = (round(luma_w / valid_w), round(luma_h / valid_h))
        plane = _planes.resample(
            pixels, pw, ph, valid_w, valid_h, *resize_size, box,
            simd=PLANES_SIMD, stride=stride, upsample=upsample,
        )  # fmt: skip
        out.append(_turn(np.frombuffer(plane, np.uint8).reshape(bh, bw), method))
    if kind == "GRAY":  # what an RGB grey encodes to: the same Y, neutral chroma
        neutral = np.full_like(out[0], 128)
        out += [neutral, neutral]
    return Planes(*(np.ascontiguousarray(p) for p in out))


def _turn(arr: np.ndarray, method: Image.Transpose | None) -> np.ndarray:
    """``Image.transpose(method)`` on an HxW or HxWxC array (a view; Pillow's pixels)."""
    T = Image.Transpose
    if method is None:
        return arr
    return {
        T.FLIP_LEFT_RIGHT: lambda a: a[:, ::-1],
        T.FLIP_TOP_BOTTOM: lambda a: a[::-1],
        T.ROTATE_180: lambda a: a[::-1, ::-1],
        T.ROTATE_90: lambda a: np.rot90(a, 1),
        T.ROTATE_270: lambda a: np.rot90(a, -1),
        T.TRANSPOSE: lambda a: np.swapaxes(a, 0, 1),
        T.TRANSVERSE: lambda a: np.swapaxes(a, 0, 1)[::-1, ::-1],
    }[method](arr)


def _scaled_jpeg(
    data: bytes, assignment: Assignment, orientation: int, max_pixels: int
) -> tuple[Image.Image, tuple[float, float, float, float]]:
    """Decode a JPEG at the smallest eighth covering ``resize_size``; the crop box in it.

    The Pillow path (``resample="lanczos-pillow"``, the reference the planes are held to).
    Returns the oriented RGB image and the float box of
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

    ``resample="lanczos"`` (default): literal Lanczos over the crop box, on the JPEG's own
    planes (see the module doc; shown here as the RGB a decoder makes of them) or, for other
    sources, from Pillow's decode after draft/reduce at >= 2x. ``"bicubic-aa"``: Pillow
    decode; when no draft/reduce applied, torch's bicubic to ``resize_size`` then the crop
    (the reference geometry); after draft/reduce Lanczos over the crop box, since bicubic's
    softness would add to those prefilters'. ``facts``: what ingest recorded about the bytes
    (probed from the header when None).
    """
    out = _to_bucket(data, assignment, max_pixels, resample, facts)
    return out.to_rgb() if isinstance(out, Planes) else out


def _to_bucket(
    data: bytes,
    assignment: Assignment,
    max_pixels: int,
    resample: str,
    facts: SourceFacts | None,
) -> Image.Image | Planes:
    """``resize_to_bucket``'s pixels: the JPEG's planes from the planar path (encoded as
    they are, never turned into RGB), an RGB Pillow image from the others."""
    if resample not in RESAMPLE_CHOICES:
        raise ValueError(f"resample must be one of {RESAMPLE_CHOICES}, got {resample!r}")
    target = (assignment.shape.width, assignment.shape.height)
    if resample in _LANCZOS:
        facts = facts if facts is not None else SourceFacts.probe(data, max_pixels)
        if facts.scaled_decode:
            try:
                if resample == "lanczos":
                    return _planar_jpeg(data, assignment, facts.orientation, max_pixels)
                img, box = _scaled_jpeg(data, assignment, facts.orientation, max_pixels)
            except AssignmentMismatch:
                raise
            except ValueError:
                # libjpeg-turbo's strict mode refuses what Pillow tolerates (e.g. extraneous
                # bytes before a marker), and the planes take YCbCr and grey only: the
                # policy decode below decides, as at ingest.
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
    """Source bytes to the bucket's training JPEG: the planes encoded as they are, or the
    RGB pixels by ``encode_jpeg`` (the same quality, subsampling and header)."""
    out = _to_bucket(data, assignment, max_pixels, resample, facts)
    return encode_planes(out) if isinstance(out, Planes) else encode_jpeg(out)


def encode_planes(planes: Planes, quality: int = JPEG_QUALITY) -> bytes:
    """``encode_jpeg`` for pixels that are already the JPEG's planes: baseline, 4:4:4,
    standard tables at ``quality``, accurate integer DCT, JFIF header only."""
    w, h = planes.size
    return _planes.encode(planes.y, planes.cb, planes.cr, w, h, quality)


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
