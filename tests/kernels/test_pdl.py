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


def _compiled_gemv(k: int, block_n: int, block_k: int, stages: int) -> tuple[str, object]:
    """The bf16 GEMV compiled and launched programmatically on one row of x and a [64, k]
    weight, checked against a float32 product: its PTX and metadata."""
    from kernels.triton_gemv import _gemv_kernel

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(64, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, 64, device=dev, dtype=torch.bfloat16)
    kernel = _gemv_kernel[(64 // block_n,)](
        x, w, out, 1, 64, k, x.stride(0), w.stride(0), out.stride(0), 1,
        ROWS=1, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=True, STAGES=stages, ACT=False, LATE=False,
        num_warps=4,
        **pdl(dev, 1),
    )  # fmt: skip
    torch.testing.assert_close(out.float(), (x.float() @ w.float().T), rtol=2e-2, atol=3e-1)
    return kernel.asm["ptx"], kernel.metadata


@pytest.mark.gpu
def test_the_gemv_waits_on_the_device_before_it_stores() -> None:
    """The compiled GEMV is launched programmatically and waits (griddepcontrol.wait) after its
    first weight load and before any store: what the launch's correctness rests on."""
    ptx, metadata = _compiled_gemv(256, 8, 128, 1)
    assert getattr(metadata, "launch_pdl", None) is True
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("ld.global") < wait < ptx.index("griddepcontrol.launch_dependents")
    assert wait < ptx.index("st.global")


@pytest.mark.gpu
def test_the_pipelined_gemv_waits_before_its_first_load() -> None:
    """A pipelined launch (STAGES > 1, long rows') has its loads, x's among them, issued by the
    compiler's prologue: the wait must come before every one of them, and before the store."""
    ptx, _ = _compiled_gemv(1024, 16, 256, 4)
    wait = ptx.index("griddepcontrol.wait")
    assert "cp.async" in ptx  # pipelined through shared memory
    loads = [i for i in (ptx.find("cp.async"), ptx.find("ld.global")) if i >= 0]
    assert wait < min(loads) and wait < ptx.index("st.global")


@pytest.mark.gpu
def test_a_graph_of_pdl_launches_gives_the_plain_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph captured with programmatic launches, replayed on new inputs each time (so a read
    before a wait would see the last replay's values), against plain eager launches."""
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
    x, res = rand(1, hidden), rand(1, hidden)  # the graph's inputs, refilled before each replay
    monkeypatch.setattr(triton_common, "_PDL_ENV", True)
    assert pdl(dev, 1).get("USE_PDL") is True
    assert pdl(dev, triton_common.PDL_MAX_ROWS + 1) == {"USE_PDL": False}
    w["kc"], w["vc"] = kv[0].clone(), kv[1].clone()
    _layer_chain(x, res, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer_chain(x, res, w)
    for _ in range(3):
        x.copy_(rand(1, hidden))
        res.copy_(rand(1, hidden))
        w["kc"].copy_(kv[0])
        w["vc"].copy_(kv[1])
        graph.replay()
        got = (out.clone(), w["kc"].clone(), w["vc"].clone())
        monkeypatch.setattr(triton_common, "_PDL_ENV", False)
        plain = dict(w, kc=kv[0].clone(), vc=kv[1].clone())
        want = (_layer_chain(x.clone(), res.clone(), plain), plain["kc"], plain["vc"])
        monkeypatch.setattr(triton_common, "_PDL_ENV", True)
        torch.cuda.synchronize()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
