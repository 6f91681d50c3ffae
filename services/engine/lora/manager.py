"""The adapters a worker serves and the device slots they take turns in.

Any number of adapters may be registered (read once, kept on the CPU); ``--max-loras`` of them
are resident in the wrapped layers' slots at a time. Before each forward, ``begin_step`` makes
the step's adapters resident (loading into free slots, else into those of adapters the step does
not use, least recently used first: the scheduler never puts more distinct adapters in a step
than there are slots) and hands the layers the step's segments: one per adapter, its rows
gathered wherever they lie. A decode step replayed from a CUDA graph takes the same plan
(``plan``) into the graph's fixed-size buffers instead (``graph_inputs``).

Under tensor parallelism every rank holds every adapter, cut as its layers are
(:class:`RankCut`): B's rows of its heads and MLP rows where the layer is column-parallel
(q, k, v, gate, up), A's columns of its input where it is row-parallel (o, down), whose partial
updates the ranks' sum adds up with the base layer's. Each rank picks its own slots: a step
names its adapters, and a slot is only this rank's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from protos.errors import ConfigError
from services.config import LoRAConfig
from services.engine.lora.adapter import LoRAAdapter, read_adapter
from services.engine.lora.layers import PEFT_MODULES, LoRABatch, apply_lora
from services.engine.rope import halves_from_pairs

ROW_PARALLEL = ("o_proj", "down_proj")  # peft modules whose input a rank holds a part of


@dataclass(frozen=True)
class RankCut:
    """A tensor-parallel rank's part of each peft module: the span of the whole layer's output
    rows (column-parallel) or input columns (row-parallel) it holds, and that whole size."""

    spans: dict[str, tuple[int, int]]
    whole: dict[str, int]

    @classmethod
    def of(cls, q: tuple[int, int], kv: tuple[int, int], mlp: tuple[int, int],
           sizes: tuple[int, int, int]) -> RankCut:  # fmt: skip
        """``q``, ``kv``: the rank's rows of the q and k / v projections (heads times head dim),
        ``mlp`` its intermediate rows; ``sizes``: the whole model's (q rows, kv rows, MLP)."""
        nq, nkv, inter = sizes
        spans = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q,
                 "gate_proj": mlp, "up_proj": mlp, "down_proj": mlp}  # fmt: skip
        whole = {"q_proj": nq, "k_proj": nkv, "v_proj": nkv, "o_proj": nq,
                 "gate_proj": inter, "up_proj": inter, "down_proj": inter}  # fmt: skip
        return cls(spans, whole)

    def whole_shape(self, module: str, local: tuple[int, int]) -> tuple[int, int]:
        """The (in, out) features of the whole layer, from the rank's."""
        k, n = local
        return (self.whole[module], n) if module in ROW_PARALLEL else (k, self.whole[module])

    def cut(
        self, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank's part of an adapter's A [r, K] and B [N, r]."""
        lo, hi = self.spans[module]
        return (a[:, lo:hi], b) if module in ROW_PARALLEL else (a, b[lo:hi])


@dataclass(frozen=True)
class StepSegments:
    """A step's adapter rows as plain data, one segment per slot the step uses (slot order): the
    segment's rows are ``rows[starts[i] : starts[i] + lens[i]]``, wherever they lie in the
    batch, so requests of one adapter share one segment and each adapter's weights are read once
    per row block."""

    rows: list[int]
    starts: list[int]
    lens: list[int]
    slots: list[int]

    def row_slots(self, total: int) -> list[int]:
        """Each of ``total`` rows' slot, -1 for a row in no segment (the fused path's index)."""
        out = [-1] * total
        for start, n, slot in zip(self.starts, self.lens, self.slots, strict=True):
            for row in self.rows[start : start + n]:
                out[row] = slot
        return out


class LoRAManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
        cut: RankCut | None = None,
    ) -> None:  # fmt: skip
        """``cut``: this rank's part of each projection (tensor parallelism)."""
        mla = getattr(getattr(model, "cfg", None), "mla", None)
        if mla is not None:  # its q and kv projections are not the wrapped layers
            raise ConfigError(
                "LoRA adapters on multi-head latent attention models (DeepSeek) are not "
                "supported yet: serve it without --enable-lora"
            )
        self.config, self.device, self.cut = config, device, cut
        self.batch = LoRABatch()
        self.layers = apply_lora(model, config.max_loras, config.max_lora_rank, self.batch,
                                 dtype, device)  # fmt: skip
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: list[str | None] = [None] * config.max_loras  # the adapter in each slot
        self._last_used = [0] * config.max_loras
        self._clock = itertools.count(1)
        self._loads = itertools.count()
        self.salts: dict[str, str] = {}  # prefix-cache salt per adapter: unique per load
        # a model whose q and k rows the loader reordered (GLM's, Cohere's rotary pairs): the
        # adapters' q and k rows (B's) are reordered alike, (head_dim, rotary_dim)
        arch = getattr(model, "cfg", None)
        self.pairs = (arch.head_dim, arch.rotary_dim) if arch and arch.rotary_interleaved else None
        for name, path in config.modules:
            self.add(name, path)

    # ---- registry ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def _shape_of(self, layer: int, module: str) -> tuple[int, int] | None:
        ours, shard = PEFT_MODULES[module]
        wrapped = self.layers.get((layer, ours))
        if wrapped is None:
            return None
        local = wrapped.shard_shape(shard)
        return self.cut.whole_shape(module, local) if self.cut is not None else local

    def add(self, name: str, path: str) -> None:
        """Register an adapter; ConfigError for a name in use or an adapter we cannot serve."""
        if name in self.adapters:
            raise ConfigError(f"LoRA adapter {name!r} is already loaded")
        # read and checked in full before the name is registered: a refusal registers nothing
        adapter = read_adapter(name, path, self.config.max_lora_rank, self._shape_of)
        if self.pairs is not None:
            for (layer, module), (a, b) in adapter.weights.items():
                if module in ("q_proj", "k_proj"):  # B [out, r]: its rows as the layer's
                    adapter.weights[layer, module] = (a, halves_from_pairs(b, *self.pairs))
        self.adapters[name] = adapter
        self.salts[name] = f"lora:{name}:{next(self._loads)}"

    def remove(self, name: str) -> None:
        """Unregister an adapter (the caller checked no request runs under it)."""
        if name not in self.adapters:
            raise KeyError(name)
        del self.adapters[name]
        del self.salts[name]
        for slot, held in enumerate(self.slots):
            if held == name:
                self.slots[slot] = None

    # ---- slots ---------------------------------------------------------------------------------
    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        # the slot names no adapter while its layers are rewritten: a copy that fails halfway
        # (out of device memory) leaves it empty, not holding one adapter's weights in some
        # layers and another's in the rest under the old adapter's name
        self.slots[slot] = None
        by_layer: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            ours, shard = PEFT_MODULES[module]
            if self.cut is not None:
                a, b = self.cut.cut(module, a, b)
            by_layer.setdefault((layer, ours), {})[shard] = (a.to(self.device), b.to(self.device))
        for key, wrapped in self.layers.items():
            wrapped.set_slot(slot, by_layer.get(key, {}))
        self.slots[slot] = adapter.name

    def _resident(self, wanted: set[str]) -> dict[str, int]:
        """Slot of each wanted adapter, loading those not resident."""
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"{len(wanted)} adapters in one step, {len(self.slots)} slots")
        slot_of = {name: s for s, name in enumerate(self.slots) if name in wanted}
        for name in sorted(wanted - set(slot_of)):
            free = [s for s, held in enumerate(self.slots) if held is None or held not in wanted]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self._last_used[s]))
            self._load(slot, self.adapters[name])
            slot_of[name] = slot
        now = next(self._clock)
        for slot in slot_of.values():
            self._last_used[slot] = now
        return slot_of

    def plan(self, runs: Sequence[tuple[str, int]]) -> StepSegments | None:
        """The step's segments, its adapters made resident; None when no row has an adapter.
        ``runs``: (adapter, tokens) of each request in the step's row order ("" = base)."""
        wanted = {name for name, _ in runs if name}
        if not wanted:
            return None
        slot_of = self._resident(wanted)
        by_slot: dict[int, list[int]] = {}
        at = 0
        for name, n in runs:
            if name:
                by_slot.setdefault(slot_of[name], []).extend(range(at, at + n))
            at += n
        segments = StepSegments([], [], [], [])
        for slot, rows in sorted(by_slot.items()):
            if rows:
                segments.starts.append(len(segments.rows))
                segments.lens.append(len(rows))
                segments.slots.append(slot)
                segments.rows.extend(rows)
        return segments if segments.rows else None

    def begin_step(self, runs: Sequence[tuple[str, int]]) -> None:
        """An eager step: its segments (``plan``) uploaded and handed to the layers."""
        plan = self.plan(runs)
        if plan is None:
            self.batch.clear()
            return
        p, g = len(plan.rows), len(plan.lens)
        row_slots = plan.row_slots(sum(n for _, n in runs))
        idx = torch.tensor([*plan.rows, *plan.starts, *plan.lens, *plan.slots, *row_slots],
                           dtype=torch.int32).to(self.device)  # [P + 3 G + T]  # fmt: skip
        seg = idx[p : p + 3 * g].view(3, g)
        self.batch.segments = (idx[:p], seg[0], seg[1], seg[2], max(plan.lens))
        self.batch.row_slots = idx[p + 3 * g :]
