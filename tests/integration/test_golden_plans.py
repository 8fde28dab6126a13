"""Golden plans for a grid of zoo models x clusters (process replay for refactors).

Every decision the planner makes and every number it predicts is in the YAML; only the solver's wall time, which
depends on the machine, is zeroed. A refactor proves itself by leaving these files byte for byte unchanged.
Regenerate deliberately with ``AUTOPAR_UPDATE_GOLDEN=1 python -m pytest tests -k golden_plan``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import ir
from autopar.ir.plan import plan_from_yaml, plan_to_yaml
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin
from autopar.zoo import build

from golden_files import GOLDEN_DIR, check_golden

# (model, cluster, nodes, global batch, pins): small and large models, every built-in cluster, 1 to 128 nodes.
CASES = [
    ("gpt-tiny", "dgx-a100-80gb", 1, 16, {}),
    ("gpt-tiny", "dgx-h100", 2, 32, {"pp": 2, "schedule": "interleaved_1f1b", "recompute": "selective"}),
    ("gpt2-small", "dgx-a100-80gb", 1, 64, {}),
    ("gpt2-small", "dgx-h100", 4, 64, {}),
    ("llama-tiny", "dgx-h100", 2, 32, {"tp": 2, "pp": 2}),
    ("llama-tiny", "h200", 1, 16, {}),
    ("moe-tiny", "dgx-h100", 4, 16, {}),
    ("mlp-tiny", "dgx-h100", 4, 16, {}),
    ("mlp-large", "dgx-a100-80gb", 1, 256, {}),
    ("mlp-large", "dgx-h100", 4, 256, {}),
    ("gpt3-1.3b", "dgx-a100-80gb", 1, 256, {}),
    ("gpt3-175b", "dgx-a100-80gb", 128, 1536, {}),
]


def _case_id(case: tuple) -> str:
    model, cluster, nodes, gb, pins = case
    pinned = "".join(f"_{k}{v}" for k, v in sorted(pins.items()))
    return f"{model}_{cluster}_{nodes}n_gb{gb}{pinned}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_golden_plan(case: tuple) -> None:
    model, cluster, nodes, gb, pins = case
    spec = build(model, batch=1, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, model_name=model)
    plan = search(graph, load_builtin(cluster, nodes=nodes), PlanOptions(global_batch=gb, pins=pins)).best
    plan = replace(plan, solver=replace(plan.solver, wall_s=0.0))  # the only field that depends on the machine
    text = plan_to_yaml(plan)
    assert plan_from_yaml(text) == plan  # the YAML round-trips exactly
    check_golden(GOLDEN_DIR / "plans" / f"{_case_id(case)}.yaml", text)
