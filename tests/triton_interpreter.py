"""Work Triton's CPU interpreter does and throws away, skipped for the suite (tests/conftest.py).

Every kernel test runs under ``TRITON_INTERPRET=1``, where the interpreter (triton 3.9) spends
more than half of its time on two things whose results nothing reads:

- **Integer overflow checks.** ``a + b``, ``a - b`` and ``a * b`` on int32 tensors also compute
  the operation in int64, compare it with int32's range and hand the result to
  ``device_assert``, which drops it unless the interpreter's ``debug`` option is on (it is off:
  compiled kernels outside debug mode skip the check too). Turning ``sanitize_overflow`` off
  removes only that dead computation: no result changes.
- **Re-patching ``triton.language`` on every device-function call.** A launch patches the
  language modules the kernel sees (each builtin replaced by its interpreted form, undone when
  the launch ends); each call of a ``@triton.jit`` helper inside the kernel then walks every
  member of those modules again (``inspect.getmembers``, ~4 ms a call) and finds nothing left
  to patch. The call now skips that walk when each language module it sees is already patched;
  a helper that sees a module the launch did not patch is patched as before.

Three more costs of the interpreter's bookkeeping (not of its arithmetic) are cut without
changing what it computes (together ~28% of a kernel test module's CPU time, e.g.
tests/kernels/test_triton_quant.py 52 -> 38 s):

- **Broadcasting two blocks of one rank.** Every binary operation on two blocks works out their
  common shape by comparing ``triton.language`` tuples with lists, which rebuilds each list as a
  language tuple with a type per element. The same rule (a dimension of 1 takes the other's) is
  now worked out on plain lists of ints; blocks of equal shapes come back as they are, as the
  full check returns them. Other ranks, scalars and mismatches go to the original.
- **The numpy dtype of each value.** ``_get_np_dtype`` builds its table of twenty types on every
  call (tens of thousands a test); the answer per type is now kept.
- **Block types and tensor shapes built again for every value.** Each operation's result gets a
  new ``block_type`` (its shape made a language tuple with a type per element, checked, named)
  and a tensor whose shape is made a tuple of ``constexpr`` again; the parts that depend only on
  the element type and the shape are now built once per shape and shared (none of them is ever
  modified).

Three more cut the interpreter's per-operation checks of its operands' types, which depend on
the types and shapes alone (the type checking was a third of the prefill kernel tests' time;
together 13-18% of a kernel test module's CPU time: tests/kernels/test_triton_prefill.py
43 -> 35 s, test_triton_moe.py 33 -> 28 s, test_triton_quant.py 16.5 -> 14.5 s):

- **The computation type of each binary operation.** ``binary_op_type_checking_impl`` checks
  pointer use and works out the type both operands are cast to from the operands' scalar types,
  whether each is a Python scalar, and the op's flags, through a dozen dtype tests each time;
  that outcome is now kept per such key (a plain dtype keyed by its name, which everything about
  it is worked out from; a pointer by its element type's name, address space and constness),
  and a tensor already of the computation type is not cast to itself. A Python scalar's type,
  its range check and constant, every other cast and the broadcast are still done each call
  through the same methods; a check that raises is never kept (it raises again), and other
  operands or types go to the original.
- **The block type a scalar is splat to.** A block with a scalar makes the scalar's block type
  (``with_element_ty``) and its IR form (``to_ir``, a second block type) on each operation; both
  are now kept per (scalar type, shape) as above.
- **The builtin wrapper behind each patched builtin.** A launch replaces each builtin by a
  function that passes ``_semantic`` on to the builtin's wrapper, whose only work is to check
  that it was given and not None; the replacement now calls the function the wrapper wraps, with
  the same arguments (members that are not such wrappers are patched as before).

``install()`` is a no-op when Triton is not installed, not interpreting, or its interpreter no
longer has these internals (then the suite is only slower); each bookkeeping saving is applied
where its own internals are still there.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import Any


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Apply the savings to this process's interpreter; True when they were applied."""
    if not interpreting():
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder: Any = getattr(interpreter, "interpreter_builder", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    options: Any = getattr(builder, "options", None)
    if (
        patch_lang is None
        or getattr(patch_lang, "skips_patched_modules", False)
        or not hasattr(options, "__dataclass_fields__")
        or getattr(options, "debug", True)  # in debug mode the checks do assert
        or not hasattr(options, "sanitize_overflow")
    ):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    interpreter._patch_lang = _skipping_patched_modules(patch_lang, tl)
    # the bookkeeping savings, each where its internals are still there
    semantic: Any = getattr(interpreter, "interpreter_semantic", None)
    core = tl.core
    if hasattr(semantic, "broadcast_impl_value") and hasattr(semantic, "make_tensor"):
        semantic.broadcast_impl_value = _equal_shapes_first(semantic, core.block_type)
    if callable(getattr(interpreter, "_get_np_dtype", None)):
        interpreter._get_np_dtype = _kept_np_dtypes(interpreter._get_np_dtype, tl)
    if hasattr(core, "constexpr"):
        core.block_type.__init__ = _kept_block_types(core.block_type.__init__, core.constexpr)
        core.tensor.__init__ = _kept_tensor_shapes(core.tensor.__init__)
    if all(
        hasattr(semantic, name)
        for name in (
            "binary_op_type_checking_impl",
            "check_ptr_type_impl",
            "computation_type_impl",
            "to_tensor_type",
            "to_tensor",
            "_cast_to_computation_type",
            "broadcast_impl_value",
            "tensor",
        )
    ) and hasattr(core, "pointer_type"):
        semantic.binary_op_type_checking_impl = _kept_operand_types(semantic, core)
        if hasattr(semantic, "builder") and hasattr(core.block_type, "with_element_ty"):
            semantic.broadcast_impl_value = _kept_splat_types(semantic, core)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if callable(patch_attr) and callable(getattr(core, "builtin", None)):
        interpreter._patch_attr = _calling_builtins_directly(patch_attr, interpreter, core.builtin)
    return True


def _equal_shapes_first(semantic: Any, block_type: type) -> Callable[[Any, Any], Any]:
    """``semantic.broadcast_impl_value`` for two blocks of one rank worked out on plain lists of
    ints (each dimension of 1 broadcast to the other's; equal shapes returned as they are), as
    the original does; different ranks, mismatched dimensions (its error) and a scalar with a
    block go to the original."""
    broadcast = semantic.broadcast_impl_value

    def to(value: Any, ty: Any, dims: list[int], shape: list[int]) -> Any:
        if dims == shape:
            return value
        handle = semantic.builder.create_broadcast(value.handle, shape)
        return semantic.make_tensor(handle, block_type(ty.scalar, shape))

    def equal_first(lhs: Any, rhs: Any) -> Any:
        lt, rt = lhs.type, rhs.type
        if lt.is_block() and rt.is_block():
            ls, rs = list(lt.shape.values), list(rt.shape.values)
            if ls == rs:
                return lhs, rhs
            if len(ls) == len(rs):
                shape = [b if a == 1 else a for a, b in zip(ls, rs, strict=True)]
                if all(b in (1, a) for a, b in zip(shape, rs, strict=True)):
                    return to(lhs, lt, ls, shape), to(rhs, rt, rs, shape)
        return broadcast(lhs, rhs)

    return equal_first


def _calling_builtins_directly(
    patch_attr: Callable[..., None], interpreter: Any, builtin: Callable[[Any], Any]
) -> Callable[..., None]:
    """``_patch_attr`` whose replacement of a ``@builtin`` calls the function the builtin wraps
    with ``_semantic`` set to the interpreter's semantic, as the original's replacement does
    through the builtin's wrapper (whose only work, a check that ``_semantic`` is given and not
    None, then always passes); members that are not such wrappers are patched as before."""
    wrapper_code = builtin(lambda _semantic=None: None).__code__

    def patching(obj: Any, name: str, member: Any, builder: Any, scope: Any) -> None:
        code = getattr(member, "__code__", None)
        if code is not wrapper_code or code.co_freevars != ("fn",):
            return patch_attr(obj, name, member, builder, scope)
        fn = member.__closure__[0].cell_contents

        def new_member(*args: Any, **kwargs: Any) -> Any:
            semantic = interpreter.interpreter_semantic
            if semantic is None:  # the wrapper's error, as before
                kwargs = {k: v for k, v in kwargs.items() if k != "_semantic"}
                return member(*args, **kwargs, _semantic=semantic)
            kwargs.pop("_semantic", None)
            kwargs["_semantic"] = semantic  # last, as the original passes it
            return fn(*args, **kwargs)

        scope.set_attr(obj, name, new_member)

    patching.__wrapped__ = patch_attr  # type: ignore[attr-defined]
    return patching


def _type_key(ty: Any, plain: Any, pointer: Any) -> Any:
    """What a scalar type is, as a key: a plain dtype is all its name (every attribute and test of
    one is worked out from it); a pointer to one is that name, its address space and constness
    (all its equality compares). None for any other type."""
    if type(ty) is plain:
        return ty.name
    if type(ty) is pointer and type(ty.element_ty) is plain:
        return (ty.element_ty.name, ty.address_space, ty.const)
    return None


def _kept_splat_types(semantic: Any, core: Any) -> Callable[[Any, Any], Any]:
    """``semantic.broadcast_impl_value`` for a block with a scalar: the scalar is splat to the
    block's shape as the original does, with the block type it gets (``with_element_ty``) and
    that type's IR form (``to_ir``, whose shape ``create_splat`` reads) kept per (scalar type,
    shape) instead of built twice a call; everything else goes to the original."""
    broadcast = semantic.broadcast_impl_value
    plain, pointer = core.dtype, core.pointer_type
    kept: dict[Any, tuple[Any, Any]] = {}

    def splat(value: Any, block_ty: Any) -> Any:
        dims = getattr(block_ty.shape, "values", None)
        key = _type_key(value.type, plain, pointer)
        if dims is None or key is None:
            return None
        key = (key, tuple(dims))
        found = kept.get(key)
        if found is None:
            ty = block_ty.with_element_ty(value.type.scalar)
            found = kept[key] = (ty, ty.to_ir(semantic.builder))
        ty, ir_ty = found
        return semantic.make_tensor(semantic.builder.create_splat(ir_ty, value.handle), ty)

    def splatting(lhs: Any, rhs: Any) -> Any:
        lblock, rblock = lhs.type.is_block(), rhs.type.is_block()
        if lblock and not rblock:
            splat_rhs = splat(rhs, lhs.type)
            if splat_rhs is not None:
                return lhs, splat_rhs
        elif rblock and not lblock:
            splat_lhs = splat(lhs, rhs.type)
            if splat_lhs is not None:
                return splat_lhs, rhs
        return broadcast(lhs, rhs)

    return splatting


def _kept_operand_types(semantic: Any, core: Any) -> Callable[..., tuple[Any, Any]]:
    """``semantic.binary_op_type_checking_impl`` with its checks of the two operand types (no
    pointer where none is allowed, the computation type both are cast to) worked out once per
    (operand types, scalar or not, the op's flags) and kept; the value-dependent steps (a Python
    scalar's type, its range check and constant, each cast, the broadcast) are still done on
    every call, through the same methods. Operands other than tensors and Python ints, floats
    and bools, and types other than plain dtypes and pointers to them go to the original; a check
    that raises raises again each time (never kept)."""
    check = semantic.binary_op_type_checking_impl
    tensor, plain, pointer = semantic.tensor, core.dtype, core.pointer_type
    scalars = (int, float, bool)
    # per key: where the computation type is (NO_ARITHMETIC, LHS's, RHS's or GIVEN), the type
    # given, and whether the lhs, the rhs are tensors of it already (cast to themselves)
    kept: dict[Any, tuple[int, Any, bool, bool]] = {}
    NO_ARITHMETIC, LHS, RHS, GIVEN = range(4)

    def type_key(ty: Any) -> Any:
        return _type_key(ty, plain, pointer)

    def plan(
        lty: Any, lsc: bool, rty: Any, rsc: bool, allow_l: Any, allow_r: Any, arith: Any, div: Any
    ) -> tuple[int, Any, bool, bool]:
        semantic.check_ptr_type_impl(lty, rty, allow_l)
        semantic.check_ptr_type_impl(rty, lty, allow_r)
        if not (arith and not lty.is_ptr() and not rty.is_ptr()):
            return NO_ARITHMETIC, None, False, False
        ret = semantic.computation_type_impl(lty, lsc, rty, rsc, div)
        where = LHS if ret is lty else RHS if ret is rty else GIVEN
        return where, ret, not lsc and lty == ret, not rsc and rty == ret

    def checking(
        lhs: Any,
        rhs: Any,
        allow_lhs_ptr: Any = False,
        allow_rhs_ptr: Any = False,
        arithmetic_check: Any = True,
        div_or_mod: Any = False,
    ) -> tuple[Any, Any]:
        lcls, rcls = type(lhs), type(rhs)
        lsc, rsc = lcls in scalars, rcls in scalars
        if not (lsc or lcls is tensor) or not (rsc or rcls is tensor):
            return check(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        lty = semantic.to_tensor_type(lhs) if lsc else lhs.dtype
        rty = semantic.to_tensor_type(rhs) if rsc else rhs.dtype
        lkey, rkey = type_key(lty), type_key(rty)
        if lkey is None or rkey is None:
            return check(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        flags = (allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        key = (lkey, lsc, rkey, rsc, flags)
        try:
            found = kept.get(key)
        except TypeError:  # an unhashable flag
            return check(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        if found is None:
            found = kept[key] = plan(lty, lsc, rty, rsc, *flags)
        where, ret, lkeep, rkeep = found
        if where == NO_ARITHMETIC:
            lhs, rhs = semantic.to_tensor(lhs), semantic.to_tensor(rhs)
        else:
            ret = lty if where == LHS else rty if where == RHS else ret
            if not lkeep:
                lhs = semantic._cast_to_computation_type(lhs, ret)
            if not rkeep:
                rhs = semantic._cast_to_computation_type(rhs, ret)
        return semantic.broadcast_impl_value(lhs, rhs)

    return checking


def _int_shape(shape: Any, constexpr: type) -> tuple[int, ...] | None:
    """``shape`` (a list, a tuple or a language tuple of ints or constexprs) as a tuple of
    ints; None for anything else."""
    values = getattr(shape, "values", shape)
    if not isinstance(values, (list, tuple)):
        return None
    dims = tuple(v.value if type(v) is constexpr else v for v in values)
    return dims if all(type(d) is int for d in dims) else None


def _kept_block_types(init: Callable[..., None], constexpr: type) -> Callable[..., None]:
    """``block_type.__init__`` with the shape, element count and name it builds kept per
    (element type, shape); a shape it refuses is refused again each time (never kept)."""
    kept: dict[Any, tuple[Any, Any, str]] = {}

    def kept_init(self: Any, element_ty: Any, shape: Any) -> None:
        dims = _int_shape(shape, constexpr)
        key = (element_ty, dims)
        try:
            found = kept.get(key) if dims is not None else None
        except TypeError:  # an unhashable element type
            dims = found = None
        if found is None:
            init(self, element_ty, shape)
            if dims is not None:
                kept[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = found

    return kept_init


def _kept_tensor_shapes(init: Callable[..., None]) -> Callable[..., None]:
    """``tensor.__init__`` with a block's shape (a tuple of constexpr) and element count kept
    per shape."""
    kept: dict[Any, tuple[Any, Any]] = {}

    def kept_init(self: Any, handle: Any, type: Any) -> None:
        dims = getattr(type.shape, "values", None) if type.is_block() else None
        key = tuple(dims) if dims is not None else None
        found = kept.get(key) if key is not None else None
        if found is None:
            init(self, handle, type)
            if key is not None:
                kept[key] = (self.shape, self.numel)
            return
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        self.shape, self.numel = found

    return kept_init


def _kept_np_dtypes(np_dtype: Callable[[Any], Any], tl: Any) -> Callable[[Any], Any]:
    """``_get_np_dtype`` with each type's answer kept: a block's is its element type's."""
    kept: dict[Any, Any] = {}

    def get(tt_dtype: Any) -> Any:
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return kept[key]
        except KeyError:
            kept[key] = found = np_dtype(key)
            return found
        except TypeError:  # an unhashable type: asked as before
            return np_dtype(tt_dtype)

    return get


def _skipping_patched_modules(patch_lang: Callable[[Any], Any], tl: Any) -> Callable[[Any], Any]:
    languages = (tl, tl.core)
    is_builtin = tl.core.is_builtin

    def patched(lang: Any) -> bool:
        # a launch's patch replaces every builtin of the module, program_id among them
        marker = getattr(lang, "program_id", None)
        return marker is not None and not is_builtin(marker)

    seen: dict[Any, list[Any]] = {}  # the language modules each jit function's globals hold

    def skipping(fn: Any) -> Any:
        langs = seen.get(fn)
        if langs is None:
            langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages]
            seen[fn] = langs
        if langs and all(patched(lang) for lang in langs):
            return _NothingToRestore()
        return patch_lang(fn)

    skipping.skips_patched_modules = True  # type: ignore[attr-defined]
    return skipping
