"""Fusion patterns: which chains of memory-bound ops run as one generated kernel.

The matcher works on :class:`NodeView` s, the part of a node it needs, so the same rules run on the IR
(:mod:`autopar.ir.passes.fuse`, the ``fuse`` pass and its analysis) and on a ``torch.fx.GraphModule``
(:mod:`autopar.codegen.kernels.fx_rewrite`, which rewrites the module to call the fused kernels).

Rules
-----
1. Only pointwise, norm and softmax ops (and the reductions inside an RMSNorm written out by hand) join a group.
   Matmuls, attention, convolutions, embeddings, losses, gathers, copies and collectives end a group: a group never
   crosses one (the bias of a preceding Linear is the one exception, see ``bias_act``).
2. Groups are anchored on patterns, matched in this order; a node belongs to at most one group:

   ``add_norm``  [add ->] LayerNorm | RMSNorm.  The RMSNorm may be a module (``nn.RMSNorm``) or the primitive chain
                 ``x * rsqrt(mean(x.pow(2), -1, keepdim) + eps) [* weight]``.  The residual ``add`` joins when it
                 is the norm input; its sum is *also written out* (it is the residual stream), but not re-read.
   ``swiglu``    ``silu(gate) * up`` (the silu's only user is the mul).
   ``bias_act``  ``act(linear(x) + b)`` for act in gelu (erf or tanh form, as the model calls it), silu, relu,
                 when the producer is a Linear with a bias whose only user is the activation.  In the IR the
                 group is the activation node (the bias stays inside ``linear`` there); the fx rewrite splits the
                 Linear into ``F.linear(x, W)`` + the fused ``bias_act`` kernel (Megatron-LM's bias-GeLU fusion).
   ``softmax``   ``softmax(x [* s | / s], dim=-1)``; a causal mask is generated from indices only through the
                 kernel API (``fused_softmax(causal=True)``) -- mask tensors in a graph are not pattern-matched.
   ``dropout``   a dropout with ``p > 0``, alone (its backward regenerates the Philox mask).
   ``pointwise`` any remaining connected run of >= 2 pointwise ops of equal output size (analysis only: counted
                 for the cost model, executed eagerly; no kernel is generated for it).
3. Every intermediate of a matched pattern (except the residual sum) must have all its users inside the group, so
   nothing fused away is needed later; a ``pointwise`` run ends at a value with outside users, or writes it out.

The kinds with a generated kernel (:data:`KERNEL_KINDS`) are the vocabulary codegen's ``KernelSpec`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from autopar.ir.ops import OpKind

__all__ = ["NodeView", "Match", "match_patterns", "KERNEL_KINDS", "EAGER_KIND"]

KERNEL_KINDS: tuple[str, ...] = ("bias_act", "swiglu", "add_norm", "softmax", "dropout")
"""Pattern kinds that run as one generated kernel, in codegen's order."""
EAGER_KIND = "pointwise"
"""The group kind counted by the cost analysis but executed eagerly (no generated kernel)."""

_ACTS = {"gelu", "silu", "relu"}


@dataclass(frozen=True, slots=True)
class NodeView:
    """The part of a node the matcher needs; built from an ``autopar.ir.Node`` or a ``torch.fx.Node``."""

    name: str
    op: str
    """Canonical op name (``autopar.ir.ops.canonical_op``)."""
    kind: OpKind
    inputs: tuple[str, ...]
    """Tensor inputs (node names, parameter FQNs) in argument order."""
    params: tuple[str, ...] = ()
    scalars: tuple[Any, ...] = ()
    """Non-tensor positional arguments."""
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def acts(self) -> tuple[str, ...]:
        return tuple(i for i in self.inputs if i not in self.params)


@dataclass(frozen=True, slots=True)
class Match:
    """One pattern occurrence: kind, member nodes in graph order, named roles, and spec attributes."""

    kind: str
    nodes: tuple[str, ...]
    roles: tuple[tuple[str, str], ...]
    """(role, value) pairs: x, r, weight, bias, gate, up, linear, out, sum."""
    attrs: tuple[tuple[str, Any], ...]

    def role(self, key: str) -> str | None:
        return dict(self.roles).get(key)

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)


# ---- matcher -----------------------------------------------------------------------------------------------------
class _Ctx:
    def __init__(self, views: Iterable[NodeView], outputs: Iterable[str]) -> None:
        self.views = {v.name: v for v in views}
        self.order = list(self.views)
        self.users: dict[str, list[str]] = {}
        for v in self.views.values():
            for i in v.inputs:
                self.users.setdefault(i, []).append(v.name)
        self.outputs = set(outputs)
        self.taken: set[str] = set()

    def sole_user(self, value: str) -> str | None:
        us = self.users.get(value, [])
        return us[0] if len(us) == 1 and value not in self.outputs else None

    def free(self, name: str | None) -> NodeView | None:
        v = self.views.get(name) if name is not None else None
        return v if v is not None and name not in self.taken else None


def _scalar_arg(v: NodeView, idx: int = 0) -> Any:
    return v.scalars[idx] if len(v.scalars) > idx else None


def _rms_chain(c: _Ctx, pow_node: NodeView) -> Match | None:
    """x.pow(2) -> mean(-1, keepdim) -> + eps -> rsqrt -> x * r [-> * weight]."""
    if pow_node.op != "pow" or _scalar_arg(pow_node) != 2 or len(pow_node.acts) != 1:
        return None
    x = pow_node.acts[0]
    mean = c.free(c.sole_user(pow_node.name))
    if mean is None or mean.op != "mean" or _scalar_arg(mean) not in (-1,) or not mean.attrs.get("keepdim"):
        return None
    add = c.free(c.sole_user(mean.name))
    if add is None or add.op != "add" or len(add.inputs) != 1 or not isinstance(_scalar_arg(add), float):
        return None
    rs = c.free(c.sole_user(add.name))
    if rs is None or rs.op != "rsqrt":
        return None
    mul = c.free(c.sole_user(rs.name))
    if mul is None or mul.op != "mul" or set(mul.inputs) != {x, rs.name}:
        return None
    members, out, weight = [pow_node.name, mean.name, add.name, rs.name, mul.name], mul.name, None
    wmul = c.free(c.sole_user(mul.name))
    if wmul is not None and wmul.op == "mul" and len(wmul.params) == 1 and len(wmul.inputs) == 2:
        members.append(wmul.name)
        out, weight = wmul.name, wmul.params[0]
    roles = [("x", x), ("out", out)] + ([("weight", weight)] if weight else [])
    return Match("add_norm", tuple(members), tuple(roles),
                 (("eps", float(_scalar_arg(add))), ("norm", "rms_norm"), ("weight", weight is not None)))


def _module_norm(v: NodeView) -> Match | None:
    if v.op not in ("layer_norm", "rms_norm") or len(v.acts) != 1 or v.attrs.get("module") is False:
        return None
    weight = next((p for p in v.params if p.endswith("weight")), None)
    bias = next((p for p in v.params if p.endswith("bias")), None)
    eps = v.attrs.get("eps")
    if eps is None:  # functional / ATen form: eps is the float among the positional scalars
        eps = next((s for s in v.scalars if isinstance(s, float)), None)
    roles = [("x", v.acts[0]), ("out", v.name)] + ([("weight", weight)] if weight else []) + \
        ([("bias", bias)] if bias else [])
    attrs = (("eps", 1e-5 if eps is None else float(eps)), ("norm", v.op), ("norm_bias", bias is not None),
             ("weight", weight is not None))
    return Match("add_norm", (v.name,), tuple(roles), attrs)


def _with_residual(c: _Ctx, m: Match) -> Match:
    x = m.role("x")
    add = c.free(x)
    if add is None or add.op != "add" or len(add.acts) != 2 or add.scalars or add.params:
        return m
    roles = tuple((k, v) for k, v in m.roles if k != "x") + (("x", add.acts[0]), ("r", add.acts[1]),
                                                              ("sum", add.name))
    return Match("add_norm", (add.name, *m.nodes), roles, m.attrs + (("residual", True),))


def _norms(c: _Ctx) -> list[Match]:
    out = []
    for name in c.order:
        v = c.free(name)
        if v is None:
            continue
        m = _module_norm(v) or _rms_chain(c, v)
        if m is not None:
            m = _with_residual(c, m)
            c.taken.update(m.nodes)
            out.append(m)
    return out


def _swiglus(c: _Ctx) -> list[Match]:
    out = []
    for name in c.order:
        v = c.free(name)
        if v is None or v.op != "mul" or len(v.acts) != 2 or v.params:
            continue
        for gate_node, up in ((v.acts[0], v.acts[1]), (v.acts[1], v.acts[0])):
            s = c.free(gate_node)
            if s is not None and s.op == "silu" and c.sole_user(s.name) == v.name and len(s.acts) == 1:
                m = Match("swiglu", (s.name, v.name), (("gate", s.acts[0]), ("up", up), ("out", v.name)), ())
                c.taken.update(m.nodes)
                out.append(m)
                break
    return out


def _bias_acts(c: _Ctx) -> list[Match]:
    out = []
    for name in c.order:
        v = c.free(name)
        if v is None or v.op not in _ACTS or len(v.acts) != 1:
            continue
        lin = c.views.get(v.acts[0])
        bias = next((p for p in lin.params if p.endswith("bias")), None) if lin is not None else None
        if lin is None or lin.op != "linear" or bias is None or c.sole_user(lin.name) != v.name:
            continue
        act = "gelu_tanh" if v.op == "gelu" and v.attrs.get("approximate") == "tanh" else v.op
        m = Match("bias_act", (v.name,), (("x", lin.name), ("linear", lin.name), ("bias", bias), ("out", v.name)),
                  (("act", act), ("bias", True)))
        c.taken.add(v.name)
        out.append(m)
    return out


def _softmaxes(c: _Ctx) -> list[Match]:
    out = []
    for name in c.order:
        v = c.free(name)
        dim = v.attrs.get("dim", _scalar_arg(v)) if v is not None else None
        if v is None or v.op != "softmax" or dim != -1 or len(v.acts) != 1:
            continue
        members, x, scale = [v.name], v.acts[0], None
        pre = c.free(x)
        if pre is not None and pre.op in ("mul", "div") and len(pre.inputs) == 1 and \
                isinstance(_scalar_arg(pre), (int, float)) and c.sole_user(pre.name) == v.name:
            s = float(_scalar_arg(pre))
            scale = s if pre.op == "mul" else 1.0 / s
            members.insert(0, pre.name)
            x = pre.inputs[0]
        m = Match("softmax", tuple(members), (("x", x), ("out", v.name)), (("scale", scale),))
        c.taken.update(members)
        out.append(m)
    return out


def _dropouts(c: _Ctx) -> list[Match]:
    out = []
    for name in c.order:
        v = c.free(name)
        p = (v.attrs.get("p", _scalar_arg(v)) if v is not None else None)
        if v is None or v.op != "dropout" or not isinstance(p, float) or p <= 0.0 or len(v.acts) != 1:
            continue
        c.taken.add(v.name)
        out.append(Match("dropout", (v.name,), (("x", v.acts[0]), ("out", v.name)), (("p", p),)))
    return out


def match_patterns(views: Iterable[NodeView], outputs: Iterable[str] = ()) -> list[Match]:
    """All kernel-backed pattern matches (every kind but ``pointwise``), in the rule order of the module doc."""
    c = _Ctx(views, outputs)
    return [*_norms(c), *_swiglus(c), *_bias_acts(c), *_softmaxes(c), *_dropouts(c)]

