"""The pipelining benchmark (``kernels.bench.gemv_stages``) on the CPU under the interpreter:
each launch is run, checked and timed (the timer stubbed), and a launch with the served chunk
length gives the served bits, alone or in a batch."""

from __future__ import annotations

import pytest
import torch

from kernels.bench import gemv_stages


@pytest.mark.parametrize(
    ("kind", "rows", "launches"),
    [
        ("bf16", 2, [(8, 128, 2, 1), (16, 256, 4, 3)]),
        ("fp8", 1, [(8, 128, 2, 1, 1), (16, 256, 4, 1, 3)]),
        ("int4", 1, [(16, 256, 2)]),
    ],
)
def test_each_launch_is_checked_and_timed(
    kind: str, rows: int, launches: list[tuple[int, ...]], graph_calls: list[object],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], device: torch.device,
) -> None:  # fmt: skip
    monkeypatch.setattr(gemv_stages, f"{kind.upper()}_LAUNCHES", launches)
    monkeypatch.setattr(gemv_stages, "STAGES", (1, 3))
    # k < the served GEMVs' long rows: bf16 (8, 256, 2), fp8 (16, 512, 8) cut to K, int4's
    # default chunk (1024) cut to K by its wrapper; 40 outputs: a partial block of them
    row = gemv_stages.time_shape(kind, "tiny", 40, 256, 1000.0, rows=rows, device=str(device))
    timed = [label for label in row["all_us"] if label != "served"]
    if kind == "int4":  # each launch at each of STAGES, plus the served launch's
        assert {"(16, 256, 2, 1)", "(16, 256, 2, 3)", "(16, 256, 2, 3) x whole"} <= set(timed)
    else:
        assert set(map(str, launches)) <= set(timed)
    assert len(graph_calls) == len(row["all_us"])
    assert row["floor_us"] > 0 and f"x{rows}" in capsys.readouterr().out
    if kind == "bf16":  # a verify step's rows: each the bits it gets alone, at every launch
        assert all(row["rows_alone_bits"].values()) and len(row["rows_alone_bits"]) == len(timed)
        assert row["served_bits"]["(8, 256, 2, 1)"]  # the served launch itself


def test_the_pipelined_int4_gemv_gives_the_served_bits(
    gen: torch.Generator, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the served kernel's chunk the pipelined int4 GEMV makes the same planes and sums."""
    from kernels.triton_quant import w4a16_linear
    from tests.kernels.paged import rand
    from tests.kernels.test_triton_quant import int4_weight

    n, k = 40, 512
    qweight, scales, zeros = int4_weight(k, n, 128, torch.bfloat16, gen, device)
    x = rand((1, k), torch.bfloat16, gen, device)
    served = w4a16_linear(x, qweight, scales, zeros, 128, config=(16, 256, 2, 1))
    monkeypatch.setattr(gemv_stages, "INT4_LAUNCHES", [(16, 256, 2)])
    monkeypatch.setattr(gemv_stages, "STAGES", (1, 3))
    _, forms = gemv_stages.int4_forms(n, k)
    for stages in (1, 3):
        for whole in ("", " x whole"):  # x by strided columns, or whole and split
            got = forms[str((16, 256, 2, stages)) + whole](x, (qweight, scales, zeros))
            assert torch.equal(got, served)


def test_rows_are_checked() -> None:
    with pytest.raises(SystemExit) as exc:
        gemv_stages.main(["--rows", "9"])
    assert exc.value.code == 2
