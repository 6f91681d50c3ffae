"""Several --served-model-name names, as vLLM serves them: each accepted and listed, a response
naming the one asked for, the first for metrics and a request without a model."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import httpx
import pytest

from gateway.core.config import config_from_args
from services.cli import build_parser
from tests.gateway.stack import Stack

NAMES = ("smol", "smol-latest", "gpt-3.5-turbo")


@pytest.fixture(scope="module")
def stack(tokenizer_dir: str) -> Iterator[Stack]:
    s = Stack(
        tokenizer_dir, ["colocated"], served_model_name=NAMES[0], served_model_aliases=NAMES[1:]
    ).start()
    try:
        yield s
    finally:
        s.stop()


def test_every_name_is_listed_with_its_own_card(stack: Stack) -> None:
    cards = httpx.get(f"{stack.base_url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == list(NAMES)
    assert all(c["parent"] is None and c["root"] == "embedded" for c in cards)
    one = httpx.get(f"{stack.base_url}/v1/models/gpt-3.5-turbo").json()
    assert one == cards[2]


@pytest.mark.parametrize("name", [*NAMES, None])
def test_a_request_may_name_any_and_its_response_names_that_one(
    stack: Stack, name: str | None
) -> None:
    body = {"prompt": "hi", "max_tokens": 2} | ({"model": name} if name else {})
    r = httpx.post(f"{stack.base_url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == (name or NAMES[0])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(
        f"{stack.base_url}/v1/chat/completions", json=chat | ({"model": name} if name else {})
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == (name or NAMES[0])


def test_another_name_is_a_404_that_lists_every_served_name(stack: Stack) -> None:
    r = httpx.post(f"{stack.base_url}/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert all(f"`{n}`" in message for n in NAMES), message


@pytest.mark.parametrize("command", [["serve", "/m"], ["up"], ["gateway"]])
def test_the_flag_takes_several_names(command: list[str], tokenizer_dir: str) -> None:
    """vLLM's `--served-model-name a b` was "unrecognized arguments: b"."""
    args = build_parser().parse_args([*command, "--served-model-name", "a", "b", "a"])
    assert args.served_model_name == ["a", "b", "a"]
    if command == ["gateway"]:
        config = config_from_args(args, tokenizer_dir)
        assert config.model_names == ("a", "b")  # a repeated name listed once


def test_one_name_stays_one(tokenizer_dir: str) -> None:
    args = argparse.Namespace(**vars(build_parser().parse_args(["gateway"])))
    assert config_from_args(args, tokenizer_dir, "default").model_names == ("default",)
    args.served_model_name = "given"  # a namespace built by hand, with a plain string
    assert config_from_args(args, tokenizer_dir).model_names == ("given",)
