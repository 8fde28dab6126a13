"""Expert parallelism in the planner (issue 14): ep is searched, the all_to_all is costed and shown, memory covers
the expert shards, pins work."""

from __future__ import annotations

import dataclasses

import pytest

from autopar import ir
from autopar.ir.plan import MeshPlan
from autopar.planner.inter_op.expert import ep_choices, ep_cost, ep_groups, imbalance, moe_regions
from autopar.planner.inter_op.memory import memory_breakdown
from autopar.planner.options import PlanOptions
from autopar.planner.report import explain_node, render_plan
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin
from autopar.profiles.cost import CostModel
from autopar.zoo import build, get_config


def _graph(name: str, seq: int | None = None) -> ir.Graph:
    spec = build(name, batch=1, seq=seq)
    return ir.trace(spec.model, spec.example_inputs, model_name=name)


@pytest.fixture(scope="module")
def graphs() -> dict[str, ir.Graph]:
    return {n: _graph(n) for n in ("mixtral-8x7b", "deepseek-moe-16b")}


# what the search may choose besides ep: tp within a node, micro-batches up to 2 (keeps the test's intra-op solves
# few); pp, dp, ZeRO, recompute and schedules are all searched
_FAST = {"workers": 1, "top_k": 0, "max_tp": 8, "max_micro_batch": 2, "intra_op_time_limit_s": 5.0}


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-moe-16b"])
def test_full_size_traced_flops_match_topk_count(graphs: dict[str, ir.Graph], name: str) -> None:
    from test_sparse_moe import check_topk_flops

    cfg = get_config(name)
    check_topk_flops(graphs[name], cfg, cfg.seq)


@pytest.mark.parametrize("nodes", [8, 64])
@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-moe-16b"])
def test_planner_chooses_ep_and_explains_all_to_all(graphs: dict[str, ir.Graph], name: str, nodes: int) -> None:
    g = graphs[name]
    plan = search(g, load_builtin("dgx-h100", nodes=nodes), PlanOptions(global_batch=32 * nodes, **_FAST)).best
    assert plan.mesh.ep > 1, plan.mesh
    node = next(n.name for n in g.nodes if n.op == "grouped_mm")
    text = explain_node(plan, node)
    assert f"expert parallel: ep={plan.mesh.ep}" in text and "all_to_all" in text and " ms fwd" in text, text
    assert "expert parallel: ep=" in render_plan(plan)


def test_pin_ep_and_cost_terms(graphs: dict[str, ir.Graph]) -> None:
    g = graphs["mixtral-8x7b"]
    prof = load_builtin("dgx-h100", nodes=8)
    plan = search(g, prof, PlanOptions(global_batch=256, pins={"ep": 2, "tp": 1, "pp": 1}, **_FAST)).best
    assert (plan.mesh.ep, plan.mesh.dp) == (2, 64)
    with pytest.raises(ValueError, match="no candidate"):  # 3 divides no dp of 64 ranks (nor 8 experts)
        search(g, prof, PlanOptions(global_batch=256, pins={"ep": 3, "tp": 1, "pp": 1}, **_FAST))
    cost = CostModel(prof)
    (r0, *_), regions = moe_regions(g), moe_regions(g)
    assert len(regions) == 32 and r0.experts == 8 and r0.rows == 2 * 4096 and r0.width == 4096
    assert ep_choices(g, 64) == [1, 2, 4, 8] and ep_choices(g, 64, 16) == []
    _, c8 = ep_cost(g, cost, ep=8, tp=1, cp=1, micro_batch=1, dtype="bfloat16")
    # one all_to_all of S x h bf16 elements per rank, dispatch and combine, forward and backward, each block
    a2a = cost.collective_time("all_to_all", 2 * 4096 * 4096 * 2, span=cost.span(8, 1))
    counts = cost.collective_time("all_to_all", 8 * 8, span=cost.span(8, 1))  # E int64 counts first
    assert c8.calls == 5 * 32 and c8.a2a_bytes == 2 * 4096 * 4096 * 2
    assert c8.a2a_fwd_s == pytest.approx(32 * (2 * a2a + counts)) and c8.a2a_bwd_s == pytest.approx(2 * 32 * a2a)
    _, c_inter = ep_cost(g, cost, ep=8, tp=8, cp=1, micro_batch=1, dtype="bfloat16")  # ep group spans 8 nodes
    assert c_inter.a2a_fwd_s > 3 * c8.a2a_fwd_s
    # load imbalance: the busiest ep rank sets the pace
    assert imbalance(None, 8, 4) == 1.0 and imbalance([1] * 8, 8, 4) == 1.0
    assert imbalance([4, 0, 1, 1, 1, 1, 0, 0], 8, 4) == pytest.approx(2.0)
    _, skew = ep_cost(g, cost, ep=4, tp=1, cp=1, micro_batch=1, dtype="bfloat16", load=[4, 0, 1, 1, 1, 1, 0, 0])
    _, even = ep_cost(g, cost, ep=4, tp=1, cp=1, micro_batch=1, dtype="bfloat16")
    assert skew.a2a_fwd_s > 1.5 * even.a2a_fwd_s
    assert [len(x) for x in ep_groups(MeshPlan(dp=8, ep=4, tp=2))] == [4] * 4
    assert ep_groups(MeshPlan(dp=4, ep=2, tp=2))[:2] == [[0, 2], [4, 6]]


def test_memory_expert_state_sharded_over_dp_over_ep() -> None:
    dense, experts, dp = 1e9, 8e9, 64
    kw = {"mixed_precision": True, "activations": 0.0, "capacity": 80e9}
    base = memory_breakdown(param_elems=dense + experts, zero=1, dp=dp, **kw)
    # ep=8: a rank holds 1/8 of the experts; ZeRO shards their state over the dp/ep = 8 ranks holding the same ones
    ep = memory_breakdown(param_elems=dense + experts / 8, zero=1, dp=dp, expert_elems=experts / 8, ep=8, **kw)
    assert ep.optimizer == pytest.approx(base.optimizer)  # Adam state: expert/dp either way
    assert ep.params == pytest.approx(base.params - 2 * experts * 7 / 8)  # the gathered bf16 copy shrinks by ep
    zero0 = memory_breakdown(param_elems=dense + experts / 8, zero=0, dp=dp, expert_elems=experts / 8, ep=8, **kw)
    assert zero0.optimizer == pytest.approx(8 * (dense + experts / 8))
    with pytest.raises(ValueError, match="ep divide dp"):
        memory_breakdown(param_elems=1.0, zero=1, dp=6, expert_elems=1.0, ep=4, **kw)


def test_every_plan_the_search_emits_for_a_moe_runs() -> None:
    """The search never emits an ep plan the runtime refuses (before: ep with ZeRO >= 1 raised NotImplementedError):
    every plan among the best 40 for the sparse MoE on two clusters passes the runtime's check, ep > 1 with
    ZeRO 1-3 and with pp among them; ep > 1 is never paired with tp > 1 (no tensor-parallel rule for the grouped
    matmuls), pinned or not."""
    from autopar.codegen.runtime.expert_parallel import check_supported

    spec = build("sparse-moe-tiny", batch=8, device="meta")
    g = ir.trace(spec.model, spec.example_inputs, model_name="sparse-moe-tiny")
    fast = {"workers": 1, "max_micro_batch": 1, "intra_op_time_limit_s": 1.0}
    seen: set[tuple[int, int, int]] = set()
    for prof, nodes in (("dgx-h100", 1), ("dgx-a100", 2)):
        r = search(g, load_builtin(prof, nodes=nodes), PlanOptions(global_batch=64 * nodes, top_k=40, **fast))
        for p in (r.best, *r.alternatives):
            check_supported(p)
            assert p.mesh.ep == 1 or p.mesh.tp == 1, p.mesh
            if p.mesh.ep > 1:
                seen.add((p.zero, min(p.mesh.pp, 2), p.mesh.tp))
    assert {(1, 1, 1), (3, 1, 1), (1, 2, 1)} <= seen, seen
    assert ep_choices(g, 8, tp=2) == [1] and ep_choices(g, 8, 2, tp=2) == [] and ep_choices(g, 8) == [1, 2, 4]
    with pytest.raises(ValueError, match="no candidate"):
        search(g, load_builtin("dgx-h100", nodes=1), PlanOptions(global_batch=64, pins={"ep": 2, "tp": 2}, **fast))
    hand_made = search(g, load_builtin("dgx-h100", nodes=1), PlanOptions(global_batch=64, pins={"tp": 2}, **fast))
    with pytest.raises(NotImplementedError, match="tp=1"):
        check_supported(dataclasses.replace(hand_made.best, mesh=dataclasses.replace(hand_made.best.mesh, ep=2)))
