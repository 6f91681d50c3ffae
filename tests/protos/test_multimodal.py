"""The gateway's image-token arithmetic agrees with transformers' image processor."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from protos.multimodal import (
    VisionSpec,
    expand_placeholders,
    image_size,
    place_images,
    smart_resize,
)
from protos.sampling_params import InvalidRequestError


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


SIZES = [(1, 1), (28, 28), (48, 64), (200, 30), (1000, 7), (448, 448), (1080, 1920), (3, 500)]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_smart_resize_equals_the_image_processors(height: int, width: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as reference,
    )

    for lo, hi in [(56 * 56, 28 * 28 * 1280), (28 * 28 * 4, 28 * 28 * 24)]:
        assert smart_resize(height, width, 28, lo, hi) == reference(height, width, 28, lo, hi)


def test_grid_and_token_count_of_a_448_image() -> None:
    spec = VisionSpec(image_token_id=9, vision_start_id=7, vision_end_id=8)
    grid = spec.grid(448, 448)
    assert grid == (1, 32, 32)
    assert spec.tokens_of(grid) == 256


def test_an_elongated_image_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        smart_resize(1, 300, 28, 56 * 56, 28 * 28 * 1280)


def test_placeholders_expand_to_each_images_count() -> None:
    ids, offsets = expand_placeholders([1, 9, 2, 9, 3], 9, [3, 2])
    assert ids == [1, 9, 9, 9, 2, 9, 9, 3]
    assert offsets == [1, 5]
    with pytest.raises(InvalidRequestError, match="2 image placeholders but 1 images"):
        expand_placeholders([9, 9], 9, [4])


def test_image_size_refuses_what_is_not_an_image() -> None:
    with pytest.raises(InvalidRequestError, match="could not be decoded"):
        image_size(b"GIF89a but not really")


def test_an_image_that_is_refused_is_named_by_its_place_in_the_prompt() -> None:
    """Several images: the 400 says which one (the 2nd here); no Python object's repr."""
    spec = VisionSpec(image_token_id=9, vision_start_id=7, vision_end_id=8)
    good = _png(30, 20)
    with pytest.raises(InvalidRequestError, match=r"^image 2 of the prompt: .*could not be") as e:
        place_images([9, 9], spec, [good, b"\x00\x01 not an image"])
    assert "object at 0x" not in str(e.value) and "not a known image format" in str(e.value)


def test_a_decompression_bomb_gets_the_size_limit_message() -> None:
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")  # ~50 KB declaring 400 megapixels
    with pytest.raises(InvalidRequestError, match="larger than the 67 megapixels allowed"):
        image_size(buf.getvalue())
