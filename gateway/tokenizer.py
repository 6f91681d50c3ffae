"""A torch-free tokenizer: ``tokenizers`` for ids, Jinja for the chat template.

The directory is what ``transformers``' ``save_pretrained`` writes: tokenizer.json,
tokenizer_config.json and, in newer versions, chat_template.jinja.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from gateway.chat_template import ChatTemplate, ChatTemplateError, pick_template
from services.config import ConfigError
from services.token_bytes import TokenBytes, is_byte_level

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


class GatewayTokenizer:
    def __init__(self, directory: str, chat_template_path: str | None = None) -> None:
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise ConfigError(f"no tokenizer.json in {directory!r}: pass --tokenizer DIR")
        self.directory = directory
        self._tok = Tokenizer.from_file(path)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        self.special_tokens: dict[str, str] = {
            key: text for key in _SPECIAL_KEYS if (text := _token_text(config.get(key))) is not None
        }
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos else None
        self._bytes = TokenBytes(self.id_to_token, is_byte_level(self._tok.decoder))
        source = self._load_template(directory, config, chat_template_path)
        self._template = ChatTemplate(source, self.special_tokens) if source else None

    @staticmethod
    def _load_template(directory: str, config: dict[str, Any], override: str | None) -> str | None:
        if override:
            with open(override, encoding="utf-8") as f:
                return f.read()
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return f.read()
        return pick_template(config.get("chat_template"))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        token = self._tok.id_to_token(token_id)
        return None if token is None else str(token)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes (part of a character where one spans tokens; see services.token_bytes)."""
        return self._bytes(token_id, self.decode([token_id]))

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self._template is None:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template; start the gateway with "
                "--chat-template FILE or use /v1/completions"
            )
        return self._template.render(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """The ids of ``transformers``' ``apply_chat_template(messages, tokenize=True)``."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _model_files() -> Any:
    try:
        return importlib.import_module("services.model_files")
    except ImportError:
        return None


def default_model_name(model: str) -> str:
    """The name served when --served-model-name is not given: the model's own name."""
    model_files = _model_files()
    try:
        return str(model_files.resolve_model(model).name) if model_files else model
    except (OSError, ValueError):
        return model


def resolve_tokenizer_dir(model: str, tokenizer: str | None) -> str:
    """``--tokenizer`` if given, else the model directory, else ``services.model_files``."""
    if tokenizer:
        return tokenizer
    if os.path.isfile(os.path.join(model, "tokenizer.json")):
        return model
    model_files = _model_files()
    if model_files is None:
        raise ConfigError(f"cannot find a tokenizer for --model {model!r}: pass --tokenizer DIR")
    try:
        return str(model_files.resolve_tokenizer_dir(model))
    except (OSError, subprocess.CalledProcessError) as e:
        raise ConfigError(f"cannot find a tokenizer for --model {model!r}: {e}") from e
