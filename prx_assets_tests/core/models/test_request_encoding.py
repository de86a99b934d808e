"""Request bodies splice the image's data URL in instead of JSON-scanning a megabyte of
base64: the bytes still decode to exactly the body, untrusted text is still escaped, and
nothing but a URL this package encoded can be spliced."""

from __future__ import annotations

import json
import pickle

import pytest

from prx_assets.core.captions.models.base import DataURL, data_url
from prx_assets.core.captions.models.captioners import OpenAICaptioner
from prx_assets.core.captions.models.openai_http import encode_body
from prx_assets.demo.jpegs import solid_jpeg


def test_a_body_with_data_urls_decodes_to_the_same_body() -> None:
    url = data_url(solid_jpeg((64, 48), (200, 10, 10)))
    hostile = 'alt "text" \\ with </script> \x00 and é and a fake placeholder 00ff:0'
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": hostile},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "image_url", "image_url": {"url": data_url(b"second")}},
                    {"type": "text", "text": hostile},
                ],
            },
        ],
        "temperature": 0.2,
    }
    encoded = encode_body(body)
    assert json.loads(encoded) == body
    assert encoded.count(url.encode()) == 1  # spliced once, in place
    assert (
        encode_body({"a": [1, "x"]}) == json.dumps({"a": [1, "x"]}, separators=(",", ":")).encode()
    )


def test_the_captioners_body_carries_its_image_as_a_spliced_data_url() -> None:
    captioner = OpenAICaptioner(base_url="http://127.0.0.1:9/v1", model="m")
    body = captioner.request_body(data_url(solid_jpeg((32, 32), (1, 2, 3))))
    assert json.loads(encode_body(body)) == json.loads(json.dumps(body))


@pytest.mark.parametrize(
    "value",
    ['data:image/jpeg;base64,AA"}', "data:image/jpeg;base64,AA\\u0022", "data:é", "http://x"],
)
def test_only_a_clean_data_url_can_be_spliced(value: str) -> None:
    with pytest.raises(ValueError, match="not a data URL"):
        DataURL(value)


def test_a_data_url_survives_a_worker_pool_round_trip() -> None:
    url = data_url(b"\xff\xd8\xff")
    back = pickle.loads(pickle.dumps(url))
    assert isinstance(back, DataURL) and back == url
