"""``resize="server"``: the ingested JPEG goes to the fleet as it is, metadata stripped, and
the server's processor resizes it; whatever a server would decode to other pixels than our
decode policy is prepared here instead (``core/captions/models/passthrough.py``)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from prx_assets.core.captions.models import CaptionInput, OpenAICaptioner
from prx_assets.core.captions.models.captioners import prepare_caption_job
from prx_assets.core.captions.models.passthrough import server_ready_url, strip_jpeg_metadata
from prx_assets.core.ingest.decode import decode_rgb
from prx_assets.core.workers import make_pool
from prx_assets.demo.jpegs import bundled_photos, crop_to_aspect, encoded

from .conftest import ChatServer

GPS_MARK = b"PRX-GPS-48.8566N-2.3522E"


def _photo(w: int = 1800, aspect: float = 1.5) -> Image.Image:
    src = crop_to_aspect(bundled_photos()[1], aspect)
    return src.resize((w, round(w / aspect)), Image.Resampling.LANCZOS)


def _jpeg(img: Image.Image, orientation: int | None = None, **save: object) -> bytes:
    exif = Image.Exif()
    exif[0x010E] = GPS_MARK.decode()  # ImageDescription: stands for private metadata
    if orientation is not None:
        exif[0x0112] = orientation
    return encoded(img, "JPEG", quality=90, exif=exif, comment=b"shot by someone", **save)


def _sent(url: str) -> bytes:
    assert url.startswith("data:image/jpeg;base64,")
    return base64.b64decode(url.split(",", 1)[1])


def test_stripping_drops_metadata_and_keeps_every_pixel_and_the_colour_segments():
    img = _photo()
    icc = b"\0" * 128  # any ICC payload: kept byte for byte (APP2 decides colours)
    data = _jpeg(img, icc_profile=icc)
    assert GPS_MARK in data and b"shot by someone" in data
    stripped = strip_jpeg_metadata(data)
    assert stripped is not None
    assert GPS_MARK not in stripped and b"shot by someone" not in stripped
    assert b"ICC_PROFILE" in stripped and b"JFIF" in stripped
    before = np.asarray(decode_rgb(data))
    after = np.asarray(decode_rgb(stripped))
    assert np.array_equal(before, after)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\xd8", b"\xff\xd8\xff\xe1\x00", b"\xff\xd8\xff\xd9", b"not a jpeg at all"],
)
def test_stripping_refuses_what_does_not_parse_to_a_scan(data: bytes):
    assert strip_jpeg_metadata(data) is None


def test_only_what_a_server_decodes_like_our_policy_is_passed_through():
    img = _photo(1200)
    plain = _jpeg(img)
    url = server_ready_url(plain)
    assert url is not None and _sent(url) == strip_jpeg_metadata(plain)
    assert server_ready_url(_jpeg(img, orientation=1)) is not None
    # A server does not rotate by EXIF; CMYK and PNG decode otherwise; size is bounded.
    assert server_ready_url(_jpeg(img, orientation=6)) is None
    assert server_ready_url(_jpeg(img.convert("CMYK"))) is None
    assert server_ready_url(encoded(img, "PNG")) is None
    assert server_ready_url(plain, max_bytes=len(plain) - 1) is None
    assert server_ready_url(plain, max_pixels=img.width * img.height - 1) is None
    truncated_header = plain[:300]
    assert server_ready_url(truncated_header) is None


def test_the_fleet_gets_the_original_or_a_draft_re_encode_and_a_pixel_budget(
    chat_server: ChatServer,
):
    """Through real HTTP: an upright JPEG arrives as itself (metadata stripped) with the
    processor's area budget; a rotated one arrives prepared here, upright and bounded."""
    cap = OpenAICaptioner("m", base_url=chat_server.base_url, resize="server", max_side=512)
    upright, rotated = _jpeg(_photo(1600)), _jpeg(_photo(1600), orientation=6)
    results = cap.caption([CaptionInput("up", image=upright), CaptionInput("rot", image=rotated)])
    assert [r.key for r in results] == ["up", "rot"]
    bodies = [r["body"] for r in chat_server.requests]
    assert all(b["mm_processor_kwargs"] == {"max_pixels": 512 * 512 * 3 // 4} for b in bodies)
    sent = {}
    for body in bodies:
        part = body["messages"][1]["content"][0]
        sent[len(sent)] = _sent(part["image_url"]["url"])
    originals = [s for s in sent.values() if s == strip_jpeg_metadata(upright)]
    assert len(originals) == 1
    (prepared,) = [s for s in sent.values() if s != strip_jpeg_metadata(upright)]
    out = Image.open(io.BytesIO(prepared))
    assert max(out.size) == 512 and out.height > out.width  # rotated upright, then bounded
    assert all(GPS_MARK not in s for s in sent.values())


def test_server_resize_is_its_own_identity_and_the_pool_prepares_the_same_request():
    url = "http://127.0.0.1:9/v1"
    plain = OpenAICaptioner("m", base_url=url)
    draft = OpenAICaptioner("m", base_url=url, resize="draft")
    server = OpenAICaptioner("m", base_url=url, resize="server")
    assert server.identity.param("resize") == "server"
    prints = {c.identity.fingerprint() for c in (plain, draft, server)}
    assert len(prints) == 3
    images = [_jpeg(_photo(1400)), _jpeg(_photo(1400), orientation=8)]
    here = [server.prepare(CaptionInput(f"k{i}", image=b)) for i, b in enumerate(images)]
    jobs = [
        (f"k{i}", b, server.max_side, server.jpeg_quality, "server") for i, b in enumerate(images)
    ]
    with make_pool("process", 2) as pool:
        there = list(pool.map_ordered(prepare_caption_job, jobs))
    assert there == here
