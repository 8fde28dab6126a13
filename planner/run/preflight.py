"""Checks ``autopar run`` makes before it starts any process: the plan loads and validates, the model given with
``--model`` is the one the plan was made for (graph fingerprint), and the plan fits that model's graph (every layer
group in exactly one stage, op shardings naming its nodes, placements valid for each tensor's rank and size); see
:func:`autopar.ir.plan_check.check_plan_graph`.  The workers run the same check (a worker started by hand)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["plan_graph"]

log = logging.getLogger(__name__)


def plan_graph(plan: Any, model: str, seq: int | None = None) -> Any:
    """The model's graph traced at the batch the plan was made for, checked against the plan.

    ``autopar plan`` traces batch 1, ``auto_parallel`` the caller's example batch, hand-made plans the micro or
    global batch: the first of these whose fingerprint is the plan's is used.  Raises SchemaError when none is
    (another model, or another ``--seq``) or when the plan does not fit the graph."""
    from autopar.ir.plan_check import check_plan_graph
    from autopar.planner.graphs import traced_graph

    first = None
    for b in dict.fromkeys((plan.micro_batch, 1, plan.global_batch)):
        graph = traced_graph(model, batch=b, seq=seq, frontend="fx")  # a built-in model's from the graph cache
        if graph.fingerprint == plan.graph_fingerprint:
            check_plan_graph(plan, graph)
            return graph
        first = first or graph
    assert first is not None
    check_plan_graph(plan, first)  # raises: the fingerprint differs
    return first
