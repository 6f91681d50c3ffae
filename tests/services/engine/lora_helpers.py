"""Random peft LoRA adapters on the embedded model (or another base), and peft's merged model
as the reference."""

from __future__ import annotations

import copy
import functools
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from services.model_files import prepare_model

# (name, peft LoraConfig fields): attention-only at rank 8; MLP + q at rank 16 under rsLoRA
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "mlp-r16": {"r": 16, "lora_alpha": 32, "use_rslora": True,
                "target_modules": ["gate_proj", "up_proj", "down_proj", "q_proj"]},
}  # fmt: skip


def base_hf_dir() -> Path:
    hf_dir = prepare_model("embedded").hf_dir
    assert hf_dir is not None
    return hf_dir


@functools.lru_cache(maxsize=2)
def _loaded(path: Path) -> Any:
    """The model of one folder, loaded once (two kept: a test's base and the embedded model);
    never handed out itself, only copies of it (:func:`_base_model`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _base_model(base: Path | None = None) -> Any:
    """A fresh float32 copy of the base model: peft wraps and merges into the model it is given,
    so each caller gets its own deep copy of the one loaded per folder (loading it again costs
    ~1 s for the embedded model, a copy a fraction of that)."""
    return copy.deepcopy(_loaded(base or base_hf_dir()))


def make_adapter(path: Path, seed: int, base: Path | None = None, **lora: Any) -> Path:
    """A peft adapter with random A and B (a fresh adapter's B is zero: a no-op that no test
    could tell from the base model), saved as peft saves one. ``base``: a checkpoint folder
    (default: the embedded model)."""
    from peft import LoraConfig, get_peft_model

    model = _base_model(base)
    torch.manual_seed(seed)  # after the load: the same adapter whether the base was cached or not
    model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return path


def make_adapters(root: Path, base: Path | None = None) -> dict[str, Path]:
    """Every adapter of :data:`ADAPTERS` under ``root``, on ``base`` (default: the embedded
    model)."""
    return {
        name: make_adapter(root / name, seed, base, **cfg)
        for seed, (name, cfg) in enumerate(ADAPTERS.items())
    }


def peft_greedy(
    adapter: Path | None, prompts: list[list[int]], n: int, eos: int | Collection[int] | None,
    base: Path | None = None,
) -> list[list[int]]:  # fmt: skip
    """Greedy tokens of peft's merged model (float32; None: the base model), cut after the
    first EOS (``eos``: an id or the ids the engine stops on; None: never cut)."""
    from peft import PeftModel

    stops = [] if eos is None else [eos] if isinstance(eos, int) else sorted(eos)
    model = _base_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0)  # fmt: skip
            got = out[0, len(ids) :].tolist()
            ends = [i for i, t in enumerate(got) if t in stops]
            outs.append(got[: ends[0] + 1] if ends else got)
    return outs
