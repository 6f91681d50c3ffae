"""Mistral 3 with images (Pixtral's vision tower, Mistral 3's projector) in our engine against
transformers' ``Mistral3ForConditionalGeneration`` (float32, a tiny random checkpoint): greedy,
token for token, with one image, two images of different sizes, an image larger than the
processor's longest edge and a text-only prompt, batched and prefilled in chunks that cut
through images; the image's run of tokens ([IMG] rows, [IMG_BREAK], [IMG_END]) as transformers'
processor builds it; the prefix cache keyed by image content; bad images refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from protos.multimodal import content_hash
from protos.sampling_params import InvalidRequestError
from services.engine.llm import LLM
from tests.services.engine.conftest import BESIDE
from tests.services.engine.image_prompts import ImagePrompts, built_fixture
from tests.services.mistral3_model import build, hf_greedy, png, processor_prompt

# every engine here on the test tokenizer, loaded once (tests/services/engine/_tp_tokenizers.py)
pytestmark = pytest.mark.usefixtures("tokenizers_loaded_once")

IMAGES = ImagePrompts(png, hf_greedy, new=10)
GREEDY = IMAGES.greedy
_prompt, _reference = IMAGES.prompt, IMAGES.reference

# (chat parts, the images' (seed, width, height))
CASES = [
    (("<image>", "What is in the picture?"), [(1, 64, 48)]),
    (("<image>", "and", "<image>", "differ how?"), [(3, 64, 64), (4, 100, 40)]),
    (("Describe", "<image>", "briefly."), [(2, 300, 150)]),  # scaled down to 112 pixels wide
    (("No picture here, just text.",), []),
]


built = built_fixture("mistral3", build)


@pytest.fixture(scope="module")
def llm(built: tuple[Path, Any]) -> LLM:
    # a 16-token step budget: the prompts are prefilled in chunks that cut through images
    return LLM(str(built[0]), max_num_batched_tokens=16, enable_prefix_caching=True, **BESIDE)


def test_the_prompt_holds_the_image_tokens_of_transformers_processor(
    built: tuple[Path, Any], llm: LLM
) -> None:
    for parts, images in CASES:
        prompt = _prompt(llm, parts, images)
        ids, items = llm.encode_with_images(prompt)
        text = llm.tokenizer.decode(prompt["prompt_token_ids"])
        assert ids == processor_prompt(built[0], text, prompt["multi_modal_data"]["image"])
        for item, (_, width, height) in zip(items, images, strict=True):
            rows, cols = item.grid[1] // 2, item.grid[2] // 2
            assert item.num_tokens == rows * (cols + 1)  # [IMG] x cols + a break, each row
            assert max(item.grid[1], item.grid[2]) * 14 <= 112
            assert (rows, cols) != (0, 0) and (width > height) == (cols > rows)


def test_greedy_equals_transformers_batched_and_chunked(built: tuple[Path, Any], llm: LLM) -> None:
    prompts = [_prompt(llm, parts, images) for parts, images in CASES]
    results = llm.generate(prompts, GREEDY)  # all in one batch
    for prompt, res in zip(prompts, results, strict=True):
        assert res.outputs[0].token_ids == _reference(built, llm, prompt)


def test_two_ranks_give_the_tokens_of_one(built: tuple[Path, Any], llm: LLM) -> None:
    """The language model split over two ranks (Gloo), the tower and projector whole on each
    (their q/k/v and gate/up names are never cut): the greedy tokens of one rank."""
    prompts = [_prompt(llm, parts, images) for parts, images in CASES[:2]]
    want = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    with LLM(str(built[0]), max_num_batched_tokens=16, tensor_parallel_size=2, **BESIDE) as tp:
        assert [r.outputs[0].token_ids for r in tp.generate(prompts, GREEDY)] == want


def test_the_image_decides_the_output(llm: LLM) -> None:
    IMAGES.check_the_image_decides_the_output(llm)


def test_prefix_cache_keys_image_blocks_by_content(built: tuple[Path, Any], llm: LLM) -> None:
    """Two images of one size give the same token ids: the second must not read the first's
    KV; the first again hits the cache and is not encoded again."""
    IMAGES.check_prefix_cache_keys_image_blocks_by_content(built, llm)


def test_bad_image_input_is_refused(llm: LLM) -> None:
    ids = IMAGES.check_bad_images_are_refused(llm)
    with pytest.raises(InvalidRequestError, match="image tokens"):  # [IMG] without an image
        llm.generate(ids, GREEDY)


def test_an_image_is_checked_when_added(llm: LLM) -> None:
    """What reaches the engine without the gateway's checks (a gRPC client of a worker): an
    image whose grid is not the one its tokens were counted for, or a run of tokens without
    its row breaks, is refused as the request is added; the engine goes on serving."""
    prompt = _prompt(llm, ("<image>", "hi"), [(51, 56, 56)])
    ids, (image,) = llm.encode_with_images(prompt)
    other = png(52, 112, 112)  # 4x4 merged patches, not the 2x2 of the tokens
    wrong = replace(image, data=other, content_hash=content_hash(other))
    with pytest.raises(InvalidRequestError, match="patch grid"):
        llm.engine.add_request("wrong", ids, GREEDY, images=[wrong])
    pad = ids[image.offset]
    flat = ids[: image.offset] + [pad] * image.num_tokens + ids[image.end :]  # no breaks
    with pytest.raises(InvalidRequestError, match="image tokens"):
        llm.engine.add_request("flat", flat, GREEDY, images=[image])
    assert not llm.engine.has_unfinished
    assert llm.generate(prompt, GREEDY)[0].outputs[0].finish_reason == "length"


def test_without_an_image_processor_the_language_model_is_served(
    built: tuple[Path, Any], tmp_path: Path
) -> None:
    """A Mistral 3 checkpoint without preprocessor_config.json, or quantized (its tower is not
    built quantized): its language model alone (as before images were served), images refused
    with the reason."""
    IMAGES.check_the_language_model_alone(built, tmp_path)
