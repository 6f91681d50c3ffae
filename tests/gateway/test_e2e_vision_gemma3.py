"""Gemma 3's images end to end: the official ``openai`` client sends chat messages with
``image_url`` data URLs to `tandem up` serving a tiny random Gemma 3 checkpoint on the CPU,
disaggregated (the decode worker gets the KV and the images' placement). Greedy
tokens equal transformers' (float32, eager attention: bidirectional within each image) with
one image, two and none, on the prompt the gateway builds; usage counts an image's 16 soft
tokens with their wrapping; a repeated image is served from the prefix cache; bad images and
more than --limit-mm-per-prompt are a 400 (slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gateway import vision_stack as vision
from tests.services.engine.image_prompts import built_fixture
from tests.services.gemma3_model import build, hf_greedy, png

NEW = 8
# (text parts with <image> where an image goes, the images' (seed, width, height))
CASES = [
    (("<image>", "What is in the picture?"), [(1, 64, 48)]),
    (("Compare", "<image>", "and", "<image>", "please."), [(3, 64, 64), (4, 200, 40)]),
    (("Just text, no picture.",), []),
]

pytestmark = vision.DISAGGREGATED_ONLY


model = built_fixture("gemma3", build, fixture="model")


# 24 tokens a step: the scheduler keeps each (20-token wrapped) image in one chunk
served = vision.served_fixture("--max-num-batched-tokens", "24")


def _expected(model: tuple[Path, Any], case: int, images: list[bytes]) -> list[list[int]]:
    """transformers' greedy tokens of a case on the prompt the gateway builds (the chat
    template's ids, each <start_of_image> expanded), each as the bytes chat logprobs report
    for it (computed once for both topologies)."""
    return vision.reference_bytes(model, CASES[case][0], images, hf_greedy, NEW)


def test_greedy_tokens_equal_transformers(served: tuple[str, str], model: tuple[Path, Any]) -> None:
    url, name = served
    vision.assert_greedy_cases(url, name, CASES, png, lambda i, images: _expected(model, i, images))


def test_a_repeated_image_hits_the_prefix_cache_and_another_does_not(
    served: tuple[str, str],
) -> None:
    b = vision.repeated_image_chats(*served, png)  # the other image: the same token ids
    cached_b = b.usage.prompt_tokens_details
    assert cached_b is None or (cached_b.cached_tokens or 0) < 16  # not the first image's


def test_image_tokens_count_against_the_context(served: tuple[str, str]) -> None:
    """An image of any size is 16 soft tokens between <start_of_image> and <end_of_image>,
    wrapped in two newlines each side: usage counts them, and so does the context check."""
    prompt, plain = vision.image_prompt_tokens(*served, png(41, 300, 90))
    assert prompt > plain + 16


@vision.bad_images
def test_bad_images_are_a_400(served: tuple[str, str], content: dict, message: str) -> None:
    vision.assert_bad_image_400(*served, content, message)


def test_more_images_than_the_limit_are_a_400(served: tuple[str, str]) -> None:
    vision.assert_over_the_limit_400(*served, png)
