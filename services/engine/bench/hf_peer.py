"""The transformers peer of W1, each batch size in its own fresh process.

A peer is measured at its best: in a process of its own, started on a GPU nothing else holds
(run after our engine in the same process, ``generate`` was 28% slower: the allocator and the
CUDA context were ours), at its best batch size. ``tandem bench offline --compare-transformers``
runs this module once per batch size before it loads its own engine; each run builds the model
(random weights from the same config for ``--load-format dummy``, the checkpoint otherwise),
generates exactly ``--output-len`` tokens for every prompt (``min_new_tokens``, greedy) and
prints one JSON line::

    python -m services.engine.bench.hf_peer --model llama-3.1-8b --load-format dummy \
        --num-prompts 256 --input-len 1024 --output-len 128 --batch-size 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PEER_TIMEOUT_S = 900.0


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The prompts of W1 (ours and the peer's are the same ids)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=gen).tolist()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_hf(hf: Any, prompts: list[list[int]], output_len: int, batch: int) -> float:
    """Seconds for transformers ``generate`` to give every prompt ``output_len`` tokens."""
    import torch

    dev = next(hf.parameters()).device
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device=dev)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                        min_new_tokens=output_len, do_sample=False, pad_token_id=0)  # fmt: skip
    _sync()
    return time.perf_counter() - t0


def _config_dir_or_file(model: str) -> tuple[Path, bool]:
    """(a config.json or an HF directory, whether real weights sit beside it)."""
    from services.model_files import is_prepared, prepare_model, resolve_model

    files = resolve_model(model)
    if files.kind == "named":
        return files.path, False
    if files.kind == "gguf" and not is_prepared(files):
        files = prepare_model(model)  # the checkpoint converted from the GGUF
    assert files.hf_dir is not None
    return files.hf_dir, True


def build_peer(model: str, load_format: str, dtype_name: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    where, has_weights = _config_dir_or_file(model)
    if where.is_file():
        raw = json.loads(where.read_text())
        cfg = AutoConfig.for_model(
            raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"}
        )
    else:
        cfg = AutoConfig.from_pretrained(where)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype_name == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, dtype_name)
    if has_weights and load_format != "dummy":
        hf = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, device_map=dev.type)
    else:  # random weights: the speed of generate does not depend on their values
        with dev:
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return hf.eval()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    hf = build_peer(args.model, args.load_format, args.dtype)
    prompts = random_prompts(args.num_prompts, args.input_len, hf.config.vocab_size)
    run_hf(hf, prompts[: min(args.batch_size, 4)], 4, args.batch_size)  # warm-up
    try:
        seconds = run_hf(hf, prompts, args.output_len, args.batch_size)
    except torch.OutOfMemoryError:
        return {"batch_size": args.batch_size, "error": "out of memory"}
    total = args.num_prompts * (args.input_len + args.output_len)
    return {
        "batch_size": args.batch_size,
        "seconds": seconds,
        "total_tok_s": total / seconds,
        "dtype": str(next(hf.parameters()).dtype),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
    }


def sweep(args: argparse.Namespace, batch_sizes: list[int]) -> dict[str, Any]:
    """One fresh process per batch size; the best one is the peer's figure."""
    runs: dict[str, Any] = {}
    for bs in batch_sizes:
        cmd = [sys.executable, "-m", "services.engine.bench.hf_peer", "--model", args.model,
               "--load-format", args.load_format, "--dtype", args.dtype,
               "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--batch-size", str(bs)]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            runs[f"bs{bs}"] = {"batch_size": bs, "error": f"timed out after {PEER_TIMEOUT_S:g} s"}
            continue
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            error = "out of memory" if "OutOfMemoryError" in done.stderr else " | ".join(tail)
            runs[f"bs{bs}"] = {"batch_size": bs, "error": error}
        else:
            runs[f"bs{bs}"] = json.loads(lines[-1])
        print(
            f"transformers generate batch {bs} (own process): {_line(runs[f'bs{bs}'])}", flush=True
        )
    timed = [r for r in runs.values() if "seconds" in r]
    best = max(timed, key=lambda r: r["total_tok_s"]) if timed else None
    return {"runs": runs, "best": best}


def _line(run: dict[str, Any]) -> str:
    if "error" in run:
        return str(run["error"])
    return f"{run['seconds']:.2f} s, {run['total_tok_s']:,.0f} total tok/s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, required=True)
    args = p.parse_args(argv)
    print(json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
