"""The rule table: which sharding rule enumerates the strategies of which op, and :func:`strategies_for`.

A node's rule is looked up by op name first, then by op kind; unknown or odd ops (and any rule that fails) fall back
to ``replicate``, which is always the first strategy, so enumeration never raises.
"""

from __future__ import annotations

import logging
from typing import Any

from autopar.ir.graph import Graph, Node
from autopar.planner.intra_op.rules_elementwise import _loss, _norm, _pointwise, _reduction, _softmax
from autopar.planner.intra_op.rules_matmul import _conv, _embedding, _linear, _matmul, _sdpa
from autopar.planner.intra_op.rules_shape import _cat, _free_source, _identity_like, _view
from autopar.planner.intra_op.strategy import Strategy, _Ctx

__all__ = ["strategies_for"]

log = logging.getLogger(__name__)

_DISPATCH: dict[str, Any] = {
    "linear": _linear, "matmul": _matmul, "sdpa": _sdpa, "embedding": _embedding, "conv": _conv,
    "softmax": _softmax, "log_softmax": _softmax, "cat": _cat, "stack": _cat,
    "clone": _identity_like, "contiguous": _identity_like, "copy": _identity_like,
    "cross_entropy": _loss, "nll_loss": _loss, "mse_loss": _loss,
}
_KIND_DISPATCH: dict[str, Any] = {
    "norm": _norm, "pointwise": _pointwise, "reduction": _reduction, "view": _view,
    "input": _free_source, "creation": _free_source,
}


def strategies_for(graph: Graph, node: Node, t: int) -> tuple[Strategy, ...]:
    """All strategies of ``node`` on a tp axis of size ``t``; the first is ``replicate``. Never raises."""
    ctx = _Ctx(graph, node, t)
    rep = ctx.mk("replicate", {}, "R", default=None if node.kind in ("creation", "input") else "R")
    if t == 1 or not node.outputs:
        return (rep,)
    try:
        fn = _DISPATCH.get(node.op) or _KIND_DISPATCH.get(node.kind)
        extra = fn(ctx) if fn is not None else []
    except Exception as e:  # enumeration must never stop the planner; replicate is always valid
        log.debug("strategy enumeration failed for %s (%s): %s; replicating", node.name, node.op, e)
        extra = []
    seen = {(rep.inputs, rep.output)}
    out = [rep]
    for s in extra:
        if (s.inputs, s.output) not in seen:
            seen.add((s.inputs, s.output))
            out.append(s)
    return tuple(out)
