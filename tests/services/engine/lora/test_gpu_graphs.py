"""LoRA decode steps replayed from CUDA graphs against the same steps run eagerly, on a GPU:
one engine (SmolLM2-135M's shape, dummy weights, 4 random rank-16 adapters on every
projection), one batch mixing the adapters and the base model, greedy, generated once through
the captured graphs and once with them set aside: the same tokens, token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODEL, ADAPTERS, RANK, BATCH = "smollm2-135m", 4, 16, 16  # BATCH: a graph bucket, no padding


def _adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> tuple[Any, ...]:
    """(the LoRA config of ADAPTERS random rank-RANK adapters on MODEL's shape, BATCH random
    prompts, each row's adapter: interleaved, each adapter's rows apart, every fifth row the
    base model's). K unsplit: the split shrink adds its slices with atomics in any order,
    which would make eager differ from eager (in the last bit), let alone from a replay."""
    from kernels import triton_lora
    from services.config import LoRAConfig, ModelConfig
    from services.engine.bench.hf_peer import random_prompts
    from services.engine.bench.lora_cost import write_adapter
    from services.engine.loader import read_arch

    monkeypatch.setattr(triton_lora, "_split_k", lambda *_: 1)
    _, arch = read_arch(ModelConfig(model=MODEL, load_format="dummy"))
    names = [f"lora{i}" for i in range(ADAPTERS)]
    modules = tuple((n, str(write_adapter(tmp_path / n, arch, RANK, i))) for i, n in enumerate(names))  # fmt: skip
    lora = LoRAConfig(modules=modules, max_loras=ADAPTERS, max_lora_rank=RANK)
    prompts = random_prompts(BATCH, 40, arch.vocab_size, seed=seed)
    return lora, prompts, [([*names, ""])[i % (ADAPTERS + 1)] for i in range(BATCH)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replayed_lora_decode_equals_eager(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protos.sampling_params import SamplingParams
    from services.engine.llm import LLM

    lora, prompts, under = _adapters(tmp_path, monkeypatch, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, lora_name=n)
              for n in under]  # fmt: skip
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * BATCH
    # no prefix hits (the second run would prefill less); a short max_model_len keeps the
    # graphs' decode attention unsplit, as the eager steps' is at these contexts
    with LLM(MODEL, load_format="dummy", dtype=dtype, lora_config=lora, max_num_seqs=BATCH,
             max_model_len=128, num_blocks=256, enable_prefix_caching=False) as llm:  # fmt: skip
        runner = llm.engine.runner

        def tokens(p: list[SamplingParams]) -> list[list[int]]:
            return [r.outputs[0].token_ids for r in llm.generate(prompts, p)]

        assert runner.graphs is not None and runner.graphs.lora_graphs, "no LoRA graphs captured"
        graphed, base_graphed = tokens(params), tokens(plain)
        replays = runner.forwards.graph_lora
        graphs, runner.graphs = runner.graphs, None
        eager, base = tokens(params), tokens(plain)
        runner.graphs = graphs
    assert replays >= 16, f"only {replays} LoRA decode steps replayed a graph"
    assert runner.forwards.graph_lora == replays, "a step with graphs set aside replayed one"
    differ = [i for i, n in enumerate(under) if n and eager[i] != base[i]]
    assert len(differ) >= BATCH // 2, (
        "the adapters barely change the tokens: a test that can't fail"
    )
    parted = [i for i in range(BATCH) if graphed[i] != eager[i]]
    base_parted = [i for i in range(BATCH) if base_graphed[i] != base[i]]
    assert not parted, (f"graph-replayed LoRA decode parts from eager on rows {parted} (under "
                        f"{[under[i] for i in parted]}); base-model graphs part on {base_parted}")  # fmt: skip


def test_drafts_verified_under_adapters_on_a_gpu_give_the_tokens_without_drafts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n-gram speculative decoding with adapters on a GPU: verify steps (a request's token and
    its drafts, each row under the request's adapter) replayed from the captured graphs and run
    eagerly give the tokens of an engine without drafts, but at a float32 near-tie (a verify
    step sums in another order); drafts are kept (a random model's outputs repeat)."""
    from protos.sampling_params import SamplingParams
    from services.engine.llm import LLM
    from tests.services.engine.test_speculative import assert_same_but_near_ties

    lora, prompts, under = _adapters(tmp_path, monkeypatch, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, lora_name=n,
                             logprobs=5) for n in under]  # fmt: skip
    knobs = {"load_format": "dummy", "dtype": "float32", "lora_config": lora,
             "max_num_seqs": BATCH, "max_model_len": 128, "num_blocks": 256,
             "enable_prefix_caching": False}  # fmt: skip
    draft = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}  # fmt: skip
    with LLM(MODEL, **knobs) as plain:
        want = plain.generate(prompts, params)
    with LLM(MODEL, speculative_config=draft, **knobs) as spec:
        runner = spec.engine.runner
        assert runner.graphs is not None and runner.graphs.lora_graphs, "no LoRA graphs captured"
        graphed = spec.generate(prompts, params)
        replays, kept = runner.forwards.graph_lora, spec.engine.spec_stats.num_accepted_tokens
        graphs, runner.graphs = runner.graphs, None
        eager = spec.generate(prompts, params)
        runner.graphs = graphs
        kept_eager = spec.engine.spec_stats.num_accepted_tokens - kept
    assert replays > 0, "no verify step with adapters replayed a graph"
    assert kept > 16 and kept_eager > 16, f"drafts hardly kept ({kept}, {kept_eager})"
    assert_same_but_near_ties(graphed, want, 5, most=2)
    assert_same_but_near_ties(eager, want, 5, most=2)
