"""Prompts for `tandem bench serve`: random fixed-length prompts (as vLLM's random dataset) or a file.

- token ids: exact lengths, sent as ``prompt: [ids]`` to /v1/completions (needs no tokenizer);
- text from random vocabulary ids, decoded and re-encoded with ``--tokenizer`` until the text is
  exactly ``input_len`` tokens (or as close as the tokenizer allows);
- JSONL ``--prompts-file``: ``{"prompt": ...}`` or ``{"messages": [...]}``, optional ``max_tokens``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Without a tokenizer the vocabulary is unknown: ids in this range exist in every vocabulary of
# 30k+ tokens (Llama 2/3, Mistral, Qwen, SmolLM) and avoid the special tokens at the low end.
SAFE_ID_RANGE = (1000, 30000)
CHAT = "/v1/chat/completions"


class DatasetError(ValueError):
    """The prompts cannot be built as asked; the message says what to change."""


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str | list[int] | None  # for /v1/completions
    messages: list[dict[str, Any]] | None  # for /v1/chat/completions
    prompt_len: int  # tokens as counted here (the server's usage count wins when reported)
    output_len: int


def load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise DatasetError(f"--tokenizer {path}: no tokenizer.json there")
    return Tokenizer.from_file(str(file))


def _sampleable_ids(tokenizer: Any) -> np.ndarray:
    special = set(tokenizer.get_added_tokens_decoder())
    ids = np.array([i for i in range(tokenizer.get_vocab_size()) if i not in special])
    if len(ids) == 0:
        raise DatasetError("the tokenizer has no ordinary tokens to sample from")
    return ids


def exact_length_text(tokenizer: Any, rng: np.random.Generator, ids: np.ndarray, n: int) -> str:
    """Text that encodes to ``n`` tokens: decode random ids, re-encode, trim or top up, repeat.

    Cuts go a little deeper on each retry: a cut inside a multi-byte character re-encodes longer.
    Returns the closest text found when a tokenizer never lands exactly (rare in practice).
    """
    tokens = [int(i) for i in rng.choice(ids, n)]
    best_text, best_gap = "", math.inf
    for attempt in range(32):
        text = tokenizer.decode(tokens)
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if not got:  # e.g. a lone byte of a multi-byte character decodes to nothing
            tokens = [int(i) for i in rng.choice(ids, n)]
            continue
        if abs(len(got) - n) < best_gap:
            best_text, best_gap = text, abs(len(got) - n)
        if len(got) == n:
            break
        keep = n - attempt // 2
        if len(got) > n:
            tokens = got[:keep] if keep > 0 else [int(i) for i in rng.choice(ids, n)]
        else:
            tokens = got + [int(i) for i in rng.choice(ids, n - len(got))]
    return best_text


def _wrap(prompt: str | list[int], endpoint: str) -> tuple[Any, Any]:
    if endpoint == CHAT:
        if not isinstance(prompt, str):
            raise DatasetError(f"token-id prompts need --endpoint /v1/completions, not {CHAT}")
        return None, [{"role": "user", "content": prompt}]
    return prompt, None


def random_prompts(
    num: int, input_len: int, output_len: int, endpoint: str, seed: int, tokenizer: Any = None
) -> list[BenchPrompt]:
    rng = np.random.default_rng(seed)
    if tokenizer is None:
        if endpoint == CHAT:
            raise DatasetError(f"{CHAT} needs --tokenizer DIR (or --prompts-file) to build prompts")
        low, high = SAFE_ID_RANGE
        return [
            BenchPrompt(
                [int(i) for i in rng.integers(low, high, input_len)], None, input_len, output_len
            )
            for _ in range(num)
        ]
    ids = _sampleable_ids(tokenizer)
    out = []
    for _ in range(num):
        text = exact_length_text(tokenizer, rng, ids, input_len)
        length = len(tokenizer.encode(text, add_special_tokens=False).ids)
        prompt, messages = _wrap(text, endpoint)
        out.append(BenchPrompt(prompt, messages, length, output_len))
    return out


def _from_line(
    line: dict[str, Any], where: str, endpoint: str, output_len: int, tokenizer: Any
) -> BenchPrompt:
    out_len = int(line.get("max_tokens") or line.get("output_len") or output_len)
    if "messages" in line:
        if endpoint != CHAT:
            raise DatasetError(f"{where}: 'messages' needs --endpoint {CHAT}")
        text = " ".join(str(m.get("content", "")) for m in line["messages"])
        return BenchPrompt(None, line["messages"], _count(tokenizer, text), out_len)
    if "prompt" not in line:
        raise DatasetError(f"{where}: each line needs 'prompt' or 'messages'")
    prompt, messages = _wrap(line["prompt"], endpoint)
    length = len(prompt) if isinstance(prompt, list) else _count(tokenizer, str(line["prompt"]))
    return BenchPrompt(prompt, messages, length, out_len)


def _count(tokenizer: Any, text: str) -> int:
    if tokenizer is None:
        return len(text.split())  # a rough guess; the server's usage replaces it
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def file_prompts(
    path: str, num: int, output_len: int, endpoint: str, tokenizer: Any = None
) -> list[BenchPrompt]:
    """The first ``num`` prompts of a JSONL file (repeated when it has fewer)."""
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except ValueError as exc:
                raise DatasetError(f"{path}:{number}: not JSON ({exc})") from exc
            if not isinstance(line, dict):
                raise DatasetError(f"{path}:{number}: expected a JSON object")
            prompts.append(_from_line(line, f"{path}:{number}", endpoint, output_len, tokenizer))
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    return [prompts[i % len(prompts)] for i in range(num)]
