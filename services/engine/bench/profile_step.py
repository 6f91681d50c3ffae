"""Where a step's GPU time goes: the kernels of one step, by total time.

    python -m services.engine.bench.profile_step --model llama-3.1-8b --batch 1 --context 1024
    python -m services.engine.bench.profile_step --model llama-3.1-8b --batch 8 --context 1024 \
        --prefill
    python -m services.engine.bench.profile_step --batch 224 --context 1100 --max-model-len 1200 \
        --quantization fp8 --kv-cache-dtype fp8

Runs one eager decode forward (+ logits) of ``--batch`` sequences at ``--context`` tokens under
the torch profiler and prints each kernel's count, total and mean time, then the sum of kernel
time against the CUDA-graph replay time of the same step: what the graph spends beyond the
kernels themselves is launch gaps and tails between dependent kernels. With ``--prefill`` the
step is ``--batch`` whole prompts of ``--context`` tokens (nothing cached, as W1's prefill steps),
timed as it runs (prefill takes no graph). The timed loop (20 steps back to back) can run its
kernels slower than the one profiled step (an H200's clocks under sustained GEMMs: 8 x 1024
prompts of Llama-3.1-8B 185.5 ms a step against 172.0 ms of kernels, while its Chrome trace
showed the GPU busy for 355.2 of 357.9 ms over two steps), so the difference is an upper bound on
host gaps: ``--trace-out`` and ``scripts/device/trace_gaps.py`` measure them.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import TypedDict

import torch

from protos.blocks import blocks_for
from protos.sampling_params import SamplingParams
from services.config import QUANTIZATION_METHODS
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine
from services.scheduling.outputs import ScheduledRequest, SchedulerOutput


class KernelRow(TypedDict):
    kernel: str
    count: int
    total_ms: float
    mean_us: float


def decode_step(engine: LLMEngine, batch: int, context: int) -> SchedulerOutput:
    """A synthetic decode-only step: ``batch`` sequences whose ``context - 1`` tokens are cached."""
    bs = engine.runner.block_size
    nblk = blocks_for(context, bs)
    if batch * nblk > engine.runner.num_blocks:
        raise SystemExit(
            f"{batch} x {context} tokens do not fit in {engine.runner.num_blocks} blocks"
        )
    gen = torch.Generator().manual_seed(0)
    out = SchedulerOutput()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for b in range(batch):
        tokens = torch.randint(0, engine.vocab_size, (context,), generator=gen).tolist()
        out.requests.append(
            ScheduledRequest(
                request_id=f"p{b}", token_ids=tokens[-1:], start_pos=context - 1,
                block_ids=list(range(b * nblk, (b + 1) * nblk)), sample=True,
                sampling_params=params, output_token_ids=[], prompt_token_ids=tokens,
            )
        )  # fmt: skip
    return out


def prefill_step(engine: LLMEngine, batch: int, context: int) -> SchedulerOutput:
    """A synthetic prefill step: ``batch`` prompts of ``context`` tokens, nothing cached, each
    sampling its first token."""
    bs = engine.runner.block_size
    nblk = blocks_for(context + 1, bs)
    if batch * nblk > engine.runner.num_blocks:
        raise SystemExit(
            f"{batch} x {context} tokens do not fit in {engine.runner.num_blocks} blocks"
        )
    gen = torch.Generator().manual_seed(0)
    out = SchedulerOutput()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for b in range(batch):
        tokens = torch.randint(0, engine.vocab_size, (context,), generator=gen).tolist()
        out.requests.append(
            ScheduledRequest(
                request_id=f"p{b}", token_ids=tokens, start_pos=0,
                block_ids=list(range(b * nblk, (b + 1) * nblk)), sample=True,
                sampling_params=params, output_token_ids=[], prompt_token_ids=tokens,
            )
        )  # fmt: skip
    return out


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--prefill", action="store_true", help="whole prompts instead of decodes")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="quantized weights (dummy, as tandem bench latency makes them)",
    )
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--trace-out",
        default=None,
        help="a Chrome trace (host and GPU) of two steps as they are timed: where the gaps are",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA GPU")
    engine = LLMEngine(
        build_config(args.model, load_format="dummy", max_model_len=args.max_model_len,
                     max_num_seqs=max(args.batch, 1),
                     # a decode step schedules one token per sequence: a budget of batch x
                     # context would size the activations of a prefill that never runs
                     max_num_batched_tokens=max(
                         8192, args.batch * (args.context if args.prefill else 1)),
                     quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    )  # fmt: skip
    runner = engine.runner
    make = prefill_step if args.prefill else decode_step
    step = make(engine, args.batch, args.context)
    for _ in range(3):
        runner.forward_logits(step)  # graph path (warm)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        runner.forward_logits(step)
    end.record()
    end.synchronize()
    graph_ms = start.elapsed_time(end) / 20
    graphs, runner.graphs = runner.graphs, None  # eager, so the profiler sees every kernel
    for _ in range(2):
        runner.forward_logits(step)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward_logits(step)
        torch.cuda.synchronize()
    runner.graphs = graphs
    if args.trace_out:  # two steps back to back, as the timed loop runs them
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as traced:
            for _ in range(2):
                runner.forward_logits(step)
            torch.cuda.synchronize()
        traced.export_chrome_trace(args.trace_out)
    kernels: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name].append(ev.device_time_total / 1e3)  # ms
    rows = sorted(
        (KernelRow(kernel=k, count=len(v), total_ms=sum(v), mean_us=1e3 * sum(v) / len(v))
         for k, v in kernels.items()),
        key=lambda r: -r["total_ms"],
    )  # fmt: skip
    busy = sum(r["total_ms"] for r in rows)
    launches = sum(r["count"] for r in rows)
    for r in rows[: args.top]:
        print(
            f"{r['total_ms']:8.3f} ms {r['count']:5d} x {r['mean_us']:8.2f} us  {r['kernel'][:90]}"
        )
    kind = "prefill" if args.prefill else "batch"
    print(
        f"{kind} {args.batch} context {args.context}: {launches} kernels, {busy:.3f} ms busy; "
        f"{'step' if args.prefill else 'graph replay'} {graph_ms:.3f} ms "
        f"(gaps and clocks {graph_ms - busy:.3f} ms)",
        flush=True,
    )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"batch": args.batch, "context": args.context, "prefill": args.prefill,
                       "graph_ms": graph_ms,
                       "kernel_busy_ms": busy, "kernels": rows}, fh, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
