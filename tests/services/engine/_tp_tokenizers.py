"""The engine's tokenizer loaded once per set of tokenizer files, for the modules that start many
engines on tiny checkpoints holding the same test tokenizer (the architecture and
tensor-parallel parity tests).

On such a checkpoint the tokenizer is most of an engine's start: transformers parses the
49152-token vocabulary twice (a third of a second; the model itself loads in a few
milliseconds). Neither module tests the loading of a tokenizer; their engines get the very
tokenizer they would load, loaded once."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# what AutoTokenizer reads of a model directory (config.json: its model_type alone)
_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")  # fmt: skip


def _key(hf_dir: str) -> tuple[str, ...] | None:
    """The tokenizer files' digest and the config's model type; None where a directory holds
    no tokenizer.json (the embedded model's GGUF folder, a named config: loaded as usual)."""
    root = Path(hf_dir)
    if not (root / "tokenizer.json").is_file():
        return None
    digest = hashlib.sha256()
    for name in _FILES:
        f = root / name
        digest.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"-"))
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    kind = (config.get("model_type"), config.get("tokenizer_class"))
    return digest.hexdigest(), repr(kind)


@contextlib.contextmanager
def tokenizers_loaded_once() -> Iterator[None]:
    """``services.engine.llm_engine.load_tokenizer`` with each set of files loaded once (keyed
    by their bytes), for as long as the context lasts."""
    from services.engine import llm_engine

    load = llm_engine.load_tokenizer
    loaded: dict[tuple[str, ...], Any] = {}

    def once(hf_dir: str) -> Any:
        key = _key(hf_dir)
        if key is None:
            return load(hf_dir)
        if key not in loaded:
            loaded[key] = load(hf_dir)
        return loaded[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "load_tokenizer", once)
        yield
