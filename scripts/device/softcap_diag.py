"""The decode and prefill attention kernels against their torch references on a GPU at the tiny
Gemma 2 test shapes (head dims 16 and 64, a 24-key window or none, soft-capped at 1.5 or not),
each with the tiles the engine would choose: the largest difference of each.

    python3 scripts/device/softcap_diag.py      (on a lent GPU machine, TRITON_INTERPRET=0)
"""

from __future__ import annotations

import itertools

import torch

from kernels.attention import ref_paged_decode_attention, ref_prefill_attention
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import prefill_attention, step_tiles
from tests.kernels.paged import paged_kv


def main() -> None:
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    group = 2
    cases = itertools.product([[30], [23, 9]], [0, 24], [0.0, 1.5], [16, 64])
    for lens, window, cap, d in cases:
        k, v, tables = paged_kv(lens, 16, 2, d, torch.float32, gen, dev)
        qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
        t = int(qsl[-1])
        q = torch.randn((t, 2 * group, d), generator=gen).to(dev) * 3
        ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        knobs = {"window": window, "softcap": cap}
        got = prefill_attention(q, k, v, tables, qsl, ctx, d**-0.5, **knobs)
        want = ref_prefill_attention(q, k, v, tables, qsl, ctx, d**-0.5, **knobs)
        qd = torch.randn((len(lens), 2 * group, d), generator=gen).to(dev) * 3
        dec = paged_decode_attention(qd, k, v, tables, ctx, d**-0.5, **knobs)
        ref = ref_paged_decode_attention(qd, k, v, tables, ctx, d**-0.5, **knobs)
        tiles = tuple(step_tiles(t, 2 * group, group, d, torch.float32, dev))[:5]
        prefill_err = (got - want).abs().max().item()
        decode_err = (dec - ref).abs().max().item()
        print(f"{lens} window {window} cap {cap} d {d} tiles {tiles} "
              f"prefill {prefill_err:.2e} decode {decode_err:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
