"""One decompression-bomb limit: the project's (Pillow's warning limit, ~89.5 MP) is the
number every rejection names, also where Pillow's own 2x check (179 MP) fires first."""

import pytest
from PIL import Image

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS, DecodeRejected, inspect_image
from prx_assets.demo.jpegs import encoded


def _png(width: int, height: int) -> bytes:
    return encoded(Image.new("1", (width, height)), "PNG")  # a few KB whatever the size


@pytest.mark.parametrize("size", [(12_000, 9_000), (20_000, 20_000)])  # 108 MP, 400 MP
def test_every_bomb_rejection_names_the_project_limit(size):
    assert DEFAULT_MAX_PIXELS == Image.MAX_IMAGE_PIXELS == 89_478_485
    with pytest.raises(DecodeRejected) as err:
        inspect_image(_png(*size))
    assert err.value.reason == "decompression_bomb"
    assert f"limit of {DEFAULT_MAX_PIXELS} px" in err.value.detail
    assert str(2 * Image.MAX_IMAGE_PIXELS) not in err.value.detail  # never Pillow's 179 MP


def test_a_lower_configured_limit_is_the_one_named():
    with pytest.raises(DecodeRejected) as err:
        inspect_image(_png(20_000, 20_000), max_pixels=1_000_000)
    assert "limit of 1000000 px" in err.value.detail
