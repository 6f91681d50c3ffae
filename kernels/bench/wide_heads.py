"""Whole-prompt prefill attention for heads wider than 128 on a CUDA GPU: the tile sweep behind
``triton_prefill.WIDE_WHOLE_PROMPT_TILES``. DeepSeek's expanded MLA prefill
(``varlen_attention``: 192-dim queries and keys, 128-dim values, 16 heads) and Gemma 3's
256-dim heads (8 query heads over 4 KV heads), 8 x 1024 prompts, against SDPA on the same
tensors; each tile choice checked against the reference first.

    python -m kernels.bench.wide_heads [--json-out F]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

import torch

from kernels.bench.roofline import median_ms

CANDIDATES = [(128, 64, 8, 2), (128, 64, 8, 1), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2),
              (64, 32, 4, 2), (128, 64, 4, 2)]  # fmt: skip
SHAPES = {  # name: (q heads, kv heads, qk dim, v dim)
    "deepseek expanded": (16, 16, 192, 128),
    "gemma3 256": (8, 4, 256, 256),
}


def sweep(prompts: int = 8, n: int = 1024) -> list[dict[str, Any]]:
    from kernels.attention import ref_varlen_attention
    from kernels.triton_prefill import Tiles, varlen_attention

    rows: list[dict[str, Any]] = []
    dt, t = torch.bfloat16, prompts * n
    starts = torch.arange(0, t + 1, n, device="cuda", dtype=torch.int32)
    pairs = prompts * n * (n + 1) // 2
    for name, (hq, hkv, d, dv) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((t, hq, d), device="cuda", dtype=dt, generator=gen)
        k = torch.randn((t, hkv, d), device="cuda", dtype=dt, generator=gen)
        v = torch.randn((t, hkv, dv), device="cuda", dtype=dt, generator=gen)
        flops = 2.0 * (d + dv) * hq * pairs
        want = ref_varlen_attention(q[: 2 * n], k[: 2 * n], v[: 2 * n], starts[:3], d**-0.5)
        for tiles in [None, *CANDIDATES]:
            cfg = Tiles(*tiles, True) if tiles else None
            fn = functools.partial(varlen_attention, q, k, v, starts, d**-0.5, tiles=cfg)
            try:
                got = varlen_attention(q[: 2 * n], k[: 2 * n], v[: 2 * n], starts[:3], d**-0.5, tiles=cfg)  # fmt: skip
                err = float((got.float() - want.float()).abs().max())
                ms = median_ms(fn)
            except Exception as exc:  # a tile that does not compile here (shared memory)
                rows.append({"shape": name, "tiles": str(tiles), "error": str(exc)[:200]})
                continue
            rows.append({"shape": name, "tiles": str(tiles or "default"), "ms": ms,
                         "tflop_per_s": flops / ms / 1e9, "max_err": err})  # fmt: skip
        g = hq // hkv
        qs = q.view(prompts, n, hq, d).transpose(1, 2)
        ks, vs = (x.view(prompts, n, hkv, -1).transpose(1, 2) for x in (k, v))
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qs, ks, vs,
                                 is_causal=True, enable_gqa=g > 1)  # fmt: skip
        ms = median_ms(sdpa)
        rows.append(
            {"shape": name, "tiles": "torch sdpa", "ms": ms, "tflop_per_s": flops / ms / 1e9}
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = sweep()
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:18} {r['tiles']:18} error {r['error'][:80]}")
        else:
            print(f"{r['shape']:18} {r['tiles']:18} {r['ms']:8.4f} ms {r['tflop_per_s']:6.1f} TFLOP/s"
                  f"  err {r.get('max_err', 0):.3g}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
