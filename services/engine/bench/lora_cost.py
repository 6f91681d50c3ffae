"""What serving LoRA adapters costs: offline throughput of a batch spread over N random adapters
against the same batch on the base model (issue 22: at most 15% at batch 64, 4 adapters of
rank 16).

Each variant runs in a process of its own (two engines of the 8B shape do not fit one GPU side
by side, and a fresh process is a clean peer), one after the other: the base model
without ``--enable-lora`` (CUDA graphs on, as users run it), then ``--enable-lora`` with the
batch's requests spread round-robin over the adapters (CUDA graphs on too: decode steps with
adapters replay the LoRA twin of each batch size's graph). The adapters are random (seeded) peft
directories on every projection of the model (q, k, v, o, gate, up, down), written into a
temporary folder; the base model may be ``--load-format dummy``. Output tokens per second over
the whole batch (prefill included), and the ratio; each variant's forwards by path (the runner's
``ForwardCounts``: steps replayed from graphs, with adapters or not, and eager steps), so the
result says whether the LoRA variant's decode steps did replay graphs (``lora_graphs``), and how
many projections took the fused path (``lora_fused``: the shrink in the base GEMM; none under
``TANDEM_LORA_FUSED=0``, which the children inherit). Prints one JSON object.

    python -m services.engine.bench.lora_cost --model llama-3.1-8b --load-format dummy \
        --dtype bfloat16 --adapters 4 --rank 16 --batch 64 --input-len 512 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from protos.sampling_params import SamplingParams
from services.config import LoRAConfig, ModelConfig
from services.engine.llm import LLM
from services.engine.loader import read_arch
from services.engine.lora.layers import PEFT_MODULES
from services.engine.model_config import ArchConfig

TARGETS = tuple(PEFT_MODULES)  # every projection LoRA serves
PREFIX = "base_model.model.model.layers"


def projection_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection LoRA targets, per layer."""
    h, q, kv, i = (arch.hidden_size, arch.num_heads * arch.head_dim,
                   arch.num_kv_heads * arch.head_dim, arch.intermediate_size)  # fmt: skip
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def write_adapter(path: Path, arch: ArchConfig, rank: int, seed: int) -> Path:
    """A random peft LoRA adapter (every projection of every layer) at ``path``."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(arch.num_layers):
        for name, (k, n) in projection_shapes(arch).items():
            module = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"{PREFIX}.{layer}.{module}.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * k**-0.5
            weights[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * rank**-0.5
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGETS), "bias": "none", "use_dora": False}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    return path


def throughput(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], warmup: list[list[int]]
) -> dict[str, Any]:
    """Output tokens per second of the batch, and the forwards it ran by path. The warm-up
    runs a whole batch of other prompts of the same shape first: a Triton kernel compiles a
    variant per launch shape (a LoRA shrink over 4 segments of 2048 rows is not one over 2 of
    512), and a compile inside the timed run would be counted as LoRA's cost; the same prompts
    would be served from the prefix cache."""
    llm.generate(warmup, params)  # every kernel variant compiled, graphs captured
    before = asdict(llm.engine.runner.forwards)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = asdict(llm.engine.runner.forwards)
    forwards = {k: after[k] - before[k] for k in after}
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall, "forwards": forwards}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``throughput`` of ``args.variant`` (base or lora), in this process."""
    knobs: dict[str, Any] = dict(dtype=args.dtype, load_format=args.load_format,
                                 max_model_len=args.input_len + args.output_len + 16,
                                 max_num_seqs=args.batch, device=args.device)  # fmt: skip
    _, arch = read_arch(ModelConfig(model=args.model, load_format=args.load_format))
    gen = torch.Generator().manual_seed(0)
    prompts, warmup = (
        [torch.randint(100, arch.vocab_size - 100, (args.input_len,), generator=gen).tolist()
         for _ in range(args.batch)]
        for _ in range(2)
    )  # fmt: skip
    if args.variant == "base":
        plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        with LLM(args.model, **knobs) as llm:
            return throughput(llm, prompts, [plain] * args.batch, warmup)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"lora{i}" for i in range(args.adapters)]
        modules = tuple((n, str(write_adapter(Path(tmp) / n, arch, args.rank, i)))
                        for i, n in enumerate(names))  # fmt: skip
        lora = LoRAConfig(modules=modules, max_loras=args.adapters, max_lora_rank=args.rank)
        params = [SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                 lora_name=names[i % len(names)]) for i in range(args.batch)]  # fmt: skip
        with LLM(args.model, lora_config=lora, **knobs) as llm:
            manager = llm.engine.runner.lora
            assert manager is not None
            # how many projections take the fused path (TANDEM_LORA_FUSED=0: none)
            wrapped = manager.layers.values()
            fused = {"fused": sum(w.fused for w in wrapped), "projections": len(wrapped)}
            return {**throughput(llm, prompts, params, warmup), "lora_fused": fused}


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    got = {}
    for variant in ("base", "lora"):
        cmd = [sys.executable, "-m", "services.engine.bench.lora_cost", *argv, "--variant", variant]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        got[variant] = json.loads(out.strip().splitlines()[-1])
    base, with_lora = got["base"]["tok_s"], got["lora"]["tok_s"]
    return {"model": args.model, "dtype": args.dtype, "batch": args.batch,
            "input_len": args.input_len, "output_len": args.output_len,
            "adapters": args.adapters, "rank": args.rank,
            "base_tok_s": round(base, 1), "lora_tok_s": round(with_lora, 1),
            "cost": round(1 - with_lora / base, 4),
            "lora_graphs": got["lora"]["forwards"]["graph_lora"] > 0,
            "lora_fused": got["lora"]["lora_fused"],
            "base_forwards": got["base"]["forwards"], "lora_forwards": got["lora"]["forwards"],
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json-out")
    ap.add_argument("--variant", choices=("base", "lora"), help=argparse.SUPPRESS)  # a child
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(measure(args)))
        return 0
    forwarded = [a for a in (sys.argv[1:] if argv is None else argv)]
    if args.json_out:  # the children print; only the parent writes the file
        i = forwarded.index("--json-out")
        del forwarded[i : i + 2]
    result = run(args, forwarded)
    text = json.dumps(result)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
