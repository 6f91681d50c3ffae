"""A Triton kernel's Hopper machine code (SASS), compiled on any machine, no GPU needed: the
instructions of its main loop, counted by opcode.

    python -m kernels.bench.sass int4-gemv [int4-gemv-single int4-gemm fp8-gemv] [--rows N]
        [--block-k 1024] [--warps 8] [--json-out sass.json]

The kernel is compiled for sm_90 as the runtime would specialize it for the Llama-3.1-8B
shapes (pointers and sizes divisible by 16, one row of x a constant), with the ``ptxas`` and
``nvdisasm`` that ship in Triton's wheel; the loop is the longest backward branch. What it
says is what the GPU issues per chunk of each thread, which bounds a kernel whose time is its
instructions rather than its bytes: the int4 GEMV had 359 a chunk where its arithmetic asks
~230 (each nibble plane an AND and an OR where one LOP3 does both; fixed by making planes in
pairs with the float's bits in a register, 267). Compile with the Triton of the GPU image
(3.6) to read what runs there; later ones schedule a little differently.

- ``int4-gemv``: ``kernels.triton_quant._w4_gemv_kernel`` (nibble planes in pairs).
- ``int4-gemv-single``: the GEMV before pairs, ``kernels.bench.w4_unpack``'s ``single`` form.
- ``int4-gemm``: ``kernels.triton_quant._w4_gemm_kernel`` on the nibble planes at the small
  batches' tile (x loaded plane by plane, or whole above ``W4_PLANES_X_WHOLE_ROWS`` rows).
- ``fp8-gemv``: ``kernels.triton_quant._fp8_gemv_kernel``, per-channel scales.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCH = 90  # Hopper: the H100 and H200 the benchmarks run on
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\(\.(L_x_\d+)\)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass(frozen=True)
class Loop:
    start: int  # byte offsets of its first instruction and its backward branch
    end: int
    opcodes: dict[str, int]  # base opcode (LOP3, FFMA, ...) -> instructions

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())


def parse_loops(sass: str) -> list[Loop]:
    """Every loop of nvdisasm's listing (a branch back to a label before it), longest first."""
    instructions: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        ins = _INSTRUCTION.match(line)
        if ins:
            address = int(ins.group(1), 16)
            labels.update((name, address) for name in pending)
            pending.clear()
            instructions.append((address, ins.group(2)))
    loops = []
    for address, text in instructions:
        branch = _BRANCH.search(text)
        if branch and labels.get(branch.group(1), address) < address:
            start = labels[branch.group(1)]
            body = [t for a, t in instructions if start <= a <= address]
            names = (_PREDICATE.sub("", t).split()[0].split(".")[0] for t in body)
            loops.append(Loop(start, address, dict(collections.Counter(names).most_common())))
    return sorted(loops, key=lambda loop: -loop.instructions)


def highest_register(sass: str) -> int:
    """The highest general register the code names, plus one: about what a thread holds (a
    lower bound; the second register of a 64-bit pair and wide loads' others are not named)."""
    return max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1) + 1


def _int4_gemv(args: argparse.Namespace, single: bool) -> tuple[Any, dict, dict, list[str]]:
    from kernels import triton_quant as tq

    if single:
        from kernels.bench.w4_unpack import _w4_gemv_single_kernel as fn
    else:
        fn = tq._w4_gemv_kernel
    pointers = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
                "out_ptr": "*bf16"}  # fmt: skip
    constants = {"GROUP": 128, "ROWS": args.rows, "BLOCK_N": args.block_n, "BLOCK_K": args.block_k,
                 "SPLIT": 1, "USE_PDL": True}  # fmt: skip
    if not single:  # the served kernel's plain launch: no SiLU-and-mul epilogue
        constants.update(ACT=False, LATE=False)
    if args.rows == 1:
        constants.update(M=1, GROUPS=1)  # the launcher's specialization of a 1
    sizes = ["N", "K", "K_PER", "s_xm", "s_qk", "s_sg", "s_om"]
    return fn, pointers, constants, sizes


def _fp8_gemv(args: argparse.Namespace) -> tuple[Any, dict, dict, list[str]]:
    from kernels import triton_quant as tq

    pointers = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16"}
    launch = tq.fp8_gemv_config(28672, 4096, 4096)
    constants = {"M": 1, "BLOCK_N": args.block_n, "BLOCK_K": args.block_k, "EVEN_K": True,
                 "SPLIT": 1, "ROW_SCALE": True, "USE_PDL": True, "ACT": 0, "LATE": False,
                 "STAGES": launch[4] if len(launch) == 5 else 1}  # fmt: skip
    sizes = ["N", "K", "K_PER", "s_xm", "s_wn", "s_sn", "s_om"]
    return tq._fp8_gemv_kernel, pointers, constants, sizes


def _int4_gemm(args: argparse.Namespace) -> tuple[Any, dict, dict, list[str]]:
    from kernels import triton_quant as tq

    pointers = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
                "out_ptr": "*fp32"}  # fmt: skip
    constants = {"GROUP": 128, "BLOCK_M": tq.W4_SMALL_GEMM_CONFIG[0], "BLOCK_N": args.block_n,
                 "BLOCK_K": args.block_k, "UPCAST": False,
                 "PRECISION": "tf32", "SPLIT": tq.W4_SMALL_GEMM_CONFIG[4], "PLANES": True,
                 "X_WHOLE": args.rows > tq.W4_PLANES_X_WHOLE_ROWS}  # fmt: skip
    sizes = ["N", "K", "K_PER", "s_xm", "s_qk", "s_sg", "s_om"]
    return tq._w4_gemm_kernel, pointers, constants, sizes


@dataclass(frozen=True)
class Preset:
    build: Any  # launch (rows, block_n, block_k) -> (kernel, pointers, constants, sizes)
    launch: Any  # () -> the served (BLOCK_N, BLOCK_K, warps): int4 GEMV, its default launch
    # (qkv and o; gate_up and down take W4_GEMV_WIDE_N_CONFIG and W4_GEMV_LONG_K_CONFIG);
    # the GEMM, its small batches' tile; FP8, the 8B gate_up projection's
    rows: range  # the rows of x the kernel takes


def _int4_gemv_launch() -> tuple[int, ...]:
    from kernels import triton_quant as tq

    return tq.W4_GEMV_CONFIG[:3]


def _int4_gemm_launch() -> tuple[int, ...]:
    from kernels import triton_quant as tq

    return tq.W4_SMALL_GEMM_CONFIG[1:4]  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, SPLIT)


def _fp8_gemv_launch() -> tuple[int, ...]:
    from kernels import triton_quant as tq

    return tq.fp8_gemv_config(28672, 4096, 4096)[:3]  # per-channel scales: K is one block


PRESETS = {
    "int4-gemv": Preset(
        functools.partial(_int4_gemv, single=False), _int4_gemv_launch, range(1, 3)
    ),
    "int4-gemm": Preset(_int4_gemm, _int4_gemm_launch, range(1, 17)),
    "int4-gemv-single": Preset(
        functools.partial(_int4_gemv, single=True), _int4_gemv_launch, range(1, 3)
    ),
    "fp8-gemv": Preset(_fp8_gemv, _fp8_gemv_launch, range(1, 2)),
}


def compile_sass(fn: Any, pointers: dict, constants: dict, sizes: list[str], num_warps: int) -> str:
    """``fn`` (a ``triton.jit`` function) compiled for sm_90 and disassembled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    signature = {n: ("constexpr" if n in constants else pointers.get(n, "i32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*pointers, *sizes]}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", ARCH, 32),
                              options={"num_warps": num_warps})  # fmt: skip
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        done = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True,
                              text=True, check=True)  # fmt: skip
    return done.stdout


def describe(kernel: str, args: argparse.Namespace) -> dict:
    """One preset compiled at its served launch (``--block-k`` and ``--warps`` override) and its
    loops counted."""
    preset = PRESETS[kernel]
    block_n, block_k, warps = preset.launch()
    launch = argparse.Namespace(rows=args.rows, block_n=block_n, block_k=args.block_k or block_k)
    warps = args.warps or warps
    fn, pointers, constants, sizes = preset.build(launch)
    sass = compile_sass(fn, pointers, constants, sizes, warps)
    loops = [{"start": lp.start, "end": lp.end, "instructions": lp.instructions,
              "opcodes": lp.opcodes} for lp in parse_loops(sass)]  # fmt: skip
    return {"kernel": kernel, "rows": args.rows, "block_n": launch.block_n,
            "block_k": launch.block_k, "warps": warps, "registers": highest_register(sass),
            "loops": loops}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kernels", nargs="+", choices=sorted(PRESETS), metavar="KERNEL",
                   help=f"one or more of {', '.join(sorted(PRESETS))}")  # fmt: skip
    p.add_argument(
        "--rows",
        type=int,
        default=1,
        help="rows of x: 1-2 for the int4 GEMVs, 1-16 for the GEMM, 1 for fp8",
    )
    p.add_argument("--block-k", type=int, default=None, help="K a chunk (default: as served)")
    p.add_argument("--warps", type=int, default=None, help="warps a program (default: as served)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    for kernel in args.kernels:
        rows = PRESETS[kernel].rows
        if args.rows not in rows:
            takes = f"{rows[0]} to {rows[-1]} rows" if len(rows) > 1 else f"{rows[0]} row"
            p.error(f"--rows {args.rows}: {kernel} takes {takes} of x")
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels must be real JIT functions
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        return subprocess.run(
            [sys.executable, "-m", "kernels.bench.sass", *argv], env=env
        ).returncode
    try:
        results = [describe(kernel, args) for kernel in args.kernels]
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        print(
            f"kernels.bench.sass: cannot disassemble ({e}); needs Triton's nvdisasm",
            file=sys.stderr,
        )
        return 2
    for r in results:
        print(f"{r['kernel']}: {r['registers']} registers; the main loop", end=" ")
        if r["loops"]:
            print(f"{r['loops'][0]['instructions']} instructions a chunk:")
            print("  " + "  ".join(f"{k} {v}" for k, v in r["loops"][0]["opcodes"].items()))
        else:
            print("not found (no backward branch)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"kernels": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
