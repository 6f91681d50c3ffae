"""Text fidelity from outside: real ``tandem prefill|decode|gateway`` processes serving a tiny
random model with a byte-level BPE tokenizer (``tests.tokenizer_zoo``), driven by the official
openai client. What the completions return, whole and streamed, is ``tokenizer.decode`` of the
tokens they generated, also where a character is split over tokens: at the first token (which
the prefill worker makes and the decode worker goes on from) and at the end of the output, where
the bytes of a character the output only begins are dropped (no U+FFFD), as vLLM drops them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests import tokenizer_zoo
from tests.gateway.test_e2e_real import wait_healthy
from tests.services.procs import Fleet, fleet

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
SPLIT = "猫狗"  # characters the tokenizer never saw: each is spelt by tokens of its bytes


@pytest.fixture(scope="module")
def served(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    tok = tokenizer_zoo.byte_level_tokenizer("qwen2")
    model = tokenizer_zoo.tiny_model(tmp_path_factory.mktemp("byte_level"), tok, "qwen2")
    prefill = fleet.start("prefill", "--model", str(model), name="fidelity-prefill")
    decode = fleet.start("decode", "--model", str(model), name="fidelity-decode")
    gateway = fleet.gateway(prefill=[prefill], decode=[decode], args=["--model", str(model)])
    wait_healthy(gateway, 2)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    yield client, tok
    for proc in (gateway, prefill, decode):
        proc.kill()


def _complete(client: Any, **kw: Any) -> tuple[str, list[int], Any, str]:
    """The whole text, its token ids, the usage and the streamed text joined."""
    model = client.models.list().data[0].id
    extra = {**kw.pop("extra_body", {})}
    whole = client.completions.create(
        model=model, temperature=0, logprobs=0,
        extra_body={**extra, "return_tokens_as_token_ids": True}, **kw,
    )  # fmt: skip
    choice = whole.choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    chunks = client.completions.create(
        model=model, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body=extra, **kw,
    )  # fmt: skip
    streamed, usage = "", None
    for chunk in chunks:
        streamed += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert usage == whole.usage
    return choice.text, ids, whole.usage, streamed


def test_a_character_split_over_tokens_reads_as_decode_gives_it(served: tuple) -> None:
    """A grammar makes the output "猫狗", whose first token holds only part of "猫": the
    prefill worker does not send that part as U+FFFD (the decode worker spells "猫" once its
    last byte comes); cut after one token, the output is empty, as vLLM's: not the U+FFFD
    decode gives for the bytes."""
    client, tok = served
    assert not any("猫" in tok.convert_tokens_to_string([t]) for t in tok.get_vocab())
    regex = {"structured_outputs": {"regex": SPLIT}}
    for max_tokens in (1, 2, 8):
        text, ids, usage, streamed = _complete(
            client, prompt="Hello", max_tokens=max_tokens, extra_body=regex
        )
        expected = tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        assert text == streamed == expected, max_tokens
        assert usage.completion_tokens == len(ids)
        assert usage.prompt_tokens == len(tok("Hello")["input_ids"])
    assert text == SPLIT
    text, ids, _, streamed = _complete(client, prompt="Hello", max_tokens=1, extra_body=regex)
    assert text == streamed == "" and tok.decode(ids) == "\ufffd"
    chats = {n: _chat(client, max_tokens=n, extra_body=regex) for n in (1, 2, 3, 4, 8)}
    for whole, streamed in chats.values():  # a chat's content alike, cut anywhere in "猫狗"
        assert whole == streamed and SPLIT.startswith(whole), chats
    assert chats[1][0] == "" and chats[8][0] == SPLIT, chats


def _chat(client: Any, **kw: Any) -> tuple[str, str]:
    """A chat completion's content, whole and streamed."""
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    chunks = client.chat.completions.create(
        model=model, messages=messages, temperature=0, stream=True, **kw
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return whole.choices[0].message.content or "", streamed


def test_random_outputs_read_as_decode_gives_them(served: tuple) -> None:
    """The tiny random model's greedy outputs (bytes of split characters, stray bytes, spaces,
    newlines), whole and streamed, equal ``tokenizer.decode`` of their tokens, less the U+FFFD
    of a character they end inside."""
    client, tok = served
    for prompt in ("Hello 东京 😀 world", "  two\nlines", "北京是中国的首都。", "👍🏽❤️"):
        for max_tokens in (1, 5, 24):
            text, ids, usage, streamed = _complete(client, prompt=prompt, max_tokens=max_tokens)
            expected = tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
            assert text == streamed == expected, (prompt, max_tokens, ids)
            assert usage.completion_tokens == len(ids)
