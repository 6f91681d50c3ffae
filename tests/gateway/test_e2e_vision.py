"""Images end to end (issue 26): the official ``openai`` client sends chat messages with
``image_url`` data URLs to `tandem up` serving a tiny random Qwen2-VL checkpoint on the CPU,
colocated and disaggregated (the decode worker gets only the KV and the images' placement), and
a Qwen3-VL one disaggregated. Greedy tokens equal transformers' (float32) with one and two
images; a repeated image is served from the prefix cache (counted), a different image of the
same size is not; an image given as an http URL (the gateway fetches from 127.0.0.1 here)
answers as its data URL does; bad images get a 400 that says what to fix (slow)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway import vision_stack as vision
from tests.gateway.image_server import ImageServer
from tests.services.vl_model import build, hf_greedy, png

NEW = 8
# (text parts with <image> where an image goes, the images' (seed, width, height))
CASES = [
    (("<image>", "What is in the picture?"), [(1, 64, 48)]),
    (("Describe", "<image>", "briefly."), [(2, 30, 200)]),
    (("<image>", "and", "<image>", "differ how?"), [(3, 64, 64), (4, 100, 40)]),
    (("Compare", "<image>", "<image>"), [(5, 56, 56), (6, 84, 56)]),
]


# Qwen3-VL once, disaggregated (its serving path is Qwen2-VL's; one more topology, ~20 s)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.parametrize(
        ("family", "topology"),
        [("qwen2_vl", "colocated"), ("qwen2_vl", "disaggregated"), ("qwen3_vl", "disaggregated")],
        scope="module",
    ),
]


@pytest.fixture(scope="module")
def model(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(family)
    return path, build(path, family)


served = vision.served_fixture("--allowed-media-domains", "127.0.0.1", "--media-allow-http")


def _expected(model: tuple[Path, Any], case: int, images: list[bytes]) -> list[list[int]]:
    """transformers' greedy tokens of a case, each as the bytes chat logprobs report for it
    (computed once for both topologies)."""
    return vision.reference_bytes(model, CASES[case][0], images, hf_greedy, NEW)


def test_greedy_tokens_equal_transformers(served: tuple[str, str], model: tuple[Path, Any]) -> None:
    url, name = served
    vision.assert_greedy_cases(url, name, CASES, png, lambda i, images: _expected(model, i, images))


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    specs = CASES[0][1]
    with ImageServer({"/case0.png": png(*specs[0])}) as server:
        yield server


def test_an_image_url_answers_as_its_data_url_does(
    served: tuple[str, str], model: tuple[Path, Any], image_server: ImageServer
) -> None:
    """The gateway fetches it (127.0.0.1 is allowed here); the same bytes, the same tokens."""
    url, name = served
    parts, specs = CASES[0]
    content = [{"type": "image_url", "image_url": {"url": image_server.url("/case0.png")}}
               if p == "<image>" else {"type": "text", "text": p} for p in parts]  # fmt: skip
    out = vision.chat(url, name, [{"role": "user", "content": content}], logprobs=True)
    got = [entry.bytes for entry in out.choices[0].logprobs.content]
    assert got == _expected(model, 0, [png(*specs[0])])
    missing = {"type": "image_url", "image_url": {"url": image_server.url("/none.png")}}
    with pytest.raises(openai.BadRequestError, match="answered HTTP 404"):
        vision.chat(url, name, [{"role": "user", "content": [missing]}])


def _hits(url: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^tandem:prefix_cache_hits_total\{[^}]*\} (\S+)$",
                                            text, re.M))  # fmt: skip


def _hits_above(url: str, before: float, timeout_s: float = 20.0) -> bool:
    """The workers' hit counters on /metrics pass ``before`` (their load is polled, so it lags
    a request by up to one health interval; the time bound is a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while _hits(url) <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_repeated_image_hits_the_prefix_cache_and_another_does_not(
    served: tuple[str, str],
) -> None:
    url, name = served
    text = ["<image>", "Tell me a long story about this picture, please."]
    first = vision.image_messages(tuple(text), [png(31, 112, 112)])
    # same size: the same placeholder ids
    other = vision.image_messages(tuple(text), [png(32, 112, 112)])
    a = vision.chat(url, name, first)
    b = vision.chat(url, name, other)
    cached_b = b.usage.prompt_tokens_details
    assert cached_b is None or not cached_b.cached_tokens  # the first image's blocks not reused
    assert b.choices[0].message.content != a.choices[0].message.content
    before = _hits(url)
    again = vision.chat(url, name, first)
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the image's blocks
    assert again.choices[0].message.content == a.choices[0].message.content
    assert _hits_above(url, before)  # counted


@pytest.mark.parametrize(
    ("content", "message"),
    [
        *vision.BAD_IMAGES,
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "host 'example.com', not one"),
    ],
)  # fmt: skip
def test_bad_images_are_a_400(served: tuple[str, str], content: dict, message: str) -> None:
    vision.assert_bad_image_400(*served, content, message)


def test_more_images_than_the_limit_are_a_400(served: tuple[str, str]) -> None:
    vision.assert_over_the_limit_400(*served, png)


def test_image_tokens_count_against_the_context(served: tuple[str, str]) -> None:
    """A 112x112 image is 16 prompt tokens: usage counts them, and the context-length check
    refuses a completion that fits only if they were not counted."""
    prompt, plain = vision.image_prompt_tokens(*served, png(41, 112, 112))
    assert prompt == plain + 2 + 16  # vision start/end and 16 image tokens
