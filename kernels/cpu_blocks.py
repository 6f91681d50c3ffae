"""float32 linear layers on the CPU over weights kept in the block-quantized form they came from.

A GGUF checkpoint (the embedded default is ``Q4_1``, its embedding ``Q8_0``) is converted into
float32 safetensors, and every one of its weights is then exactly a block code times a scale
(plus an offset): 32 values share a scale ``d`` (and ``m``), each value is ``q * d + m`` with
a 4-bit ``q``, or ``q * d`` with an 8-bit one. A CPU decode step reads every weight once, so at
4 bytes a value the float32 layers are bound by memory bandwidth (~540 MB a step for the
embedded model); the same values in blocks take 0.75 (Q4: 16 bytes of codes, a float32 scale
and offset per 32) or 1.125 bytes (Q8).

:func:`find_blocks` looks at a float32 weight and returns its blocks only when every value
rebuilds bit for bit (``q * d`` then ``+ m``, each rounded to float32, as torch computes them
and ``cpu_blocks.c`` unpacks them: that file is compiled with ``-ffp-contract=off``); one value
off and the layer stays dense. Nothing about the checkpoint's names or format is assumed: the
scale candidates are the block's span / 15 (Q4: the lowest value is the offset, as llama.cpp's
``Q4_1`` quantizer makes it) or its largest magnitude / 127 (Q8), in float32 and at the three
float16 values nearest (GGUF stores scales as float16), and whatever passes the exact rebuild is
kept. A float checkpoint's weights fail on their first blocks, in microseconds.

The products (:func:`linear`) are float32 throughout, by the very weights the model was loaded
with; they differ from sgemm's only in the order of the float32 sums, as sgemm's, sgemv's and
oneDNN's already do between themselves. The packed layout keeps 16 output rows side by side
(codes ``[N/16, K, 16]``, two to a byte for Q4), so the C kernel unpacks 16 outputs' weights
for each input into one AVX-512 register's worth (two AVX2 registers) and runs every row of
``x`` through them as a small GEMM does (a row's ``x[k]`` broadcast times those 16 weights into
its accumulator): each output is one chain over ``k`` in order (a product and a sum a step,
each rounded), so a row's result depends neither on the batch size nor on its place in the
batch, nor on which of the two builds ran. Weights of N not a multiple of 16 stay dense.

The kernel is built once per machine from ``cpu_blocks.c`` by the system's C compiler
(``$CC``, else ``cc``; ``-O3 -march=native -fopenmp``, cached under
``$TANDEM_CACHE_DIR/cpu_kernels`` by the source, the flags and the CPU's feature flags) and
loaded with ctypes; its OpenMP threads are torch's own runtime (the same ``libgomp``), as many
as ``torch.get_num_threads()``. It is written for AVX-512 and for AVX2 (smaller tiles
for 16 registers); without either, or without a compiler, the layers stay dense (one log line).
``TANDEM_CPU_BLOCKS=0`` keeps them dense (a benchmark's other side).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

ENV = "TANDEM_CPU_BLOCKS"
BLOCK = 32
GROUP = 16  # output rows the kernel keeps side by side
Q4, Q8 = 4, 8
# blocks checked before the whole weight (a float checkpoint's layer fails on its first ones)
_PROBE_BLOCKS = 64
_SOURCE = Path(__file__).with_name("cpu_blocks.c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")


def enabled() -> bool:
    """``TANDEM_CPU_BLOCKS`` does not turn the block layers off."""
    return os.environ.get(ENV, "1") != "0"


@dataclass(frozen=True)
class BlockWeight:
    """A [N, K] float32 weight in blocks of 32 along K. Q4: ``q`` uint8 [N, K/2] (byte j of a
    block: value j in its low nibble, value j + 16 in its high one), ``d`` and ``m`` float32
    [N, K/32], value ``q * d + m``; Q8: ``q`` int8 [N, K], ``d`` [N, K/32], value ``q * d``."""

    fmt: int
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)


def _scale_candidates(base: torch.Tensor) -> list[torch.Tensor]:
    """``base`` [nb, 1] float32 itself and the three float16 values nearest it, as float32."""
    half = base.clamp(max=65504.0).to(torch.float16)
    bits = half.view(torch.int16)
    up = (bits + 1).view(torch.float16)
    down = (bits - 1).clamp(min=0).view(torch.float16)
    return [half.float(), base, up.float(), down.float()]


def _fit(blocks: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes [nb, 32] int16, d [nb], m [nb]) rebuilding every block of ``blocks`` [nb, 32]
    exactly in ``fmt``, else None."""
    if fmt == Q4:
        offset = blocks.amin(1, keepdim=True)
        base, lo, hi = (blocks.amax(1, keepdim=True) - offset) / 15, 0, 15
    else:
        offset = torch.zeros_like(blocks[:, :1])
        base, lo, hi = blocks.abs().amax(1, keepdim=True) / 127, -128, 127
    nb = blocks.shape[0]
    codes = torch.zeros(nb, BLOCK, dtype=torch.int16)
    scale = torch.zeros(nb, 1)
    done = torch.zeros(nb, dtype=torch.bool)
    for cand in _scale_candidates(base):
        left = (~done).nonzero().squeeze(1)
        if left.numel() == 0:
            break
        vals, d, m = blocks[left], cand[left], offset[left]
        live = d > 0
        q = torch.where(live, torch.round((vals - m) / torch.where(live, d, 1.0)), 0.0)
        q = q.clamp(lo, hi)
        rebuilt = q * d
        if fmt == Q4:
            rebuilt = rebuilt + m  # a second rounding, as the kernel's
        ok = (rebuilt == vals).all(1) & torch.isfinite(d).squeeze(1)
        hit = left[ok]
        codes[hit] = q[ok].to(torch.int16)
        scale[hit] = d[ok]
        done[hit] = True
    if not bool(done.all()):
        return None
    return codes, scale.squeeze(1), offset.squeeze(1)


def _pack(codes: torch.Tensor, fmt: int, n: int, k: int) -> torch.Tensor:
    """Codes [N * K / 32, 32] (row-major blocks) in the kernel's layout: groups of 16 output
    rows side by side for each input, [N/16, K, 16] (Q8), or two rows a byte (Q4: [N/16, K, 8],
    row i in the low nibble and row i + 8 in the high one)."""
    side = codes.reshape(n // GROUP, GROUP, k).transpose(1, 2)  # [N/16, K, 16]
    if fmt == Q8:
        return side.to(torch.int8).contiguous()
    c = side.to(torch.uint8)
    return (c[..., : GROUP // 2] | (c[..., GROUP // 2 :] << 4)).contiguous()


def _side_by_side(per_row: torch.Tensor, n: int) -> torch.Tensor:
    """[N, K/32] scales (or offsets) as the kernel reads them: [N/16, K/32, 16]."""
    return per_row.reshape(n // GROUP, GROUP, -1).transpose(1, 2).contiguous()


def find_blocks(weight: torch.Tensor) -> BlockWeight | None:
    """``weight`` ([N, K] float32 on the CPU) as Q4 or Q8 blocks that rebuild it bit for bit,
    else None (other dtypes and devices, K not a multiple of 32, any value off)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or weight.dim() != 2
        or weight.is_mkldnn
        or weight.shape[1] % BLOCK
        or weight.shape[0] % GROUP
        or weight.numel() == 0
    ):
        return None
    n, k = weight.shape
    blocks = weight.detach().contiguous().view(-1, BLOCK)
    for fmt in (Q4, Q8):
        if _fit(blocks[:_PROBE_BLOCKS], fmt) is None:
            continue
        found = _fit(blocks, fmt)
        if found is None:
            continue
        codes, d, m = found
        return BlockWeight(
            fmt,
            _pack(codes, fmt, n, k),
            _side_by_side(d.reshape(n, k // BLOCK), n),
            _side_by_side(m.reshape(n, k // BLOCK), n) if fmt == Q4 else None,
            n,
            k,
        )
    return None


def ref_dequantize(bw: BlockWeight) -> torch.Tensor:
    """The dense [N, K] float32 weight, in torch (the reference the kernel is tested against)."""
    n, k = bw.out_features, bw.in_features
    if bw.fmt == Q8:
        codes = bw.q.float()  # [N/16, K, 16]
    else:
        codes = torch.cat([bw.q & 15, bw.q >> 4], dim=-1).float()
    # [N/16, K/32, 32, 16]: each block's 32 codes of 16 rows, its scales [N/16, K/32, 1, 16]
    blocks = codes.reshape(n // GROUP, k // BLOCK, BLOCK, GROUP)
    values = blocks * bw.d.unsqueeze(2)
    if bw.m is not None:
        values = values + bw.m.unsqueeze(2)
    return values.reshape(n // GROUP, k, GROUP).transpose(1, 2).reshape(n, k)


def ref_linear(x: torch.Tensor, bw: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, ref_dequantize(bw), bias)


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (built once per machine and cached), or None where it cannot be had."""
    return build()


def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel compiled with ``extra_flags`` after the usual ones (cached as :func:`library`
    is; a test builds the AVX2 variant on an AVX-512 machine with ``-mno-avx512f``), or None."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): block-quantized CPU weights stay float32")
        return None
    source = _SOURCE.read_bytes()
    flags = (*_FLAGS, *extra_flags)
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), cc.encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    root = Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))
    path = root / "cpu_kernels" / key / "libtandem_cpu_blocks.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
            os.close(fd)
            try:
                subprocess.run(
                    [cc, *flags, str(_SOURCE), "-o", tmp],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                os.replace(tmp, path)  # atomic: concurrent workers never load a partial file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the CPU block kernel did not build (%s): weights stay float32", detail)
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.tq_block_linear.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.tq_block_linear.argtypes += [i64, ctypes.c_int]
    lib.tq_block_linear.restype = ctypes.c_int
    lib.tq_block_isa.argtypes = []
    lib.tq_block_isa.restype = ctypes.c_int
    if lib.tq_block_isa() not in (512, 256):
        log.info("the CPU block kernel needs AVX-512 or AVX2: block-quantized weights stay float32")
        return None
    return lib


def _m_ptr(bw: BlockWeight) -> int | None:
    return bw.m.data_ptr() if bw.m is not None else None


def linear(x: torch.Tensor, bw: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` [..., K] float32 on the CPU: [..., N]."""
    lib = library()
    if lib is None:  # (layers are only swapped in where the kernel built)
        return ref_linear(x, bw, bias)
    if x.dtype != torch.float32 or x.shape[-1] != bw.in_features:
        raise ValueError(
            f"a block-weight linear takes float32 [..., {bw.in_features}], got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, bw.in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = run(lib, x2, bw)
    if bias is not None:
        y += bias
    return y.reshape(*lead, bw.out_features)


def run(lib: ctypes.CDLL, x2: torch.Tensor, bw: BlockWeight) -> torch.Tensor:
    """``x2 @ W^T`` by ``lib`` (:func:`library` or a :func:`build`): x2 [rows, K] float32 with
    unit column stride, checked by the caller; a new [rows, N]."""
    rows = x2.shape[0]
    y = torch.empty(rows, bw.out_features)
    if rows:
        status = lib.tq_block_linear(
            bw.fmt, x2.data_ptr(), rows, bw.in_features, x2.stride(0), bw.q.data_ptr(),
            bw.d.data_ptr(), _m_ptr(bw), bw.out_features, y.data_ptr(), y.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"the CPU block kernel failed ({status}): no unpacking buffer")
    return y


class BlockLinear(nn.Module):
    """A linear layer whose weight is a :class:`BlockWeight` (its blocks are buffers, so the
    module's memory is counted and moved like any other's)."""

    def __init__(self, bw: BlockWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = bw.fmt, bw.in_features, bw.out_features
        self.register_buffer("q", bw.q)
        self.register_buffer("d", bw.d)
        self.register_buffer("m", bw.m)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def blocks(self) -> BlockWeight:
        m = self.m if isinstance(self.m, torch.Tensor) else None
        return BlockWeight(self.fmt, self.q, self.d, m, self.out_features, self.in_features)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.blocks, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q{self.fmt}"


def pack_blocks(model: nn.Module, kinds: tuple[type[nn.Module], ...]) -> int:
    """Swap each module of exactly one of ``kinds`` (a float32 ``Linear`` on the CPU) whose
    weight is exactly block-quantized for a :class:`BlockLinear`; the number swapped. A module
    whose weight is also read as a tensor (``keep_dense_weight``) keeps it; a weight shared
    with a module that stays (the embedding an lm_head is tied to) stays there too."""
    if not enabled():
        return 0
    targets = [
        (parent, attr, child)
        for parent in model.modules()
        for attr, child in parent.named_children()
        if type(child) in kinds and not getattr(child, "keep_dense_weight", False)
    ]
    if not targets or library() is None:
        return 0
    count = 0
    for parent, attr, child in targets:
        weight = getattr(child, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        bw = find_blocks(weight)
        if bw is None:
            continue
        bias = child.bias if isinstance(child.bias, torch.Tensor) else None
        setattr(parent, attr, BlockLinear(bw, bias))
        count += 1
    return count
