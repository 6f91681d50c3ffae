"""The model's generation_config.json as request defaults (vLLM's --generation-config)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.core.generation_defaults import load, parse_override
from protos.errors import ConfigError
from services.cli import build_parser
from tests.gateway.stack import Stack

QWEN3 = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "bos_token_id": 1, "do_sample": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _model_dir(tmp_path: Path, config: dict[str, object]) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_reads_the_sampling_keys_of_the_model_file(tmp_path: Path) -> None:
    config = {**QWEN3, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 64}
    assert load("auto", _model_dir(tmp_path, config), None) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 64,
    }  # fmt: skip


def test_a_file_without_sampling_keys_or_no_file_gives_no_defaults(tmp_path: Path) -> None:
    # the embedded model's converted generation_config.json holds only token ids
    assert load("auto", _model_dir(tmp_path, {"bos_token_id": 1, "eos_token_id": 2}), None) == {}
    assert load("auto", str(tmp_path / "missing"), None) == {}
    assert load("auto", None, None) == {}


def test_vllm_mode_ignores_the_file_but_not_the_override(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, QWEN3)
    assert load("vllm", d, None) == {}
    assert load("vllm", d, '{"top_p": 0.5}') == {"top_p": 0.5}


def test_a_directory_mode_reads_that_directory(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3}')
    assert load(str(other), _model_dir(tmp_path, QWEN3), None) == {"temperature": 0.3}
    with pytest.raises(ConfigError, match="auto, vllm or a directory"):
        load(str(tmp_path / "nope"), None, None)


def test_the_override_wins_and_adds_keys(tmp_path: Path) -> None:
    got = load("auto", _model_dir(tmp_path, QWEN3), '{"temperature": 0.2, "max_new_tokens": 9}')
    assert got == {"temperature": 0.2, "top_k": 20, "top_p": 0.95, "max_new_tokens": 9}


def test_defaults_in_use_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "gateway.core.generation_defaults"):
        load("auto", _model_dir(tmp_path, QWEN3), None)
    assert "--generation-config vllm" in caplog.text and '"top_k": 20' in caplog.text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{bad", "JSON object"),
        ("[1]", "JSON object"),
        ('{"temprature": 0.5}', "unknown key"),
        ('{"top_k": 2.5}', "integer"),
        ('{"temperature": "hot"}', "number"),
        ('{"max_new_tokens": 0}', "at least 1"),
        ('{"temperature": 2.5}', r"temperature must be in \[0, 2\]"),  # every request a 400
    ],
)
def test_bad_overrides_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_override(text)


def test_a_bad_file_value_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"generation_config\.json: temperature"):
        load("auto", _model_dir(tmp_path, {"temperature": "warm"}), None)


@pytest.mark.parametrize("command", ["gateway", "up"])
@pytest.mark.parametrize(
    "flags",
    [
        ["--override-generation-config", "{bad"],
        ["--override-generation-config", '{"seed": 1}'],
        ["--generation-config", "/no/such/dir"],
    ],
)
def test_bad_flag_values_exit_2(
    command: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, *flags])
    assert exc.value.code == 2
    assert "generation-config" in capsys.readouterr().err


def test_good_flag_values_parse(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["gateway", "--generation-config", str(tmp_path),
         "--override-generation-config", '{"top_k": 5}']
    )  # fmt: skip
    assert (args.generation_config, args.override_generation_config) == (
        str(tmp_path), '{"top_k": 5}',
    )  # fmt: skip
    assert build_parser().parse_args(["up"]).generation_config == "auto"


@pytest.fixture(scope="module")
def llama_stack(tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("llama")
    config = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05,
              "max_new_tokens": 32}  # fmt: skip
    defaults = load("auto", _model_dir(d, config), '{"min_p": 0.02}')
    stack = Stack(tokenizer_dir, ["colocated"], generation_defaults=defaults).start()
    try:
        yield stack
    finally:
        stack.stop()


def _sent(stack: Stack, path: str, body: dict[str, object]) -> object:
    samplings = stack.workers[0].records.samplings
    before = len(samplings)
    r = httpx.post(f"{stack.base_url}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert len(samplings) > before
    return samplings[-1]


def test_defaults_reach_the_worker_when_the_request_omits_them(llama_stack: Stack) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})):
        s = _sent(llama_stack, path, body)
        assert s.temperature == pytest.approx(0.6)  # type: ignore[attr-defined]
        assert s.top_p == pytest.approx(0.9)  # type: ignore[attr-defined]
        assert s.min_p == pytest.approx(0.02)  # type: ignore[attr-defined]
        assert s.repetition_penalty == pytest.approx(1.05)  # type: ignore[attr-defined]
        assert s.top_k == 0  # type: ignore[attr-defined]  # not in the file: vLLM's neutral


def test_max_new_tokens_is_chat_default_max_tokens_only(llama_stack: Stack) -> None:
    assert _sent(llama_stack, "/v1/chat/completions", CHAT).max_tokens == 32  # type: ignore[attr-defined]
    # completions keep their max_tokens default of 16, as vLLM's legacy API does
    completion = _sent(llama_stack, "/v1/completions", {"prompt": "hi"})
    assert completion.max_tokens == 16  # type: ignore[attr-defined]


def test_request_fields_win(llama_stack: Stack) -> None:
    body = {**CHAT, "temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
            "max_tokens": 5}  # fmt: skip
    s = _sent(llama_stack, "/v1/chat/completions", body)
    assert (s.temperature, s.top_p, s.min_p, s.repetition_penalty, s.max_tokens) == (  # type: ignore[attr-defined]
        0.0, 1.0, 0.0, 1.0, 5,
    )  # fmt: skip
    completion = _sent(llama_stack, "/v1/completions", {"prompt": "hi", "temperature": 1.0})
    assert completion.temperature == 1.0  # type: ignore[attr-defined]


def test_a_default_max_tokens_past_the_context_shrinks_to_fit(tokenizer_dir: str) -> None:
    stack = Stack(tokenizer_dir, ["colocated"],
                  generation_defaults={"max_new_tokens": 100_000}).start()  # fmt: skip
    try:
        s = _sent(stack, "/v1/chat/completions", CHAT)
        max_model_len = stack.workers[0].behavior.max_model_len
        assert 0 < s.max_tokens < max_model_len  # type: ignore[attr-defined]
    finally:
        stack.stop()
