"""TTFT of a repeated long prompt after its KV was pushed out of the pool (issue 24,
acceptance 3): recomputed without the host tier, copied back with it.

One engine, one GPU: prompt A (``--prompt-len`` tokens) runs once; then an unrelated prompt B of
the same length takes the pool, evicting A's blocks (into the host tier when there is one); then
A again. Each run's TTFT is the time from adding the request to its first token. Prints one JSON
object; run it once with ``--kv-offloading-size 0`` and once with a tier to compare.

    python -m services.engine.bench.host_tier_ttft --model llama-3.1-8b --load-format dummy \\
        --prompt-len 16384 --kv-offloading-size 8
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from protos.blocks import blocks_for
from protos.sampling_params import SamplingParams
from services.engine.llm import build_config
from services.engine.llm_engine import LLMEngine


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft(engine: LLMEngine, prompt: list[int], name: str) -> tuple[float, list[int]]:
    """Seconds from adding the request to its first token, and its 8 greedy tokens (a restored
    KV must give the same ones as a computed one)."""
    _sync()
    t0 = time.perf_counter()
    engine.add_request(name, prompt, SamplingParams(temperature=0.0, max_tokens=8))
    tokens: list[int] = []
    while engine.has_unfinished and not tokens:
        tokens = [t for out in engine.step() for t in out.token_ids]
    _sync()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished:
        tokens += [t for out in engine.step() for t in out.token_ids]
    return elapsed, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.prompt_len
    blocks = blocks_for(n, 16) + args.spare_blocks  # A, or B, fits; not both
    config = build_config(args.model, load_format=args.load_format, max_model_len=n + 16,
                          num_blocks=blocks, kv_offloading_gib=args.kv_offloading_size,
                          device=args.device)  # fmt: skip
    engine = LLMEngine(config)
    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.vocab_size, 32000)
    a = torch.randint(100, vocab, (n,), generator=gen).tolist()
    b = torch.randint(100, vocab, (n,), generator=gen).tolist()
    warm = torch.randint(100, vocab, (256,), generator=gen).tolist()
    ttft(engine, warm, "warm")  # kernels compiled before anything is timed
    first, a1 = ttft(engine, a, "a1")
    pushed, _ = ttft(engine, b, "b")
    again, a2 = ttft(engine, a, "a2")  # restored into B's just-evicted blocks: the hard case
    stats = engine.stats()
    return {
        "kv_offloading_gib": args.kv_offloading_size,
        "prompt_len": n,
        "pool_blocks": blocks,
        "ttft_first_s": first,
        "ttft_other_prompt_s": pushed,
        "ttft_repeat_after_push_out_s": again,
        "repeat_tokens_equal": a1 == a2,
        "prefix_cache_hits_tokens": stats.prefix_cache_hits,
        "host_tier_hits_tokens": stats.prefix_cache_host_hits,
        "offload_stored_blocks": stats.kv_offload_stored,
        "offload_restored_blocks": stats.kv_offload_restored,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--spare-blocks", type=int, default=64)
    p.add_argument("--kv-offloading-size", type=float, default=0.0, help="GiB; 0: no host tier")
    print(json.dumps(run(p.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
