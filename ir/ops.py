"""The op registry: canonical op names, their cost class, and FLOPs/bytes rules.

Both front ends (``torch.fx.symbolic_trace`` and ``torch.export``) name the same computation differently
(``torch.nn.functional.linear``, ``nn.Linear``, ``aten.linear.default``...).  :func:`canonical_op` maps all of them to
one canonical name, and :data:`OP_RULES` gives each canonical op a kind and a cost rule.

FLOP conventions (the ones Megatron-LM's published formulas use, so calibration compares like with like):

* a multiply-add is 2 FLOPs; ``linear``/``matmul`` cost ``2*M*N*K`` forward and twice that backward
  (input gradient + weight gradient);
* attention (``sdpa``) costs ``2*B*H*Sq*Sk*(Dqk + Dv)`` forward, counting the full score matrix even when causal
  (as Megatron does), and twice that backward;
* convolution costs ``2 * out_numel * (C_in / groups) * prod(kernel)`` forward, twice that backward;
* other ops cost one FLOP per output element (a few for transcendental ones), backward the same; views cost nothing.

Bytes are what the op reads (all tensor inputs, parameters included) and writes (its outputs), unfused; views move
nothing.  An op the registry does not know is costed by bytes only and reported in ``Graph.unknown_ops``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Sequence

from autopar.ir.graph import TensorMeta

__all__ = ["OpKind", "OpRule", "OP_RULES", "ALIASES", "canonical_op", "op_cost", "KINDS"]


class OpKind(StrEnum):
    """The cost class of an op (``Node.kind``, ``OpRule.kind``).

    A ``StrEnum``: every member *is* its plain string (``OpKind.MATMUL == "matmul"``, same hash, ``str()`` and
    f-string give ``"matmul"``), so comparisons with strings, dict/set lookups, JSON and the graph fingerprint are
    unchanged; only ``repr`` differs, and YAML writers should store ``str(kind)``."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    CONV = "conv"
    EMBEDDING = "embedding"
    NORM = "norm"
    SOFTMAX = "softmax"
    LOSS = "loss"
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    COPY = "copy"
    GATHER = "gather"
    CREATION = "creation"
    VIEW = "view"
    INPUT = "input"
    UNKNOWN = "unknown"


KINDS: tuple[OpKind, ...] = tuple(OpKind)
"""Every op kind, in declaration order."""

Metas = Sequence["TensorMeta | None"]
FlopFn = Callable[[Metas, Sequence[TensorMeta], dict[str, Any]], float]


@dataclass(frozen=True, slots=True)
class OpRule:
    """How one canonical op is classified and costed."""

    kind: OpKind
    flops: FlopFn | None = None
    """Forward FLOPs from (input metas, output metas, attrs); None means ``per_elem`` FLOPs per output element."""
    bwd_factor: float = 1.0
    """Backward FLOPs as a multiple of forward FLOPs."""
    per_elem: float = 1.0


def _prod(xs: Sequence[int]) -> int:
    return math.prod(xs) if xs else 1


def _linear_flops(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    x, w = ins[0], ins[1]
    if x is None or w is None:
        return 0.0
    k = x.shape[-1] if x.shape else 1
    return 2.0 * outs[0].numel * k


def _matmul_flops(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    # addmm/baddbmm put the bias first: the contracted dim belongs to the first of the last two tensor inputs
    tensors = [m for m in ins if m is not None]
    if len(tensors) < 2:
        return 0.0
    a = tensors[-2]
    k = a.shape[-1] if a.shape else 1
    out_numel = outs[0].numel if outs else 0
    return 2.0 * out_numel * k


def _grouped_mm_flops(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    # x [S, K] (S = routed token-expert pairs, sorted by expert) times one expert's [K, N] weight per row group:
    # 2*S*K*N whatever the split of S over experts, i.e. exactly the top-k routed count (dropless)
    x = ins[0] if ins else None
    if x is None or not outs or not x.shape:
        return 0.0
    return 2.0 * outs[0].numel * x.shape[-1]


def _sdpa_flops(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    q, k, v = ins[0], ins[1], ins[2]
    if q is None or k is None or v is None:
        return 0.0
    *batch_heads, sq, dqk = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    return 2.0 * _prod(batch_heads) * sq * sk * (dqk + dv)


def _conv_flops(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    w = ins[1]
    if w is None:
        return 0.0
    return 2.0 * outs[0].numel * _prod(w.shape[1:])


def _einsum_flops(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    eq = str(attrs.get("equation", ""))
    tensors = [m for m in ins if m is not None]
    if "->" not in eq or "." in eq:
        return 2.0 * (outs[0].numel if outs else 0)
    lhs = eq.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for spec, meta in zip(lhs, tensors):
        for c, s in zip(spec.strip(), meta.shape):
            sizes[c] = s
    return 2.0 * _prod(list(sizes.values()))


def _zero(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    return 0.0


def _loss_flops(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    x = ins[0]
    return 4.0 * x.numel if x is not None else 0.0


def _reduction_flops(ins: Metas, outs: Sequence[TensorMeta], attrs: dict[str, Any]) -> float:
    x = ins[0] if ins else None
    return float(x.numel) if x is not None else 0.0


_P = OpRule(OpKind.POINTWISE)
_P4 = OpRule(OpKind.POINTWISE, per_elem=4.0)  # transcendental (gelu/silu/exp/tanh...)
_V = OpRule(OpKind.VIEW, flops=_zero, bwd_factor=0.0)
_C = OpRule(OpKind.COPY, flops=_zero)
_R = OpRule(OpKind.REDUCTION, flops=_reduction_flops)

OP_RULES: dict[str, OpRule] = {
    "linear": OpRule(OpKind.MATMUL, _linear_flops, 2.0),
    "matmul": OpRule(OpKind.MATMUL, _matmul_flops, 2.0),
    "einsum": OpRule(OpKind.MATMUL, _einsum_flops, 2.0),
    "grouped_mm": OpRule(OpKind.MATMUL, _grouped_mm_flops, 2.0),
    "sdpa": OpRule(OpKind.ATTENTION, _sdpa_flops, 2.0),
    "conv": OpRule(OpKind.CONV, _conv_flops, 2.0),
    "embedding": OpRule(OpKind.EMBEDDING, _zero),
    "layer_norm": OpRule(OpKind.NORM, per_elem=5.0),
    "rms_norm": OpRule(OpKind.NORM, per_elem=4.0),
    "batch_norm": OpRule(OpKind.NORM, per_elem=5.0),
    "group_norm": OpRule(OpKind.NORM, per_elem=5.0),
    "softmax": OpRule(OpKind.SOFTMAX, per_elem=5.0),
    "log_softmax": OpRule(OpKind.SOFTMAX, per_elem=5.0),
    "cross_entropy": OpRule(OpKind.LOSS, _loss_flops),
    "mse_loss": OpRule(OpKind.LOSS, _loss_flops),
    "nll_loss": OpRule(OpKind.LOSS, _loss_flops),
    # pointwise
    **{k: _P for k in ("add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "abs", "clamp", "where",
                        "masked_fill", "relu", "dropout", "cast", "reciprocal", "maximum", "minimum", "eq", "ne",
                        "lt", "gt", "le", "ge", "logical_not", "logical_and", "fill", "square", "floor_divide",
                        "remainder", "sign", "bitwise_and", "bitwise_or", "triu", "tril", "floor", "ceil",
                        "round", "isnan", "nan_to_num", "addcmul", "lerp")},
    **{k: _P4 for k in ("gelu", "silu", "sigmoid", "tanh", "exp", "log", "sin", "cos", "erf", "softplus",
                         "mish", "hardswish", "elu", "leaky_relu", "log1p", "expm1")},
    # reductions
    **{k: _R for k in ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "argmax", "argmin", "topk",
                        "cumsum", "norm", "prod", "any", "all", "sort", "pool", "logsumexp", "histc",
                        "argsort", "bincount")},
    # data movement
    **{k: _C for k in ("cat", "stack", "clone", "contiguous", "copy", "pad", "repeat", "roll", "flip")},
    **{k: OpRule(OpKind.GATHER, _zero) for k in ("gather", "scatter", "index_select", "index", "scatter_add",
                                            "index_put", "one_hot", "masked_select")},
    **{k: OpRule(OpKind.CREATION, _zero, 0.0) for k in ("arange", "zeros", "ones", "full", "empty", "zeros_like",
                                                   "ones_like", "full_like", "empty_like", "rand", "randn",
                                                   "rand_like", "randn_like", "scalar_tensor", "lift")},
    **{k: _V for k in ("view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "flatten",
                        "unflatten", "expand", "expand_as", "view_as", "getitem", "split", "chunk", "unbind",
                        "slice", "select", "narrow", "alias", "detach", "identity", "as_strided",
                        "movedim", "split_with_sizes", "view_as_real", "view_as_complex")},
}

#: front-end names -> canonical op (names not listed here map to themselves if they are in OP_RULES)
ALIASES: dict[str, str] = {
    # matmul family
    "mm": "matmul", "bmm": "matmul", "addmm": "matmul", "baddbmm": "matmul", "matmul": "matmul",
    "Linear": "linear", "NonDynamicallyQuantizableLinear": "linear", "__matmul__": "matmul",
    # grouped (per-expert) matmul of a sparse MoE: torch's, transformers' CPU fallback, the zoo's
    "_grouped_mm": "grouped_mm", "grouped_mm_fallback": "grouped_mm", "expert_mm": "grouped_mm",
    # attention
    "scaled_dot_product_attention": "sdpa", "_scaled_dot_product_flash_attention": "sdpa",
    "_scaled_dot_product_efficient_attention": "sdpa", "_scaled_dot_product_flash_attention_for_cpu": "sdpa",
    "_scaled_dot_product_cudnn_attention": "sdpa",
    # conv
    "conv1d": "conv", "conv2d": "conv", "conv3d": "conv", "convolution": "conv", "_convolution": "conv",
    "Conv1d": "conv", "Conv2d": "conv", "Conv3d": "conv",
    # embedding / norms / softmax / losses
    "Embedding": "embedding", "LayerNorm": "layer_norm", "native_layer_norm": "layer_norm", "RMSNorm": "rms_norm",
    "_fused_rms_norm": "rms_norm", "BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm", "_native_batch_norm_legit": "batch_norm",
    "native_batch_norm": "batch_norm", "_native_batch_norm_legit_functional": "batch_norm",
    "GroupNorm": "group_norm", "native_group_norm": "group_norm",
    "Softmax": "softmax", "_softmax": "softmax", "_log_softmax": "log_softmax", "LogSoftmax": "log_softmax",
    "CrossEntropyLoss": "cross_entropy", "MSELoss": "mse_loss", "nll_loss_forward": "nll_loss",
    "nll_loss_nd": "nll_loss", "nll_loss2d_forward": "nll_loss",
    # pointwise
    "__add__": "add", "__radd__": "add", "__iadd__": "add", "iadd": "add", "add_": "add", "rsub": "sub",
    "__sub__": "sub", "__rsub__": "sub", "__mul__": "mul", "__rmul__": "mul", "mul_": "mul", "imul": "mul",
    "truediv": "div", "__truediv__": "div", "__rtruediv__": "div", "div_": "div", "floordiv": "floor_divide",
    "__neg__": "neg", "__pow__": "pow", "pow_": "pow", "mod": "remainder", "sub_": "sub", "neg_": "neg",
    "ReLU": "relu", "relu_": "relu", "GELU": "gelu", "SiLU": "silu", "Sigmoid": "sigmoid", "Tanh": "tanh",
    "Dropout": "dropout", "native_dropout": "dropout", "dropout_": "dropout", "masked_fill_": "masked_fill",
    "clamp_min": "clamp", "clamp_max": "clamp", "clip": "clamp", "to": "cast", "type_as": "cast",
    "float": "cast", "half": "cast", "bfloat16": "cast", "type": "cast", "_to_copy": "cast", "long": "cast",
    "int": "cast", "bool": "cast", "double": "cast", "_assert_tensor_metadata": "identity",
    "ne_": "ne", "eq_": "eq", "fill_": "fill", "masked_fill.Scalar": "masked_fill", "ReLU6": "relu",
    "__and__": "bitwise_and", "__or__": "bitwise_or", "and_": "bitwise_and", "or_": "bitwise_or",
    "__invert__": "logical_not", "bitwise_not": "logical_not", "mean.dim": "mean", "sum.dim_IntList": "sum",
    "mul.Tensor": "mul", "silu_": "silu", "gelu_": "gelu", "exp_": "exp",
    "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__gt__": "gt", "__le__": "le", "__ge__": "ge",
    "eq.Scalar": "eq", "lt.Scalar": "lt",
    # reductions and pooling
    "max_pool2d": "pool", "avg_pool2d": "pool", "adaptive_avg_pool2d": "pool", "_adaptive_avg_pool2d": "pool",
    "max_pool2d_with_indices": "pool", "MaxPool2d": "pool", "AvgPool2d": "pool", "AdaptiveAvgPool2d": "pool",
    "max_pool1d": "pool", "adaptive_avg_pool1d": "pool", "mean_dim": "mean",
    # data movement
    "concat": "cat", "concatenate": "cat", "hstack": "cat", "vstack": "cat", "constant_pad_nd": "pad",
    "clone_": "clone", "copy_": "copy", "index_put_": "index_put", "scatter_add_": "scatter_add",
    "scatter_": "scatter", "index_add": "scatter_add", "index_copy": "scatter", "masked_scatter": "scatter",
    "new_zeros": "zeros", "new_ones": "ones", "new_full": "full", "new_empty": "empty",
    "lift_fresh_copy": "lift", "lift_fresh": "lift", "tensor": "creation_tensor",
    # views
    "_unsafe_view": "view", "Flatten": "flatten", "Identity": "identity", "transpose_": "transpose",
    "unsqueeze_": "unsqueeze", "squeeze_": "squeeze", "numpy_T": "t", "mT": "transpose", "T": "t",
    "slice_scatter": "scatter", "select_scatter": "scatter", "Unflatten": "unflatten", "swapaxes": "transpose",
    "swapdims": "transpose", "_reshape_alias": "view", "dropout.default": "dropout",
}


def canonical_op(name: str) -> str:
    """Map a front-end op name (function, method, module class or aten op name) to the canonical op name.

    Returns the input unchanged when it is unknown (the caller reports it)."""
    if name in OP_RULES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    stripped = re.sub(r"_+$", "", name)  # in-place variants: add_ -> add
    if stripped in OP_RULES:
        return stripped
    if stripped in ALIASES:
        return ALIASES[stripped]
    return name


def op_cost(op: str, ins: Metas, outs: Sequence[TensorMeta],
            attrs: dict[str, Any]) -> tuple[OpKind, float, float, float, float]:
    """(kind, flops_fwd, flops_bwd, bytes_read, bytes_written) of one op; unknown ops get ``kind='unknown'`` and a
    conservative bytes-only cost (everything read and written once, no FLOPs)."""
    rule = OP_RULES.get(op)
    read = float(sum(m.nbytes for m in ins if m is not None))
    written = float(sum(o.nbytes for o in outs))
    if rule is None:
        return OpKind.UNKNOWN, 0.0, 0.0, read, written
    if rule.kind == OpKind.VIEW:
        return OpKind.VIEW, 0.0, 0.0, 0.0, 0.0
    if rule.kind == OpKind.EMBEDDING:
        # a lookup reads one row per index, not the whole table
        idx = ins[1] if len(ins) > 1 and ins[1] is not None and ins[1].dtype.startswith("int") else ins[0]
        read = float((idx.nbytes if idx is not None else 0) + written)
    if rule.flops is not None:
        fwd = rule.flops(ins, outs, attrs)
    else:
        fwd = rule.per_elem * float(sum(o.numel for o in outs))
    return rule.kind, fwd, fwd * rule.bwd_factor, read, written
