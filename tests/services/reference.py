"""Greedy outputs of the offline engine (``services.engine.llm.LLM``), the parity reference of
the worker tests. One engine per test process, loaded on first use; results are cached."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protos.sampling_params import SamplingParams

_LLM: Any = None
_CACHE: dict[tuple[tuple[int, ...], int], Expected] = {}


@dataclass(frozen=True)
class Expected:
    token_ids: list[int]
    text: str
    finish_reason: str | None


def _llm() -> Any:
    global _LLM
    if _LLM is None:
        from services.engine.llm import LLM

        _LLM = LLM("embedded", max_model_len=1024, num_blocks=256, dtype="float32", device="cpu")
    return _LLM


def greedy_reference(prompts: list[list[int]], max_tokens: int) -> list[Expected]:
    """What the offline engine generates greedily for each prompt (cached per prompt)."""
    todo = [p for p in dict.fromkeys(map(tuple, prompts)) if (p, max_tokens) not in _CACHE]
    if todo:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        for prompt, res in zip(todo, _llm().generate([list(p) for p in todo], params), strict=True):
            out = res.outputs[0]
            _CACHE[prompt, max_tokens] = Expected(list(out.token_ids), out.text, out.finish_reason)
    return [_CACHE[tuple(p), max_tokens] for p in prompts]


_HF: Any = None


def _hf() -> Any:
    """transformers' model of the embedded GGUF, float32 on the CPU (loaded once), from its
    converted folder (tests/services/engine/test_gguf_convert.py: the tensors transformers
    reads from the GGUF itself)."""
    global _HF
    import torch

    if _HF is None:
        from transformers import AutoModelForCausalLM

        from services.model_files import prepare_model

        _HF = AutoModelForCausalLM.from_pretrained(
            prepare_model("embedded").hf_dir, dtype=torch.float32
        ).eval()
    return _HF


def transformers_logprobs(ids: list[int]) -> Any:
    """transformers' log-softmax over the embedded model's forward pass (float32, CPU): a
    [len(ids), vocab] tensor; row q is the distribution of the token at q + 1."""
    import torch

    with torch.no_grad():
        return _hf()(torch.tensor([ids])).logits[0].log_softmax(-1)


def transformers_hidden(ids: list[int]) -> Any:
    """The base model's ``last_hidden_state`` (after the final RMSNorm), [len(ids), hidden]."""
    import torch

    with torch.no_grad():
        return _hf().model(input_ids=torch.tensor([ids])).last_hidden_state[0]
