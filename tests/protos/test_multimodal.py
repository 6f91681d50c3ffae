"""The gateway's image-token arithmetic agrees with transformers' image processor."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from protos.errors import ConfigError
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


# Gemma 3: newline runs of 1 .. 4 as single tokens (Gemma's vocabulary has them), the image
# tokens, begin and end
NL = {"\n": 107, "\n\n": 108, "\n\n\n": 109, "\n\n\n\n": 110}
GEMMA3 = {"model_type": "gemma3", "mm_tokens_per_image": 4, "image_token_index": 9,
          "boi_token_index": 7, "eoi_token_index": 8,
          "vision_config": {"image_size": 56, "patch_size": 14}}  # fmt: skip


def test_gemma3_spans_wrap_the_image_and_merge_newlines_as_the_tokenizer() -> None:
    """Every image the tower's square: 4x4 patches pooled 2x2, 4 image tokens whatever its
    size, wrapped in "\\n\\n" <start_of_image> ... <end_of_image> "\\n\\n"; the wrapping
    newlines merge with newline tokens beside them ("\\n" + "\\n\\n": one "\\n\\n\\n" token,
    two images side by side: "\\n\\n\\n\\n"), as transformers' processor's text tokenizes."""
    spec = VisionSpec.from_dicts(GEMMA3, {"size": {"height": 56, "width": 56}}, NL)
    assert spec.grid(480, 1000) == spec.grid(20, 20) == (1, 4, 4) and spec.merge_size == 2
    assert spec.span((1, 4, 4)) == [108, 7, 9, 9, 9, 9, 8, 108]
    assert spec.run((1, 4, 4)) == [9] * 4 and spec.placeholder_id == 7
    png = _png(30, 20)
    ids, items = place_images([1, 107, 7, 2], spec, [png])
    assert ids == [1, 109, 7, 9, 9, 9, 9, 8, 108, 2]
    assert [(im.offset, im.num_tokens) for im in items] == [(3, 4)]
    ids, items = place_images([7, 7, 107, 3], spec, [png, png])  # side by side, "\n" after
    assert ids == [108, 7, 9, 9, 9, 9, 8, 110, 7, 9, 9, 9, 9, 8, 109, 3]
    assert [im.offset for im in items] == [2, 9]
    no_three = VisionSpec.from_dicts(GEMMA3, {}, {"\n": 107, "\n\n": 108})
    ids, _ = place_images([107, 7], no_three, [png])  # no single token for three: kept apart
    assert ids == [107, 108, 7, 9, 9, 9, 9, 8, 108]


def test_gemma3_specs_refuse_what_the_engine_cannot_serve() -> None:
    with pytest.raises(ConfigError, match="do_pan_and_scan"):
        VisionSpec.from_dicts(GEMMA3, {"do_pan_and_scan": True}, NL)
    with pytest.raises(ConfigError, match="not the vision tower's image_size 56"):
        VisionSpec.from_dicts(GEMMA3, {"size": {"height": 64, "width": 64}}, NL)
    with pytest.raises(ConfigError, match="mm_tokens_per_image 9 must be a square"):
        VisionSpec.from_dicts({**GEMMA3, "mm_tokens_per_image": 9}, {}, NL)
    with pytest.raises(ConfigError, match="no single token for two newlines"):
        VisionSpec.from_dicts(GEMMA3, {}, {"\n": 107})
    vision = {"hidden_size": 1152, "image_size": 896, "patch_size": 14}
    published = VisionSpec.from_dicts(  # google/gemma-3-4b-it's
        {"model_type": "gemma3", "vision_config": vision}, {"do_pan_and_scan": None, "size": {"height": 896, "width": 896}},
        NL,
    )  # fmt: skip
    assert published.grid(1, 1) == (1, 64, 64) and published.merge_size == 4
    assert published.tokens_of(published.grid(1, 1)) == 256


def test_pixtral_size_keeps_a_thin_image_a_patch_wide() -> None:
    """Scaled to fit longest_edge, a side floored to 0 pixels (300 x 2 into 112) keeps one
    patch row (was 0: an empty grid, an IndexError on expanding its tokens); the usual
    shapes as transformers' processor sizes them."""
    from protos.multimodal import pixtral_size

    assert pixtral_size(300, 2, 112, 28) == (112, 28)
    assert pixtral_size(2, 300, 112, 28) == (28, 112)
    assert pixtral_size(1024, 768, 1540, 28) == (1036, 784)
    assert pixtral_size(3000, 1500, 1540, 28) == (1540, 784)
