"""A simulated prefill for the KV transfer benchmark: real per-layer compute, KV written per layer.

Each of the ``num_layers`` layers runs the work of one Llama-3.1-8B decoder layer over N tokens
in bf16 on random weights (shared by all layers: the same FLOPs and bytes as distinct ones):
RMS norm, qkv 4096x6144, the layer's K and V written into the paged caches at the request's
slots, causal attention (32 query heads over 8 KV heads), o 4096x4096, gate_up 4096x28672,
SiLU-and-mul, down 14336x4096. Right after writing a layer's KV it records that layer in a
:class:`LayerReady`, which is what a streamed ``KvSender.send`` waits on. Napkin math: a layer
is 2 * N * 218 M FLOPs (0.45 TFLOP for 1024 tokens; 14.3 TFLOP for 32 layers, ~20 ms at
~700 TFLOP/s on an H200), plus attention.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from kvtransfer.ready import LayerReady


class SimPrefill:
    def __init__(
        self,
        device: torch.device,
        hidden: int = 4096,
        q_heads: int = 32,
        kv_heads: int = 8,
        head_dim: int = 128,
        intermediate: int = 14336,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.hidden, self.q_heads, self.kv_heads, self.head_dim = (
            hidden,
            q_heads,
            kv_heads,
            head_dim,
        )
        q_dim, kv_dim = q_heads * head_dim, kv_heads * head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
            return (w / rows**0.5).to(dtype)

        self.w_qkv = weight(hidden, q_dim + 2 * kv_dim)  # [4096, 6144]
        self.w_o = weight(q_dim, hidden)  # [4096, 4096]
        self.w_gate_up = weight(hidden, 2 * intermediate)  # [4096, 28672]
        self.w_down = weight(intermediate, hidden)  # [14336, 4096]
        self.device, self.dtype = device, dtype

    def tokens(self, n: int, seed: int) -> torch.Tensor:  # [n, hidden]
        gen = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(n, self.hidden, generator=gen, device=self.device, dtype=torch.float32)
        return x.to(self.dtype)

    def run(
        self,
        caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        slots: torch.Tensor,  # [N] int64: block * block_size + offset of each token
        x: torch.Tensor,  # [N, hidden]
        ready: LayerReady | None = None,
    ) -> torch.Tensor:  # [N, hidden]
        n, hd = x.shape[0], self.head_dim
        q_dim, kv_dim = self.q_heads * hd, self.kv_heads * hd
        for i, cache in enumerate(caches):
            qkv = _rms(x) @ self.w_qkv  # [N, q_dim + 2 kv_dim]
            q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=1)
            for kv, new in enumerate((k, v)):  # this layer's KV, into its blocks
                cache[kv].view(-1, self.kv_heads, hd).index_copy_(
                    0, slots, new.view(n, self.kv_heads, hd).to(cache.dtype)
                )
            if ready is not None:
                ready.record(i)
            x = x + _attention(q, k, v, self.q_heads, self.kv_heads, hd) @ self.w_o
            gate, up = (_rms(x) @ self.w_gate_up).chunk(2, dim=1)  # [N, I] each
            x = x + (F.silu(gate) * up) @ self.w_down
        return x

    def run_in_thread(
        self, caches: list[torch.Tensor], slots: torch.Tensor, x: torch.Tensor, ready: LayerReady
    ) -> threading.Thread:
        """Run on another thread (as the engine's thread would), failing ``ready`` on error."""

        def body() -> None:
            try:
                cuda = self.device.type == "cuda"
                with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
                    self.run(caches, slots, x, ready)
            except BaseException as e:
                ready.fail(f"simulated prefill failed: {e!r}")
                raise

        thread = threading.Thread(target=body, name="sim-prefill", daemon=True)
        thread.start()
        return thread


def _rms(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_heads: int, kv_heads: int, hd: int
) -> torch.Tensor:  # [N, q_heads * hd]
    n = q.shape[0]
    group = q_heads // kv_heads

    def heads(t: torch.Tensor) -> torch.Tensor:  # [N, Hkv * D] -> [1, Hq, N, D], GQA-expanded
        t = t.reshape(n, kv_heads, hd).transpose(0, 1)[:, None]  # [Hkv, 1, N, D]
        return t.expand(kv_heads, group, n, hd).reshape(q_heads, n, hd)[None]

    qh = q.reshape(n, q_heads, hd).transpose(0, 1)[None]  # [1, Hq, N, D]
    out = F.scaled_dot_product_attention(qh, heads(k), heads(v), is_causal=True)
    return out[0].transpose(0, 1).reshape(n, q_heads * hd)


def slots_of(block_ids: list[int], block_size: int, num_tokens: int, device: torch.device) -> torch.Tensor:  # fmt: skip
    """The cache slot of each of ``num_tokens`` tokens laid out over ``block_ids``."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    pos = torch.arange(num_tokens, dtype=torch.int64)
    return (ids[pos // block_size] * block_size + pos % block_size).to(device)
