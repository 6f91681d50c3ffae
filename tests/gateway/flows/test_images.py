"""Chat images in the gateway: data URLs decoded, limits, placeholders expanded to each image's
token count (what the context-length check sees)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from gateway.core.errors import APIError
from gateway.flows.image_fetch import ImageURL
from gateway.flows.images import check_images, image_from_part, images_in_prompt
from protos.multimodal import VisionSpec

SPEC = VisionSpec(image_token_id=9, vision_start_id=7, vision_end_id=8,
                  min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 24)  # fmt: skip


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_data_url_gives_back_the_image_bytes() -> None:
    data = _png(3, 2)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert image_from_part(_part(url), "p") == data
    assert image_from_part({"type": "image_url", "image_url": url}, "p") == data  # a bare string


def test_an_http_url_is_kept_for_the_fetcher() -> None:
    """Parsing does not know the gateway's flags: gateway.flows.image_fetch decides."""
    for url in ("https://example.com/cat.png", "HTTP://example.com/cat.png"):
        assert image_from_part(_part(url), "p") == ImageURL(url, "p")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:application/pdf;base64,AAAA", "not an image"),
        ("data:image/png;base64,!!!", "not valid base64"),
        ("ftp://x", "must be a data: URL .* or, where the gateway fetches images, an https URL"),
    ],
)
def test_urls_that_cannot_be_served_are_a_400(url: str, words: str) -> None:
    with pytest.raises(APIError, match=words) as e:
        image_from_part(_part(url), "messages[0].content")
    assert e.value.status == 400


def test_detail_low_is_refused_and_auto_or_high_pass() -> None:
    url = "data:image/png;base64," + base64.b64encode(_png(3, 2)).decode()
    for detail in ("auto", "high", None):
        part = {"type": "image_url", "image_url": {"url": url, "detail": detail}}
        assert image_from_part(part, "p") == _png(3, 2)
    with pytest.raises(APIError, match="detail 'low' is not supported") as e:
        image_from_part({"type": "image_url", "image_url": {"url": url, "detail": "low"}}, "p")
    assert e.value.status == 400


def test_placeholders_expand_to_the_image_token_counts() -> None:
    ids, items = images_in_prompt([1, 7, 9, 8, 2, 7, 9, 8], [_png(64, 48), _png(112, 112)], SPEC)
    assert [(i.offset, i.num_tokens, i.grid) for i in items] == [
        (2, 4, (1, 4, 4)),  # 64x48 rounds to 56x56: 4x4 patches, 2x2 merged tokens
        (9, 16, (1, 8, 8)),
    ]
    assert ids == [1, 7, *[9] * 4, 8, 2, 7, *[9] * 16, 8]
    assert items[0].content_hash != items[1].content_hash


def test_an_undecodable_image_or_a_placeholder_mismatch_is_a_400() -> None:
    with pytest.raises(APIError, match="could not be decoded"):
        images_in_prompt([7, 9, 8], [b"\x89PNG\r\n\x1a\n truncated"], SPEC)
    with pytest.raises(APIError, match="1 image placeholders but 2 images"):
        images_in_prompt([7, 9, 8], [_png(8, 8), _png(8, 8)], SPEC)


def test_a_text_only_model_or_too_many_images_is_a_400() -> None:
    with pytest.raises(APIError, match="served for text only and takes no images"):
        check_images(1, None, None, "m")
    with pytest.raises(APIError, match="3 images but at most 2"):
        check_images(3, SPEC, 2, "m")
    check_images(2, SPEC, 2, "m")
    check_images(50, SPEC, None, "m")
