"""Images end to end (issue 26): the official ``openai`` client sends chat messages with
``image_url`` data URLs to `tandem up` serving a tiny random Qwen2-VL checkpoint on the CPU,
colocated and disaggregated (the decode worker gets only the KV and the images' placement), and
a Qwen3-VL one disaggregated. Greedy tokens equal transformers' (float32) with one and two
images; a repeated image is served from the prefix cache (counted), a different image of the
same size is not; an image given as an http URL (the gateway fetches from 127.0.0.1 here)
answers as its data URL does; bad images get a 400 that says what to fix (slow)."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from deploy.procfs import descendants
from protos.multimodal import VisionSpec, place_images
from protos.token_bytes import TokenBytes
from services.engine.llm_engine import load_tokenizer
from tests.deploy.test_launcher import Up
from tests.gateway.image_server import ImageServer
from tests.services.vl_model import build, hf_greedy, png

TANDEM_UP = (sys.executable, "-m", "services.cli", "up")
READY = re.compile(r"^Tandem is ready: (http://\S+/v1) \(gateway \+ .+, model (.+)\)$")
NEW = 8
# (text parts with <image> where an image goes, the images' (seed, width, height))
CASES = [
    (("<image>", "What is in the picture?"), [(1, 64, 48)]),
    (("Describe", "<image>", "briefly."), [(2, 30, 200)]),
    (("<image>", "and", "<image>", "differ how?"), [(3, 64, 64), (4, 100, 40)]),
    (("Compare", "<image>", "<image>"), [(5, 56, 56), (6, 84, 56)]),
]


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _messages(parts: tuple[str, ...], images: list[bytes]) -> list[dict[str, Any]]:
    pics = iter(images)
    content = [
        {"type": "image_url", "image_url": {"url": _url(next(pics))}}
        if p == "<image>"
        else {"type": "text", "text": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


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


@pytest.fixture(scope="module")
def served(
    topology: str, model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:  # fmt: skip
    flags = ["--model", str(model[0]), "--max-model-len", "512", "--limit-mm-per-prompt",
             '{"image": 2}', "--allowed-media-domains", "127.0.0.1", "--media-allow-http"]  # fmt: skip
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


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)


def _chat(url: str, name: str, messages: list[dict[str, Any]], logprobs: bool = False) -> Any:
    return _client(url).chat.completions.create(
        model=name, messages=messages, max_tokens=NEW, temperature=0,  # type: ignore[arg-type]
        logprobs=logprobs, extra_body={"ignore_eos": True},
    )  # fmt: skip


REFERENCE: dict[tuple[Path, int], list[list[int]]] = {}


def _expected(model: tuple[Path, Any], case: int, images: list[bytes]) -> list[list[int]]:
    """transformers' greedy tokens of a case, each as the bytes chat logprobs report for it
    (computed once for both topologies)."""
    if (model[0], case) not in REFERENCE:
        path, hf = model
        tok = load_tokenizer(str(path))
        content = [{"type": "image"} if p == "<image>" else {"type": "text", "text": p}
                   for p in CASES[case][0]]  # fmt: skip
        ids = tok.apply_chat_template([{"role": "user", "content": content}],
                                      add_generation_prompt=True, return_dict=True)["input_ids"]  # fmt: skip
        spec = VisionSpec.of_model_dir(path)
        assert spec is not None
        full, _ = place_images(ids, spec, images)
        tokens = hf_greedy(hf, path, full, images, NEW)
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
    out = _chat(url, name, [{"role": "user", "content": content}], logprobs=True)
    got = [entry.bytes for entry in out.choices[0].logprobs.content]
    assert got == _expected(model, 0, [png(*specs[0])])
    missing = {"type": "image_url", "image_url": {"url": image_server.url("/none.png")}}
    with pytest.raises(openai.BadRequestError, match="answered HTTP 404"):
        _chat(url, name, [{"role": "user", "content": [missing]}])


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
    first = _messages(tuple(text), [png(31, 112, 112)])
    other = _messages(tuple(text), [png(32, 112, 112)])  # same size: the same placeholder ids
    a = _chat(url, name, first)
    b = _chat(url, name, other)
    cached_b = b.usage.prompt_tokens_details
    assert cached_b is None or not cached_b.cached_tokens  # the first image's blocks not reused
    assert b.choices[0].message.content != a.choices[0].message.content
    before = _hits(url)
    again = _chat(url, name, first)
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the image's blocks
    assert again.choices[0].message.content == a.choices[0].message.content
    assert _hits_above(url, before)  # counted


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"type": "image_url", "image_url": {"url": _url(b"\x89PNG broken")}}, "could not be decoded"),
        ({"type": "image_url", "image_url": {"url": _url(b"hello", "text/plain")}}, "not an image"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "host 'example.com', not one"),
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


def test_image_tokens_count_against_the_context(served: tuple[str, str]) -> None:
    """A 112x112 image is 16 prompt tokens: usage counts them, and the context-length check
    refuses a completion that fits only if they were not counted."""
    url, name = served
    messages = _messages(("<image>", "hi"), [png(41, 112, 112)])
    text_only = [{"role": "user", "content": "hi"}]
    client = _client(url)
    with_image = client.chat.completions.create(model=name, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    plain = client.chat.completions.create(model=name, messages=text_only, max_tokens=1)  # type: ignore[arg-type]
    prompt = with_image.usage.prompt_tokens
    assert prompt == plain.usage.prompt_tokens + 2 + 16  # vision start/end and 16 image tokens
    with pytest.raises(openai.BadRequestError, match=f"{prompt} in the messages"):
        client.chat.completions.create(model=name, messages=messages, max_tokens=512 - prompt + 1)  # type: ignore[arg-type]
