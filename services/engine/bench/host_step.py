"""A decode step's host work: ``LLMEngine.step`` with the model's forward stubbed (issue 23).

    OMP_NUM_THREADS=1 python -m services.engine.bench.host_step --batch 256 --steps 200

On a GPU the host builds a step's inputs, launches the CUDA graph and, after reading the
sampled tokens, updates the requests, checks stops, detokenizes and makes the outputs; what
of that is not hidden behind the graph's replay, the GPU waits for. Here (the CPU) the
engine's decode graphs are the uncaptured ``DecodeGraphs``, which run the forward the graph
would replay over the same buffers, and the model's forward and logits are stubs that hand
back precomputed logits at once: what remains is the host's share of a step, through the
same path a GPU decode step takes (``ModelRunner._graph_forward``), sampling included
(greedy: the graph's argmax; ``--sampled``: the sampler, temperature and top-p;
``--penalties``: repetition, frequency and presence penalties on every row). The stub's
logits are ``--vocab`` wide (a few kinds of rows, cycled, so tokens vary): the sampler's
tensor work over a real vocabulary is the device's, and on the CPU it would swamp the host's.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import pstats
import statistics
import time
from typing import Any

import torch

from protos.blocks import blocks_for
from protos.sampling_params import SamplingParams
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine

WARMUP_STEPS = 5


class _Logits:
    """The stub model's head: one of ``kinds`` precomputed [rows, vocab] tables per call."""

    def __init__(self, rows: int, vocab: int, kinds: int = 8) -> None:
        gen = torch.Generator().manual_seed(0)
        self.tables = [torch.randn(rows, vocab, generator=gen) for _ in range(kinds)]
        self.calls = 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, *] -> [n, vocab]
        self.calls += 1
        return self.tables[self.calls % len(self.tables)][: hidden.shape[0]]


def stub_model(engine: LLMEngine, vocab: int) -> None:
    """The forward returns at once ([T, 1] hidden rows); the head returns precomputed logits;
    decode steps take the graph path (uncaptured on the CPU: the same buffers, stubbed)."""
    runner = engine.runner
    model = runner.model
    rows = max(engine.config.scheduler.token_budget, engine.config.scheduler.max_num_seqs)

    def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)  # [T, 1]

    model.forward = forward  # type: ignore[method-assign]
    model.compute_logits = _Logits(rows, vocab)  # type: ignore[method-assign]
    max_blocks = blocks_for(runner.max_model_len, runner.block_size)
    runner.graphs = DecodeGraphs(
        model, runner.kv_caches, engine.config.scheduler.max_num_seqs, max_blocks, runner.device
    )


def argmax_ms(batch: int, vocab: int, repeats: int = 50) -> float:
    """What the uncaptured graph's argmax over the stub's logits costs the CPU per step."""
    logits = _Logits(batch, vocab, kinds=1).tables[0]
    t0 = time.perf_counter()
    for _ in range(repeats):
        logits.argmax(dim=-1)
    return 1e3 * (time.perf_counter() - t0) / repeats


def build_engine(batch: int, prompt_len: int, max_tokens: int, model: str) -> LLMEngine:
    context = prompt_len + max_tokens
    blocks = batch * blocks_for(context, 16) + 16
    return LLMEngine(
        build_config(model, device="cpu", max_num_seqs=batch, max_model_len=context + 16,
                     num_blocks=blocks, max_num_batched_tokens=max(batch * prompt_len, 2048))
    )  # fmt: skip


def decode_ms(engine: LLMEngine, params: SamplingParams, batch: int, prompt_len: int,
              steps: int, profile: cProfile.Profile | None = None,
              prompt_vocab: int | None = None) -> list[float]:  # fmt: skip
    """Milliseconds of each of ``steps`` decode-only steps with ``batch`` requests running;
    prompt ids below ``prompt_vocab`` (penalties index the stub's logits with them)."""
    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.vocab_size, 32000, prompt_vocab or 32000)
    for i in range(batch):
        prompt = torch.randint(100, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"host-{time.monotonic_ns()}-{i}", prompt, params)
    while engine.scheduler.waiting or engine.last_step_shape != (batch, batch):
        engine.step()  # the prefill steps
    for _ in range(WARMUP_STEPS):
        engine.step()
    times = []
    for _ in range(steps):
        if profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - t0))
        if profile is not None:
            profile.disable()
        assert engine.last_step_shape == (batch, batch), "a request finished or was preempted"
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--model", default="embedded", help="whose tokenizer and config (weights unused)"
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--vocab", type=int, default=1024, help="width of the stub's logits")
    p.add_argument("--sampled", action="store_true", help="temperature 0.8, top-p 0.95")
    p.add_argument("--penalties", action="store_true", help="repetition 1.1, frequency 0.2 and "
                   "presence 0.1 on every request (such steps run one at a time)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="cProfile's top 30, two orders")
    p.add_argument("--no-gc-freeze", action="store_true", help="measure without the worker's "
                   "gc.freeze (services.common.runtime): what it saves")  # fmt: skip
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.vocab < 2:
        p.error("--batch and --steps must be positive, --vocab at least 2")
    torch.set_num_threads(1)
    max_tokens = args.steps + WARMUP_STEPS + 8
    engine = build_engine(args.batch, args.prompt_len, max_tokens, args.model)
    stub_model(engine, args.vocab)
    if not args.no_gc_freeze:
        gc.collect()  # as a worker does once its engine is built (services.common.runtime)
        gc.freeze()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if args.sampled:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                                ignore_eos=True)  # fmt: skip
    if args.penalties:
        params = dataclasses.replace(params, repetition_penalty=1.1, frequency_penalty=0.2,
                                     presence_penalty=0.1)  # fmt: skip
    profile = cProfile.Profile() if args.profile else None
    with torch.inference_mode():
        times = decode_ms(engine, params, args.batch, args.prompt_len, args.steps, profile,
                          args.vocab if args.penalties else None)  # fmt: skip
    gc.unfreeze()  # (a caller in the same process, a test, collects as before)
    if profile is not None:
        for order in ("cumulative", "tottime"):
            pstats.Stats(profile).sort_stats(order).print_stats(30)
    median = statistics.median(times)
    kind = ("sampled" if args.sampled else "greedy") + (" with penalties" if args.penalties else "")
    print(
        f"batch {args.batch} {kind}: {median:.3f} ms/step (median of {len(times)}; mean "
        f"{statistics.fmean(times):.3f}), {1e3 * median / args.batch:.2f} us/token; of it the "
        f"stub graph's argmax (device work on a GPU) {argmax_ms(args.batch, args.vocab):.3f} ms",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
