"""Golden plan YAML: a refactor that changes what the planner decides (or predicts) shows up here.

Regenerate deliberately with ``AUTOPAR_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_plans.py``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

import ir
from examples.zoo import build
from ir.plan import plan_from_yaml, plan_to_yaml
from planner.options import PlanOptions
from planner.search import search
from profiles.builtin import load_builtin

GOLDEN = Path(__file__).parent / "golden"
CASES = [("gpt2-small", "dgx-a100-80gb", 1, 64, {}), ("llama-tiny", "dgx-h100", 2, 32, {"tp": 2, "pp": 2})]


@pytest.mark.parametrize("model,cluster,nodes,gb,pins", CASES, ids=[c[0] for c in CASES])
def test_plan_matches_golden(model: str, cluster: str, nodes: int, gb: int, pins: dict) -> None:
    spec = build(model, batch=1, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, model_name=model)
    plan = search(graph, load_builtin(cluster, nodes=nodes), PlanOptions(global_batch=gb, pins=pins)).best
    plan = replace(plan, solver=replace(plan.solver, wall_s=0.0))  # the only field that depends on the machine
    text = plan_to_yaml(plan)
    path = GOLDEN / f"plan_{model}_{cluster}_{nodes}n.yaml"
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN") == "1" or not path.exists():
        path.write_text(text)
    assert plan_from_yaml(path.read_text()) == plan_from_yaml(text)
    assert text == path.read_text()
