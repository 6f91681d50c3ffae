"""The fused MoE (Triton) against the roofline and against a per-expert torch loop.

    python -m kernels.bench.moe [--tokens 1 16 256 4096] [--models M ...] [--row-budget-s 120]
        [--tune-pairs] [--json-out moe.json]

Shapes are Qwen3-30B-A3B's (H 2048, I 768, 128 experts, top-8), Mixtral-8x7B's (H 4096,
I 14336, 8 experts, top-2) and gpt-oss-20b's (H 2880, I 2880, 32 experts, top-4, with expert
biases and the clamped SwiGLU; its checkpoint's MXFP4 experts dequantized) MoE layers in bf16;
the ``-awq`` / ``-gptq`` rows are the first two with their experts held as packed int4 in groups
of 128 (as AWQ and GPTQ checkpoints load: a quarter of the weight bytes, plus their scales and
zeros, which the GB/s counts); the ``-gptq-act-order`` row Qwen3-30B-A3B's as a GPTQ act-order
checkpoint loads (each expert's columns sorted by group, x read through its permutation, a
random one per expert here; down_proj's permutation is folded into gate_up_proj's rows at load,
``Experts.finish_loading``, so the intermediate is read as it is).
Napkin math: every expert some token chose is read once (3 * H * I weights: gate, up, down), so
at batch 1 the floor is bytes / copy bandwidth: 8 x 9.4 MB = 75 MB for Qwen3-30B-A3B (~25 us at
~3 TB/s), 2 x 352 MB = 704 MB for Mixtral (~235 us), 4 x 50 MB = 199 MB for gpt-oss-20b (~66 us;
its biases add 0.03%). At large batch the layer does 6 * T * top_k * H * I FLOP (two GEMMs over
the gate/up rows, one over down): 4096 tokens are 309 GFLOP for Qwen3-30B-A3B, ~0.3 ms at
~1 PFLOP/s of dense bf16, and 815 GFLOP for gpt-oss-20b. Each row reports GB/s of expert weights
read against the copy bandwidth and TFLOP/s; the best launch of a small sweep is kept, every
launch first checked against the torch reference. Times are ``do_bench`` medians with L2 flushed
between runs, of CUDA-graph replays (the kernels' own time, which picks the best tiles and gives
GB/s and FLOP/s; a decode step replays the layer from a graph) beside eager calls (Python
launches included) and the host's microseconds per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kernels.moe import ClampedSwiGLU, Int4Scales

MODELS = {  # name -> (H, I, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "qwen3-30b-a3b-awq": (2048, 768, 128, 8),
    "mixtral-8x7b-gptq": (4096, 14336, 8, 2),
    "qwen3-30b-a3b-gptq-act-order": (2048, 768, 128, 8),
}
GPT_OSS = {"gpt-oss-20b"}  # experts with biases and the clamped SwiGLU
# experts held as packed int4 (kernels.moe.Int4Scales, as AWQ/GPTQ checkpoints load): group size
INT4 = {"qwen3-30b-a3b-awq": 128, "mixtral-8x7b-gptq": 128, "qwen3-30b-a3b-gptq-act-order": 128}
ACT_ORDER = {"qwen3-30b-a3b-gptq-act-order"}  # int4 experts with their columns' permutations
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps); None: the launcher's own choice
    None, (16, 64, 64, 4), (16, 128, 64, 4), (32, 64, 64, 4), (64, 64, 64, 4),
    (64, 128, 64, 8), (128, 128, 64, 8),
]  # fmt: skip
# the int4 rows': K tiles of one group of 128 (the widest inside a group) and of 64, narrow N
# tiles too (each weight is unpacked once per BLOCK_M rows; the grid's programs are few at T=16)
INT4_CONFIGS = [
    None, (16, 64, 128, 4), (16, 32, 128, 4), (16, 128, 128, 8), (32, 64, 128, 4),
    (32, 128, 128, 8), (64, 128, 128, 8), (16, 64, 64, 4), (64, 64, 64, 4),
]  # fmt: skip
ROW_BUDGET_S = 120.0  # a row's sweep stops past this many seconds (its first launch always runs)


@dataclass
class Case:
    """One MoE layer's inputs, routed by a random router (softmax, top-k, renormalized)."""

    x: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    weights: torch.Tensor  # [T, top_k]
    ids: torch.Tensor  # [T, top_k]
    b13: torch.Tensor | None = None  # [E, 2I]
    b2: torch.Tensor | None = None  # [E, H]
    clamp: ClampedSwiGLU | None = None
    int4: Int4Scales | None = None  # w13 and w2 packed int4 (int32 words of eight)

    def gpt_oss(self) -> dict[str, Any]:
        """The biases, the clamp and int4 groups, as fused_moe's keyword arguments."""
        extra: dict[str, Any] = {"b13": self.b13, "b2": self.b2, "clamp": self.clamp}
        return {**extra, "int4": self.int4} if self.int4 is not None else extra

    def bytes(self) -> int:
        """The experts some token chose (biases, int4 scales and zeros included), read once; x
        read and the output written."""
        touched = int(self.ids.unique().numel())
        tensors = [self.w13, self.w2, *(b for b in (self.b13, self.b2) if b is not None)]
        if self.int4 is not None:
            q = self.int4
            tensors += [q.w13_scale, q.w13_zeros, q.w2_scale, q.w2_zeros]
            tensors += [p for p in (q.w13_perm, q.w2_perm) if p is not None]
        per_expert = sum(t[0].numel() * t.element_size() for t in tensors)
        return touched * per_expert + 2 * self.x.numel() * self.x.element_size()

    def flops(self) -> float:
        _, two_i, _ = self.w13.shape
        h = self.x.shape[1]
        return 2.0 * self.ids.numel() * h * (two_i + two_i // 2)  # = 6 T top_k H I


def build(tokens: int, h: int, inter: int, experts: int, top_k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, gpt_oss: bool = False, int4_group: int | None = None, act_order: bool = False) -> Case:  # fmt: skip
    """``gpt_oss``: with O(1) biases and gpt-oss's clamp, x scaled so ~9% of the gate and up
    values pass its limit of 7. ``int4_group``: the experts quantized to packed int4 in groups
    of that many input features (as AWQ/GPTQ experts are held); ``act_order``: with a random
    permutation of each expert's H columns (int32, as act-order experts are held once
    down_proj's is folded)."""
    from kernels.moe import ClampedSwiGLU, Int4Scales, quantize_int4_experts, ref_moe_routing

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)

    weights, ids = ref_moe_routing(torch.randn((tokens, experts), generator=gen), top_k, True)
    case = Case(rand(tokens, h), rand(experts, 2 * inter, h, scale=h**-0.5),
                rand(experts, h, inter, scale=inter**-0.5), weights.to(device), ids.to(device))  # fmt: skip
    if gpt_oss:
        case.x *= 4
        case.b13, case.b2, case.clamp = rand(experts, 2 * inter), rand(experts, h), ClampedSwiGLU()
    if int4_group is not None:
        case.w13, s13, z13 = quantize_int4_experts(case.w13, int4_group)
        case.w2, s2, z2 = quantize_int4_experts(case.w2, int4_group)
        case.int4 = Int4Scales(s13, z13, s2, z2, int4_group)
    if case.int4 is not None and act_order:  # x's; down_proj's is folded at load
        p13 = torch.stack([torch.randperm(h, generator=gen) for _ in range(experts)])
        case.int4 = dataclasses.replace(case.int4, w13_perm=p13.to(device, torch.int32))
    return case


def run(case: Case, config: tuple[int, int, int, int] | None) -> torch.Tensor:
    from kernels.triton_moe import fused_moe

    return fused_moe(
        case.x, case.w13, case.w2, case.weights, case.ids, config=config, **case.gpt_oss()
    )


def check(case: Case, config: tuple[int, int, int, int] | None) -> float:
    """Relative error of one launch against the reference; raises SystemExit past 1e-2."""
    return _checked(case, run(case, config), f"fused_moe config {config}")


def _checked(case: Case, out: torch.Tensor, what: str) -> float:
    """Relative error of ``out`` against the reference; raises SystemExit past 1e-2."""
    from kernels.moe import ref_fused_moe

    ref = ref_fused_moe(case.x, case.w13, case.w2, case.weights, case.ids, **case.gpt_oss())
    ref = ref.float()
    err = ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    if not err < 1e-2:
        raise SystemExit(f"{what}: relative error {err:.2e}")
    return err


def configs_of(model: str) -> list[tuple[int, int, int, int] | None]:
    """The grouped kernels' launches a row sweeps: the int4 rows' own (K tiles inside a group)."""
    return INT4_CONFIGS if model in INT4 else CONFIGS


def bench_shape(model: str, tokens: int, copy: float, budget_s: float = ROW_BUDGET_S) -> dict[str, Any]:  # fmt: skip
    """One row: the best launch of the sweep (stopped once ``budget_s`` seconds have gone, the
    rest named in ``skipped``: a slow kernel's compilations and replays once ran past the GPU
    lease's limit on the Mixtral GPTQ row)."""
    from kernels.bench.roofline import graph_ms, host_us, median_ms
    from kernels.moe import ref_fused_moe

    h, inter, experts, top_k = MODELS[model]
    case = build(tokens, h, inter, experts, top_k, torch.device("cuda"),
                 gpt_oss=model in GPT_OSS, int4_group=INT4.get(model),
                 act_order=model in ACT_ORDER)  # fmt: skip
    best: tuple[tuple[int, int, int, int] | None, float] | None = None
    deadline = time.monotonic() + budget_s
    configs = configs_of(model)
    skipped: list[tuple[int, int, int, int] | None] = []
    for i, cfg in enumerate(configs):
        if i and time.monotonic() > deadline:
            skipped = configs[i:]
            break
        check(case, cfg)
        ms = graph_ms(functools.partial(run, case, cfg))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    assert best is not None
    fn = functools.partial(run, case, best[0])
    loop_ms = median_ms(
        functools.partial(
            ref_fused_moe, case.x, case.w13, case.w2, case.weights, case.ids, **case.gpt_oss()
        )
    )
    gbs = case.bytes() / best[1] / 1e6
    return {"model": model, "tokens": tokens, "graph_ms": best[1], "config": best[0],
            "triton_ms": median_ms(fn), "host_us": host_us(fn),
            "gb_per_s": gbs, "pct_of_copy": 100 * gbs / copy,
            "tflop_per_s": case.flops() / best[1] / 1e9, "torch_loop_ms": loop_ms,
            "skipped": skipped}  # fmt: skip


PAIR_GATE_UP = [(4, 512, 2), (8, 256, 4), (8, 512, 4), (16, 128, 2), (16, 256, 4), (16, 512, 4),
                (32, 256, 4), (32, 128, 4)]  # fmt: skip
PAIR_DOWN = [(8, 256, 2), (16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 512, 8), (64, 128, 4),
             (64, 256, 8)]  # fmt: skip
# the int4 rows' pair tiles (BLOCK_K one group of 128; wider ones are halved to it, so the float
# sweep's would repeat) and their K loops' pipeline stages, swept with the best tiles
PAIR_INT4 = [(8, 128, 2), (16, 128, 2), (16, 128, 4), (32, 128, 4), (32, 128, 8), (64, 128, 8)]
PAIR_INT4_STAGES = [2, 3, 4, 5, 6]


def tune_pairs(model: str, tokens: int, copy: float) -> dict[str, Any]:
    """The pair kernels' (kernels.triton_moe_pairs) tiles: the gate/up tile swept with the
    served down tile, then the down tile with the best gate/up one (int4 rows: their own
    tiles, then the pipeline's stages with the best two); each launch checked against the
    reference first. Beside them the grouped kernels' best launch."""
    from kernels.bench.roofline import graph_ms
    from kernels.triton_moe_pairs import DOWN_TILES, INT4_DOWN_TILES, INT4_STAGES, fused_moe_pairs

    h, inter, experts, top_k = MODELS[model]
    case = build(tokens, h, inter, experts, top_k, torch.device("cuda"),
                 gpt_oss=model in GPT_OSS, int4_group=INT4.get(model),
                 act_order=model in ACT_ORDER)  # fmt: skip
    int4 = case.int4 is not None

    def pairs_ms(tiles: Any, stages: int | None = None) -> float:
        fn = functools.partial(fused_moe_pairs, case.x, case.w13, case.w2, case.weights,
                               case.ids, tiles=tiles, stages=stages, **case.gpt_oss())  # fmt: skip
        _checked(case, fn(), f"pairs {tiles} stages {stages}")
        return graph_ms(fn)

    gate_up_tiles, down_tiles = (PAIR_INT4, PAIR_INT4) if int4 else (PAIR_GATE_UP, PAIR_DOWN)
    served_down = INT4_DOWN_TILES if int4 else DOWN_TILES
    gate_up = {str(gu): pairs_ms((gu, served_down)) for gu in gate_up_tiles}
    best_gu = min(gate_up_tiles, key=lambda gu: gate_up[str(gu)])
    down = {str(dn): pairs_ms((best_gu, dn)) for dn in down_tiles}
    best_dn = min(down_tiles, key=lambda dn: down[str(dn)])
    stages: dict[int, float] = {}
    if int4:
        stages = {s: pairs_ms((best_gu, best_dn), s) for s in PAIR_INT4_STAGES}
    best_stages = min(stages, key=stages.__getitem__) if stages else INT4_STAGES
    configs = configs_of(model)[1:]
    grouped = {str(c): graph_ms(functools.partial(run, case, c)) for c in configs}
    best = min([*down.values(), *stages.values()])
    return {"model": model, "tokens": tokens, "gate_up_sweep_ms": gate_up, "down_sweep_ms": down,
            "stages_sweep_ms": stages, "best_tiles": [best_gu, best_dn],
            "best_stages": best_stages if int4 else None, "pairs_ms": best,
            "pct_of_copy": 100 * case.bytes() / best / 1e6 / copy,
            "grouped_ms": grouped, "grouped_best_ms": min(grouped.values())}  # fmt: skip


def bench_routing(tokens: int, experts: int, top_k: int, copy: float) -> dict[str, Any]:
    """The router's softmax and top-k (kernels.triton_routing) against torch's, in graphs: the
    logits read once and the choice written are its bytes."""
    from kernels.bench.roofline import graph_ms
    from kernels.moe import ref_moe_routing
    from kernels.triton_routing import moe_routing

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((tokens, experts), generator=gen).to("cuda")
    got, want = moe_routing(logits, top_k, True), ref_moe_routing(logits, top_k, True)
    if not torch.equal(got[1], want[1]):
        raise SystemExit(f"routing T={tokens} E={experts}: experts differ from torch's")
    ms = graph_ms(functools.partial(moe_routing, logits, top_k, True))
    torch_ms = graph_ms(functools.partial(ref_moe_routing, logits, top_k, True))
    nbytes = logits.numel() * 4 + tokens * top_k * 12
    return {"tokens": tokens, "experts": experts, "top_k": top_k, "graph_ms": ms,
            "torch_graph_ms": torch_ms, "pct_of_copy": 100 * nbytes / ms / 1e6 / copy}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--json-out", default=None)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="the rows to run (default: all)")  # fmt: skip
    p.add_argument("--row-budget-s", type=float, default=ROW_BUDGET_S,
                   help="seconds a row's sweep may take before it stops (its first launch runs)")  # fmt: skip
    p.add_argument("--routing", action="store_true",
                   help="the router's softmax and top-k (Qwen3-30B-A3B's 128 experts, top-8)")  # fmt: skip
    p.add_argument(
        "--tune-pairs",
        action="store_true",
        help="sweep the pair kernels' tiles (few tokens) against the grouped kernels",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels.bench.moe needs a CUDA GPU")
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    if args.routing:
        for tokens in args.tokens:
            r = bench_routing(tokens, 128, 8, copy)
            rows.append(r)
            print(f"routing T={tokens:<5d} Triton {r['graph_ms'] * 1e3:6.1f} us "
                  f"({r['pct_of_copy']:5.1f}% of copy) | torch {r['torch_graph_ms'] * 1e3:6.1f} us",
                  flush=True)  # fmt: skip
        if args.json_out:
            write_results(args.json_out, copy, rows)
        return 0
    if args.tune_pairs:
        for model in args.models:
            for tokens in args.tokens:
                r = tune_pairs(model, tokens, copy)
                rows.append(r)
                print(f"{model:14s} T={tokens:<3d} pairs {r['pairs_ms'] * 1e3:7.1f} us "
                      f"({r['pct_of_copy']:3.0f}% of copy) {r['best_tiles']} stages "
                      f"{r['best_stages']}; grouped {r['grouped_best_ms'] * 1e3:7.1f} us",
                      flush=True)  # fmt: skip
        if args.json_out:
            write_results(args.json_out, copy, rows)
        return 0
    for model in args.models:
        for tokens in args.tokens:
            r = bench_shape(model, tokens, copy, args.row_budget_s)
            rows.append(r)
            print(
                f"{model:14s} T={tokens:<5d} Triton {r['graph_ms'] * 1e3:8.1f} us in a graph "
                f"{r['gb_per_s']:6.0f} GB/s ({r['pct_of_copy']:3.0f}% of copy) "
                f"{r['tflop_per_s']:6.1f} TFLOP/s; eager {r['triton_ms'] * 1e3:8.1f} us, host "
                f"{r['host_us']:6.1f} us | torch loop {r['torch_loop_ms'] * 1e3:8.1f} us "
                f"{r['config']}"
                + (f" ({len(r['skipped'])} launches skipped)" if r["skipped"] else ""),
                flush=True,
            )
    if args.json_out:
        write_results(args.json_out, copy, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
