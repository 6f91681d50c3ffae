"""Which transformers generate settings make W1's peer fastest? One variant per process (argv)."""

import json
import sys
import time

import torch

from services.engine.bench.hf_peer import build_peer, random_prompts

variant, bs = sys.argv[1], int(sys.argv[2])
hf = build_peer("llama-3.1-8b", "dummy", "auto")
prompts = random_prompts(256, 1024, hf.config.vocab_size)
kw: dict = {"max_new_tokens": 128, "min_new_tokens": 128, "do_sample": False, "pad_token_id": 0}
if variant == "static":
    kw["cache_implementation"] = "static"


def go(ps: list, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, len(ps), bs):
        ids = torch.tensor(ps[i : i + bs], device="cuda")
        extra = {} if variant == "nomask" else {"attention_mask": torch.ones_like(ids)}
        with torch.inference_mode():
            hf.generate(ids, **{**kw, "max_new_tokens": n, "min_new_tokens": n}, **extra)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


warm = go(prompts[:bs], 128 if variant.startswith("static") else 4)  # compiled: same shapes
s = go(prompts, 128)
print(
    json.dumps(
        {"variant": variant, "bs": bs, "seconds": s, "tok_s": 256 * 1152 / s, "warmup_s": warm}
    )
)
