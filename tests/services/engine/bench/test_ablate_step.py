"""Each kind the ablation can skip replaces that kernel's entry point, and only it."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from services.engine.bench import ablate_step


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import triton_decode

    for name in ("silu_and_mul", "rms_norm", "rotary_write_kv"):
        monkeypatch.setattr(ops, name, getattr(ops, name))
    monkeypatch.setattr(triton_decode, "_merge_splits_kernel", triton_decode._merge_splits_kernel)


def test_each_skip_replaces_its_kernel(restored: None) -> None:
    from kernels import triton_decode

    before = {n: getattr(ops, n) for n in ("silu_and_mul", "rms_norm", "rotary_write_kv")}
    ablate_step.SKIPS["none"]()
    assert {n: getattr(ops, n) for n in before} == before
    x = torch.arange(8.0).view(1, 8)
    ablate_step.SKIPS["silu"]()
    assert torch.equal(ops.silu_and_mul(x), x[:, :4])
    ablate_step.SKIPS["norm"]()
    r = torch.ones(1, 8)
    out, res = ops.rms_norm(x, torch.ones(8), 1e-5, r)
    assert out is x and res is r
    ablate_step.SKIPS["rotary"]()
    q = torch.randn(1, 2, 4)
    assert ops.rotary_write_kv(torch.zeros(1), q, q, q, x, q, q, x) is q
    ablate_step.SKIPS["merge"]()
    assert triton_decode._merge_splits_kernel[(1, 1)](1, 2, out=3) is None
    assert ops.rms_norm is not before["rms_norm"]  # the others stayed replaced


def test_an_unknown_kind_is_a_clean_cli_error() -> None:
    with pytest.raises(SystemExit) as exc:
        ablate_step.main(["--skip", "attention"])
    assert exc.value.code == 2
