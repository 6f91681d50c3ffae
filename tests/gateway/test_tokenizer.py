"""The torch-free tokenizer gives exactly transformers' ids for the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.chat_template import ChatTemplateError
from gateway.tokenizer import GatewayTokenizer, default_model_name, resolve_tokenizer_dir
from services.config import ConfigError

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke about ünïcödé and emoji 🎉\n\twith tabs"},
    ],
    [{"role": "user", "content": ""}],
]
PROMPTS = ["Hello world", " leading space", "ünïcödé 🎉\n\n  code:\tx = 1", "<|im_start|>user"]

_HF = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
convs, prompts = json.loads(sys.argv[2]), json.loads(sys.argv[3])
def ids(x):
    return list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)
out = {
    "chat": [ids(tok.apply_chat_template(c, add_generation_prompt=True)) for c in convs],
    "chat_nogen": [ids(tok.apply_chat_template(c, add_generation_prompt=False)) for c in convs],
    "prompts": [tok(p)["input_ids"] for p in prompts],
    "decoded": [tok.decode(tok(p)["input_ids"]) for p in prompts],
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hf_ids(tokenizer_dir: str) -> dict[str, list[list[int]]]:
    result = subprocess.run(
        [sys.executable, "-c", _HF, tokenizer_dir, json.dumps(CONVERSATIONS), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    data: dict[str, list[list[int]]] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def test_chat_template_ids_match_transformers(tokenizer_dir: str, hf_ids: dict) -> None:
    tok = GatewayTokenizer(tokenizer_dir)
    for conv, expected in zip(CONVERSATIONS, hf_ids["chat"], strict=True):
        assert tok.apply_chat_template(conv, add_generation_prompt=True) == expected
    for conv, expected in zip(CONVERSATIONS, hf_ids["chat_nogen"], strict=True):
        assert tok.apply_chat_template(conv, add_generation_prompt=False) == expected


def test_prompt_ids_and_decoding_match_transformers(tokenizer_dir: str, hf_ids: dict) -> None:
    tok = GatewayTokenizer(tokenizer_dir)
    assert [tok.encode(p) for p in PROMPTS] == hf_ids["prompts"]
    assert [tok.decode(tok.encode(p)) for p in PROMPTS] == hf_ids["decoded"]


def test_special_tokens_come_from_tokenizer_config(tokenizer_dir: str) -> None:
    tok = GatewayTokenizer(tokenizer_dir)
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.eos_token_id == tok.encode("<|im_end|>", add_special_tokens=False)[0]
    assert tok.vocab_size == 49152


def test_override_template_replaces_the_models(tokenizer_dir: str, tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    )
    tok = GatewayTokenizer(tokenizer_dir, chat_template_path=str(path))
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user]hi<|im_end|>"


def test_template_from_tokenizer_config_when_no_jinja_file(tokenizer_dir: str, tmp_path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(Path(tokenizer_dir, name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "<{{ messages[0].content }}>"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert GatewayTokenizer(str(tmp_path)).render_chat([{"role": "user", "content": "x"}]) == "<x>"


def test_missing_template_is_a_clear_error(tokenizer_dir: str, tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(Path(tokenizer_dir, "tokenizer.json").read_bytes())
    tok = GatewayTokenizer(str(tmp_path))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_default_model_name_comes_from_model_files() -> None:
    assert default_model_name("embedded") == "SmolLM2-135M-Instruct"
    assert default_model_name("/no/such/model") == "/no/such/model"


def test_resolve_tokenizer_dir(tokenizer_dir: str, tmp_path) -> None:
    assert resolve_tokenizer_dir("whatever", tokenizer_dir) == tokenizer_dir
    assert resolve_tokenizer_dir(tokenizer_dir, None) == tokenizer_dir
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        GatewayTokenizer(str(tmp_path))


def test_token_bytes_rebuild_a_split_character(tokenizer_dir: str) -> None:
    tok = GatewayTokenizer(tokenizer_dir)
    text = "Emojis: 😀🎉 日本"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
