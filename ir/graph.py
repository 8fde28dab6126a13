"""The graph IR: frozen dataclasses describing what a model computes.

A :class:`Graph` is a topologically ordered tuple of :class:`Node` s.  Each node is one tensor operation with a
canonical op name (see :mod:`autopar.ir.ops`), the names of the values it reads (other nodes, or parameter/buffer
FQNs), the metadata of the tensors it produces, the module it came from, and its forward/backward FLOPs and bytes.  No
weight is ever stored: parameters are described by :class:`ParamInfo` (name, shape, dtype).  Graph queries that need
more than one node live on :class:`Graph`: what an input is (:meth:`Graph.input_meta`), which tensor owns a view's
storage (:meth:`Graph.storage_key`), and what autograd saves for a node's backward (:meth:`Graph.saved_tensors`).

Graphs are values.  Passes build new graphs with :func:`dataclasses.replace`; :func:`autopar.ir.verify` checks the
invariants.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

__all__ = ["TensorMeta", "ParamInfo", "Node", "LayerGroup", "Graph", "SavedTensor", "DTYPE_BYTES", "FLOAT_DTYPES"]

#: bytes per element of the dtypes the IR knows (``str(torch.dtype)`` without the ``torch.`` prefix)
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
#: floating-point dtypes: the values that carry gradients
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
# what autograd saves for backward, by op (Graph.saved_tensors)
_SAVE_INPUT = frozenset({"gelu", "silu", "relu", "sigmoid", "tanh", "exp", "log", "sin", "cos", "erf", "softplus",
                         "mish", "hardswish", "elu", "leaky_relu", "log1p", "expm1", "pow", "square", "sqrt",
                         "abs", "clamp", "maximum", "minimum"})
_SAVE_OUTPUT = frozenset({"softmax", "log_softmax", "rsqrt", "reciprocal"})


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of one tensor value (no data)."""

    shape: tuple[int, ...]
    """Concrete sizes; symbolic sizes are specialised to the example inputs' sizes."""
    dtype: str
    """dtype name without the ``torch.`` prefix, e.g. ``"float32"``."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A parameter or buffer of the model, by its canonical (first, de-duplicated) fully qualified name."""

    name: str
    meta: TensorMeta
    kind: Literal["param", "buffer"] = "param"
    aliases: tuple[str, ...] = ()
    """Other FQNs that refer to the same tensor (tied weights such as ``lm_head.weight``)."""


@dataclass(frozen=True, slots=True)
class Node:
    """One tensor operation."""

    name: str
    """Unique name inside the graph (from the front end, e.g. ``linear_3``)."""
    op: str
    """Canonical op name from :mod:`autopar.ir.ops` (``linear``, ``sdpa``, ``layer_norm``, ``add``, ``view``...)."""
    kind: str
    """Cost class of the op: matmul, attention, conv, embedding, norm, softmax, loss, pointwise, reduction,
    copy, gather, creation, view, input, unknown."""
    inputs: tuple[str, ...]
    """Values read, in argument order: node names or parameter/buffer FQNs."""
    outputs: tuple[TensorMeta, ...]
    """Tensors produced (most ops produce one; ``split`` produces several)."""
    module_path: str = ""
    """FQN of the innermost module the op was called from, e.g. ``blocks.3.attn`` ("" for the root)."""
    module_type: str = ""
    """Class name of that module."""
    params: tuple[str, ...] = ()
    """The subset of ``inputs`` that are parameters or buffers."""
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    attrs: tuple[tuple[str, Any], ...] = ()
    """Non-tensor arguments that matter to sharding and cost (dims, causal flag...), as sorted (key, value) pairs."""
    target: str = ""
    """The front end's original target (``aten.linear.default``, ``torch.nn.Linear``...), for messages."""

    @property
    def out(self) -> TensorMeta:
        """The first (usually only) output."""
        return self.outputs[0]

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def activation_inputs(self) -> tuple[str, ...]:
        return tuple(i for i in self.inputs if i not in self.params)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """A contiguous run of nodes forming one layer of the model's layer sequence.

    Repeated blocks (``blocks.0`` .. ``blocks.N``) each form one group with the same ``structural_hash``; the nodes
    before the first block and after the last one form the ``prefix`` and ``suffix`` groups.
    """

    index: int
    start: int
    """Index of the first node of the group in ``Graph.nodes``."""
    end: int
    """One past the last node."""
    module_path: str
    module_type: str
    role: Literal["prefix", "block", "suffix", "whole"]
    structural_hash: str
    """Hash of the group's op structure, shapes and parameter shapes, independent of names: equal hashes mean the
    planner may solve the group once and reuse the answer."""
    params: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """A tensor autograd keeps for backward: an input (``pos`` >= 0), the output (``pos == -1``) or an extra
    (``pos == -2``: a mask or statistics, ``nbytes`` given, sharded like the output)."""

    pos: int
    key: str
    """Storage identity: saved tensors with the same key and placement are stored once."""
    meta: TensorMeta | None = None
    nbytes: float = 0.0
    """For extras: bytes at the traced shape (not scaled by the training dtype)."""


def _int_arg(node: Node) -> int | None:
    args = node.attr("args")
    if isinstance(args, (tuple, list)) and len(args) == 1 and isinstance(args[0], int):
        return args[0]
    if isinstance(args, int):
        return args
    return None


@dataclass(frozen=True)
class Graph:
    """A traced model."""

    nodes: tuple[Node, ...]
    params: tuple[ParamInfo, ...]
    inputs: tuple[str, ...]
    """Names of the input nodes (kind ``input``), in argument order."""
    outputs: tuple[str, ...]
    layers: tuple[LayerGroup, ...] = ()
    unknown_ops: tuple[str, ...] = ()
    """Targets the op registry did not know; they were costed by bytes only."""
    frontend: Literal["fx", "export"] = "fx"
    model_name: str = ""
    opaque: tuple[tuple[str, str], ...] = ()
    """(submodule FQN, why) of regions no front end captured, each one ``opaque`` node (:mod:`autopar.ir.opaque`)."""

    @cached_property
    def _index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    # ---- lookups -----------------------------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        return self.nodes[self._index[name]]

    def index(self, name: str) -> int:
        return self._index[name]

    def has_node(self, name: str) -> bool:
        return name in self._index

    @cached_property
    def param_map(self) -> dict[str, ParamInfo]:
        return {p.name: p for p in self.params}

    @cached_property
    def users(self) -> dict[str, tuple[str, ...]]:
        """For every node and parameter, the nodes that read it."""
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for p in self.params:
            out[p.name] = []
        for n in self.nodes:
            for i in n.inputs:
                out.setdefault(i, []).append(n.name)
        return {k: tuple(v) for k, v in out.items()}

    def input_meta(self, node: Node, i: int) -> TensorMeta | None:
        """Meta of ``node.inputs[i]`` (the selected output for ``getitem`` of a multi-output node)."""
        name = node.inputs[i]
        if name in self.param_map:
            return self.param_map[name].meta
        if not self.has_node(name):
            return None
        src = self.node(name)
        if not src.outputs:
            return None
        if len(src.outputs) > 1 and node.op == "getitem":
            idx = _int_arg(node)
            if idx is not None and -len(src.outputs) <= idx < len(src.outputs):
                return src.outputs[idx]
        return src.outputs[0]

    def storage_key(self, name: str) -> str:
        """Follow single-input, numel-preserving views up to the tensor that owns the storage."""
        seen = 0
        while self.has_node(name) and seen < 64:
            n = self.node(name)
            acts = n.activation_inputs
            if n.kind != "view" or len(acts) != 1 or not self.has_node(acts[0]) or len(n.outputs) != 1:
                break
            src = self.node(acts[0])
            if not src.outputs or len(src.outputs) > 1 or src.outputs[0].numel != n.out.numel:
                break
            name, seen = acts[0], seen + 1
        return name

    def saved_tensors(self, node: Node) -> tuple[SavedTensor, ...]:
        """What autograd keeps for ``node``'s backward (flash/efficient attention: no S^2 score matrix).

        Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1 counts
        the same tensors for a transformer layer."""
        op, kind = node.op, node.kind
        metas = [self.input_meta(node, i) for i in range(len(node.inputs))]
        acts = [i for i, x in enumerate(node.inputs) if x not in node.params and metas[i] is not None]

        def inp(i: int) -> SavedTensor:
            return SavedTensor(i, self.storage_key(node.inputs[i]) + "@in", metas[i])

        if not node.outputs or kind in ("view", "input", "creation"):
            return ()
        out = SavedTensor(-1, node.name + "@in", node.out)
        if kind in ("matmul", "conv"):
            return tuple(inp(i) for i in acts)
        if kind == "attention":
            q = metas[acts[0]] if acts else None
            lse = float(math.prod(q.shape[:-1]) * 4) if q is not None else 0.0  # fp32 logsumexp per query row
            return (*(inp(i) for i in acts[:3]), out, SavedTensor(-2, node.name + "@lse", None, lse))
        if kind == "norm":
            rows = node.out.numel // max(1, node.out.shape[-1] if node.out.shape else 1)
            nstats = 1 if op == "rms_norm" else 2
            return (*(inp(i) for i in acts[:1]), SavedTensor(-2, node.name + "@stats", None, 4.0 * nstats * rows))
        if kind == "softmax" or op in _SAVE_OUTPUT:
            return (out,)
        if op == "dropout":
            return (SavedTensor(-2, node.name + "@mask", None, float(node.out.numel)),)
        if op in _SAVE_INPUT:
            return tuple(inp(i) for i in acts[:1])
        if op in ("mul", "div"):
            return tuple(inp(i) for i in acts
                         if metas[i] is not None and metas[i].dtype in FLOAT_DTYPES)  # type: ignore[union-attr]
        if kind == "embedding":
            return tuple(inp(i) for i in acts)
        if kind == "loss":
            return tuple(inp(i) for i in acts[:1])
        return ()

    # ---- summaries ---------------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        """The batch size the graph was traced with (leading dim of its first input; 1 without inputs)."""
        for name in self.inputs:
            shape = self.node(name).out.shape
            if shape:
                return int(shape[0])
        return 1

    @property
    def num_params(self) -> int:
        """Number of trainable parameter elements (buffers excluded, tied weights counted once)."""
        return sum(p.meta.numel for p in self.params if p.kind == "param")

    @property
    def param_bytes(self) -> int:
        return sum(p.meta.nbytes for p in self.params if p.kind == "param")

    def flops(self, kinds: tuple[str, ...] | None = None, *, backward: bool = True) -> float:
        """Training FLOPs of one step (forward + backward, no recomputation), optionally restricted to op kinds."""
        tot = 0.0
        for n in self.nodes:
            if kinds is None or n.kind in kinds:
                tot += n.flops_fwd + (n.flops_bwd if backward else 0.0)
        return tot

    def matmul_flops(self, *, backward: bool = True) -> float:
        """Matrix-multiply FLOPs (linear/matmul, attention, convolution), the convention of Megatron's formulas."""
        return self.flops(("matmul", "attention", "conv"), backward=backward)

    def blocks(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.layers if g.role == "block")

    def group_nodes(self, group: LayerGroup) -> tuple[Node, ...]:
        return self.nodes[group.start:group.end]

    @cached_property
    def fingerprint(self) -> str:
        """A stable hash of the computation (ops, dataflow, shapes, dtypes, parameter shapes).

        Plans record it so a plan made for one model is not applied to another."""
        h = hashlib.sha256()
        for p in self.params:
            h.update(json.dumps([p.name, list(p.meta.shape), p.meta.dtype, p.kind]).encode())
        for n in self.nodes:
            h.update(json.dumps([n.name, n.op, list(n.inputs),
                                 [[list(o.shape), o.dtype] for o in n.outputs]]).encode())
        return h.hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        """Counts for display: nodes, params, FLOPs, layer groups, unknown ops."""
        kinds: dict[str, int] = {}
        for n in self.nodes:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        blocks = self.blocks()
        return {
            "model": self.model_name,
            "frontend": self.frontend,
            "nodes": len(self.nodes),
            "params": self.num_params,
            "param_bytes": self.param_bytes,
            "train_flops": self.flops(),
            "matmul_train_flops": self.matmul_flops(),
            "layer_groups": len(self.layers),
            "repeated_blocks": len(blocks),
            "distinct_blocks": len({b.structural_hash for b in blocks}),
            "op_kinds": dict(sorted(kinds.items())),
            "unknown_ops": list(self.unknown_ops),
            "opaque_regions": [f"{path} ({why})" for path, why in self.opaque],
            "fingerprint": self.fingerprint,
        }
