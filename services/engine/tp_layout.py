"""Which part of the model each tensor-parallel rank holds: plain arithmetic, no torch.

Query heads are split by KV group, so each rank attends with whole groups of its own KV heads:
with at least as many KV heads as ranks, each rank takes a contiguous run of KV heads (runs
differ by at most one head: SmolLM2's 3 KV heads over 2 ranks are 2 + 1) and their query heads;
with fewer KV heads than ranks, each KV head is replicated on ``size / Hkv`` ranks, which split
its query heads. The MLP's intermediate rows split the same way (column-parallel gate/up,
row-parallel down); the vocabulary is split into equal shards of ``ceil(V / size)`` rows, the
last one padded, so the logits gather is one equal-sized all-gather. A Mixture-of-Experts layer
keeps every expert on every rank, each with its share of the expert's intermediate rows (the
router replicated, the block's output summed over the ranks, as a row-parallel layer's; a
shared expert, DeepSeek's, Qwen2-MoE's, Granite's or ERNIE's, split as an MLP). DeepSeek's latent attention splits by head too, each
projection at its own per-head width (q: nope + rope dims, kv_b: nope + value, o_proj's input:
value), its latent projections whole on every rank. A vision-language model's vision tower is whole on every rank (each encodes the step's images;
its language model splits as any).

Quantized checkpoints split the same way: each piece of a quantized layer (an fp8 weight and its
block or per-channel scales; AWQ's and GPTQ's packed weights, zero points and group scales) is
cut where the float weight would be, its own dimension and packing taken into account (a block
of 128 rows, 8 values to an int32, a group of input rows). A rank's span must then start and end
on those units: ``TPLayout.of`` refuses, naming the layer and the unit, a model whose heads or
MLP rows do not. GPTQ act-order (and compressed-tensors actorder "group") checkpoints are
refused (their groups run across every rank's input rows).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from services.config import ConfigError
from services.engine.model_config import VISION_TOWERS, ArchConfig, MlaConfig

if TYPE_CHECKING:  # torch-free here; the package imports the quantized layers (and torch)
    from services.engine.quantization.config import QuantConfig

Span = tuple[int, int]  # [start, end)

# checkpoint tensor name -> (which span, the dimension it cuts); anything else is replicated
_SLICES = {
    "q_proj": ("q", 0),
    "k_proj": ("kv", 0),
    "v_proj": ("kv", 0),
    "o_proj": ("q", 1),
    "gate_proj": ("mlp", 0),
    "up_proj": ("mlp", 0),
    "down_proj": ("mlp", 1),
    "c_fc": ("mlp", 0),  # StarCoder2's MLP (not gated)
    "c_proj": ("mlp", 1),
}
# a quantized projection's pieces beside (or instead of) its weight: fp8 scales, AWQ's and GPTQ's
# packed words, zero points, group scales and act-order indices, compressed-tensors' int4 ones
QUANT_PIECES = (
    "weight_scale_inv|weight_scale|qweight|qzeros|scales|g_idx"
    "|weight_packed|weight_zero_point|weight_g_idx|weight_shape"
)
_PIECE = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|c_fc|c_proj)\."
    rf"(weight|bias|{QUANT_PIECES})$"
)
# a projection a checkpoint stores fused (Phi-3's), as our layers hold it: a rank's rows of it
# are one run per piece (q, k, v; gate, up)
_FUSED = re.compile(r"\.(qkv_proj|gate_up_proj)\.(weight|bias)$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_HEAD_NORMS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")
_VISION = VISION_TOWERS  # a vision tower's (and projector's) tensors: whole on every rank
# one expert's tensor as checkpoints store them (Qwen3-MoE's names; Mixtral's w1 / w3 / w2):
# gate and up cut along their rows, down along its columns
_EXPERT = re.compile(
    r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\."
    rf"(weight|{QUANT_PIECES})$"
)
# DeepSeek's attention projections cut by head at their own widths (the span of
# TPLayout._mla_spans, the dimension), every piece of them (a float weight, or a quantized
# one's scales, packed words and zeros) in its own units; its other attention tensors are whole
_MLA_CUTS = {
    ".self_attn.q_proj": ("q", 0), ".self_attn.q_b_proj": ("q", 0),
    ".self_attn.kv_b_proj": ("kv_b", 0), ".self_attn.o_proj": ("o", 1),
}  # fmt: skip
# a shared expert's projection, cut by its intermediate rows as an MLP's: DeepSeek's, GLM-4.5's
# and ERNIE 4.5's ``shared_experts``, Qwen2-MoE's ``shared_expert``, Granite MoE's
# ``shared_mlp`` (gate and up stacked in ``input_linear``, as ours in ``gate_up_proj``)
_SHARED = re.compile(
    r"\.(?:shared_experts?|shared_mlp)\."
    r"(gate_proj|up_proj|down_proj|output_linear|gate_up_proj|input_linear)\."
    rf"(weight|bias|{QUANT_PIECES})$"
)


@dataclass(frozen=True)
class PieceCut:
    """Where one checkpoint piece holds a float weight's output rows (``rows``) and input
    columns (``cols``): (the piece's dimension, units of the weight per entry along it); None:
    the piece is whole on every rank along that axis (a per-channel scale's columns)."""

    rows: tuple[int, int] | None
    cols: tuple[int, int] | None


def piece_cuts(piece: str, qcfg: QuantConfig | None) -> PieceCut | None:
    """How ``piece`` of a projection is laid out; None: the rank does not load it at all."""
    if piece in ("weight", "bias") or qcfg is None:
        return PieceCut((0, 1), (1, 1))
    if qcfg.method == "fp8":
        if piece == "weight_scale_inv" and qcfg.weight_block is not None:
            bn, bk = qcfg.weight_block
            return PieceCut((0, bn), (1, bk))
        return PieceCut((0, 1), None)  # weight_scale: per channel [N, 1] (or one per tensor)
    if qcfg.method == "compressed-tensors":  # by output row, as the float weight
        groups = None if qcfg.channel else (1, qcfg.group_size)  # per channel: whole rows
        if piece == "weight_packed":  # [N, K/8]
            return PieceCut((0, 1), (1, 8))
        if piece == "weight_scale":  # [N, K/G]
            return PieceCut((0, 1), groups)
        if piece == "weight_zero_point":  # [N/8, K/G]
            return PieceCut((0, 8), groups)
        return None  # weight_shape (the whole tensor's), weight_g_idx without act-order
    group, awq = qcfg.group_size, qcfg.method == "awq"
    if piece == "qweight":  # AWQ [K, N/8]; GPTQ [K/8, N]
        return PieceCut((1, 8), (0, 1)) if awq else PieceCut((1, 1), (0, 8))
    if piece == "qzeros":  # [K/G, N/8]
        return PieceCut((1, 8), (0, group))
    if piece == "scales":  # [K/G, N]
        return PieceCut((1, 1), (0, group))
    return None  # g_idx without act-order: the trivial order, not needed


def _alignment(qcfg: QuantConfig) -> tuple[int, int]:
    """(rows, columns) of the float weight a rank's span must be a multiple of."""
    if qcfg.method == "fp8":
        return qcfg.weight_block or (1, 1)
    # per channel: the rank's input columns then served in groups of 32 at least (channel_group)
    return 8, 32 if qcfg.channel else qcfg.group_size


def _mla_whole(arch: ArchConfig) -> dict[str, int]:
    """The whole model's rows of the spans of ``TPLayout._mla_spans``: DeepSeek's q projection,
    kv_b and o_proj's input."""
    m, nq = arch.mla, arch.num_heads
    if m is None:
        return {}
    return {"q": nq * m.qk_head_dim, "kv_b": nq * (m.qk_nope_head_dim + m.v_head_dim),
            "o": nq * m.v_head_dim}  # fmt: skip


def split(n: int, parts: int, index: int) -> Span:
    """The index-th of ``parts`` contiguous runs of ``n`` items, the first ones one longer."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class CheckpointSlice:
    dim: int  # 0: rows (out features, vocab), 1: columns (in features)
    start: int
    end: int
    pad_to: int | None = None  # rows the rank's parameter has (a padded vocabulary shard)
    skip: bool = False  # the rank does not load this tensor
    runs: tuple[Span, ...] = ()  # rows of several runs, joined in order (a fused tensor)


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span  # the real rows of this rank's vocabulary shard
    vocab_shard: int  # rows of every rank's shard (the last one padded)
    head_dim: int
    quant: QuantConfig | None = None  # a quantized checkpoint's format (None: float weights)
    moe_intermediate: Span = (0, 0)  # each expert's intermediate rows this rank holds
    # the whole model's rows of q, of k (and of v), of the MLP's intermediate
    whole_rows: tuple[int, int, int] = (0, 0, 0)
    # OLMo 2's q/k norms over the whole projection: their weights cut as the q and k rows
    qk_norm_whole: bool = False
    # DeepSeek's latent attention: its projections cut by head at their own widths
    # (``_mla_slice``); an MoE's shared expert's intermediate rows this rank holds
    mla: MlaConfig | None = None
    shared_intermediate: Span = (0, 0)
    shared_whole: int = 0  # the whole shared expert's intermediate rows

    @classmethod
    def of(
        cls, arch: ArchConfig, rank: int, size: int, quant: QuantConfig | None = None
    ) -> TPLayout:
        """This rank's part; ConfigError naming the cause when the model cannot be split.
        ``quant``: the quantization of the checkpoint as loaded (None for float weights, and
        for fp8 quantized at load time, which quantizes each rank's float slice)."""
        nq, nkv = arch.num_heads, arch.num_kv_heads
        where = f"--tensor-parallel-size {size}"
        if quant is not None and quant.desc_act:
            raise ConfigError(
                f"{where}: act-order checkpoints (GPTQ desc_act, compressed-tensors actorder "
                '"group") are not split (their groups mix every rank\'s input rows); use 1, '
                "or a checkpoint without act-order"
            )
        if nq % nkv:
            raise ConfigError(f"{where}: {nq} query heads are not a multiple of {nkv} KV heads")
        if arch.mla is not None:  # the latent cache's one KV head: every rank holds it whole
            if nq < size:
                raise ConfigError(f"{where}: {nq} query heads cannot be split over {size} ranks")
            q, kv = split(nq, size, rank), (0, nkv)
        elif nkv >= size:
            kv = split(nkv, size, rank)
            q = (kv[0] * nq // nkv, kv[1] * nq // nkv)
        elif size % nkv or nq % size:
            raise ConfigError(
                f"{where}: {nkv} KV heads and {nq} query heads cannot be split over {size} "
                f"ranks (with fewer KV heads than ranks, the ranks must be a multiple of the KV "
                "heads and divide the query heads)"
            )
        else:
            per_kv = size // nkv  # ranks sharing one replicated KV head
            kv = (rank // per_kv, rank // per_kv + 1)
            q = (rank * nq // size, (rank + 1) * nq // size)
        if arch.intermediate_size < size:
            raise ConfigError(f"{where}: intermediate size {arch.intermediate_size} is too small")
        shard = -(-arch.vocab_size // size)
        vocab = (min(rank * shard, arch.vocab_size), min((rank + 1) * shard, arch.vocab_size))
        mlp = split(arch.intermediate_size, size, rank)
        experts, shared = (0, 0), (0, 0)
        shared_whole = arch.moe.shared_intermediate_size if arch.moe is not None else 0
        if shared_whole:  # split as an MLP, its partial sum joining the experts'
            if shared_whole < size:
                raise ConfigError(f"{where}: the shared experts' size is too small")
            shared = split(shared_whole, size, rank)
        if arch.moe is not None:
            if arch.moe.intermediate_size < size:
                raise ConfigError(
                    f"{where}: the experts' intermediate size {arch.moe.intermediate_size} is "
                    "too small"
                )
            experts = split(arch.moe.intermediate_size, size, rank)
        whole = (nq * arch.head_dim, nkv * arch.head_dim, arch.intermediate_size)
        layout = cls(rank, size, q, kv, mlp, vocab, shard, arch.head_dim, quant, experts, whole,
                     arch.qk_norm_whole, arch.mla, shared, shared_whole)  # fmt: skip
        if size > 1 and quant is not None and quant.serialized:
            layout._check_alignment(arch, where)
        return layout

    def _check_alignment(self, arch: ArchConfig, where: str) -> None:
        """Every rank's cut of a quantized layer lands on its format's units (any rank: the
        spans of all ranks are checked, so every rank refuses alike)."""
        assert self.quant is not None
        rows, cols = _alignment(self.quant)
        d = arch.head_dim
        what = {"fp8": "fp8 block", "awq": "AWQ", "gptq": "GPTQ",
                "compressed-tensors": "compressed-tensors int4"}[self.quant.method]  # fmt: skip
        for r in range(self.size):
            other = TPLayout.of(arch, r, self.size)
            q = (other.q_heads[0] * d, other.q_heads[1] * d, arch.num_heads * d)
            kv = (other.kv_heads[0] * d, other.kv_heads[1] * d, arch.num_kv_heads * d)
            mlp = (*other.intermediate, arch.intermediate_size)
            checks = [  # (what is cut, its span, the unit it must fall on, along which axis)
                ("q_proj rows", q, rows, "rows"), ("o_proj input columns", q, cols, "columns"),
                ("k_proj and v_proj rows", kv, rows, "rows"),
                ("gate_proj and up_proj rows", mlp, rows, "rows"),
                ("down_proj input columns", mlp, cols, "columns"),
            ]  # fmt: skip
            if arch.mla is not None:  # the latent attention's, at its own per-head widths
                spans, mla = other._mla_spans(), _mla_whole(arch)
                checks = [
                    *checks[3:],
                    ("q_proj (q_b_proj) rows", (*spans["q"], mla["q"]), rows, "rows"),
                    ("kv_b_proj rows", (*spans["kv_b"], mla["kv_b"]), rows, "rows"),
                    ("o_proj input columns", (*spans["o"], mla["o"]), cols, "columns"),
                ]  # fmt: skip
            if self.shared_whole:
                shared = (*other.shared_intermediate, self.shared_whole)
                checks += [("shared experts' gate and up rows", shared, rows, "rows"),
                           ("shared experts' down input columns", shared, cols, "columns")]  # fmt: skip
            if arch.moe is not None:
                experts = (*other.moe_intermediate, arch.moe.intermediate_size)
                checks += [("experts' gate and up rows", experts, rows, "rows"),
                           ("experts' down input columns", experts, cols, "columns")]  # fmt: skip
            for name, (start, end, whole), unit, axis in checks:
                if start % unit or (end % unit and end != whole):
                    raise ConfigError(
                        f"{where}: rank {r}'s {name} [{start}, {end}) do not fall on the {what} "
                        f"unit of {unit} {axis}; use a tensor-parallel size that cuts them on "
                        "whole units (or 1)"
                    )

    def local_arch(self, arch: ArchConfig) -> ArchConfig:
        """The plain model this rank builds: its heads, its MLP rows (and experts' rows), its
        vocabulary shard."""
        moe = arch.moe
        if moe is not None:
            moe = replace(
                moe, intermediate_size=self.moe_intermediate[1] - self.moe_intermediate[0]
            )
            shared = self.shared_intermediate[1] - self.shared_intermediate[0]
            moe = replace(moe, shared_intermediate_size=shared)
        return replace(
            arch,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab_shard,
            moe=moe,
        )

    def checkpoint_slice(
        self, name: str, shape: tuple[int, ...] | None = None
    ) -> CheckpointSlice | None:
        """The part of an HF checkpoint tensor (of ``shape``) this rank loads; None: all of it
        (norms, and a per-tensor scale, a vision tower)."""
        if name.startswith(_VISION):
            return None
        name = name.replace("model.language_model.", "model.")  # transformers 5's VL names
        if name in _VOCAB:
            return CheckpointSlice(0, *self.vocab, pad_to=self.vocab_shard)
        if self.mla is not None and ".self_attn." in name:
            return self._mla_slice(name, shape)
        shared = _SHARED.search(name)
        if shared is not None and self.shared_intermediate != (0, 0):
            return self._shared_slice(shared.group(1), shared.group(2), shape)
        fused = _FUSED.search(name)
        if fused is not None:
            return CheckpointSlice(0, 0, 0, runs=self.fused_runs(fused.group(1)))
        if name.endswith(_HEAD_NORMS) and self.qk_norm_whole:  # [H D]: the rank's rows
            return CheckpointSlice(
                0, *self.row_spans()["q" if name.endswith(_HEAD_NORMS[0]) else "kv"]
            )
        if name.endswith(_HEAD_NORMS) and shape is not None and len(shape) == 2:
            # a weight per head (Cohere's q/k LayerNorms, [H, D]): the rank's heads
            heads = self.q_heads if name.endswith(_HEAD_NORMS[0]) else self.kv_heads
            return CheckpointSlice(0, *heads)
        expert = _EXPERT.search(name)
        if expert is not None:  # an expert's gate/up rows, or its down projection's columns
            dim = int(expert.group(1) in ("down_proj", "w2"))
            return self._piece_slice(expert.group(2), dim, self.moe_intermediate, shape)
        match = _PIECE.search(name)
        if match is None:
            return None
        span, dim = _SLICES[match.group(1)]
        return self._piece_slice(match.group(2), dim, self.row_spans()[span], shape)

    def _piece_slice(
        self, piece: str, dim: int, span: Span, shape: tuple[int, ...] | None
    ) -> CheckpointSlice | None:
        """The rank's part of one checkpoint piece (a weight, or a quantized weight's packed
        words, scales or zeros) of a projection whose rows (``dim`` 0) or input columns (1)
        the rank holds ``span`` of; None for a row-parallel layer's bias, added once after the
        all-reduce."""
        if piece == "bias" and dim == 1:
            return None
        cuts = piece_cuts(piece, self.quant)
        if cuts is None:
            return CheckpointSlice(0, 0, 0, skip=True)
        if piece == "weight_scale" and shape is not None and math.prod(shape) == 1:
            return None  # one scale for the whole tensor
        cut = cuts.rows if dim == 0 else cuts.cols
        if cut is None:
            return None
        start, end = span
        tensor_dim, unit = cut
        return CheckpointSlice(tensor_dim, start // unit, -(-end // unit))

    def _shared_slice(
        self, proj: str, piece: str, shape: tuple[int, ...] | None
    ) -> CheckpointSlice | None:
        """A shared expert's tensor: its gate and up rows (a stacked gate/up tensor's two runs),
        its down projection's input columns, each quantized piece in its own units."""
        if proj in ("gate_up_proj", "input_linear"):  # [2I, H]: the rank's rows of each half
            if piece not in ("weight", "bias"):
                raise ConfigError(
                    f"--tensor-parallel-size {self.size}: a quantized stacked shared expert "
                    f"({proj}.{piece}) is not split over ranks: use 1"
                )
            s0, s1 = self.shared_intermediate
            whole = self.shared_whole
            return CheckpointSlice(0, 0, 0, runs=((s0, s1), (whole + s0, whole + s1)))
        dim = int(proj in ("down_proj", "output_linear"))
        return self._piece_slice(piece, dim, self.shared_intermediate, shape)

    def _mla_spans(self) -> dict[str, Span]:
        """This rank's rows of DeepSeek's q projection (each head's qk dims), of kv_b (each
        head's nope key and value) and of the o_proj input (each head's value)."""
        if self.mla is None:
            return {}
        (h0, h1), m = self.q_heads, self.mla
        kv = m.qk_nope_head_dim + m.v_head_dim
        return {"q": (h0 * m.qk_head_dim, h1 * m.qk_head_dim), "kv_b": (h0 * kv, h1 * kv),
                "o": (h0 * m.v_head_dim, h1 * m.v_head_dim)}  # fmt: skip

    def _mla_slice(self, name: str, shape: tuple[int, ...] | None = None) -> CheckpointSlice | None:
        """A DeepSeek attention tensor's part: q and kv_b by rows, o_proj by columns, each
        piece of a quantized one (fp8 block scales, AWQ's and GPTQ's packed words, zeros and
        group scales) in its own units; the latent projections and norms (and o_proj's bias,
        added once after the sum) whole."""
        module, _, piece = name.rpartition(".")
        for suffix, (span, dim) in _MLA_CUTS.items():
            if module.endswith(suffix):
                return self._piece_slice(piece, dim, self._mla_spans()[span], shape)
        return None

    def _mla_param_slice(self, name: str, arch: ArchConfig) -> tuple[int, int, list[Span]] | None:
        """``param_slice`` of DeepSeek's attention."""
        spans, whole = self._mla_spans(), _mla_whole(arch)
        for suffix, (span, dim) in _MLA_CUTS.items():
            if name.endswith(f"{suffix}.weight"):
                return dim, whole[span], [spans[span]]
        return None

    def fused_runs(self, fused: str) -> tuple[Span, ...]:
        """This rank's rows of a whole fused projection: its q, k and v rows of ``qkv_proj``,
        its gate and up rows of ``gate_up_proj``."""
        spans = self.row_spans()
        q_rows, kv_rows, mlp_rows = self.whole_rows
        if fused == "qkv_proj":
            (q0, q1), (k0, k1) = spans["q"], spans["kv"]
            v = q_rows + kv_rows
            return (q0, q1), (q_rows + k0, q_rows + k1), (v + k0, v + k1)
        (i0, i1) = spans["mlp"]
        return (i0, i1), (mlp_rows + i0, mlp_rows + i1)

    def row_spans(self) -> dict[str, Span]:
        """This rank's rows of the whole q projection, of k and v, and of the MLP's
        intermediate: where its column-parallel layers' outputs (and its row-parallel layers'
        inputs) lie in the whole model's."""
        d = self.head_dim
        return {
            "q": (self.q_heads[0] * d, self.q_heads[1] * d),
            "kv": (self.kv_heads[0] * d, self.kv_heads[1] * d),
            "mlp": self.intermediate,
        }

    def on_one_rank(self, name: str) -> bool:
        """A bias added inside a computation the ranks sum (gpt-oss's experts' down projection
        bias, added before the router weight): rank 0 holds it, the others zeros."""
        return name.endswith("experts.down_proj_bias")

    def param_slice(self, name: str, arch: ArchConfig) -> tuple[int, int, list[Span]] | None:
        """Where this rank's part of our (fused) parameter ``name`` lies in the whole model's
        (``arch``): the dimension, the whole size along it, the spans to concatenate; None: all
        of it. Random ``--load-format dummy`` weights are drawn whole and cut here, so N ranks
        hold the weights of one."""
        d, nq, nkv, inter = arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.intermediate_size
        q = (self.q_heads[0] * d, self.q_heads[1] * d)
        kv = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        mlp = self.intermediate
        if name.startswith(_VISION):
            return None
        if name in _VOCAB:
            return 0, arch.vocab_size, [self.vocab]
        if self.mla is not None and ".self_attn." in name:
            return self._mla_param_slice(name, arch)
        shared = _SHARED.search(name)
        if shared is not None and self.shared_intermediate != (0, 0):  # ours: gate_up, down
            (s0, s1), i = self.shared_intermediate, self.shared_whole
            if shared.group(1) == "gate_up_proj":
                return 0, 2 * i, [(s0, s1), (i + s0, i + s1)]
            return (1, i, [(s0, s1)]) if shared.group(2) == "weight" else None
        if name.endswith("experts.gate_up_proj") and arch.moe is not None:  # [E, 2I, H]
            e, i = self.moe_intermediate, arch.moe.intermediate_size
            return 1, 2 * i, [e, (i + e[0], i + e[1])]
        if name.endswith("experts.down_proj") and arch.moe is not None:  # [E, H, I]
            return 2, arch.moe.intermediate_size, [self.moe_intermediate]
        if name.endswith("experts.gate_up_proj_bias") and arch.moe is not None:  # [E, 2I]
            e, i = self.moe_intermediate, arch.moe.intermediate_size
            return 1, 2 * i, [e, (i + e[0], i + e[1])]
        if name.endswith("self_attn.sinks"):  # [Hq]: one per query head
            return 0, nq, [self.q_heads]
        if ".qkv_proj." in name:
            k, v = nq * d, (nq + nkv) * d
            return 0, (nq + 2 * nkv) * d, [q, (k + kv[0], k + kv[1]), (v + kv[0], v + kv[1])]
        if name.endswith(".o_proj.weight"):
            return 1, nq * d, [q]
        if ".gate_up_proj." in name:
            return 0, 2 * inter, [mlp, (inter + mlp[0], inter + mlp[1])]
        if name.endswith(".down_proj.weight"):
            return 1, inter, [mlp]
        if name.endswith((".c_fc.weight", ".c_fc.bias")):  # StarCoder2's MLP
            return 0, inter, [mlp]
        if name.endswith(".c_proj.weight"):
            return 1, inter, [mlp]
        return None
