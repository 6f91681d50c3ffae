"""On a GPU: once the start-up warm-up has run, serving a W1-like mix (whole prompts, chunks after
a cached prefix, decodes beside prompt chunks) meets no Triton kernel variant it has not already
built; a compilation there would land on a request (a second or more of TTFT). With a 16-bit and
an FP8 KV cache, and with FP8 weights (whose W8A8 inputs come from the fused norm and SiLU)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"), [(None, "auto"), (None, "fp8"), ("fp8", "auto")]
)
def test_serving_after_warmup_builds_no_new_kernel(
    monkeypatch: pytest.MonkeyPatch, quantization: str | None, kv_cache_dtype: str
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if "fp8" in (quantization, kv_cache_dtype) and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm89+")
    from triton import knobs

    if not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    llm = LLM("smollm2-135m", load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=64, max_num_batched_tokens=8192, num_blocks=2048,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    built: list[str] = []

    def hook(**kw: Any) -> bool:  # called on a kernel variant this process has not built yet
        constants = kw["compile"]["constants"]
        built.append(f"{kw['repr'][:60]} {constants} {kw['compile']['configs']}")
        return False  # go on and build it

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(200, 1800, (48,), generator=gen).tolist()
    prompts = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in lens]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    try:
        outs = llm.generate(prompts, params)
    finally:  # the GPU's memory back for the next engine, whatever happened
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert [len(o.outputs[0].token_ids) for o in outs] == [24] * len(prompts)
    assert built == [], f"kernels built while serving, after the warm-up: {built}"
