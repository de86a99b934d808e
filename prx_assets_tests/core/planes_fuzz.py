"""Fuzzing the JPEG planes extension (``prx_assets/core/shards/_planes.c``) under
AddressSanitizer and UBSan.

Why: the shard stage hands attacker-controlled bytes to libjpeg-turbo through ``_planes``,
and ``_planes.c`` does its own bounds arithmetic around it (plane sizes, row pointers,
kernels folded with chroma upsampling). A memory error there is not a rejected image: it is
a crashed worker, or silently wrong pixels. So the extension is compiled a second time,
from the same source, with ``-fsanitize=address,undefined`` (``build_sanitized``), and a
child Python (``libasan`` preloaded, ``halt_on_error``) runs every case through what the
shard path does with a JPEG: ``_planes.decode`` at 1/1, 1/2, 1/4 or 1/8, then
``resize.resample_planes`` (the caller's own plane geometry, AVX2 or portable kernels), then
``_planes.encode``. Each case must end ``rendered`` or ``rejected`` (the extension's
``ValueError``: a per-image rejection for the caller); anything else is ``unexpected``, and a
sanitizer report kills the child, naming the case it was on.

The cases are deterministic (``cases(n, seed)``): real photos cropped and encoded by Pillow
and simplejpeg (4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, greyscale; baseline and progressive;
restart markers; sizes 1x1, 17x9, 4097x3, ...), DC-only JPEGs written here with any sampling
factors libjpeg accepts or refuses (3x1, 4x1, 1x4, 3x3, chroma above luma, fractional
ratios), headers that claim huge sizes, then mutations: truncation, bit flips, SOF sizes,
component counts, sampling factors and precision, DQT/DHT garbage, duplicate SOF, missing or
doubled EOI, restart markers, splices.

Used by ``test_planes_fuzz.py`` (about 2,000 cases) and ``benchmarks/fuzz_planes.py`` (as
many as asked, ``make fuzz``).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import io
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import simplejpeg
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "prx_assets" / "core" / "shards" / "_planes.c"
PHOTOS = REPO / "prx_assets" / "demo" / "photos"
LIMIT = 89_478_485  # the default pixel limit (DEFAULT_MAX_PIXELS): what the shard path passes
SANITIZE = (
    "-fsanitize=address,undefined,float-cast-overflow,float-divide-by-zero",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
)
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=0"
UBSAN_OPTIONS = "halt_on_error=1:abort_on_error=1:print_stacktrace=1"
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: UndefinedBehavior")


class SanitizerUnavailable(RuntimeError):
    """The sanitizer build or its runtime cannot be had here (compiler, headers, libasan)."""


# ------------------------------------------------------------------ the sanitizer build


def _gcc() -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SanitizerUnavailable("no gcc on PATH (.ci/build-deps installs it)")
    return gcc


def asan_runtime() -> str:
    """The path of gcc's libasan, which must be the first library of the child process."""
    path = subprocess.run(
        [_gcc(), "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not path or not os.path.isabs(path) or not os.path.exists(path):
        raise SanitizerUnavailable(
            f"gcc does not find libasan.so ({path!r}); Debian: apt-get install libasan8"
        )
    return os.path.realpath(path)


def _compile(sources: list[Path], out: Path, libraries: tuple[str, ...]) -> None:
    include = sysconfig.get_paths()["include"]
    cmd = [
        _gcc(), "-shared", "-fPIC", "-O1", "-g", "-std=gnu11", *SANITIZE,
        f"-I{include}", *map(str, sources), "-o", str(out), *(f"-l{lib}" for lib in libraries),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SanitizerUnavailable(f"sanitizer build failed: {' '.join(cmd)}\n{done.stderr}")


def build_sanitized(directory: Path) -> Path:
    """``_planes.c`` compiled with ASan and UBSan into ``directory``; the module's path."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out = Path(directory) / f"_planes{suffix}"
    _compile([SOURCE], out, ("jpeg", "m"))
    return out


_CANARY_C = """
#include <stdlib.h>
int canary_heap(int size, int at) {
  char *volatile p = malloc((size_t)size);
  p[at] = 1;
  int r = p[0];
  free(p);
  return r;
}
int canary_signed(int a) { return a + 1; }
"""
CANARIES = (
    ("canary_heap(8, 8)", "heap-buffer-overflow"),
    ("canary_signed(2147483647)", "signed integer overflow"),
)


def check_sanitizers_catch(directory: Path) -> list[str]:
    """Runs a deliberate 1-byte heap overflow and a signed overflow, built and run as the
    fuzz cases are, and returns the reports they must produce: proof that a clean fuzz run
    means something here. Raises ``SanitizerUnavailable`` if one goes unreported."""
    src = Path(directory) / "canary.c"
    src.write_text(_CANARY_C)
    lib = Path(directory) / "canary.so"
    _compile([src], lib, ())
    reports = []
    for call, expected in CANARIES:
        code = f"import ctypes; ctypes.CDLL({str(lib)!r}).{call}"
        done = subprocess.run(
            [sys.executable, "-c", code], env=sanitizer_env(), capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        if done.returncode == 0 or expected not in done.stderr:
            raise SanitizerUnavailable(
                f"a deliberate {expected} in {call} went unreported (rc {done.returncode}): "
                f"{done.stderr[-2000:]}"
            )
        reports.append(done.stderr)
    return reports


def sanitizer_env() -> dict[str, str]:
    """The environment a sanitized child runs in: libasan preloaded, halting on a report."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = asan_runtime()
    env["ASAN_OPTIONS"] = ASAN_OPTIONS
    env["UBSAN_OPTIONS"] = UBSAN_OPTIONS
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


# ------------------------------------------------------------------ seed JPEGs


@dataclass(frozen=True)
class Case:
    """One input: its name (how the reports point at it), its bytes, what it must do
    (``any``: render or be rejected; ``rendered``; ``rejected``) and, for a rejection, the
    texts one of which its message must contain."""

    name: str
    data: bytes
    expect: str = "any"
    messages: tuple[str, ...] = ()


@lru_cache(maxsize=1)
def _photo_pixels() -> tuple[np.ndarray, ...]:
    out = []
    for name in ("chelsea.png", "coffee.png", "rocket.jpg", "text.png"):
        with Image.open(PHOTOS / name) as img:
            out.append(np.asarray(img.convert("RGB")))
    return tuple(out)


def _crop(index: int, size: tuple[int, int]) -> Image.Image:
    """A ``size`` crop of a real photo (tiled when the photo is smaller)."""
    w, h = size
    pix = _photo_pixels()[index % len(_photo_pixels())]
    reps = (-(-h // pix.shape[0]), -(-w // pix.shape[1]), 1)
    pix = np.tile(pix, reps) if reps != (1, 1, 1) else pix
    y0, x0 = (index * 37) % (pix.shape[0] - h + 1), (index * 53) % (pix.shape[1] - w + 1)
    return Image.fromarray(np.ascontiguousarray(pix[y0 : y0 + h, x0 : x0 + w]), "RGB")


SIZES = ((1, 1), (17, 9), (9, 17), (64, 48), (203, 151), (4097, 3), (3, 1100), (333, 1))


def _pillow(img: Image.Image, **kw: object) -> bytes:
    # Not prx_assets.demo.jpegs.encoded: importing it loads prx_assets.core.shards.resize,
    # and so the planes extension, before run_child installs the sanitized build.
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def real_seeds() -> list[Case]:
    """Real photos encoded by Pillow (4:4:4, 4:2:2, 4:2:0, greyscale; baseline, progressive,
    restart markers) and simplejpeg (4:4:0, 4:1:1): every one must render."""
    seeds = []
    for i, size in enumerate(SIZES):
        img = _crop(i, size)
        for sub in ("4:4:4", "4:2:2", "4:2:0"):
            for prog in (False, True):
                name = f"pillow-{size[0]}x{size[1]}-{sub}-{'prog' if prog else 'base'}"
                data = _pillow(img, quality=90, subsampling=sub, progressive=prog)
                seeds.append(Case(name, data, "rendered"))
        seeds.append(Case(f"pillow-{size[0]}x{size[1]}-rst", _pillow(
            img, quality=85, subsampling="4:2:0", restart_marker_blocks=3
        ), "rendered"))  # fmt: skip
        grey = _pillow(img.convert("L"), quality=90, progressive=i % 2 == 1)
        seeds.append(Case(f"pillow-{size[0]}x{size[1]}-grey", grey, "rendered"))
        for sub in ("440", "411", "422", "420"):
            data = simplejpeg.encode_jpeg(np.asarray(img), 88, "RGB", sub)
            seeds.append(Case(f"simplejpeg-{size[0]}x{size[1]}-{sub}", data, "rendered"))
    return seeds


# ------------------------------------------------------------------ DC-only JPEGs

# The standard luminance DC table (ITU T.81 K.3); AC: one symbol, end of block.
_DC_BITS = (0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0)
_DC_VALS = tuple(range(12))
_AC_BITS = (1,) + (0,) * 15
_AC_VALS = (0,)


def _huffman_codes(bits: tuple[int, ...], vals: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    codes, code, k = {}, 0, 0
    for length in range(1, 17):
        for _ in range(bits[length - 1]):
            codes[vals[k]] = (code, length)
            code, k = code + 1, k + 1
        code <<= 1
    return codes


_DC_CODES = _huffman_codes(_DC_BITS, _DC_VALS)
_EOB = _huffman_codes(_AC_BITS, _AC_VALS)[0]


class _BitWriter:
    def __init__(self) -> None:
        self.out = bytearray()
        self.acc = 0
        self.n = 0

    def put(self, code: int, length: int) -> None:
        self.acc = (self.acc << length) | code
        self.n += length
        while self.n >= 8:
            self.n -= 8
            byte = (self.acc >> self.n) & 0xFF
            self.out.append(byte)
            if byte == 0xFF:
                self.out.append(0)  # byte stuffing
        self.acc &= (1 << self.n) - 1

    def flush(self) -> None:
        if self.n:
            self.put((1 << (8 - self.n)) - 1, 8 - self.n)


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes((0xFF, marker)) + struct.pack(">H", len(payload) + 2) + payload


def dc_jpeg(
    size: tuple[int, int],
    sampling: tuple[tuple[int, int], ...],
    restart: int = 0,
    ids: tuple[int, ...] | None = None,
    sof: int = 0xC0,
) -> bytes:
    """A baseline JPEG whose blocks hold only a DC value (a blocky but real picture), with
    any sampling factors (1..4 each): what no common encoder writes, decoded as libjpeg
    decodes any other file. ``restart``: a restart marker every that many MCUs."""
    w, h = size
    nc = len(sampling)
    ids = ids or tuple(range(1, nc + 1))
    hmax = max(s[0] for s in sampling)
    vmax = max(s[1] for s in sampling)
    out = bytearray(b"\xff\xd8")
    out += _segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
    out += _segment(0xDB, b"\x00" + bytes([1] * 64))
    comps = b"".join(bytes((ids[c], (hs << 4) | vs, 0)) for c, (hs, vs) in enumerate(sampling))
    out += _segment(sof, struct.pack(">BHHB", 8, h, w, nc) + comps)
    out += _segment(0xC4, b"\x00" + bytes(_DC_BITS) + bytes(_DC_VALS))
    out += _segment(0xC4, b"\x10" + bytes(_AC_BITS) + bytes(_AC_VALS))
    if restart:
        out += _segment(0xDD, struct.pack(">H", restart))
    out += _segment(0xDA, bytes([nc]) + b"".join(bytes((i, 0)) for i in ids) + b"\x00\x3f\x00")
    bits = _BitWriter()
    pred = [0] * nc

    def block(c: int, by: int, bx: int) -> None:
        dc = ((bx * 7 + by * 13 + c * 29) % 31 - 15) * 40
        diff, pred[c] = dc - pred[c], dc
        cat = abs(diff).bit_length()
        bits.put(*_DC_CODES[cat])
        if cat:
            bits.put(diff if diff > 0 else diff + (1 << cat) - 1, cat)
        bits.put(*_EOB)

    if nc == 1:  # non-interleaved: one block per MCU, over the component's own blocks
        hs, vs = sampling[0]
        rows = math.ceil(math.ceil(h * vs / vmax) / 8)
        cols = math.ceil(math.ceil(w * hs / hmax) / 8)
        mcus = [[(0, by, bx)] for by in range(rows) for bx in range(cols)]
    else:
        mcus = []
        for my in range(-(-h // (8 * vmax))):
            for mx in range(-(-w // (8 * hmax))):
                mcus.append([
                    (c, my * vs + v, mx * hs + u)
                    for c, (hs, vs) in enumerate(sampling)
                    for v in range(vs)
                    for u in range(hs)
                ])  # fmt: skip
    for m, blocks in enumerate(mcus):
        if restart and m and m % restart == 0:
            bits.flush()
            bits.out += bytes((0xFF, 0xD0 + (m // restart - 1) % 8))
            pred = [0] * nc
        for c, by, bx in blocks:
            block(c, by, bx)
    bits.flush()
    return bytes(out + bits.out + b"\xff\xd9")


# Sampling factors (Y, Cb, Cr) or (Y,) and whether libjpeg's own upsampler takes them (a
# decoder that makes RGB refuses fractional ratios): those may be refused.
SAMPLINGS = (
    ((1, 1), (1, 1), (1, 1)),
    ((2, 2), (1, 1), (1, 1)),
    ((2, 1), (1, 1), (1, 1)),
    ((1, 2), (1, 1), (1, 1)),
    ((4, 1), (1, 1), (1, 1)),
    ((1, 4), (1, 1), (1, 1)),
    ((3, 1), (1, 1), (1, 1)),
    ((1, 3), (1, 1), (1, 1)),
    ((3, 3), (1, 1), (1, 1)),
    ((4, 2), (1, 1), (1, 1)),
    ((2, 4), (1, 1), (1, 1)),
    ((4, 2), (2, 1), (1, 1)),
    ((2, 2), (1, 2), (2, 1)),
    ((4, 1), (2, 1), (1, 1)),
    ((1, 1), (2, 2), (2, 2)),
    ((3, 1), (2, 1), (1, 1)),
    ((3, 2), (1, 1), (1, 1)),
    ((2, 2), (2, 2), (2, 2)),
    ((4, 4), (1, 1), (1, 1)),  # 18 blocks per MCU: over libjpeg's 10, refused
    ((1, 1),),
    ((3, 2),),
    ((4, 4),),
    ((1, 1), (1, 1), (1, 1), (1, 1)),  # CMYK: not planes, refused
)
DC_SIZES = ((1, 1), (17, 9), (9, 17), (33, 65), (100, 75), (4097, 3), (3, 260), (250, 250))


def dc_seeds() -> list[Case]:
    """DC-only JPEGs over every sampling in ``SAMPLINGS`` and size in ``DC_SIZES``."""
    out = []
    for k, sampling in enumerate(SAMPLINGS):
        tag = "-".join(f"{a}x{b}" for a, b in sampling)
        for j, size in enumerate(DC_SIZES):
            restart = (0, 1, 2, 5)[(k + j) % 4]
            data = dc_jpeg(size, sampling, restart)
            out.append(Case(f"dc-{size[0]}x{size[1]}-{tag}-rst{restart}", data))
    return out


# A refusal on the header: the pixel limit, or libjpeg's own maximum side (65,500).
REFUSED_ON_HEADER = ("exceeds the limit", "Maximum supported image dimension")


def huge_header_cases() -> list[Case]:
    """Headers that claim more pixels than the limit, with a scan of a few bytes: refused
    on the header, before any plane is allocated."""
    out = []
    for w, h in ((65500, 65500), (65535, 65535), (65535, 1366), (46341, 46341), (9459, 9460)):
        for sampling in (((1, 1), (1, 1), (1, 1)), ((2, 2), (1, 1), (1, 1)), ((1, 1),)):
            head = dc_jpeg((8, 8), sampling)
            data = _set_sof_size(head, w, h)
            for cut in (len(data), data.index(b"\xff\xda") + 20):
                name = f"huge-{w}x{h}-{len(sampling)}c-cut{cut}"
                out.append(Case(name, data[:cut], "rejected", REFUSED_ON_HEADER))
    return out


# ------------------------------------------------------------------ mutations


def segments(data: bytes) -> list[tuple[int, int, int]]:
    """(offset, marker, total length) of each marker segment before the first scan."""
    out, i = [], 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        length = struct.unpack(">H", data[i + 2 : i + 4])[0]
        if length < 2 or i + length + 2 > len(data):
            break
        out.append((i, marker, length + 2))
        if marker == 0xDA:
            break
        i += length + 2
    return out


def _find(data: bytes, markers: tuple[int, ...]) -> list[tuple[int, int, int]]:
    return [s for s in segments(data) if s[1] in markers]


_SOFS = (0xC0, 0xC1, 0xC2)


def _set_sof_size(data: bytes, w: int, h: int) -> bytes:
    off = [s for s in _find(data, _SOFS) if s[2] >= 10][0][0]
    return data[: off + 5] + struct.pack(">HH", h, w) + data[off + 9 :]


def _poke(data: bytes, at: int, values: bytes) -> bytes:
    return data[:at] + values + data[at + len(values) :]


def mutate(data: bytes, rng: random.Random, other: bytes) -> tuple[str, bytes]:
    """One mutation of ``data`` chosen by ``rng`` (``other``: a second seed, for splices)."""
    kind = rng.choice(MUTATIONS)
    if len(data) < 4:  # a stacked truncation left next to nothing: grow it from another
        return "splice-onto-stub", data + other[rng.randrange(len(other)) :]
    segs = segments(data)
    sofs = [s for s in _find(data, _SOFS) if s[2] >= 10]
    if kind == "truncate":
        cut = rng.randrange(len(data))
        return f"truncate@{cut}", data[:cut]
    if kind == "truncate-near-marker" and segs:
        off = rng.choice(segs)[0] + rng.randrange(-3, 12)
        off = max(0, min(off, len(data)))
        return f"truncate@{off}", data[:off]
    if kind == "bitflip":
        buf = bytearray(data)
        n = rng.choice((1, 1, 2, 4, 8))
        for _ in range(n):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        return f"bitflip x{n}", bytes(buf)
    if kind == "header-bytes" and segs:
        end = segs[-1][0] + segs[-1][2]
        buf = bytearray(data)
        n = rng.choice((1, 2, 3))
        for _ in range(n):
            buf[rng.randrange(min(end, len(buf)))] = rng.choice((0, 1, 0xFF, 0x7F, 0x80, 0x11))
        return f"header-bytes x{n}", bytes(buf)
    if kind == "sof-size" and sofs:
        w = rng.choice((0, 1, 2, 7, 8, 9, 15, 16, 17, 4097, 30000, 65500, 65535))
        h = rng.choice((0, 1, 2, 3, 8, 16, 31, 1000, 65500, 65535))
        return f"sof-size {w}x{h}", _set_sof_size(data, w, h)
    if kind == "sof-sampling" and sofs:
        off = sofs[0][0]
        nc = data[off + 9]
        c = rng.randrange(max(nc, 1))
        value = rng.choice((0x00, 0x10, 0x01, 0x11, 0x12, 0x21, 0x22, 0x31, 0x13, 0x33, 0x41,
                            0x14, 0x44, 0x42, 0x24, 0x50, 0x05, 0xFF, 0x32, 0x23))  # fmt: skip
        return f"sof-sampling c{c}={value:#04x}", _poke(data, off + 11 + 3 * c, bytes([value]))
    if kind == "sof-components" and sofs:
        off = sofs[0][0]
        n = rng.choice((0, 1, 2, 3, 4, 5, 10, 255))
        return f"sof-components {n}", _poke(data, off + 9, bytes([n]))
    if kind == "sof-precision" and sofs:
        p = rng.choice((0, 1, 7, 9, 12, 16, 255))
        return f"sof-precision {p}", _poke(data, sofs[0][0] + 4, bytes([p]))
    if kind == "sof-type" and sofs:
        t = rng.choice((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC9, 0xCA, 0xCB, 0xCD))
        return f"sof-type {t:#x}", _poke(data, sofs[0][0] + 1, bytes([t]))
    if kind == "sof-qtable" and sofs:
        off = sofs[0][0]
        c = rng.randrange(max(data[off + 9], 1))
        t = rng.choice((1, 2, 3, 4, 0xFF))
        return f"sof-qtable c{c}={t}", _poke(data, off + 12 + 3 * c, bytes([t]))
    if kind == "duplicate-sof" and sofs:
        off, _, length = sofs[0]
        sos = _find(data, (0xDA,))
        at = sos[0][0] if sos and rng.random() < 0.5 else off
        return "duplicate-sof", data[:at] + data[off : off + length] + data[at:]
    if kind == "sof-after-scan" and sofs:
        off, _, length = sofs[0]
        at = rng.randrange(len(data) // 2, len(data))
        return f"sof@{at}", data[:at] + data[off : off + length] + data[at:]
    if kind in ("dqt-garbage", "dht-garbage"):
        found = _find(data, (0xDB,) if kind == "dqt-garbage" else (0xC4,))
        if found:
            off, _, length = rng.choice(found)
            buf = bytearray(data)
            for _ in range(rng.choice((1, 3, 10))):
                i = off + 4 + rng.randrange(max(length - 4, 1))
                if i < len(buf):
                    buf[i] = rng.randrange(256)
            if rng.random() < 0.3:  # a length that lies
                buf[off + 2 : off + 4] = struct.pack(">H", rng.choice((0, 2, 3, length + 9, 65535)))
            return kind, bytes(buf)
    if kind == "drop-segment" and segs:
        off, marker, length = rng.choice(segs)
        return f"drop {marker:#x}", data[:off] + data[off + length :]
    if kind == "eoi":
        body = data[:-2] if data.endswith(b"\xff\xd9") else data
        choice = rng.choice(("missing", "double", "junk", "early"))
        if choice == "missing":
            return "eoi-missing", body
        if choice == "double":
            return "eoi-double", data + b"\xff\xd9"
        if choice == "junk":
            return "eoi-junk-after", data + bytes(rng.randrange(256) for _ in range(64))
        at = rng.randrange(len(body))
        return f"eoi@{at}", body[:at] + b"\xff\xd9"
    if kind == "restart-markers":
        buf = bytearray(data)
        for _ in range(rng.choice((1, 2, 5))):
            at = rng.randrange(len(buf))
            buf[at:at] = bytes((0xFF, 0xD0 + rng.randrange(8)))
        return "restart-markers", bytes(buf)
    if kind == "dri" and segs:
        sos = _find(data, (0xDA,))
        if sos:
            at = sos[0][0]
            ri = rng.choice((0, 1, 2, 3, 7, 65535))
            return f"dri {ri}", data[:at] + _segment(0xDD, struct.pack(">H", ri)) + data[at:]
    if kind == "sos-fields":
        sos = _find(data, (0xDA,))
        if sos:
            off, _, length = sos[0]
            i = off + 4 + rng.randrange(max(length - 4, 1))
            return f"sos-byte@{i - off}", _poke(data, i, bytes([rng.randrange(256)]))
    if kind == "splice":
        a, b = rng.randrange(len(data)), rng.randrange(len(other))
        return f"splice {a}+{b}", data[:a] + other[b:]
    cut = rng.randrange(len(data))  # a mutation that found nothing to change: truncate
    return f"truncate@{cut}", data[:cut]


MUTATIONS = (
    "truncate", "truncate", "truncate-near-marker", "bitflip", "bitflip", "bitflip",
    "header-bytes", "sof-size", "sof-size", "sof-sampling", "sof-sampling", "sof-sampling",
    "sof-components", "sof-precision", "sof-type", "sof-qtable", "duplicate-sof",
    "sof-after-scan", "dqt-garbage", "dht-garbage", "drop-segment", "eoi", "restart-markers",
    "dri", "sos-fields", "splice",
)  # fmt: skip


@lru_cache(maxsize=1)
def _seeds() -> tuple[Case, ...]:
    return tuple(real_seeds() + dc_seeds() + huge_header_cases())


def seeds() -> list[Case]:
    """Every unmutated case: real photos, DC-only JPEGs, huge headers."""
    return list(_seeds())


def cases(n: int, seed: int = 0) -> Iterator[Case]:
    """``n`` cases, the same for the same (n, seed): the unmutated ones first (as many as
    fit), then mutations of them, one to three stacked."""
    base = seeds()
    mutable = [c for c in base if not c.name.startswith("huge-")]
    yield from base[:n]
    for i in range(max(0, n - len(base))):
        rng = random.Random(f"{seed}:{i}")
        parent = rng.choice(mutable)
        data, names = parent.data, []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            what, data = mutate(data, rng, rng.choice(mutable).data)
            names.append(what)
        yield Case(f"{parent.name} | {' , '.join(names)}", data)


# ------------------------------------------------------------------ the child


@dataclass
class Summary:
    """What a child run saw: outcomes per case kind, and every case that broke a rule."""

    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)
    messages: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


def _render(planes_mod: object, resize: object, data: bytes, rng: random.Random) -> None:
    """The shard path's calls on one JPEG: decode, resample_planes, encode."""
    denom = rng.choice((1, 1, 2, 4, 8))
    kind, w, h, planes = planes_mod.decode(data, denom, LIMIT)  # type: ignore[attr-defined]
    for pixels, pw, ph, _, _, stride in planes:
        if not (stride >= pw and len(pixels) >= stride * ph):
            raise AssertionError(f"plane {pw}x{ph} stride {stride} in {len(pixels)} bytes")
    # A bucket's canvas: reductions and enlargements, the crop box somewhere inside it.
    rw = max(1, min(512, round(w * rng.choice((0.05, 0.3, 0.5, 0.7, 1.0, 1.5, 2.5)))))
    rh = max(1, min(512, round(h * rng.choice((0.05, 0.3, 0.5, 0.7, 1.0, 1.5, 2.5)))))
    bw, bh = rng.randint(1, min(rw, 96)), rng.randint(1, min(rh, 96))
    left, top = rng.randint(0, rw - bw), rng.randint(0, rh - bh)
    resize.PLANES_SIMD = rng.random() < 0.7  # type: ignore[attr-defined]
    out = resize.resample_planes(kind, planes, (rw, rh), (left, top, left + bw, top + bh))  # type: ignore[attr-defined]
    if out.size != (bw, bh):
        raise AssertionError(f"rendered {out.size}, not {(bw, bh)}")
    jpeg = resize.encode_planes(out)  # type: ignore[attr-defined]
    if not jpeg.startswith(b"\xff\xd8") or not jpeg.endswith(b"\xff\xd9"):
        raise AssertionError("encode returned no JPEG")


def run_child(module_path: str, n: int, seed: int, start: int, stop: int, progress: str) -> int:
    """Runs cases [start, stop) of ``cases(n, seed)`` against the module at ``module_path``
    (inside the sanitized process) and prints a JSON ``Summary``."""
    # The runtimes this process must have: ASan's first of all (preloaded), UBSan's as the
    # module's own dependency.
    for where, sym in ((None, "__asan_init"), (module_path, "__ubsan_handle_add_overflow_abort")):
        if not hasattr(ctypes.CDLL(where), sym):
            print(json.dumps({"error": f"sanitizer runtime missing: {sym} in {where}"}))
            return 3
    spec = importlib.util.spec_from_file_location("prx_assets.core.shards._planes", module_path)
    assert spec is not None and spec.loader is not None
    planes_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planes_mod)
    sys.modules["prx_assets.core.shards._planes"] = planes_mod  # what resize.py imports
    from prx_assets.core.shards import resize

    if resize._planes is not planes_mod:
        print(json.dumps({"error": "resize.py did not take the sanitized module"}))
        return 3
    summary = Summary()
    with open(progress, "w", buffering=1) as log:
        for index, case in enumerate(cases(n, seed)):
            if not start <= index < stop:
                continue
            log.write(f"{index}\t{case.name}\n")
            rng = random.Random(f"render:{seed}:{index}")
            try:
                _render(planes_mod, resize, case.data, rng)
                outcome = "rendered"
            except ValueError as exc:
                outcome = "rejected"
                summary.messages[str(exc).split(":")[0][:60]] += 1
                if case.messages and not any(m in str(exc) for m in case.messages):
                    summary.violations.append(f"{index} {case.name}: refused as {exc!r}")
            except Exception:  # noqa: BLE001 - every other outcome is a finding
                outcome = "unexpected"
                tb = traceback.format_exc(limit=3)
                summary.violations.append(f"{index} {case.name}: {tb}")
            if case.expect not in ("any", outcome) and outcome != "unexpected":
                summary.violations.append(f"{index} {case.name}: {outcome}, not {case.expect}")
            group = case.name.split("-")[0] if "|" not in case.name else "mutated"
            summary.outcomes[f"{group}:{outcome}"] += 1
            summary.cases += 1
    print(json.dumps({
        "cases": summary.cases,
        "outcomes": dict(sorted(summary.outcomes.items())),
        "messages": dict(summary.messages.most_common(40)),
        "violations": summary.violations[:50],
        "violation_count": len(summary.violations),
    }))  # fmt: skip
    return 0


# ------------------------------------------------------------------ the parent


def run_sanitized(
    module_path: Path, code: str, timeout: float = 600.0
) -> subprocess.CompletedProcess:
    """``code`` run in a sanitized child with the sanitized module bound to ``planes``
    (and installed as ``prx_assets.core.shards._planes``, what resize.py imports)."""
    prelude = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location("
        f"'prx_assets.core.shards._planes', {str(module_path)!r})\n"
        "planes = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(planes)\n"
        "sys.modules['prx_assets.core.shards._planes'] = planes\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=REPO, env=sanitizer_env(),
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@dataclass
class FuzzRun:
    """One sanitized child's result: exit status, its summary, and on a crash the case
    it was on and the sanitizer's report."""

    returncode: int
    summary: dict
    last_case: str
    stderr: str
    seconds: float

    @property
    def sanitizer_reports(self) -> list[str]:
        """The sanitizer report lines in the child's stderr (none on a clean run)."""
        return [
            line for line in self.stderr.splitlines() if any(m in line for m in SANITIZER_MARKS)
        ]

    def explain(self) -> str:
        """What went wrong, for an assertion message."""
        return (
            f"rc {self.returncode}; last case: {self.last_case}\n"
            f"summary: {json.dumps(self.summary, indent=1)[:4000]}\n"
            f"stderr tail:\n{self.stderr[-6000:]}"
        )


def run_fuzz(
    module_path: Path, n: int, seed: int = 0, jobs: int = 1, timeout: float = 3600.0
) -> list[FuzzRun]:
    """Cases ``cases(n, seed)`` in ``jobs`` sanitized children (contiguous slices)."""
    env = sanitizer_env()
    runs = []
    with tempfile.TemporaryDirectory(prefix="planes-fuzz-") as tmp:
        procs = []
        bounds = [round(n * j / jobs) for j in range(jobs + 1)]
        for j in range(jobs):
            progress = Path(tmp) / f"progress-{j}.txt"
            cmd = [
                sys.executable, "-m", "prx_assets_tests.core.planes_fuzz", "--child",
                "--module", str(module_path), "--cases", str(n), "--seed", str(seed),
                "--start", str(bounds[j]), "--stop", str(bounds[j + 1]),
                "--progress", str(progress),
            ]  # fmt: skip
            out, err = Path(tmp) / f"out-{j}", Path(tmp) / f"err-{j}"
            with open(out, "w") as fo, open(err, "w") as fe:
                p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe)
            procs.append((p, progress, out, err, time.monotonic()))
        for p, progress, out, err, t0 in procs:
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            lines = progress.read_text().splitlines() if progress.exists() else []
            text = out.read_text().strip().splitlines()
            try:
                summary = json.loads(text[-1]) if text else {}
            except json.JSONDecodeError:
                summary = {"stdout": text[-20:]}
            runs.append(FuzzRun(rc, summary, lines[-1] if lines else "", err.read_text(),
                                time.monotonic() - t0))  # fmt: skip
    return runs


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--module", required=True)
    ap.add_argument("--cases", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stop", type=int, default=math.inf)
    ap.add_argument("--progress", required=True)
    a = ap.parse_args(argv)
    return run_child(a.module, a.cases, a.seed, a.start, a.stop, a.progress)


if __name__ == "__main__":
    raise SystemExit(_main())
