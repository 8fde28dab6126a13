"""A plan checked against the model it is run with, before any process starts.

:func:`check_plan_graph` complements the load-time checks of :class:`autopar.ir.plan.Plan` (which need no model):
the fingerprint, stage coverage of every layer group exactly once (no layer past the model, no missing prefix or
suffix), every op sharding naming a node of the graph, and every placement valid for its tensor: the sharded dim
within the tensor's rank, a parameter's shard (``S(d)[k]``: each of the ``k`` parts) divisible by ``tp``.
Each failure is a :class:`autopar.ir.errors.SchemaError` naming the plan field, the value, and what to do.
"""

from __future__ import annotations

from autopar.ir.errors import SchemaError
from autopar.ir.graph import Graph, TensorMeta
from autopar.ir.placement import Placement
from autopar.ir.plan import Plan

__all__ = ["check_plan_graph"]

_REPLAN = "re-plan with `autopar plan` (or fix the hand edit)"


def _clip(s: object, n: int = 120) -> str:
    t = str(s)
    return t if len(t) <= n else t[:n] + "..."


def _check_shard(where: str, text: str, meta: TensorMeta | None, tp: int, *, divisible: bool) -> None:
    p = Placement.parse(text)
    if not p.is_shard or meta is None:
        return
    if p.dim >= len(meta.shape):
        raise SchemaError(where, f"placement {text} shards dim {p.dim} of a {len(meta.shape)}-d tensor "
                          f"{tuple(meta.shape)}; {_REPLAN}", doc="plan")
    n = meta.shape[p.dim]
    if divisible and (n % p.chunks or (n // p.chunks) % tp):
        raise SchemaError(where, f"placement {text} splits dim {p.dim} of size {n} into {p.chunks} part(s) over "
                          f"tp={tp} ranks, which does not divide it; {_REPLAN}", doc="plan")


def check_plan_graph(plan: Plan, graph: Graph, *, fingerprint: bool = True) -> None:
    """Raise SchemaError unless ``plan`` fits ``graph`` (see the module docstring)."""
    if fingerprint:
        plan.check_compatible(fingerprint=graph.fingerprint)
    n_layers = len(graph.layers)
    last = plan.stages[-1].layer_end if plan.stages else 0
    if last != n_layers:
        raise SchemaError(f"stages.{len(plan.stages) - 1}.layer_end",
                          f"the stages cover layer groups [0, {last}) but the model has {n_layers} (from the "
                          f"{graph.layers[0].module_path or 'prefix'} group to the last); every group must be in "
                          f"exactly one stage; {_REPLAN}" if n_layers else "the model has no layer groups",
                          doc="plan")
    tp = plan.mesh.tp
    params = graph.param_map
    for i, ps in enumerate(plan.param_shardings):
        hits = [p for name, p in params.items() if ps.matches(name)]
        if not hits:
            raise SchemaError(f"param_shardings.{i}.pattern", f"{_clip(ps.pattern)!r} matches no parameter of the "
                              f"model; {_REPLAN}", doc="plan")
        for p in hits:
            _check_shard(f"param_shardings.{i}.placement", ps.placement, p.meta, tp, divisible=True)
    for i, op in enumerate(plan.op_shardings):
        if not graph.has_node(op.node):
            raise SchemaError(f"op_shardings.{i}.node", f"{_clip(op.node)!r} is not a node of the model's graph; "
                              f"{_REPLAN}", doc="plan")
        node = graph.node(op.node)
        _check_shard(f"op_shardings.{i}.output", op.output, node.outputs[0] if node.outputs else None, tp,
                     divisible=False)
        names = node.inputs if len(op.inputs) == len(node.inputs) else node.activation_inputs
        if op.inputs and len(op.inputs) != len(names):
            raise SchemaError(f"op_shardings.{i}.inputs", f"{len(op.inputs)} placements for an op with "
                              f"{len(node.inputs)} inputs ({len(node.activation_inputs)} activations); {_REPLAN}",
                              doc="plan")
        for j, text in enumerate(op.inputs):
            k = node.inputs.index(names[j]) if names[j] in node.inputs else -1
            meta = graph.input_meta(node, k) if k >= 0 else None
            _check_shard(f"op_shardings.{i}.inputs.{j}", text, meta, tp, divisible=False)
