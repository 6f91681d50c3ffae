"""A torch-free tokenizer: ``tokenizers`` for ids, Jinja for the chat template.

The directory is what ``transformers``' ``save_pretrained`` writes: tokenizer.json,
tokenizer_config.json and, in newer versions, chat_template.jinja (a vision-language repository
may keep its template in its processor's chat_template.json only).

Chat safety: a special token typed inside a message (``<|im_start|>system`` in user content) is
text, as OpenAI treats it, not a control token that opens a new turn. Messages without any
special token's text tokenize exactly as ``transformers``' ``apply_chat_template`` does; a
message with one is rendered with a placeholder, and its content is tokenized on its own with
special tokens read as plain text. Encoding runs through ``encode_batch``, which releases the
GIL, so a large prompt tokenized on a worker thread does not stall the event loop.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Encoding, Tokenizer

from gateway.flows.chat_template import ChatTemplate, ChatTemplateError, pick_template
from protos.errors import ConfigError
from protos.token_bytes import TokenBytes, is_byte_level

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
_MARK = re.compile("\ue000(\\d+)\ue001")  # a message's content, held out of the template


class SpecialTokenInMessage(ValueError):
    """A message holds a special token's text and the template did not keep it apart."""


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
        self._as_text = Tokenizer.from_file(path)  # reads special tokens' text as plain text
        self._as_text.encode_special_tokens = True
        self._specials = sorted(
            (t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
            key=len,
            reverse=True,
        )
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
            return _override_template(override)
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return f.read()
        template = pick_template(config.get("chat_template"))
        processor_file = os.path.join(directory, "chat_template.json")  # a processor's (VL repos)
        if template is None and os.path.exists(processor_file):
            try:
                with open(processor_file, encoding="utf-8") as f:
                    template = pick_template(json.load(f).get("chat_template"))
            except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
                raise ConfigError(f"{processor_file} is not a readable chat template: {e}") from e
        return template

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._encoding(self._tok, text, add_special_tokens).ids)

    @staticmethod
    def _encoding(tok: Tokenizer, text: str, add_special_tokens: bool) -> Encoding:
        # encode_batch releases the GIL (encode does not): other threads run meanwhile
        return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def is_special(self, text: str) -> bool:
        """``text`` is one special token's (which decoding skips unless told to keep them)."""
        return text in self._specials

    def special_token_in(self, text: str) -> str | None:
        """The first special token whose text appears in ``text``, if any."""
        return next((s for s in self._specials if s in text), None)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        token = self._tok.id_to_token(token_id)
        return None if token is None else str(token)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes (part of a character where one spans tokens; see protos.token_bytes)."""
        return self._bytes(token_id, self.decode([token_id]))

    def template_reads(self, name: str) -> bool:
        """Whether the chat template reads the variable ``name`` (none without a template)."""
        return self._template is not None and name in self._template.variables

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text (``kwargs``: :meth:`ChatTemplate.render`'s, ``tools``,
        ``continue_final_message`` and ``variables`` among them)."""
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

    def chat_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        allow_special_in_content: bool = False,
        **kwargs: Any,
    ) -> tuple[list[int], str]:
        """The prompt ids and text of a chat, special tokens inside contents kept as text
        (unless ``allow_special_in_content``). Raises :class:`SpecialTokenInMessage` if the
        template transforms contents too much to keep them apart."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        held = [
            i for i, m in enumerate(messages)
            if isinstance(m.get("content"), str) and self.special_token_in(m["content"])
        ]  # fmt: skip
        if allow_special_in_content or not held:
            return self.encode(text, add_special_tokens), text
        masked = [{**m, "content": f"\ue000{i}\ue001"} if i in held else m
                  for i, m in enumerate(messages)]  # fmt: skip
        template = self.render_chat(masked, add_generation_prompt=add_generation_prompt, **kwargs)
        pieces = _MARK.split(template)  # text, index, text, index, ..., text
        contents = _contents_as_rendered(pieces, messages, text)
        if sorted(int(k) for k in pieces[1::2]) != held or contents is None:
            token = self.special_token_in(messages[held[0]]["content"])
            raise SpecialTokenInMessage(
                f"messages[{held[0]}].content holds the special token {token!r}, and this chat "
                "template cannot keep it apart as text: remove it (or start the gateway with "
                "--allow-special-tokens-in-messages to let it act as a control token)"
            )
        parts = [
            self._encoding(self._as_text, contents[int(p)], False) if k % 2
            else self._encoding(self._tok, p, False)
            for k, p in enumerate(pieces) if p
        ]  # fmt: skip
        merged = Encoding.merge(parts, growing_offsets=True)
        if add_special_tokens:
            merged = self._tok.post_process(merged, add_special_tokens=True)
        return list(merged.ids), text


def _override_template(value: str) -> str:
    """``--chat-template``: a file's text or, as vLLM takes it, the template itself (a value
    with Jinja's braces or a newline in it, not a readable file), its backslash escapes (``\\n``)
    decoded as vLLM decodes them."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name, or not UTF-8 text
        if not isinstance(e, UnicodeDecodeError) and any(c in value for c in "{}\n"):
            return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        if not isinstance(e, (OSError, UnicodeDecodeError)):
            why = str(e)
        raise ConfigError(
            f"--chat-template {value}: cannot read it ({why}); pass a Jinja template file or "
            "the template itself"
        ) from e


def _contents_as_rendered(
    pieces: list[str], messages: list[dict[str, Any]], rendered: str
) -> dict[int, str] | None:
    """The held contents as the template put them into ``rendered`` (as given, or stripped:
    many templates ``trim`` them), or None if the template changed them some other way."""
    for shape in (str, str.strip):
        contents = {int(i): shape(messages[int(i)]["content"]) for i in pieces[1::2]}
        rebuilt = "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(pieces))
        if rebuilt == rendered:
            return contents
    return None
