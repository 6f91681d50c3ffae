"""Programmatic dependent launch: off where it cannot run, and the same bits as plain launches
where it does (a batch-1 decode layer's kernel chain replayed from a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_common
from kernels.triton_common import pdl


def test_off_on_the_cpu_and_under_the_interpreter() -> None:
    assert pdl(torch.device("cpu"), 1) == {"USE_PDL": False}


def _layer_chain(x: torch.Tensor, res: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """norm -> qkv GEMV -> rotary + KV write -> decode attention (split) -> o GEMV -> norm ->
    gate_up GEMV -> SiLU -> down GEMV, twice, as batch-1 decode layers launch them."""
    from kernels.triton_attention import paged_decode_attention, rotary_write_kv
    from kernels.triton_gemv import gemv
    from kernels.triton_layers import rms_norm, silu_and_mul

    hq, hkv, d = 8, 2, 64
    pos = w["slot"]  # the token's position: its slot in a table of consecutive blocks
    for _ in range(2):
        h, res = rms_norm(x, w["n1"], 1e-5, res)
        qkv = gemv(h, w["qkv"])
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = rotary_write_kv(
            pos, q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), w["cs"],
            w["kc"], w["vc"], w["slot"],
        )  # fmt: skip
        o = paged_decode_attention(
            q, w["kc"], w["vc"], w["bt"], w["ctx"], d**-0.5, num_splits=4
        ).view(1, hq * d)
        x = gemv(o, w["o"])
        h, res = rms_norm(x, w["n2"], 1e-5, res)
        x = gemv(silu_and_mul(gemv(h, w["gu"])), w["down"])
    return x + res


@pytest.mark.gpu
def test_a_graph_of_pdl_launches_gives_the_plain_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16) * 0.1

    hidden, inter, hq, hkv, d, bs, ctx = 512, 1024, 8, 2, 64, 16, 300
    w: dict[str, torch.Tensor] = {
        "n1": rand(hidden) + 1, "n2": rand(hidden) + 1, "qkv": rand((hq + 2 * hkv) * d, hidden),
        "o": rand(hidden, hq * d), "gu": rand(2 * inter, hidden), "down": rand(hidden, inter),
        "cs": torch.randn(1024, d, generator=g, device=dev),
        "bt": torch.arange(32, device=dev, dtype=torch.int32).view(1, 32),
        "ctx": torch.tensor([ctx], device=dev, dtype=torch.int32),
        "slot": torch.tensor([ctx - 1], device=dev),
    }  # fmt: skip
    kv = rand(2, 32, bs, hkv, d)
    x, res = rand(1, hidden), rand(1, hidden)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(triton_common, "_PDL_ENV", on)
        assert pdl(dev, 1).get("USE_PDL") is on
        assert pdl(dev, triton_common.PDL_MAX_ROWS + 1) == {"USE_PDL": False}
        w["kc"], w["vc"] = kv[0].clone(), kv[1].clone()
        _layer_chain(x, res, w)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        w["kc"], w["vc"] = kv[0].clone(), kv[1].clone()
        with torch.cuda.graph(graph):
            out = _layer_chain(x, res, w)
        for _ in range(3):  # replays rewrite the same KV slot: the same result each time
            graph.replay()
        torch.cuda.synchronize()
        outs.append((out.clone(), w["kc"].clone(), w["vc"].clone()))
    for plain, launched in zip(outs[0], outs[1], strict=True):
        assert torch.equal(plain, launched)
