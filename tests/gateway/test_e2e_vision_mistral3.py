"""Mistral 3's images end to end: the official ``openai`` client sends chat messages with
``image_url`` data URLs to `tandem up` serving a tiny random Mistral 3 checkpoint on the CPU,
disaggregated (the decode worker gets the KV and the images' placement). Greedy
tokens equal transformers' (float32) with one image, two of different sizes and none; usage
counts an image's [IMG] rows with their [IMG_BREAK] / [IMG_END]; a repeated image is served
from the prefix cache; bad images and more than --limit-mm-per-prompt are a 400 (slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.engine.llm_engine import load_tokenizer
from tests.gateway import vision_stack as vision
from tests.services.engine.image_prompts import built_fixture
from tests.services.mistral3_model import build, hf_greedy, png, processor_prompt

NEW = 8
# (text parts with <image> where an image goes, the images' (seed, width, height))
CASES = [
    (("<image>", "What is in the picture?"), [(1, 64, 48)]),
    (("<image>", "and", "<image>", "differ how?"), [(3, 64, 64), (4, 100, 40)]),
    (("Just text, no picture.",), []),
]

pytestmark = vision.DISAGGREGATED_ONLY


model = built_fixture("mistral3", build, fixture="model")


served = vision.served_fixture()


REFERENCE: dict[tuple[Path, int], list[list[int]]] = {}


def _expected(model: tuple[Path, Any], case: int, images: list[bytes]) -> list[list[int]]:
    """transformers' greedy tokens of a case on the prompt its processor builds, each as the
    bytes chat logprobs report for it (computed once for both topologies)."""
    if (model[0], case) not in REFERENCE:
        path, hf = model
        tok = load_tokenizer(str(path))
        content = vision.template_content(CASES[case][0])
        text = tok.apply_chat_template([{"role": "user", "content": content}],
                                       add_generation_prompt=True, tokenize=False)  # fmt: skip
        tokens = hf_greedy(hf, path, processor_prompt(path, text, images), images, NEW)
        REFERENCE[model[0], case] = vision.as_logprob_bytes(tok, tokens)
    return REFERENCE[model[0], case]


def test_greedy_tokens_equal_transformers(served: tuple[str, str], model: tuple[Path, Any]) -> None:
    url, name = served
    vision.assert_greedy_cases(url, name, CASES, png, lambda i, images: _expected(model, i, images))


def test_a_repeated_image_hits_the_prefix_cache_and_another_does_not(
    served: tuple[str, str],
) -> None:
    b = vision.repeated_image_chats(*served, png)  # the other image: the same token ids
    cached_b = b.usage.prompt_tokens_details
    assert cached_b is None or not cached_b.cached_tokens  # the first image's blocks not reused


def test_image_tokens_count_against_the_context(served: tuple[str, str]) -> None:
    """A 112x112 image is 4 rows of 4 [IMG] tokens, each row ended by [IMG_BREAK] (the last by
    [IMG_END]): 20 prompt tokens in place of its [IMG] placeholder, counted by usage and by the
    context-length check."""
    prompt, plain = vision.image_prompt_tokens(*served, png(41, 112, 112))
    assert prompt == plain + 20


@vision.bad_images
def test_bad_images_are_a_400(served: tuple[str, str], content: dict, message: str) -> None:
    vision.assert_bad_image_400(*served, content, message)


def test_more_images_than_the_limit_are_a_400(served: tuple[str, str]) -> None:
    vision.assert_over_the_limit_400(*served, png)
