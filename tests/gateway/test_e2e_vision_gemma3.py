"""Gemma 3's images end to end: the official ``openai`` client sends chat messages with
``image_url`` data URLs to `tandem up` serving a tiny random Gemma 3 checkpoint on the CPU,
disaggregated (the decode worker gets the KV and the images' placement). Greedy
tokens equal transformers' (float32, eager attention: bidirectional within each image) with
one image, two and none, on the prompt the gateway builds; usage counts an image's 16 soft
tokens with their wrapping; a repeated image is served from the prefix cache; bad images and
more than --limit-mm-per-prompt are a 400 (slow)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from deploy.procfs import descendants
from protos.multimodal import VisionSpec, place_images
from protos.token_bytes import TokenBytes
from services.engine.llm_engine import load_tokenizer
from tests.deploy.test_launcher import Up
from tests.gateway.test_e2e_vision import READY, TANDEM_UP, _chat, _client, _messages, _url
from tests.services.gemma3_model import build, hf_greedy, png

NEW = 8
# (text parts with <image> where an image goes, the images' (seed, width, height))
CASES = [
    (("<image>", "What is in the picture?"), [(1, 64, 48)]),
    (("Compare", "<image>", "and", "<image>", "please."), [(3, 64, 64), (4, 200, 40)]),
    (("Just text, no picture.",), []),
]

pytestmark = [
    pytest.mark.slow,
    # disaggregated only: the colocated path of images is the engine's (tests/services/engine
    # /models) and Qwen-VL's e2e; one topology keeps the serial serving unit of make test short
    pytest.mark.parametrize("topology", ["disaggregated"], scope="module"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("gemma3")
    return path, build(path)


@pytest.fixture(scope="module")
def served(
    topology: str, model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    # 24 tokens a step: the scheduler keeps each (20-token wrapped) image in one chunk
    flags = ["--model", str(model[0]), "--max-model-len", "512", "--max-num-batched-tokens",
             "24", "--limit-mm-per-prompt", '{"image": 2}']  # fmt: skip
    if topology == "colocated":
        flags += ["--colocated", "1"]
    up = Up(tmp_path_factory.mktemp("logs"), *flags, program=TANDEM_UP)
    try:
        url, name = up.wait_for(READY, timeout_s=300).groups()
        yield url, name
    finally:
        started = descendants(up.proc.pid)
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                up.finish(timeout_s=60)
        for pid in started | descendants(up.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


REFERENCE: dict[tuple[Path, int], list[list[int]]] = {}


def _expected(model: tuple[Path, Any], case: int, images: list[bytes]) -> list[list[int]]:
    """transformers' greedy tokens of a case on the prompt the gateway builds (the chat
    template's ids, each <start_of_image> expanded), each as the bytes chat logprobs report
    for it (computed once for both topologies)."""
    if (model[0], case) not in REFERENCE:
        path, hf = model
        tok = load_tokenizer(str(path))
        content = [{"type": "image"} if p == "<image>" else {"type": "text", "text": p}
                   for p in CASES[case][0]]  # fmt: skip
        ids = tok.apply_chat_template([{"role": "user", "content": content}],
                                      add_generation_prompt=True, tokenize=True)  # fmt: skip
        if not isinstance(ids, list):  # transformers 5: a BatchEncoding
            ids = ids["input_ids"]
        spec = VisionSpec.of_model_dir(path)
        assert spec is not None
        placed, _ = place_images(ids, spec, images)
        tokens = hf_greedy(hf, path, placed, images, NEW)
        as_bytes = TokenBytes.of(tok)
        REFERENCE[model[0], case] = [list(as_bytes(t, tok.decode([t]))) for t in tokens]
    return REFERENCE[model[0], case]


def test_greedy_tokens_equal_transformers(served: tuple[str, str], model: tuple[Path, Any]) -> None:
    url, name = served
    for i, (parts, specs) in enumerate(CASES):
        images = [png(s, w, h) for s, w, h in specs]
        out = _chat(url, name, _messages(parts, images), logprobs=True)
        got = [entry.bytes for entry in out.choices[0].logprobs.content]
        assert got == _expected(model, i, images), (i, parts)


def test_a_repeated_image_hits_the_prefix_cache_and_another_does_not(
    served: tuple[str, str],
) -> None:
    url, name = served
    text = ("<image>", "Tell me a long story about this picture, please.")
    a = _chat(url, name, _messages(text, [png(31, 112, 112)]))
    b = _chat(url, name, _messages(text, [png(32, 112, 112)]))  # the same token ids
    cached_b = b.usage.prompt_tokens_details
    assert cached_b is None or (cached_b.cached_tokens or 0) < 16  # not the first image's
    again = _chat(url, name, _messages(text, [png(31, 112, 112)]))
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the image's blocks
    assert again.choices[0].message.content == a.choices[0].message.content


def test_image_tokens_count_against_the_context(served: tuple[str, str]) -> None:
    """An image of any size is 16 soft tokens between <start_of_image> and <end_of_image>,
    wrapped in two newlines each side: usage counts them, and so does the context check."""
    url, name = served
    client = _client(url)
    with_image = client.chat.completions.create(
        model=name, messages=_messages(("<image>", "hi"), [png(41, 300, 90)]), max_tokens=1
    )  # type: ignore[arg-type]
    plain = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )  # type: ignore[arg-type]
    prompt = with_image.usage.prompt_tokens
    assert prompt > plain.usage.prompt_tokens + 16
    with pytest.raises(openai.BadRequestError, match=f"{prompt} in the messages"):
        client.chat.completions.create(
            model=name, messages=_messages(("<image>", "hi"), [png(41, 300, 90)]),
            max_tokens=512 - prompt + 1,
        )  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"type": "image_url", "image_url": {"url": _url(b"\x89PNG broken")}}, "could not be decoded"),
        ({"type": "image_url", "image_url": {"url": _url(b"hello", "text/plain")}}, "not an image"),
    ],
)  # fmt: skip
def test_bad_images_are_a_400(served: tuple[str, str], content: dict, message: str) -> None:
    url, name = served
    with pytest.raises(openai.BadRequestError, match=message):
        _chat(url, name, [{"role": "user", "content": [content, {"type": "text", "text": "hi"}]}])


def test_more_images_than_the_limit_are_a_400(served: tuple[str, str]) -> None:
    url, name = served
    images = [png(i) for i in range(3)]
    with pytest.raises(openai.BadRequestError, match="at most 2 are allowed"):
        _chat(url, name, _messages(("<image>", "<image>", "<image>"), images))
