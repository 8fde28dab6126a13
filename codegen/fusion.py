"""Fusion analysis: which chains of memory-bound ops run as one generated kernel.

A pure analysis over :class:`autopar.ir.Graph` (one stage's nodes after sharding, or the whole graph): it returns
:class:`FusionGroup` s and never edits the graph.  The same matcher runs on a ``torch.fx.GraphModule``
(:func:`fuse_graph_module`, which rewrites the module to call the fused kernels).

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
4. Bytes: ``bytes_unfused`` is the sum of the members' IR bytes (each op reads its inputs and writes its outputs);
   ``bytes_fused`` reads each outside input once and writes only values used outside the group.  The planner
   discounts ``bytes_saved`` (see :func:`fused_bytes_saved`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from autopar import ir
from autopar.codegen.triton_gen import KernelSpec, generate_source
from autopar.ir.graph import TensorMeta

__all__ = ["FusionGroup", "fusion_groups", "fused_bytes_saved", "apply_fused_bytes", "render_kernels",
           "fuse_graph_module", "Match", "NodeView", "match_patterns"]

log = logging.getLogger(__name__)

_ACTS = {"gelu", "silu", "relu"}


@dataclass(frozen=True, slots=True)
class NodeView:
    """The part of a node the matcher needs; built from an ``autopar.ir.Node`` or a ``torch.fx.Node``."""

    name: str
    op: str
    kind: str
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


@dataclass(frozen=True, slots=True)
class FusionGroup:
    """A fused group of IR nodes."""

    kind: str
    """``add_norm``, ``swiglu``, ``bias_act``, ``softmax``, ``dropout`` or ``pointwise``."""
    nodes: tuple[str, ...]
    inputs: tuple[tuple[str, TensorMeta], ...]
    """Values read from outside the group (node names or parameter FQNs) with their metas."""
    outputs: tuple[tuple[str, TensorMeta], ...]
    """Values written by the group (used outside it, or graph outputs)."""
    ops: tuple[str, ...]
    """The members' canonical ops, in order."""
    attrs: tuple[tuple[str, Any], ...] = ()
    bytes_unfused: float = 0.0
    bytes_fused: float = 0.0

    @property
    def bytes_saved(self) -> float:
        return max(0.0, self.bytes_unfused - self.bytes_fused)

    @property
    def spec(self) -> KernelSpec | None:
        """The kernel spec, or None for ``pointwise`` groups (executed eagerly)."""
        return spec_of(self.kind, dict(self.attrs))


def spec_of(kind: str, a: dict[str, Any]) -> KernelSpec | None:
    """Kernel spec of a match/group kind with its attributes."""
    if kind == "bias_act":
        return KernelSpec(kind="bias_act", act=a["act"], bias=bool(a.get("bias")))
    if kind == "swiglu":
        return KernelSpec(kind="swiglu")
    if kind == "add_norm":
        return KernelSpec(kind="add_norm", norm=a["norm"], residual=bool(a.get("residual")),
                          weight=bool(a.get("weight", True)), norm_bias=bool(a.get("norm_bias")))
    if kind == "softmax":
        return KernelSpec(kind="softmax", scale=a.get("scale") is not None)
    if kind == "dropout":
        return KernelSpec(kind="dropout")
    return None


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


# ---- IR front end ------------------------------------------------------------------------------------------------
def _ir_view(n: ir.Node) -> NodeView:
    attrs = {k: v for k, v in n.attrs if k != "args"}
    return NodeView(n.name, n.op, n.kind, n.inputs, n.params, tuple(n.attr("args", ()) or ()), attrs)


def _pointwise_runs(graph: ir.Graph, names: list[str], taken: set[str]) -> list[list[str]]:
    """Connected runs of >= 2 free pointwise nodes whose outputs have the same number of elements."""
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    cand = [n for n in names if n not in taken and graph.node(n).kind == "pointwise"]
    for n in cand:
        parent[n] = n
    for n in cand:
        node = graph.node(n)
        for i in node.activation_inputs:
            if i in parent and graph.node(i).out.numel == node.out.numel:
                parent[find(i)] = find(n)
    runs: dict[str, list[str]] = {}
    for n in cand:
        runs.setdefault(find(n), []).append(n)
    return [r for r in runs.values() if len(r) >= 2]


def _meta(graph: ir.Graph, value: str) -> TensorMeta | None:
    if graph.has_node(value):
        return graph.node(value).out
    p = graph.param_map.get(value)
    return p.meta if p is not None else None


def _make_group(graph: ir.Graph, kind: str, members: tuple[str, ...], attrs: tuple[tuple[str, Any], ...],
                scope: set[str]) -> FusionGroup:
    inside = set(members)
    nodes = [graph.node(m) for m in members]
    ins: dict[str, TensorMeta] = {}
    for n in nodes:
        for i in n.inputs:
            meta = _meta(graph, i)
            if i not in inside and meta is not None:
                ins.setdefault(i, meta)
    outs: dict[str, TensorMeta] = {}
    for n in nodes:
        users = graph.users.get(n.name, ())
        if n.name == members[-1] or n.name in graph.outputs or any(u not in inside for u in users):
            outs[n.name] = n.out
    unfused = float(sum(n.bytes_read + n.bytes_written for n in nodes))
    fused = float(sum(m.nbytes for m in ins.values()) + sum(m.nbytes for m in outs.values()))
    return FusionGroup(kind, members, tuple(ins.items()), tuple(outs.items()), tuple(n.op for n in nodes), attrs,
                       unfused, fused)


def fusion_groups(graph: ir.Graph, nodes: Iterable[str] | None = None) -> tuple[FusionGroup, ...]:
    """Fusion groups of ``graph`` (restricted to ``nodes``, e.g. one pipeline stage), in graph order."""
    names = [n.name for n in graph.nodes] if nodes is None else [n for n in nodes if graph.has_node(n)]
    scope = set(names)
    views = [_ir_view(graph.node(n)) for n in names]
    # values leaving the scope count as outputs, so a stage never fuses away a value another stage reads
    leaving = {n for n in names if n in graph.outputs or any(u not in scope for u in graph.users.get(n, ()))}
    groups = [_make_group(graph, m.kind, m.nodes, m.attrs, scope) for m in match_patterns(views, leaving)]
    taken = {n for g in groups for n in g.nodes}
    for run in _pointwise_runs(graph, names, taken):
        groups.append(_make_group(graph, "pointwise", tuple(run), (), scope))
    groups.sort(key=lambda g: graph.index(g.nodes[0]))
    return tuple(groups)


def fused_bytes_saved(graph: ir.Graph, nodes: Iterable[str] | None = None, *,
                      kernels_only: bool = False) -> dict[str, float]:
    """Bytes each node no longer moves thanks to fusion: a group's ``bytes_saved`` split over its members in
    proportion to their unfused bytes (nodes outside groups are absent).  Subtract from a node's bytes to cost it.
    ``kernels_only`` leaves out the ``pointwise`` runs, which have no generated kernel and run eagerly."""
    out: dict[str, float] = {}
    for g in fusion_groups(graph, nodes):
        if g.bytes_saved <= 0.0 or g.bytes_unfused <= 0.0 or (kernels_only and g.spec is None):
            continue
        for name in g.nodes:
            n = graph.node(name)
            out[name] = g.bytes_saved * (n.bytes_read + n.bytes_written) / g.bytes_unfused
    return out


def apply_fused_bytes(graph: ir.Graph) -> ir.Graph:
    """A pass (``Graph -> Graph``): ``graph`` with every fused node's ``bytes_read``/``bytes_written`` reduced by
    its share of :func:`fused_bytes_saved`, so that a cost model summing node bytes counts a fused group's bytes once.

    Groups are matched per layer group (``graph.layers``; the whole graph when there are none), exactly as the runtime
    fuses each layer-group module, so no group spans two layer groups (or two pipeline stages) and identical blocks
    get identical savings.  Only groups with a generated kernel count: the ``pointwise`` runs execute eagerly.  Layer groups, names, FLOPs and the fingerprint are unchanged; a node keeps its read/write
    split (both scale by ``1 - saved / (read + written)``)."""
    scopes = [[n.name for n in graph.group_nodes(g)] for g in graph.layers] or [[n.name for n in graph.nodes]]
    saved: dict[str, float] = {}
    for names in scopes:
        saved.update(fused_bytes_saved(graph, names, kernels_only=True))
    nodes = []
    for n in graph.nodes:
        total = n.bytes_read + n.bytes_written
        s = saved.get(n.name, 0.0)
        if s <= 0.0 or total <= 0.0:
            nodes.append(n)
            continue
        keep = max(0.0, 1.0 - s / total)
        nodes.append(replace(n, bytes_read=n.bytes_read * keep, bytes_written=n.bytes_written * keep))
    log.debug("fusion saves %.3g of %.3g forward bytes", sum(saved.values()),
              sum(n.bytes_read + n.bytes_written for n in graph.nodes))
    return replace(graph, nodes=tuple(nodes))


def render_kernels(graph: ir.Graph, nodes: Iterable[str] | None = None) -> str:
    """The generated Triton source for every distinct fused kernel of ``graph``, each under a comment listing the
    groups that use it (``autopar show plan.yaml --kernels``)."""
    groups = fusion_groups(graph, nodes)
    by_spec: dict[KernelSpec, list[FusionGroup]] = {}
    eager: list[FusionGroup] = []
    for g in groups:
        spec = g.spec
        if spec is None:
            eager.append(g)
        else:
            by_spec.setdefault(spec, []).append(g)
    parts = [f"# {graph.model_name}: {len(groups)} fusion group(s), {len(by_spec)} distinct kernel(s)\n"]
    for spec, gs in by_spec.items():
        saved = sum(g.bytes_saved for g in gs)
        parts.append(f"\n# ==== {spec.name}: {len(gs)} group(s), {saved / 1e6:.3f} MB saved per step (fwd)\n")
        parts += [f"#   {' -> '.join(g.nodes)}\n" for g in gs]
        parts.append(generate_source(spec))
    if eager:
        parts.append(f"\n# ==== eager pointwise runs (no generated kernel): {len(eager)}\n")
        parts += [f"#   {' -> '.join(g.nodes)} ({', '.join(g.ops)})\n" for g in eager]
    return "".join(parts)


def fuse_graph_module(gm: Any, *, enabled: bool | None = None) -> Any:
    """Rewrite a ``torch.fx.GraphModule`` (from ``torch.fx.symbolic_trace``) to call the fused kernels; see
    :func:`autopar.codegen.kernels.fx_rewrite.fuse_graph_module`."""
    from autopar.codegen.kernels.fx_rewrite import fuse_graph_module as _fuse
    return _fuse(gm, enabled=enabled)
