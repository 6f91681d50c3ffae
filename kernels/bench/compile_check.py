"""Every Triton launch a CPU test run makes, compiled for a Hopper GPU on a machine without one.

    TRITON_INTERPRET=1 python -m kernels.bench.compile_check record launches.json -- \\
        tests/kernels -q -p no:cacheprovider
    PYTHONPATH=/path/to/triton-3.6 python -m kernels.bench.compile_check compile launches.json

The interpreter runs what a GPU's compiler would refuse (a ``tl.dot`` with K below 16, a tile
past the shared memory, a construct the code generator rejects): such a kernel passes every CPU
test and fails at its first launch on a GPU. ``record`` runs pytest under the interpreter and
writes each distinct launch (the kernel, its argument types, its constexpr values and launch
options) to a JSON file; ``compile`` compiles each for sm_90 with ``triton.compile`` (the ptxas
of Triton's wheel; no GPU, no driver) and reports those that fail or need more shared memory
than an H100/H200 block may have (227 KiB). Use the Triton of the GPU image (3.6) for
``compile``: another version compiles differently. A compile check, not a run: numerics and
speed still need the GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

ARCH = 90
MAX_SHARED = 232448  # bytes of shared memory one block may take on an H100 / H200
_DTYPES = {  # torch dtype name -> Triton pointer element type
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5", "int8": "i8", "uint8": "u8",
    "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1",
}  # fmt: skip
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl", "maxnreg", "num_ctas")


def _encode(value: Any) -> Any:
    """A constexpr value as JSON: plain values as they are, a Triton dtype by name."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    name = str(value)
    return {"tl_dtype": name}


def _arg_type(value: Any) -> str | None:
    """The signature type the runtime gives an argument, or None for a constexpr-like None."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
    block_shape = getattr(value, "block_shape", None)
    base = getattr(value, "base", None)
    if block_shape is not None and isinstance(base, torch.Tensor):  # a TMA TensorDescriptor
        dtype = _DTYPES[str(base.dtype).removeprefix("torch.")]
        return f"tensordesc<{dtype}[{','.join(str(int(b)) for b in block_shape)}]>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return None
    raise TypeError(f"argument of type {type(value).__name__}")


def record(out_path: str, pytest_args: list[str]) -> int:
    """Runs pytest under the interpreter, every launch recorded; writes the distinct ones."""
    import inspect

    import pytest
    from triton.runtime import interpreter

    seen: dict[str, dict[str, Any]] = {}
    original = interpreter.InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        try:
            params = inspect.signature(self.fn).parameters
            bound = dict(zip(self.arg_names, args, strict=False))
            bound.update({k: v for k, v in kwargs.items() if k in params})
            signature: dict[str, str] = {}
            constexprs: dict[str, Any] = {}
            for name in self.arg_names:
                param = params[name]
                value = bound.get(name, param.default)
                if "constexpr" in str(param.annotation):
                    constexprs[name] = _encode(value)
                    continue
                kind = _arg_type(value)
                if kind is None:
                    constexprs[name] = None
                else:
                    signature[name] = kind
            options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
            entry = {"module": self.fn.__module__, "kernel": self.fn.__name__,
                     "signature": signature, "constexprs": constexprs, "options": options}  # fmt: skip
            seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        except (TypeError, KeyError) as err:  # recorded as unrecordable, the run goes on
            entry = {"module": self.fn.__module__, "kernel": self.fn.__name__, "error": str(err)}
            seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run  # type: ignore[method-assign]
    code = pytest.main(pytest_args)
    with open(out_path, "w") as f:
        json.dump(list(seen.values()), f, indent=1)
    print(f"{len(seen)} distinct launches -> {out_path} (pytest exit {int(code)})")
    return 0


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "tl_dtype" in value:
        import triton.language as tl

        return getattr(tl, value["tl_dtype"])
    return value


def compile_one(entry: dict[str, Any]) -> tuple[str, int]:
    """("ok" or the error, shared memory bytes) of one recorded launch compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
    constexprs = {k: _decode(v) for k, v in entry["constexprs"].items()}
    signature = {n: entry["signature"].get(n, "constexpr") for n in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", ARCH, 32), options=entry["options"])
    shared = int(compiled.metadata.shared)
    return ("ok" if shared <= MAX_SHARED else f"shared memory {shared} > {MAX_SHARED}"), shared


def _reason(err: BaseException) -> str:
    """A compile error in one line: its root cause's message (a CompilationError's own text is
    the source excerpt with a caret under the failing call)."""
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [line.strip() for line in str(root).splitlines() if line.strip(" ^")]
    return f"{type(root).__name__}: {(lines[-1] if lines else '')[:300]}"


def compile_all(path: str, only: str | None) -> int:
    import triton

    with open(path) as f:
        entries = json.load(f)
    failed = 0
    print(f"triton {triton.__version__}: {len(entries)} launches from {path}", flush=True)
    for entry in entries:
        name = f"{entry['module']}.{entry['kernel']}"
        if only and only not in name:
            continue
        if "error" in entry:
            print(f"SKIP {name}: not recorded ({entry['error']})")
            continue
        try:
            status = compile_one(entry)[0]
        except Exception as err:  # a compile error is the finding: report it and go on
            status = _reason(err)
        if status != "ok":
            failed += 1
            detail = {k: v for k, v in entry["constexprs"].items() if isinstance(v, int | bool)}
            print(f"FAIL {name} {entry['options']} {detail}: {status}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run pytest under the interpreter, launches recorded")
    r.add_argument("out")
    r.add_argument("pytest_args", nargs=argparse.REMAINDER)
    c = sub.add_parser("compile", help="compile recorded launches for sm_90")
    c.add_argument("launches")
    c.add_argument("--only", default=None, help="kernels whose module.name contains this")
    args = p.parse_args(argv)
    if args.cmd == "record":
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("record runs the tests under the interpreter: set TRITON_INTERPRET=1")
        rest = [a for a in args.pytest_args if a != "--"]
        return record(args.out, rest)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels must be real JIT functions
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        argv = sys.argv[1:] if argv is None else list(argv)
        cmd = [sys.executable, "-m", "kernels.bench.compile_check", *argv]
        return subprocess.run(cmd, env=env).returncode
    return compile_all(args.launches, args.only)


if __name__ == "__main__":
    sys.exit(main())
