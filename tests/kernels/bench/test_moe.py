"""The fused-MoE benchmark: a clear refusal without a GPU, the napkin math of its bytes and
FLOPs, and every launch it sweeps valid (checked against the reference on the CPU here)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench import moe


def test_without_a_gpu_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        moe.main([])


def test_bytes_are_the_chosen_experts_and_flops_six_per_weight_and_pair() -> None:
    case = moe.build(1, 64, 32, 16, 4, torch.device("cpu"))
    per_expert = 3 * 64 * 32 * 2  # gate, up, down in bf16
    assert case.bytes() == 4 * per_expert + 2 * 64 * 2  # one token: top_k experts read
    assert case.flops() == 6 * 4 * 64 * 32


def test_every_swept_launch_matches_the_reference(device: torch.device) -> None:
    case = moe.build(20, 64, 48, 8, 2, device, torch.float32)
    for cfg in moe.CONFIGS:
        assert moe.check(case, cfg) < 1e-5


def test_int4_rows_count_packed_bytes_and_match_the_reference(device: torch.device) -> None:
    """The -awq / -gptq rows: experts packed (4 bits a weight plus float32 scales and uint8
    zeros a row and group), the FLOPs of the float layer; launches checked as the float ones."""
    case = moe.build(1, 64, 32, 16, 4, torch.device("cpu"), int4_group=32)
    assert case.w13.dtype == torch.int32 and case.int4 is not None
    packed = 3 * 64 * 32 // 2 + (2 * 32 * 2 + 64 * 1) * 5  # nibbles; (4 + 1) B a row and group
    assert case.bytes() == 4 * packed + 2 * 64 * 2
    assert case.flops() == 6 * 4 * 64 * 32
    assert set(moe.INT4) <= set(moe.MODELS)
    case = moe.build(20, 64, 48, 8, 2, device, torch.float32, int4_group=16)
    for cfg in (None, moe.CONFIGS[1]):
        assert moe.check(case, cfg) < 1e-5


def test_int4_rows_sweep_their_own_launches(device: torch.device) -> None:
    """The int4 rows sweep K tiles of one group of 128 (halved for narrower groups), every
    launch valid; the float rows keep their sweep."""
    assert moe.configs_of("qwen3-30b-a3b") is moe.CONFIGS
    assert moe.configs_of("qwen3-30b-a3b-awq") is moe.INT4_CONFIGS
    assert any(cfg and cfg[2] == 128 for cfg in moe.INT4_CONFIGS)
    case = moe.build(6, 256, 128, 4, 2, device, torch.float32, int4_group=128)
    for cfg in moe.INT4_CONFIGS:
        assert moe.check(case, cfg) < 1e-5


def test_act_order_rows_read_through_permutations(device: torch.device) -> None:
    """The -gptq-act-order row: each expert's H columns permuted (int32, counted in its
    bytes; down_proj's is folded into gate_up_proj's rows at load, so none), every launch
    (pairs and grouped) checked against the reference, which permutes too."""
    case = moe.build(1, 64, 32, 16, 4, torch.device("cpu"), int4_group=32, act_order=True)
    assert case.int4 is not None and case.int4.w13_perm is not None
    assert case.int4.w2_perm is None
    packed = 3 * 64 * 32 // 2 + (2 * 32 * 2 + 64 * 1) * 5 + 64 * 4  # + x's permutation
    assert case.bytes() == 4 * packed + 2 * 64 * 2
    assert set(moe.INT4) >= moe.ACT_ORDER
    case = moe.build(20, 64, 48, 8, 2, device, torch.float32, int4_group=16, act_order=True)
    for cfg in (None, moe.INT4_CONFIGS[1]):
        assert moe.check(case, cfg) < 1e-5
    few = moe.build(2, 64, 48, 8, 2, device, torch.float32, int4_group=16, act_order=True)
    assert moe.check(few, None) < 1e-5  # 4 pairs on 8 experts: the pair kernels
