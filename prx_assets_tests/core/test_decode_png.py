"""Ingest's PNG decode by libspng (``core/ingest/png_direct``): cheaper, and the same answers.

An 8-bit RGB or RGBA PNG is decoded by libspng instead of Pillow's PNG decoder. These tests prove that the pixels, the EXIF orientation,
the refusals, the pHash thumbnail and the preview are what Pillow's own decode gives, and that
every other PNG (greyscale, palette, 16-bit, 1-bit, grey + alpha, APNG, a chunk after the image
data that Pillow reads: text it may take an orientation from, ``eXIf``, ``zTXt``, ``iTXt``) is
left to Pillow (``benchmarks/bench_pipeline.py --formats mixed`` measures the CPU).
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image, ImageCms, ImageOps, PngImagePlugin

from prx_assets.core.dedup.phash import fast_thumbnail, phash_bytes, thumbnail_from_bytes
from prx_assets.core.ingest import png_direct
from prx_assets.core.ingest.decode import (
    DEFAULT_MAX_PIXELS,
    DecodeRejected,
    decode_rgb,
    inspect_and_decode,
    inspect_image,
    to_rgb,
)
from prx_assets.core.ingest.runner import check_candidate
from prx_assets.demo.jpegs import alpha_photo, demo_photo, encoded


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        out.append((data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return out


def _assemble(chunks: list[tuple[bytes, bytes]]) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(k, b) for k, b in chunks)


_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2))
_ADAM7 += ((0, 1, 1, 2),)


def _interlaced_png(pixels: np.ndarray) -> bytes:
    """An Adam7-interlaced 8-bit PNG (Pillow cannot write one), rows filtered None or Sub."""
    h, w = pixels.shape[:2]
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    colour = {1: 0, 3: 2, 4: 6}[channels]
    raw = bytearray()
    for x0, y0, dx, dy in _ADAM7:
        sub = pixels[y0::dy, x0::dx].reshape(-1, max(0, (w - x0 + dx - 1) // dx) * channels)
        for i, row in enumerate(sub.astype(np.int16)):
            if i % 2:  # Sub: each byte minus the byte one pixel to its left
                left = np.concatenate([np.zeros(channels, np.int16), row[:-channels]])
                raw += b"\x01" + ((row - left) % 256).astype(np.uint8).tobytes()
            else:
                raw += b"\x00" + row.astype(np.uint8).tobytes()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, 1)
    return _assemble([(b"IHDR", ihdr), (b"IDAT", zlib.compress(bytes(raw))), (b"IEND", b"")])


def _pillow_policy(data: bytes) -> Image.Image:
    """The policy's pixels the way Pillow's own decode makes them: load, exif_transpose."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return to_rgb(ImageOps.exif_transpose(img))[0]


@pytest.fixture
def direct_calls(monkeypatch) -> list[tuple[int, int]]:
    """The sizes libspng decoded (the path ran) during a test."""
    calls: list[tuple[int, int]] = []
    decode = png_direct.decode

    def spy(data: bytes, size: tuple[int, int], rawmode: str):
        out = decode(data, size, rawmode)
        if out is not None:
            calls.append(size)
        return out

    monkeypatch.setattr(png_direct, "decode", spy)
    return calls


def _before_image_data(data: bytes, kind: bytes, body: bytes) -> bytes:
    chunks = _chunks(data)
    at = next(i for i, (k, _) in enumerate(chunks) if k == b"IDAT")
    return _assemble([*chunks[:at], (kind, body), *chunks[at:]])


DIRECT = {
    "rgb": lambda: encoded(demo_photo(), "PNG"),
    "rgb_odd_size": lambda: encoded(demo_photo((1, 7)), "PNG"),
    "rgb_trns": lambda: encoded(demo_photo(), "PNG", transparency=(10, 20, 30)),
    "rgb_gamma_icc": lambda: _before_image_data(
        encoded(
            demo_photo(),
            "PNG",
            icc_profile=ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes(),
        ),
        b"gAMA",
        struct.pack(">I", 100000),  # gamma 1.0: applied by neither decoder
    ),
    "rgba": lambda: encoded(alpha_photo(), "PNG"),
    "rgb_interlaced": lambda: _interlaced_png(np.asarray(demo_photo((37, 29)))),
    "rgba_interlaced": lambda: _interlaced_png(np.asarray(alpha_photo())),
}


def _rgb_many_idats() -> bytes:
    """Pillow's PNG of the photo with its image data split into 1000-byte IDAT chunks."""
    chunks = _chunks(encoded(demo_photo(), "PNG"))
    stream = b"".join(body for kind, body in chunks if kind == b"IDAT")
    idats = [(b"IDAT", stream[i : i + 1000]) for i in range(0, len(stream), 1000)]
    return _assemble([chunks[0], *idats, (b"IEND", b"")])


DIRECT["rgb_many_idats"] = _rgb_many_idats
DIRECT["rgb_inert_chunks_after_image_data"] = lambda: _after_image_data(
    encoded(demo_photo(), "PNG"), *INERT_TRAILER
)
DIRECT["rgba_inert_chunks_after_image_data"] = lambda: _after_image_data(
    encoded(alpha_photo(), "PNG"), *INERT_TRAILER
)


@pytest.mark.parametrize("kind", sorted(DIRECT))
def test_plain_8_bit_png_decodes_by_libspng_to_pillows_pixels(kind: str, direct_calls) -> None:
    data = DIRECT[kind]()
    header = Image.open(io.BytesIO(data))
    assert png_direct.available()
    expected = _pillow_policy(data)
    info, rgb = inspect_and_decode(data)
    assert direct_calls == [header.size]  # the path ran, once
    assert info == inspect_image(data)
    assert info.format == "PNG" and info.mode == header.mode
    assert (
        info.conversion == {"RGB": "none", "RGBA": "alpha_on_white", "L": "greyscale"}[header.mode]
    )
    assert rgb is not None and rgb.mode == "RGB"
    assert np.array_equal(np.asarray(rgb), np.asarray(expected))
    assert np.array_equal(np.asarray(decode_rgb(data)), np.asarray(expected))


def _palette_alpha() -> bytes:
    return encoded(alpha_photo().convert("P"), "PNG", transparency=0)


def _apng() -> bytes:
    frames = [demo_photo(), demo_photo().transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    return encoded(frames[0], "PNG", save_all=True, append_images=frames[1:])


def _after_image_data(data: bytes, *extra: tuple[bytes, bytes]) -> bytes:
    chunks = _chunks(data)
    assert chunks[-1][0] == b"IEND"
    return _assemble([*chunks[:-1], *extra, chunks[-1]])


# What ImageMagick and libpng writers put after the image data: dates, private chunks.
INERT_TRAILER = (
    (b"tEXt", b"date:create\x002026-12-06T08:00:00+00:00"),
    (b"tEXt", b"date:modify\x002026-12-06T08:00:00+00:00"),
    (b"tIME", bytes([7, 234, 12, 6, 8, 0, 0])),
    (b"vpAg", bytes(9)),
    (b"tEXt", b"no key separator"),
    (b"tEXt", b"\x00empty key"),
)


def _raw_profile_exif(orientation: int) -> bytes:
    """A ``Raw profile type exif`` text value, as ImageMagick writes EXIF into PNGs."""
    raw = b"Exif\x00\x00" + _exif(orientation).tobytes()
    return b"\nexif\n%8d\n" % len(raw) + raw.hex().encode()


PILLOWS = {
    "grey": lambda: encoded(demo_photo().convert("L"), "PNG"),  # libspng is not faster there
    "grey_trns": lambda: encoded(demo_photo().convert("L"), "PNG", transparency=7),
    "grey_interlaced": lambda: _interlaced_png(np.asarray(demo_photo((9, 13)).convert("L"))),
    "palette": lambda: encoded(demo_photo().convert("P"), "PNG"),
    "palette_alpha": _palette_alpha,
    "rgb16": lambda: _assemble(
        [(b"IHDR", struct.pack(">IIBBBBB", 5, 3, 16, 2, 0, 0, 0))]
        + [(b"IDAT", zlib.compress(b"".join(b"\x00" + bytes(range(30)) for _ in range(3))))]
        + [(b"IEND", b"")]
    ),
    "grey16": lambda: encoded(
        Image.fromarray(np.arange(600, dtype=np.uint16).reshape(20, 30) * 97), "PNG"
    ),
    "grey_alpha": lambda: encoded(alpha_photo().convert("LA"), "PNG"),
    "one_bit": lambda: encoded(demo_photo().convert("1"), "PNG"),
    "apng": _apng,
    "ztxt_after_image_data": lambda: _after_image_data(
        encoded(demo_photo(), "PNG"),
        (b"zTXt", b"Comment\x00\x00" + zlib.compress(b"after the pixels")),
    ),
    "itxt_after_image_data": lambda: _after_image_data(
        encoded(demo_photo(), "PNG"), (b"iTXt", b"Comment\x00\x00\x00\x00\x00after the pixels")
    ),
    "idat_after_a_text_chunk": lambda: _after_image_data(
        encoded(demo_photo(), "PNG"), (b"tEXt", b"a\x00b"), (b"IDAT", zlib.compress(b""))
    ),
    "not_a_chunk_name_after_image_data": lambda: _after_image_data(
        encoded(demo_photo(), "PNG"), (b"t3Xt", b"a\x00b")
    ),
}


@pytest.mark.parametrize("kind", sorted(PILLOWS))
def test_other_pngs_are_left_to_pillow(kind: str, direct_calls) -> None:
    data = PILLOWS[kind]()
    info, rgb = inspect_and_decode(data)
    assert direct_calls == []
    assert rgb is not None
    assert np.array_equal(np.asarray(rgb), np.asarray(_pillow_policy(data)))
    assert info == inspect_image(data)


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def _exif_after_image_data(orientation: int) -> bytes:
    chunks = _chunks(encoded(demo_photo(), "PNG"))
    return _assemble([*chunks[:-1], (b"eXIf", _exif(orientation).tobytes()), chunks[-1]])


def _xmp(orientation: int) -> bytes:
    xmp = f'<x:xmpmeta><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>'
    itxt = b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + xmp.encode()
    return _before_image_data(encoded(demo_photo(), "PNG"), b"iTXt", itxt)


ORIENTED: dict[str, Callable[[int], bytes]] = {
    "exif_chunk": lambda o: encoded(demo_photo(), "PNG", exif=_exif(o)),
    "xmp_before_image_data": _xmp,
    "exif_after_image_data": _exif_after_image_data,  # left to Pillow, still turned
    "raw_profile_text_after_image_data": lambda o: _after_image_data(
        encoded(demo_photo(), "PNG"), (b"tEXt", b"Raw profile type exif\x00" + _raw_profile_exif(o))
    ),
    "xmp_text_after_image_data": lambda o: _after_image_data(
        encoded(demo_photo(), "PNG"),
        (b"tEXt", f'XML:com.adobe.xmp\x00<x tiff:Orientation="{o}"/>'.encode()),
    ),
    "raw_profile_text_before_image_data": lambda o: _before_image_data(
        encoded(demo_photo(), "PNG"), b"tEXt", b"Raw profile type exif\x00" + _raw_profile_exif(o)
    ),
}


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
@pytest.mark.parametrize("where", sorted(ORIENTED))
def test_png_orientation_is_read_as_pillow_reads_it(
    where: str, orientation: int, direct_calls
) -> None:
    data = ORIENTED[where](orientation)
    info, rgb = inspect_and_decode(data)
    assert info.orientation == orientation
    assert direct_calls == ([] if where.endswith("after_image_data") else [demo_photo().size])
    expected = _pillow_policy(data)
    assert rgb is not None and (info.width, info.height) == rgb.size == expected.size
    assert np.array_equal(np.asarray(rgb), np.asarray(expected))
    assert np.array_equal(np.asarray(decode_rgb(data)), np.asarray(expected))


def _outcome(fn, data: bytes):
    try:
        out = fn(data)
    except DecodeRejected as exc:
        return ("rejected", exc.reason, exc.detail)
    return np.asarray(out).tobytes() if isinstance(out, Image.Image) else out


def _damaged() -> dict[str, bytes]:
    good = encoded(demo_photo((640, 480)), "PNG")
    chunks = _chunks(good)
    idat = [i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT"]
    flipped = bytearray(good)
    for i in range(len(good) // 3, len(good) - 20, 97):  # damage the image data, not the header
        flipped[i] ^= 0x5A
    bad_crc = bytearray(good)
    bad_crc[-13] ^= 0xFF  # the last IDAT's CRC: libspng refuses, Pillow never reads it
    stream = b"".join(body for kind, body in chunks if kind == b"IDAT")
    bad_adler = stream[:-1] + bytes([stream[-1] ^ 0x01])
    short = zlib.compress(zlib.decompress(stream)[:-500])
    long = zlib.compress(zlib.decompress(stream) + b"\x00" * 5000)
    with_stream = lambda s: _assemble([chunks[0], (b"IDAT", s), (b"IEND", b"")])  # noqa: E731
    out = {f"cut_{c}": good[: int(len(good) * c)] for c in (0.3, 0.6, 0.97, 0.9999)}
    out |= {
        "no_iend": good[:-12],
        "flipped": bytes(flipped),
        "bad_idat_crc": bytes(bad_crc),
        "bad_adler32": with_stream(bad_adler),
        "too_few_rows": with_stream(short),
        "too_much_data": with_stream(long),
        "bad_filter_type": with_stream(zlib.compress(b"\x07" + zlib.decompress(stream)[1:])),
        "idat_then_other_then_idat": _assemble(
            [chunks[0], chunks[idat[0]], (b"tEXt", b"a\x00b"), *chunks[idat[0] + 1 :]]
        ),
    }
    return out


@pytest.mark.parametrize("kind", sorted(_damaged()))
def test_damaged_png_gets_pillows_answer(kind: str, monkeypatch) -> None:
    """Refused for the same reason and detail, or accepted with the same pixels, as by
    Pillow's own decode (before this path existed)."""
    data = _damaged()[kind]
    fns = (inspect_image, decode_rgb, lambda d: inspect_and_decode(d)[1])
    direct = [_outcome(fn, data) for fn in fns]
    with monkeypatch.context() as m:
        m.setattr(png_direct, "decode", lambda *a: None)
        pillow = [_outcome(fn, data) for fn in fns]
    assert direct == pillow
    if kind.startswith("cut_") and kind != "cut_0.9999":
        assert direct[0][:2] in (("rejected", "truncated"), ("rejected", "corrupt_data"))


@pytest.mark.parametrize("limit", [10, 30, 43, 44, 100])
def test_text_after_the_image_data_past_pillows_limit_gets_pillows_answer(
    limit: int, monkeypatch, direct_calls
) -> None:
    """Text chunks past Pillow's text memory limit make Pillow refuse at open (before the
    pixels) or raise in its decode (after them); a file whose text after the pixels passes
    the limit is left to Pillow, so the answer is Pillow's either way."""
    data = _after_image_data(
        _before_image_data(encoded(demo_photo(), "PNG"), b"tEXt", b"Title\x00" + b"t" * 20),
        (b"tEXt", b"Comment\x00" + b"c" * 24),
    )
    size = demo_photo().size
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", limit)  # (the test photo has 3 KB)
    direct = [_outcome(fn, data) for fn in (inspect_image, decode_rgb)]
    ran = list(direct_calls)
    with monkeypatch.context() as m:
        m.setattr(png_direct, "decode", lambda *a: None)
        pillow = [_outcome(fn, data) for fn in (inspect_image, decode_rgb)]
    assert direct == pillow
    if limit < 20:  # the header's own text is over: Pillow cannot open it
        assert direct[0][:2] == ("rejected", "corrupt_header")
    assert ran == ([] if limit < 44 else [size] * 2)


def test_the_pixel_limit_is_checked_before_libspng_runs(direct_calls) -> None:
    data = encoded(demo_photo((400, 300)), "PNG")
    with pytest.raises(DecodeRejected) as err:
        inspect_and_decode(data, max_pixels=400 * 300 - 1)
    assert err.value.reason == "decompression_bomb"
    assert direct_calls == []


def test_a_second_ihdr_never_sizes_libspngs_buffer(direct_calls) -> None:
    """libspng sizes its output by the first IHDR, Pillow by the last: a file whose first
    IHDR claims 10 GP and a later one 40x30 px passes Pillow's pixel limit, and is never
    handed to libspng (Pillow alone decodes it, as before)."""
    chunks = _chunks(encoded(demo_photo((40, 30)), "PNG"))
    bomb_ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    data = _assemble([(b"IHDR", bomb_ihdr), *chunks])
    assert Image.open(io.BytesIO(data)).size == (40, 30)
    assert png_direct.decode(data, (40, 30), "RGB") is None
    info, rgb = inspect_and_decode(data)
    assert direct_calls == []
    assert (info.width, info.height) == (40, 30) and rgb is not None
    assert np.array_equal(np.asarray(rgb), np.asarray(_pillow_policy(data)))


def _composited_on_white(img: Image.Image) -> np.ndarray:
    """The policy's alpha rule as first written: alpha_composite on white, then RGB."""
    background = Image.new("RGBA", img.size, (255, 255, 255, 255))
    background.alpha_composite(img.convert("RGBA"))
    return np.asarray(background.convert("RGB"))


def test_alpha_on_white_is_alpha_composite_for_every_value_and_alpha() -> None:
    value, alpha = (g.astype(np.uint8) for g in np.meshgrid(np.arange(256), np.arange(256)))
    # Each colour channel runs through all 256 values against every alpha (7 is odd: a
    # permutation of 0..255), so every (value, alpha) pair of every channel is checked.
    pixels = np.dstack([value, 255 - value, value * np.uint8(7), alpha])
    rgba = Image.fromarray(pixels, "RGBA")
    out, conversion = to_rgb(rgba)
    assert conversion == "alpha_on_white" and out.mode == "RGB"
    assert np.array_equal(np.asarray(out), _composited_on_white(rgba))
    for mode in ("LA", "PA", "RGBa", "P"):  # ("La" never converts to RGBA in Pillow)
        img = rgba.convert("P") if mode == "P" else rgba.convert(mode)
        if mode == "P":
            img.info["transparency"] = 3
        out, conversion = to_rgb(img)
        assert conversion == "alpha_on_white"
        assert np.array_equal(np.asarray(out), _composited_on_white(img)), mode


def test_libspng_output_that_disagrees_with_the_header_is_not_used() -> None:
    data = encoded(demo_photo(), "PNG")
    assert png_direct.decode(data, (301, 207), "RGB") is not None
    assert png_direct.decode(data, (300, 207), "RGB") is None
    assert png_direct.decode(data, (301, 207), "RGBA") is None
    assert png_direct.decode(data, (301, 207), "P") is None
    assert not png_direct.only_inert_chunks_follow(data, 8, 0)  # not where the data starts
    texted = _before_image_data(data, b"tEXt", b"a\x00b")
    at_text = texted.index(b"tEXta\x00b") + 4
    assert png_direct.only_inert_chunks_follow(texted, Image.open(io.BytesIO(texted)).tile[0][2], 0)
    assert not png_direct.only_inert_chunks_follow(texted, at_text, 0)  # an IDAT must start


@pytest.mark.parametrize("kind", ["rgb", "rgba", "rgb_interlaced"])
def test_png_thumbnail_preview_and_hash_are_pillows_bit_for_bit(kind: str, monkeypatch) -> None:
    """Ingest's stored pHash thumbnail and preview, and ``image_hashes``' own decode, are the
    same bytes whichever decoder made the pixels."""
    big = {
        "rgb": lambda: encoded(demo_photo((1501, 1003)), "PNG"),
        "rgba": lambda: encoded(alpha_photo().resize((900, 1200)), "PNG"),
        "rgb_interlaced": lambda: _interlaced_png(np.asarray(demo_photo((517, 389)))),
    }[kind]()

    def ingest_and_hash() -> tuple:
        _, (info, thumb, preview) = check_candidate((big, DEFAULT_MAX_PIXELS))
        return info, thumb, preview, fast_thumbnail(big).tobytes(), phash_bytes(big)

    direct = ingest_and_hash()
    with monkeypatch.context() as m:
        m.setattr(png_direct, "decode", lambda *a: None)
        pillow = ingest_and_hash()
    assert direct == pillow
    assert np.array_equal(thumbnail_from_bytes(direct[1]), fast_thumbnail(big))
