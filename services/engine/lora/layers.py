"""LoRA applied from outside the model: each decoder projection is wrapped in a ``LoRALinear``
that adds its tokens' adapter updates to the base layer's output.

A fused projection (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up) holds one adapter's
shards side by side: shard i's A rows at ``[i * max_rank, i * max_rank + r)`` of the stacked A
and its B block at its own output rows and those columns, zeros elsewhere, so one shrink and one
expand serve every shard. The model file knows nothing of this.

Where the base layer is a plain float ``Linear`` (no quantization, no tensor parallelism), the
shrink rides its GEMM (the fused path): the wrapper moves the base weight into the first N rows
of an extended weight [N + S R, K] whose last S R rows are every slot's stacked A (the base
layer keeps a view of its rows: no second copy), so one GEMM gives the base output and every
slot's ``x A^T``, and ``ops.expand_lora`` writes the output from it: two graph nodes a
projection where the shrink and expand of ``ops.add_lora`` took three or four (the split
shrink's zeroed buffer among them). Other bases (quantized, row-parallel) keep ``add_lora``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import ops
from services.engine.models.llama import Linear

# peft's module name -> (our layer, shard index in it)
PEFT_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}  # fmt: skip


# ops.add_lora's index arguments: seg_rows [P], seg_starts [G], seg_lens [G], seg_slots [G],
# max_seg_len
Segments = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]


@dataclass
class LoRABatch:
    """This step's segments (each adapter's rows), set before a forward and read by every
    ``LoRALinear``: the step's own tensors (eager), or views of a decode graph's fixed-size
    buffers while it is captured (``graph_inputs``); None: no row of the step has an adapter."""

    segments: Segments | None = None
    # [T] int32, each row's slot (-1: none): the same rows as ``segments``, read by the fused
    # path's expand; set and cleared with it
    row_slots: torch.Tensor | None = None

    def clear(self) -> None:
        self.segments = self.row_slots = None


def fused_enabled() -> bool:
    """``TANDEM_LORA_FUSED=0`` keeps every projection on ``add_lora`` (to compare the paths)."""
    return os.environ.get("TANDEM_LORA_FUSED", "1") != "0"


def _extendable(base: nn.Linear, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """A plain float linear layer (not a tensor-parallel subclass, which adds a collective, nor
    a quantized one) in the adapters' dtype, whose slots' A rows (``rows``) would not more than
    double its GEMM: past that the rows of slots a step leaves unused cost more than the
    launches the fused path saves (a guess, not a measurement)."""
    if type(base) not in (Linear, nn.Linear):
        return False
    w = base.weight
    return w.dtype == dtype and w.device == device and w.is_contiguous() and rows <= w.shape[0]


class LoRALinear(nn.Module):
    """``base(x)`` plus each segment's ``(x A^T) B^T``: on the fused path one GEMM over the
    extended weight then ``ops.expand_lora``, otherwise ``ops.add_lora``."""

    lora_a: torch.Tensor  # [S, shards * max_rank, K] (buffers; the extended weight's tail rows)
    lora_b: torch.Tensor  # [S, N, shards * max_rank], scaling folded in

    def __init__(
        self, base: nn.Module, in_features: int, shard_sizes: list[int], slots: int,
        max_rank: int, batch: LoRABatch, dtype: torch.dtype, device: torch.device,
        fuse: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.base, self.batch = base, batch
        self.in_features, self.shard_sizes, self.max_rank = in_features, shard_sizes, max_rank
        self.offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        r = len(shard_sizes) * max_rank
        zeros = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.weight_ext: torch.Tensor | None = None  # [N + S R, K] on the fused path
        self.bias_ext: torch.Tensor | None = None  # [N + S R], zeros past N
        if fuse and isinstance(base, nn.Linear) and _extendable(base, slots * r, dtype, device):
            a = self._extend(base, slots * r)
        else:
            a = zeros(slots, r, in_features)
        self.register_buffer("lora_a", a.view(slots, r, in_features), persistent=False)
        self.register_buffer("lora_b", zeros(slots, sum(shard_sizes), r), persistent=False)

    @property
    def fused(self) -> bool:
        """On the fused path: the shrink rides the base GEMM (``weight_ext``)."""
        return self.weight_ext is not None

    @torch.no_grad()
    def _extend(self, base: nn.Linear, extra: int) -> torch.Tensor:  # the A rows [S R, K]
        """Move the base weight (and bias) into the head of a buffer ``extra`` rows longer; the
        base layer keeps views of them, so its own forward (base-only steps) is unchanged and
        the old weight is freed."""
        w = base.weight
        n, k = w.shape
        ext = torch.zeros(n + extra, k, dtype=w.dtype, device=w.device)
        ext[:n].copy_(w)
        base.weight = nn.Parameter(ext[:n], requires_grad=w.requires_grad)
        self.weight_ext = ext
        if base.bias is not None:
            bias = torch.zeros(n + extra, dtype=base.bias.dtype, device=w.device)
            bias[:n].copy_(base.bias)
            base.bias = nn.Parameter(bias[:n], requires_grad=base.bias.requires_grad)
            self.bias_ext = bias
        return ext[n:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        segments = self.batch.segments
        if segments is None:
            return self.base(x)
        if self.weight_ext is not None:
            row_slots = self.batch.row_slots
            assert row_slots is not None, "LoRA segments set without their row_slots"
            y_ext = ops.linear(x, self.weight_ext, self.bias_ext)  # [T, N + S R]
            return ops.expand_lora(y_ext, self.lora_b, row_slots)
        base: Any = self.base
        if getattr(base, "group", None) is not None:
            # a row-parallel layer (tensor parallelism): this rank's input columns and its
            # columns of A give a partial update, summed over the ranks with the base's
            return base.reduce(
                ops.add_lora(base.partial(x), x, self.lora_a, self.lora_b, *segments)
            )
        return ops.add_lora(base(x), x, self.lora_a, self.lora_b, *segments)

    def set_slot(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds these shards (index -> (A [r, K], scaled B [n_i, r])), zeros
        for the shards the adapter does not target."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, (a, b) in shards.items():
            cols = slice(i * self.max_rank, i * self.max_rank + a.shape[0])
            rows = slice(self.offsets[i], self.offsets[i] + self.shard_sizes[i])
            self.lora_a[slot, cols] = a.to(self.lora_a.dtype)
            self.lora_b[slot, rows, cols] = b.to(self.lora_b.dtype)

    def shard_shape(self, shard: int) -> tuple[int, int]:
        """(in, out) features of one shard: the shapes an adapter's A and B must match."""
        return self.in_features, self.shard_sizes[shard]


def _shards(parent: nn.Module, attr: str, layer: nn.Module) -> list[int]:
    out = int(getattr(layer, "out_features"))  # noqa: B009
    if attr == "qkv_proj":
        nq, nkv, d = (int(getattr(parent, a)) for a in ("nq", "nkv", "d"))
        return [nq * d, nkv * d, nkv * d]
    if attr == "gate_up_proj":
        return [out // 2, out // 2]
    return [out]


def apply_lora(
    model: nn.Module, slots: int, max_rank: int, batch: LoRABatch, dtype: torch.dtype,
    device: torch.device,
) -> dict[tuple[int, str], LoRALinear]:  # fmt: skip
    """Wrap every decoder layer's projections; (layer index, our layer name) -> the wrapper.
    A Mixture-of-Experts layer's sparse MLP is not wrapped (adapters on it are refused)."""
    fuse = fused_enabled()
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    decoders: nn.ModuleList = model.model.layers  # type: ignore[union-attr,assignment]
    for i, decoder in enumerate(decoders):
        parents = (decoder.get_submodule("self_attn"), decoder.get_submodule("mlp"))
        for parent in parents:
            for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                base = getattr(parent, attr, None)
                if base is None:
                    continue
                k = int(base.in_features)
                shards = _shards(parent, attr, base)
                lora = LoRALinear(base, k, shards, slots, max_rank, batch, dtype, device, fuse)
                setattr(parent, attr, lora)
                wrapped[(i, attr)] = lora
    if device.type == "cuda":  # the fused path's moved weights: give their old blocks back
        torch.cuda.empty_cache()  # (the KV cache is planned from what is reserved)
    return wrapped
