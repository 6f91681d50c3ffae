"""``kernels.bench.sass``: Hopper machine code of the quantized GEMVs, compiled without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernels.bench.sass import highest_register, main, parse_loops

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LOP3.LUT R3, R2, 0xf000, R9, 0xea, !PT ;
        /*0020*/              @!P0 LDG.E.128 R4, desc[UR4][R12.64] ;
        /*0030*/                   FFMA R10, R3, R5, R10 ;
        /*0040*/                   FFMA R11, R3, R6, R11 ;
        /*0050*/               @P1 BRA `(.L_x_0) ;
        /*0060*/                   BRA `(.L_x_1) ;
.L_x_1:
        /*0070*/                   EXIT ;
"""


def test_a_loop_is_a_branch_back_and_its_opcodes_are_counted() -> None:
    """Predicates and modifiers dropped; a forward branch is no loop; code outside not counted."""
    (loop,) = parse_loops(LISTING)
    assert (loop.start, loop.end) == (0x10, 0x50)
    assert loop.opcodes == {"FFMA": 2, "LOP3": 1, "LDG": 1, "BRA": 1}
    assert loop.instructions == 5
    assert highest_register(LISTING) == 13  # R12 named (R12.64 is R12:R13, not counted)


def test_the_int4_gemv_makes_each_nibble_plane_with_one_lop3(tmp_path: Path) -> None:
    """Compiled for sm_90 on this machine: the served GEMV's loop takes one LOP3 a nibble
    plane (8 packed words a thread a chunk, 8 planes each) and fewer instructions than the
    form that made each plane on its own; the small batches' GEMM multiplies its eight planes
    on the tensor cores (each warp two HMMA of 16x8x16 a plane)."""
    out = tmp_path / "sass.json"
    assert main(["int4-gemv", "int4-gemv-single", "int4-gemm", "--json-out", str(out)]) == 0
    served, single, gemm = json.loads(out.read_text())["kernels"]
    assert gemm["loops"][0]["opcodes"]["HMMA"] == 16
    assert (served["kernel"], served["block_n"], served["block_k"]) == ("int4-gemv", 16, 1024)
    loop = served["loops"][0]
    assert loop["opcodes"]["LOP3"] == 64
    assert loop["opcodes"]["FFMA"] >= 64  # a multiply-add a nibble, and the chunk's epilogue
    assert loop["instructions"] < single["loops"][0]["instructions"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["int4-gemv", "--rows", "3"], "--rows 3: int4-gemv takes 1 to 2 rows of x"),
        (["int4-gemm", "--rows", "17"], "--rows 17: int4-gemm takes 1 to 16 rows of x"),
        (["fp8-gemv", "--rows", "2"], "--rows 2: fp8-gemv takes 1 row of x"),
    ],
)
def test_rows_a_kernel_does_not_take_are_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Compiled anyway, a GEMV of 3 rows would be read as one of 2; refused before compiling."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
