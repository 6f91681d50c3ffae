"""Whole-prompt attention for heads wider than 128 on a CUDA GPU: the tile sweeps behind
``triton_varlen.WIDE_VARLEN_TILES`` (DeepSeek's 192/128, Gemma 3's 256) and
``triton_prefill.WIDE_WHOLE_PROMPT_TILES``.
DeepSeek's expanded MLA prefill (``varlen_attention``: 192-dim queries and keys, 128-dim values,
16 heads) and Gemma 3's 256-dim heads (8 query heads over 4 KV heads), 8 x 1024 prompts, three
ways on the same tensors: the varlen kernel (``kernels.triton_varlen``, keys split 128 + 64,
values their own width), the paged prefill kernel's whole-prompt path as varlen_attention ran
it before (values zero-padded to the keys' width by a copy, a 256-wide tile), and torch SDPA.
Each tile choice is checked against the reference first.

    python -m kernels.bench.wide_heads [--json-out F]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from kernels.bench.roofline import median_ms

# the varlen kernel's (rows, keys, warps, stages); None: its default for the widths
VARLEN_CANDIDATES = [None, (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 2),
                     (128, 64, 4, 2), (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3),
                     (64, 32, 4, 2), (256, 64, 16, 2), (128, 64, 8, 1)]  # fmt: skip
# the padded prefill path's (rows, keys, warps, stages), packed; None: its whole-prompt default
CANDIDATES = [None, (128, 64, 8, 2), (128, 64, 8, 1), (64, 64, 4, 2), (64, 64, 4, 3),
              (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 4, 2)]  # fmt: skip
SHAPES = {  # name: (q heads, kv heads, qk dim, v dim)
    "deepseek expanded": (16, 16, 192, 128),
    "gemma3 256": (8, 4, 256, 256),
}


def padded_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, scale: float,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """How ``varlen_attention`` ran before ``kernels.triton_varlen``: the narrower of keys and
    values zero-padded to the other's width (a copy), the paged prefill kernel's whole-prompt
    path (no paged loop compiled) over one-block-a-token views it never reads, the padded
    output columns dropped."""
    from kernels.attention import pad_head_dim
    from kernels.triton_prefill import Tiles, prefill_attention

    dv, width = v.shape[2], max(q.shape[2], v.shape[2])
    q, k, v = (pad_head_dim(x, width) for x in (q, k, v))
    lens = starts[1:] - starts[:-1]
    tables = torch.zeros((lens.shape[0], 1), dtype=torch.int32, device=q.device)
    o = prefill_attention(
        q, k[:, None], v[:, None], tables, starts, lens, scale, k_new=k, v_new=v, no_prefix=True,
        tiles=Tiles(*tiles, True) if tiles else None,
    )  # fmt: skip
    return o[..., :dv]


def _timed(
    fn: Callable[..., torch.Tensor], want: torch.Tensor, part: tuple[torch.Tensor, ...],
    full: tuple[torch.Tensor, ...], scale: float, tiles: Any,
) -> dict[str, Any]:  # fmt: skip
    """One candidate: its error on the first prompts (``part``), then its time on ``full``; an
    ``error`` row for a tile that does not compile here (shared memory)."""
    try:
        got = fn(*part, scale, tiles=tiles)
        err = float((got.float() - want.float()).abs().max())
        ms = median_ms(functools.partial(fn, *full, scale, tiles=tiles))
    except Exception as exc:
        return {"tiles": str(tiles or "default"), "error": str(exc)[:200]}
    return {"tiles": str(tiles or "default"), "ms": ms, "max_err": err}


def sweep(prompts: int = 8, n: int = 1024, device: str = "cuda") -> list[dict[str, Any]]:
    from kernels.attention import ref_varlen_attention
    from kernels.triton_varlen import varlen_attention

    rows: list[dict[str, Any]] = []
    dt, t = torch.bfloat16, prompts * n
    starts = torch.arange(0, t + 1, n, device=device, dtype=torch.int32)
    pairs = prompts * n * (n + 1) // 2
    for name, (hq, hkv, d, dv) in SHAPES.items():
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn((t, hq, d), device=device, dtype=dt, generator=gen)
        k = torch.randn((t, hkv, d), device=device, dtype=dt, generator=gen)
        v = torch.randn((t, hkv, dv), device=device, dtype=dt, generator=gen)
        flops = 2.0 * (d + dv) * hq * pairs  # each path's useful FLOPs (not the padding's)
        part = (q[: 2 * n], k[: 2 * n], v[: 2 * n], starts[:3])
        want = ref_varlen_attention(*part, d**-0.5)
        for kernel, fn, choices in (("varlen", varlen_attention, VARLEN_CANDIDATES),
                                    ("padded prefill", padded_varlen, CANDIDATES)):  # fmt: skip
            for tiles in choices:
                row = _timed(fn, want, part, (q, k, v, starts), d**-0.5, tiles)
                if "ms" in row:
                    row["tflop_per_s"] = flops / row["ms"] / 1e9
                rows.append({"shape": name, "kernel": kernel, **row})
        g = hq // hkv
        qs = q.view(prompts, n, hq, d).transpose(1, 2)
        ks, vs = (x.view(prompts, n, hkv, -1).transpose(1, 2) for x in (k, v))
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qs, ks, vs,
                                 is_causal=True, enable_gqa=g > 1)  # fmt: skip
        ms = median_ms(sdpa)
        rows.append({"shape": name, "kernel": "torch sdpa", "tiles": "torch sdpa", "ms": ms,
                     "tflop_per_s": flops / ms / 1e9})  # fmt: skip
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
        head = f"{r['shape']:18} {r['kernel']:14} {r['tiles']:18}"
        if "error" in r:
            print(f"{head} error {r['error'][:80]}")
        else:
            print(f"{head} {r['ms']:8.4f} ms {r['tflop_per_s']:6.1f} TFLOP/s"
                  f"  err {r.get('max_err', 0):.3g}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
