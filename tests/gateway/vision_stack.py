"""What the `tandem up` end-to-end modules of real (tiny random) models share: a topology
started for a model directory with flags and stopped with every process it started; for the
image modules, their ``served`` fixture, the ``openai`` client and chat-message builders,
transformers' reference tokens, and the checks they all make (greedy tokens, a repeated
image from the prefix cache, image tokens counted against the context, bad images and more
than the limit a 400 that says what to fix)."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from deploy.procfs import descendants
from protos.multimodal import VisionSpec, place_images
from protos.token_bytes import TokenBytes
from services.engine.llm_engine import load_tokenizer
from tests.deploy.test_launcher import Up

TANDEM_UP = (sys.executable, "-m", "services.cli", "up")
READY = re.compile(r"^Tandem is ready: (http://\S+/v1) \(gateway \+ .+, model (.+)\)$")


@contextlib.contextmanager
def served_by_tandem(logs: Path, *flags: str) -> Iterator[tuple[str, str]]:
    """`tandem up` with ``flags`` (logs under ``logs``), ready: its base URL and model name;
    SIGTERM on leaving, then SIGKILL for anything it left."""
    up = Up(logs, *flags, program=TANDEM_UP)
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


# the Gemma 3 and Mistral 3 modules: disaggregated only (the colocated path of images is the
# engine's, tests/services/engine/models, and Qwen-VL's e2e); one topology keeps the serial
# serving unit of make test short
DISAGGREGATED_ONLY = [
    pytest.mark.slow,
    pytest.mark.parametrize("topology", ["disaggregated"], scope="module"),
]


@contextlib.contextmanager
def served_image_model(
    topology: str, model_dir: Path, logs: Path, *flags: str
) -> Iterator[tuple[str, str]]:
    """`tandem up` for an image model in ``topology`` (colocated: one worker), 512 tokens of
    context and at most 2 images a prompt, with ``flags`` besides."""
    every = ["--model", str(model_dir), "--max-model-len", "512",
             "--limit-mm-per-prompt", '{"image": 2}', *flags]  # fmt: skip
    if topology == "colocated":
        every += ["--colocated", "1"]
    with served_by_tandem(logs, *every) as url_and_name:
        yield url_and_name


def served_fixture(*flags: str) -> Any:
    """A module's ``served`` fixture: its ``model`` served in its ``topology`` by
    :func:`served_image_model` with ``flags`` besides (the base URL, the model name)."""

    @pytest.fixture(scope="module", name="served")
    def served(
        topology: str, model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[tuple[str, str]]:
        logs = tmp_path_factory.mktemp("logs")
        with served_image_model(topology, model[0], logs, *flags) as url_and_name:
            yield url_and_name

    return served


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_messages(parts: tuple[str, ...], images: list[bytes]) -> list[dict[str, Any]]:
    """One user message: each "<image>" of ``parts`` the next of ``images`` as a data URL."""
    pics = iter(images)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(next(pics))}}
        if p == "<image>"
        else {"type": "text", "text": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


def template_content(parts: tuple[str, ...]) -> list[dict[str, str]]:
    """The chat-template content of ``parts`` (an image part where "<image>" is)."""
    return [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)


def chat(
    url: str, name: str, messages: list[dict[str, Any]], logprobs: bool = False, new: int = 8
) -> Any:
    """A greedy chat completion of exactly ``new`` tokens."""
    return client(url).chat.completions.create(
        model=name, messages=messages, max_tokens=new, temperature=0,  # type: ignore[arg-type]
        logprobs=logprobs, extra_body={"ignore_eos": True},
    )  # fmt: skip


def assert_greedy_cases(
    url: str,
    name: str,
    cases: list[tuple[tuple[str, ...], list[tuple[int, int, int]]]],
    png: Callable[..., bytes],
    expected: Callable[[int, list[bytes]], list[list[int]]],
) -> None:
    """Each case's greedy tokens (as logprobs' bytes) equal ``expected(case, images)``."""
    for i, (parts, specs) in enumerate(cases):
        images = [png(s, w, h) for s, w, h in specs]
        out = chat(url, name, image_messages(parts, images), logprobs=True)
        got = [entry.bytes for entry in out.choices[0].logprobs.content]
        assert got == expected(i, images), (i, parts)


REFERENCES: dict[tuple[Path, tuple[str, ...], tuple[bytes, ...]], list[list[int]]] = {}


def reference_bytes(
    model: tuple[Path, Any],
    parts: tuple[str, ...],
    images: list[bytes],
    hf_greedy: Callable[..., list[int]],
    new: int,
) -> list[list[int]]:
    """transformers' greedy tokens on the prompt the gateway builds (the chat template's ids,
    each image's placeholder expanded), each as the bytes chat logprobs report for it
    (computed once a model, for all its topologies)."""
    key = (model[0], parts, tuple(images))
    if key not in REFERENCES:
        path, hf = model
        tok = load_tokenizer(str(path))
        ids = tok.apply_chat_template([{"role": "user", "content": template_content(parts)}],
                                      add_generation_prompt=True, return_dict=True)["input_ids"]  # fmt: skip
        spec = VisionSpec.of_model_dir(path)
        assert spec is not None
        placed, _ = place_images(ids, spec, images)
        REFERENCES[key] = as_logprob_bytes(tok, hf_greedy(hf, path, placed, images, new))
    return REFERENCES[key]


def as_logprob_bytes(tok: Any, tokens: list[int]) -> list[list[int]]:
    """``tokens`` as the bytes chat logprobs report for each."""
    as_bytes = TokenBytes.of(tok)
    return [list(as_bytes(t, tok.decode([t]))) for t in tokens]


# (an image part, what the 400 says); a module adds its own
BAD_IMAGES = [
    ({"type": "image_url", "image_url": {"url": data_url(b"\x89PNG broken")}}, "could not be decoded"),
    ({"type": "image_url", "image_url": {"url": data_url(b"hello", "text/plain")}}, "not an image"),
]  # fmt: skip
bad_images = pytest.mark.parametrize(("content", "message"), BAD_IMAGES)


def assert_bad_image_400(url: str, name: str, content: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        chat(url, name, [{"role": "user", "content": [content, {"type": "text", "text": "hi"}]}])


def assert_over_the_limit_400(url: str, name: str, png: Callable[[int], bytes]) -> None:
    """Three images where --limit-mm-per-prompt allows two."""
    images = [png(i) for i in range(3)]
    with pytest.raises(openai.BadRequestError, match="at most 2 are allowed"):
        chat(url, name, image_messages(("<image>", "<image>", "<image>"), images))


def repeated_image_chats(url: str, name: str, png: Callable[..., bytes]) -> Any:
    """One image asked about, another of its size (the same token ids), the first again: the
    first again hits the prefix cache (its image's blocks) and answers as it did; the other
    image's answer, for the module's checks of what it did not reuse."""
    text = ("<image>", "Tell me a long story about this picture, please.")
    a = chat(url, name, image_messages(text, [png(31, 112, 112)]))
    b = chat(url, name, image_messages(text, [png(32, 112, 112)]))
    again = chat(url, name, image_messages(text, [png(31, 112, 112)]))
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the image's blocks
    assert again.choices[0].message.content == a.choices[0].message.content
    return b


def image_prompt_tokens(url: str, name: str, image: bytes) -> tuple[int, int]:
    """The prompt tokens usage counts for "hi" with ``image`` and for "hi" alone; the context
    check counts the image's too (a completion that fits only without them is a 400)."""
    api = client(url)
    messages = image_messages(("<image>", "hi"), [image])
    text_only = [{"role": "user", "content": "hi"}]
    with_image = api.chat.completions.create(model=name, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    plain = api.chat.completions.create(model=name, messages=text_only, max_tokens=1)  # type: ignore[arg-type]
    prompt = with_image.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match=f"{prompt} in the messages"):
        api.chat.completions.create(model=name, messages=messages, max_tokens=512 - prompt + 1)  # type: ignore[arg-type]
    return prompt, plain.usage.prompt_tokens
