"""Rewrite a ``torch.fx.GraphModule`` so that its fusable patterns call the fused Triton kernels.

The patterns and rules are those of :mod:`autopar.ir.passes.patterns` (the IR's matcher runs on fx nodes here).
Per kind:

* ``add_norm``: ``[add ->] LayerNorm / RMSNorm (module or primitive chain)`` becomes one ``fused_add_norm`` call
  returning ``(sum, normalized)``; users of the add read the sum, users of the norm the normalized value.
* ``bias_act``: ``act(Linear(x))`` with a biased Linear becomes ``fused_bias_act(F.linear(x, W), b, act)`` -- the
  Linear is split so that the bias add moves into the activation kernel (and its backward).
* ``swiglu``: ``silu(g) * u`` becomes ``fused_swiglu(g, u)``.
* ``softmax``: ``softmax(x [* s], -1)`` becomes ``fused_softmax(x, scale=s)``.
* ``dropout``: an ``nn.Dropout`` call becomes a :class:`FusedDropout` submodule (it follows ``train()``/``eval()``);
  ``F.dropout`` becomes ``fused_dropout``.

The input module is not modified: the result is a new ``GraphModule`` sharing its parameters.
"""

from __future__ import annotations

import copy
import logging
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from autopar.codegen.kernels import launch
from autopar.codegen.kernels.autograd import fused_add_norm, fused_bias_act, fused_dropout, fused_softmax, fused_swiglu
from autopar.ir.ops import OP_RULES, OpKind, canonical_op
from autopar.ir.passes.patterns import Match, NodeView, match_patterns

__all__ = ["fuse_graph_module", "FusedDropout", "fusion_enabled"]

log = logging.getLogger(__name__)

_SIMPLE = (int, float, bool, str, type(None))
_MODULE_ATTRS = ("eps", "p", "approximate", "dim")


class FusedDropout(torch.nn.Module):
    """``nn.Dropout`` running the fused Philox kernel (mask regenerated in backward)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_dropout(x, self.p, self.training)


def fusion_enabled(enabled: bool | None) -> bool:
    """``enabled``, or when None: on with CUDA available or the Triton interpreter forced, else off."""
    if enabled is not None:
        return bool(enabled)
    return torch.cuda.is_available() or launch.interpreting()


# ---- fx -> NodeView ----------------------------------------------------------------------------------------------
def _raw_name(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    if n.op == "call_method":
        return str(n.target)
    return str(getattr(n.target, "__name__", n.target))


def _value(n: fx.Node) -> str:
    return str(n.target) if n.op == "get_attr" else n.name


def _view(gm: fx.GraphModule, n: fx.Node) -> NodeView:
    op = canonical_op(_raw_name(gm, n))
    rule = OP_RULES.get(op)
    tensors: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: tensors.append(a))  # type: ignore[arg-type,func-returns-value]
    inputs = [_value(a) for a in tensors]
    params = [_value(a) for a in tensors if a.op == "get_attr"]
    attrs: dict[str, Any] = {k: v for k, v in n.kwargs.items() if isinstance(v, _SIMPLE)}
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        own = [f"{n.target}.{p}" for p, _ in mod.named_parameters()]
        inputs += own
        params += own
        attrs.update({k: getattr(mod, k) for k in _MODULE_ATTRS
                      if hasattr(mod, k) and isinstance(getattr(mod, k), _SIMPLE)})
    scalars = tuple(a if not isinstance(a, list) else tuple(a) for a in n.args if not isinstance(a, fx.Node))
    return NodeView(n.name, op, rule.kind if rule else OpKind.UNKNOWN, tuple(inputs), tuple(params), scalars, attrs)


# ---- rewriting ---------------------------------------------------------------------------------------------------
class _Rewriter:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.by_name = {n.name: n for n in gm.graph.nodes}
        self.attrs: dict[str, fx.Node] = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
        self.dropouts = 0
        self.replaced: dict[str, fx.Node] = {}
        self.first = next(n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr"))
        for n in list(self.attrs.values()):  # hoist: a get_attr has no inputs, so moving it up is always valid
            self.first.prepend(n)

    def value(self, name: str | None) -> fx.Node | None:
        if name is None:
            return None
        if name in self.replaced:
            return self.replaced[name]
        if name in self.by_name and self.by_name[name].op != "get_attr" and name not in self.attrs:
            return self.by_name[name]
        if name not in self.attrs:
            with self.gm.graph.inserting_before(self.first):
                self.attrs[name] = self.gm.graph.get_attr(name)
        return self.attrs[name]

    def replace(self, name: str | None, new: fx.Node) -> None:
        """Point every user of node ``name`` (and later matches naming it) at ``new``."""
        self.by_name[str(name)].replace_all_uses_with(new)
        self.replaced[str(name)] = new

    def erase(self, m: Match) -> None:
        for name in reversed(m.nodes):
            node = self.by_name[name]
            assert not node.users, f"fused node {name} still has users {list(node.users)}"
            self.gm.graph.erase_node(node)

    def apply(self, m: Match) -> None:
        getattr(self, f"_{m.kind}")(m)

    def _add_norm(self, m: Match) -> None:
        g = self.gm.graph
        with g.inserting_before(self.by_name[m.nodes[0]]):
            call = g.call_function(fused_add_norm, (self.value(m.role("x")), self.value(m.role("r")),
                                                    self.value(m.role("weight")), self.value(m.role("bias"))),
                                   {"norm": m.attr("norm"), "eps": m.attr("eps")})
            if m.attr("residual"):
                s = g.call_function(operator.getitem, (call, 0))
                y = g.call_function(operator.getitem, (call, 1))
                self.replace(m.role("sum"), s)
            else:
                y = call
        self.replace(m.role("out"), y)
        self.erase(m)

    def _swiglu(self, m: Match) -> None:
        out = self.by_name[str(m.role("out"))]
        with self.gm.graph.inserting_before(out):
            new = self.gm.graph.call_function(fused_swiglu, (self.value(m.role("gate")), self.value(m.role("up"))))
        self.replace(out.name, new)
        self.erase(m)

    def _bias_act(self, m: Match) -> None:
        g = self.gm.graph
        lin, out = self.by_name[str(m.role("linear"))], self.by_name[str(m.role("out"))]
        with g.inserting_before(out):
            h = g.call_function(F.linear, (lin.args[0], self.value(f"{lin.target}.weight")))
            new = g.call_function(fused_bias_act, (h, self.value(m.role("bias")), m.attr("act")))
        self.replace(out.name, new)
        self.erase(m)
        g.erase_node(lin)

    def _softmax(self, m: Match) -> None:
        out = self.by_name[str(m.role("out"))]
        with self.gm.graph.inserting_before(out):
            new = self.gm.graph.call_function(fused_softmax, (self.value(m.role("x")),), {"scale": m.attr("scale")})
        self.replace(out.name, new)
        self.erase(m)

    def _dropout(self, m: Match) -> None:
        node = self.by_name[m.nodes[0]]
        if node.op == "call_module":
            name = f"_autopar_dropout_{self.dropouts}"
            self.dropouts += 1
            self.gm.add_submodule(name, FusedDropout(float(m.attr("p"))))
            node.target = name
            return
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        with self.gm.graph.inserting_before(node):
            new = self.gm.graph.call_function(fused_dropout, (self.value(m.role("x")), float(m.attr("p")),
                                                              training))
        self.replace(node.name, new)
        self.erase(m)


def fuse_graph_module(gm: fx.GraphModule, *, enabled: bool | None = None) -> fx.GraphModule:
    """A copy of ``gm`` whose fusable patterns call the fused kernels (rules in :mod:`autopar.ir.passes.patterns`).

    ``enabled=None`` turns fusion on when CUDA is available or ``TRITON_INTERPRET=1`` is forced; when off, ``gm``
    itself is returned.  The copy shares ``gm``'s parameters and submodules; ``gm`` is not modified.
    """
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"fuse_graph_module needs a torch.fx.GraphModule, got {type(gm).__name__}; "
                        "trace the model with torch.fx.symbolic_trace first")
    if not fusion_enabled(enabled):
        return gm
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    nodes = [n for n in new.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    outputs: set[str] = set()
    for n in new.graph.nodes:
        if n.op == "output":
            fx.node.map_arg(n.args, lambda a: outputs.add(a.name))  # type: ignore[arg-type,func-returns-value]
    matches = match_patterns([_view(new, n) for n in nodes], outputs)
    rw = _Rewriter(new)
    for m in matches:
        rw.apply(m)
    for n in list(new.graph.nodes):
        if n.op == "get_attr" and not n.users:
            new.graph.erase_node(n)
    new.graph.lint()
    new.recompile()
    kinds: dict[str, int] = {}
    for m in matches:
        kinds[m.kind] = kinds.get(m.kind, 0) + 1
    log.info("fused %d group(s) in %s: %s", len(matches), type(gm).__name__, kinds)
    return new
