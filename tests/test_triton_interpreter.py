"""tests/triton_interpreter.py: the interpreter's skipped work changes no result and leaves
``triton.language`` as it found it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import triton_interpreter

if not triton_interpreter.interpreting():
    pytest.skip("the savings apply under TRITON_INTERPRET=1", allow_module_level=True)

import triton
import triton.language as tl
from triton.language import core as tl_core
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
    assert interpreter.interpreter_semantic.broadcast_impl_value.__name__ == "equal_first"
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
