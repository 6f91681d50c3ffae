import itertools

import torch

from kernels.attention import ref_paged_decode_attention, ref_prefill_attention
from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import prefill_attention, step_tiles
from tests.kernels.paged import paged_kv

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
for lens, window, cap, d, group in itertools.product(
    [[30], [23, 9]], [0, 24], [0.0, 1.5], [16, 64], [2]
):
    k, v, t = paged_kv(lens, 16, 2, d, torch.float32, gen, dev)
    qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
    T = int(qsl[-1])
    q = torch.randn((T, 2 * group, d), generator=gen).to(dev) * 3
    L = torch.tensor(lens, dtype=torch.int32, device=dev)
    a = prefill_attention(q, k, v, t, qsl, L, d**-0.5, window=window, softcap=cap)
    b = ref_prefill_attention(q, k, v, t, qsl, L, d**-0.5, window=window, softcap=cap)
    qd = torch.randn((len(lens), 2 * group, d), generator=gen).to(dev) * 3
    c = paged_decode_attention(qd, k, v, t, L, d**-0.5, window=window, softcap=cap)
    e = ref_paged_decode_attention(qd, k, v, t, L, d**-0.5, window=window, softcap=cap)
    print(
        lens,
        window,
        cap,
        d,
        "tiles",
        tuple(step_tiles(T, 2 * group, group, d, torch.float32, dev))[:5],
        "prefill max err %.2e" % (a - b).abs().max().item(),
        "decode %.2e" % (c - e).abs().max().item(),
    )
