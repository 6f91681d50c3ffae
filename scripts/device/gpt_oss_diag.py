"""Where gpt-oss's greedy tokens part from transformers on a GPU: the tiny arch-parity
checkpoint through our engine on the CPU, and on the GPU with the torch references, with the
Triton kernels eagerly and with CUDA graphs; one line per variant, a mark per prompt.
python3 scripts/device/gpt_oss_diag.py (TANDEM_TEST_TOKENIZER set) -> stdout."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import transformers

from kernels import ops
from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from tests.services.engine.test_arch_parity import (
    BESIDE,
    CONFIGS,
    NEW_TOKENS,
    PROMPT_LENS,
    _build,
    _hf_greedy,
    _prompts,
)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt_oss"
    path = Path(tempfile.mkdtemp())
    hf = _build(path, *CONFIGS[name])
    prompts = _prompts(len(name), PROMPT_LENS)
    want = [_hf_greedy(hf, p) for p in prompts]
    print("transformers", transformers.__version__)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    triton = ops._triton
    variants = {
        "cpu": ({"device": "cpu"}, triton),
        "gpu-ref-eager": ({"enforce_eager": True}, lambda name, x: None),
        "gpu-triton-eager": ({"enforce_eager": True}, triton),
        "gpu-graphs": ({}, triton),
    }
    for label, (knobs, pick) in variants.items():
        ops._triton = pick
        llm = LLM(str(path), **{**BESIDE, **knobs})
        outs = llm.generate(prompts, greedy)
        marks = []
        for out, w in zip(outs, want, strict=True):
            got = out.outputs[0].token_ids
            first = next((i for i, (a, b) in enumerate(zip(got, w, strict=True)) if a != b), -1)
            marks.append("ok" if first < 0 else f"@{first}")
        print(f"{label:18s}", " ".join(f"{n}:{m}" for n, m in zip(PROMPT_LENS, marks, strict=True)))
        llm.close()
    ops._triton = triton


if __name__ == "__main__":
    main()
