"""The wrapped projection's two paths: the fused one (the base weight moved into an extended
buffer whose tail rows are every slot's A, one GEMM then the expand) gives what shrink-then-
expand gives, leaves base-model rows exactly as the base layer makes them, and keeps no second
copy of the base weight; bases it cannot extend keep ``add_lora``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.engine.lora.layers import LoRABatch, LoRALinear, apply_lora
from services.engine.lora.manager import StepSegments
from services.engine.models.llama import Linear, LlamaForCausalLM
from tests.kernels.test_triton_lora import segments
from tests.services.engine.lora.test_manager import ARCH

SHARDS = [16, 8, 8]  # a qkv-like layer: 32 outputs in three shards
SLOT_OF_ROW = [1, -1, 0, 1, -1, 1, 0]  # two adapters interleaved with base-model rows


def wrapped(base: nn.Module, batch: LoRABatch, fuse: bool, slots: int = 2) -> LoRALinear:
    lora = LoRALinear(base, 12, SHARDS, slots, 4, batch, torch.float32, torch.device("cpu"),
                      fuse)  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    for slot in range(slots):  # rank 3 of the max 4 on shards 0 and 2: padding columns stay 0
        lora.set_slot(slot, {i: (torch.randn(3, 12, generator=gen),
                                 torch.randn(SHARDS[i], 3, generator=gen)) for i in (0, 2)})  # fmt: skip
    return lora


def step(batch: LoRABatch, slot_of_row: list[int]) -> None:
    """The step's segments and row slots, as ``LoRAManager.begin_step`` sets them."""
    batch.segments = segments(slot_of_row, torch.device("cpu"))
    rows, starts, lens, slots = (t.tolist() for t in batch.segments[:4])
    plan = StepSegments(rows, starts, lens, slots)
    batch.row_slots = torch.tensor(plan.row_slots(len(slot_of_row)), dtype=torch.int32)


@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_path_equals_shrink_then_expand(bias: bool) -> None:
    torch.manual_seed(0)
    base = Linear(12, 32, bias=bias)
    plain = Linear(12, 32, bias=bias)
    plain.load_state_dict(base.state_dict())
    x = torch.randn(len(SLOT_OF_ROW), 12)
    with torch.no_grad():
        want = base(x)
    batch = LoRABatch()
    fused, unfused = wrapped(base, batch, fuse=True), wrapped(plain, batch, fuse=False)
    assert fused.fused and not unfused.fused
    step(batch, SLOT_OF_ROW)
    with torch.no_grad():
        got, ref = fused(x), unfused(x)
    assert got.is_contiguous() and got.shape == (len(SLOT_OF_ROW), 32)
    torch.testing.assert_close(got, ref)
    base_rows = torch.tensor([s < 0 for s in SLOT_OF_ROW])
    assert torch.equal(got[base_rows], want[base_rows]), "a base-model row changed"
    assert not torch.allclose(got[~base_rows], want[~base_rows]), "no adapter row changed"
    batch.clear()
    with torch.no_grad():
        assert torch.equal(fused(x), want), "a base-only step is the base layer's own"


def test_the_base_weight_lives_in_the_extended_buffer() -> None:
    base = Linear(12, 32, bias=False)
    before = base.weight.detach().clone()
    lora = wrapped(base, LoRABatch(), fuse=True)
    ext = lora.weight_ext
    assert ext is not None and ext.shape == (32 + 2 * 3 * 4, 12)
    assert base.weight.data_ptr() == ext.data_ptr(), "the base weight was copied, not moved"
    assert lora.lora_a.data_ptr() == ext[32:].data_ptr(), "set_slot must write the GEMM's rows"
    assert torch.equal(base.weight, before) and ext[32:].abs().sum() > 0
    lora.set_slot(0, {})  # an adapter that targets nothing here: its rows zero
    assert ext[32 : 32 + 12].abs().sum() == 0 and ext[32 + 12 :].abs().sum() > 0


class Quantized(Linear):  # stands for any base that is not a plain float Linear
    pass


@pytest.mark.parametrize(
    ("base", "slots", "why"),
    [(Quantized(12, 32, bias=False), 2, "a subclass (quantized, tensor-parallel)"),
     (Linear(12, 32, bias=False).half(), 2, "another dtype than the adapters'"),
     (Linear(12, 32, bias=False), 3, "the slots' A rows (3 x 12) outnumber the base's 32")],
)  # fmt: skip
def test_bases_that_cannot_be_extended_keep_add_lora(base: nn.Module, slots: int, why: str) -> None:
    batch = LoRABatch()
    lora = wrapped(base, batch, fuse=True, slots=slots)
    assert not lora.fused and lora.weight_ext is None, why
    if base.weight.dtype == torch.float32:
        x = torch.randn(len(SLOT_OF_ROW), 12)
        step(batch, SLOT_OF_ROW)
        with torch.no_grad():
            assert lora(x).shape == (len(SLOT_OF_ROW), 32)


def test_the_switch_turns_the_fused_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def layers() -> dict[tuple[int, str], LoRALinear]:
        return apply_lora(LlamaForCausalLM(ARCH, 16), 1, 4, LoRABatch(), torch.float32,
                          torch.device("cpu"))  # fmt: skip

    assert all(lora.fused for lora in layers().values())
    monkeypatch.setenv("TANDEM_LORA_FUSED", "0")
    assert not any(lora.fused for lora in layers().values())
