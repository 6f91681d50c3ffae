"""tests/triton_interpreter.py: the interpreter's skipped work changes no result and leaves
``triton.language`` as it found it."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests import triton_interpreter

if not triton_interpreter.interpreting():
    pytest.skip("the savings apply under TRITON_INTERPRET=1", allow_module_level=True)

import triton
import triton.language as tl
from triton.language import core as tl_core
from triton.language.semantic import TritonSemantic
from triton.runtime import interpreter


@triton.jit
def _scaled(x, k):
    return x * k + 7


@triton.jit
def _wraps_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    # two helper calls a program (each used to walk triton.language again), int32 products
    # that overflow (their check used to be computed and dropped)
    y = _scaled(_scaled(x, 65537), 3)
    tl.store(out_ptr + offs, y - tl_core.full([BLOCK], 1, tl.int32), mask=mask)


def test_installed_for_the_suite() -> None:
    assert interpreter.interpreter_builder.options.debug is False
    assert interpreter.interpreter_builder.options.sanitize_overflow is False
    assert getattr(interpreter._patch_lang, "skips_patched_modules", False)
    semantic = interpreter.interpreter_semantic
    assert semantic.broadcast_impl_value.__name__ == "splatting"
    assert semantic.binary_op_type_checking_impl.__name__ == "checking"
    assert interpreter._patch_attr.__name__ == "patching"
    assert interpreter._get_np_dtype.__name__ == "get"
    assert tl_core.block_type.__init__.__name__ == "kept_init"
    assert tl_core.tensor.__init__.__name__ == "kept_init"
    assert triton_interpreter.install() is False  # once is enough


def test_helpers_and_wrapping_int32_give_numpy_s_results_and_the_language_is_restored() -> None:
    langs = (tl, tl_core)
    before = [(lang.program_id, lang.arange, lang.load) for lang in langs]
    x = torch.arange(-50_000, 50_000, 997, dtype=torch.int32) * 4099
    out = torch.empty_like(x)
    _wraps_kernel[(triton.cdiv(x.numel(), 16),)](x, out, x.numel(), BLOCK=16)
    with np.errstate(over="ignore"):
        a = x.numpy()
        want = ((a * np.int32(65537) + np.int32(7)) * np.int32(3) + np.int32(7)) - np.int32(1)
    assert (want != (a.astype(np.int64) * 65537 + 7) * 3 + 6).any()  # the products do wrap
    np.testing.assert_array_equal(out.numpy(), want)
    # the launch's patch was undone (a module another kernel's helper patched and Triton never
    # restored stays so: the same objects as before either way)
    assert [(lang.program_id, lang.arange, lang.load) for lang in langs] == before


@triton.jit
def _broadcasts_kernel(a_ptr, b_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    a = tl.load(a_ptr + rows)  # [R]
    b = tl.load(b_ptr + cols)  # [C]
    outer = a[:, None] * b[None, :]  # [R, 1] with [1, C]
    grid = rows[:, None] * C + cols[None, :]  # the same, int32
    same = outer + outer  # equal shapes
    col = tl.sum(same, axis=1)  # [R]
    mixed = same - col[:, None] * 0.5 + 3.0  # [R, C] with [R, 1], then a scalar
    ranks = mixed + b  # [R, C] with [C]: a new leading axis for b
    tl.store(out_ptr + grid, ranks)


def test_broadcasts_of_every_kind_give_numpy_s_results() -> None:
    a = torch.arange(1, 9, dtype=torch.float32)
    b = torch.arange(16, dtype=torch.float32) - 4.5
    out = torch.empty(8, 16)
    _broadcasts_kernel[(1,)](a, b, out, R=8, C=16)
    same = 2 * a[:, None] * b[None, :]
    want = same - same.sum(1, keepdim=True) * 0.5 + 3.0 + b
    torch.testing.assert_close(out, want)


def test_kept_types_equal_fresh_ones_and_bad_shapes_are_refused_every_time() -> None:
    first = tl.block_type(tl.float16, [4, 8])
    again = tl.block_type(tl.float16, (tl.constexpr(4), 8))
    assert (again.shape, again.numel, again.name) == (first.shape, first.numel, first.name)
    assert again == first and again.element_ty == tl.float16
    assert tl.block_type(tl.float32, [4, 8]).name != first.name
    for _ in range(2):
        with pytest.raises(ValueError, match="power of 2"):
            tl.block_type(tl.float32, [3, 8])
    for ty, want in [(tl.float32, np.float32), (tl.bfloat16, np.uint16), (tl.int1, np.bool_)]:
        assert interpreter._get_np_dtype(ty) == np.dtype(want)
        assert interpreter._get_np_dtype(tl.block_type(ty, [2])) == np.dtype(want)
    pointer = tl.pointer_type(tl.float16)
    assert interpreter._get_np_dtype(pointer) == np.dtype(np.uint64)
    assert interpreter._get_np_dtype(tl.block_type(pointer, [2])) == np.dtype(np.uint64)


@triton.jit
def _mixed_kernel(f_ptr, h_ptr, b_ptr, q_ptr, i_ptr, s_ptr, u_ptr, l_ptr, fo_ptr, io_ptr, k):
    BLOCK: tl.constexpr = 16
    offs = tl.arange(0, BLOCK)
    f = tl.load(f_ptr + offs)  # float32
    h = tl.load(h_ptr + offs)  # float16
    b = tl.load(b_ptr + offs)  # bfloat16
    q = tl.load(q_ptr + offs)  # fp8e4nv
    i = tl.load(i_ptr + offs)  # int32
    s = tl.load(s_ptr + offs)  # int8
    u = tl.load(u_ptr + offs)  # uint8
    n = tl.load(l_ptr + offs)  # int64
    p = tl.program_id(0) + k  # a scalar tensor
    floats = [
        f + i,
        b * f,
        b + b,
        h * b,
        h - 2.5,
        b * 3,
        q + f,
        q.to(tl.float32) * 2.0,
        i / 3,
        f / i,
        h / b,
        p * 2.5 + f,
        1.5 - p,
        f * BLOCK,
        tl.where(i > 0, f, b),
        tl.maximum(h, 0.25),
        f % 3.0,
        i.to(tl.float32) / p,
    ]
    ints = [
        i * 65537 + 7,
        s + i,
        u + s,
        u * 3,
        s - 1,
        n + i,
        n * u,
        i // 3,
        i % 7,
        -i // 4,
        u // (u + 1),
        n // (i + 100),
        i & 0xFF,
        i >> 2,
        i ^ s,
        u << 1,
        p * i + BLOCK,
        (i < p) + s,
        (f > 0) & (i != 0),
        p - 3,
        7 - p,
        n % (s.to(tl.int64) + 200),
    ]
    for j in tl.static_range(len(floats)):
        tl.store(fo_ptr + j * BLOCK + offs, floats[j])
    for j in tl.static_range(len(ints)):
        tl.store(io_ptr + j * BLOCK + offs, ints[j])


def _mixed_run() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(16, generator=g) * 100
    i = torch.randint(-(2**31), 2**31 - 1, (16,), generator=g, dtype=torch.int32)
    args = [
        f,
        (torch.randn(16, generator=g) * 10).half(),
        (torch.randn(16, generator=g) * 10).bfloat16(),
        (torch.randn(16, generator=g) * 4).to(torch.float8_e4m3fn),
        torch.where(i == 0, 1, i),
        torch.randint(-128, 127, (16,), generator=g, dtype=torch.int8),
        torch.randint(0, 255, (16,), generator=g, dtype=torch.uint8),
        torch.randint(-(2**62), 2**62, (16,), generator=g, dtype=torch.int64),
    ]
    fo, io = torch.zeros(18, 16), torch.zeros(22, 16, dtype=torch.int64)
    _mixed_kernel[(2,)](*args, fo, io, 5)
    return fo, io


def test_operand_types_kept_splats_and_direct_builtins_give_the_original_s_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = _mixed_run()
    assert kept[0].isfinite().all() and (kept[1] != 0).any()
    semantic = interpreter.interpreter_semantic
    for name in ("binary_op_type_checking_impl", "broadcast_impl_value"):
        monkeypatch.setattr(
            semantic, name, types.MethodType(getattr(TritonSemantic, name), semantic)
        )
    monkeypatch.setattr(interpreter, "_patch_attr", interpreter._patch_attr.__wrapped__)
    fresh = _mixed_run()
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(
            a.view(torch.int32 if a.is_floating_point() else a.dtype),
            b.view(torch.int32 if b.is_floating_point() else b.dtype),
        )


@triton.jit
def _out_of_range_kernel(i_ptr, out_ptr):
    offs = tl.arange(0, 4)
    tl.store(out_ptr + offs, tl.load(i_ptr + offs) + 5_000_000_000)


def test_a_check_that_raises_raises_every_time() -> None:
    i = torch.arange(4, dtype=torch.int32)
    for _ in range(2):
        with pytest.raises(Exception, match="out of range"):
            _out_of_range_kernel[(1,)](i, torch.empty_like(i))
