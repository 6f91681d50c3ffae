"""``--kv-cache-dtype fp8`` on a GPU: quality on real weights and what the pool holds.

The embedded SmolLM2 in bf16 (CUDA graphs, batched), greedy 32 tokens of the 56 prompts of
``parity_study`` (fixed before measuring), once with a bf16 KV cache and once with an FP8 one:
how many continuations are equal to the end, and vLLM's near-tie check (where the two first
part, each side's token is in the other's top 5). Then the pool: at the same
``--gpu-memory-utilization``, how many blocks each cache dtype gets. Prints one JSON line.
``--compare weights`` checks online FP8 weights (``--quantization fp8``, bf16 cache) the same
way against the bf16 model instead (no pool figures).

    python -m services.engine.bench.kv_fp8 --json-out kv_fp8.json   (CUDA and the embedded GGUF)
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from services.engine.bench import parity_report as pr
from services.engine.bench.parity_study import STUDY_PROMPTS, equal_rate
from services.engine.llm import LLM


def _engine(kv_cache_dtype: str, device: str, **knobs: Any) -> LLM:
    return LLM("embedded", dtype="bfloat16", max_model_len=2048, max_num_seqs=16,
               device=device, kv_cache_dtype=kv_cache_dtype, **knobs)  # fmt: skip


def _greedy(
    kind: str, device: str, texts: list[str], quantization: str | None = None
) -> tuple[list[list[int]], list[Any]]:
    """The chat prompts' ids and their greedy continuations with top-5, in an engine of its own
    (gone, with its pool, when this returns)."""
    llm = _engine(kind, device, num_blocks=2048, quantization=quantization)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in texts]
    return prompts, pr.ours_greedy_top(llm, prompts)


def _blocks(kind: str, device: str, utilization: float) -> int:
    return _engine(kind, device, gpu_memory_utilization=utilization).engine.runner.num_blocks


def _collect() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out")
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu to try the script")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts (a dry run)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--compare", choices=("kv", "weights"), default="kv",
                    help="kv: an FP8 cache; weights: --quantization fp8 (online), bf16 cache")  # fmt: skip
    args = ap.parse_args(argv)
    pr.DEVICE = args.device
    texts = pr.PROMPTS + STUDY_PROMPTS
    if args.limit:
        texts = texts[: args.limit]
    prompts, auto = _greedy("auto", args.device, texts)
    _collect()
    weights = args.compare == "weights"
    _, fp8 = _greedy("auto" if weights else "fp8", args.device, texts, "fp8" if weights else None)
    _collect()
    quality = {
        "compare": args.compare,
        "vs_bf16_cache": equal_rate([c.token_ids for c in fp8], [c.token_ids for c in auto]),
        "near_ties": pr.near_ties(fp8, auto),
    }
    blocks: dict[str, int] = {}
    if args.device.startswith("cuda") and not weights:
        for kind in ("auto", "fp8"):
            blocks[kind] = _blocks(kind, args.device, args.gpu_memory_utilization)
            _collect()
    doc = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "prompts": len(prompts),
        "new_tokens": pr.NEW_TOKENS,
        "quality": quality,
        "blocks": blocks,
        "blocks_ratio": blocks["fp8"] / blocks["auto"] if blocks else None,
    }
    pr.emit(doc, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
