"""Context parallelism in the planner: the cost model picks cp for long sequences and not for short ones
(Llama-3 8B on 8 DGX H100 nodes, the same 1M tokens per batch), the ring/all-gather choice, pins, and the cp table."""

from __future__ import annotations

import pytest

from autopar import ir
from autopar.planner.inter_op.context import attention_sites, cp_choices, cp_method
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin
from autopar.profiles.cost import CostModel
from autopar.zoo import build


def _llama8b(seq: int) -> ir.Graph:
    spec = build("llama3-8b", batch=1, device="meta", seq=seq)
    return ir.trace(spec.model, spec.example_inputs, model_name="llama3-8b")


@pytest.fixture(scope="module")
def long_graph() -> ir.Graph:
    return _llama8b(131072)


# one node's tp at most and 1F1B only: the same answers as the full search (checked by hand: pp1 dp4 cp8 tp2 at 128K,
# 11.19 s/iteration against the best tp-only plan's tp8 dp8 11.81 s; dp64 at 8K), at a fraction of its CPU time
OPTS = {"dtype": "bfloat16", "top_k": 0, "workers": 1, "max_tp": 8, "schedules": ("1f1b",), "max_micro_batch": 4}


def test_cp_for_128k_not_for_8k(long_graph: ir.Graph) -> None:
    prof = load_builtin("dgx-h100", nodes=8)
    long = search(long_graph, prof, PlanOptions(global_batch=8, **OPTS)).best  # type: ignore[arg-type]
    assert long.mesh.cp > 1, long.mesh  # tp=8 (and every tp/pp mix) was searched too: cp beat it
    assert any("cp_ring" in o.comm for o in long.op_shardings if o.op == "sdpa")
    short = search(_llama8b(8192), prof, PlanOptions(global_batch=128, **OPTS)).best  # type: ignore[arg-type]
    assert short.mesh.cp == 1, short.mesh


def test_ring_hides_at_long_chunks_all_gather_wins_short(long_graph: ir.Graph) -> None:
    cost = CostModel(load_builtin("dgx-h100", nodes=8))
    site = attention_sites(long_graph)[0]
    name, fwd, bwd = cp_method(site, cost, cp=8, tp=1, mb_scale=1.0, dtype="bfloat16")
    assert name == "cp_ring" and fwd == bwd == 0.0  # 8K-token chunks: every step's transfer hides behind its block
    short = attention_sites(_llama8b(1024))[0]
    assert cp_method(short, cost, cp=8, tp=1, mb_scale=1.0, dtype="bfloat16")[0] == "cp_all_gather"
    # searched degrees: chunks long enough to hide a ring step, and only those dividing the sequence
    assert cp_choices(long_graph, cost, 64, 1, "bfloat16", None) == [1, 2, 4, 8]
    assert cp_choices(long_graph, cost, 64, 1, "bfloat16", 3) == []


def test_pin_cp_yaml_show_explain() -> None:
    import dataclasses

    import yaml

    from autopar.ir.plan import plan_from_yaml, plan_to_yaml
    from autopar.planner.options import parse_pins
    from autopar.planner.report import explain_node, render_plan

    spec = build("llama-tiny", batch=4, device="meta", seq=16)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="llama-tiny")
    prof = dataclasses.replace(load_builtin("dgx-a100-80gb", nodes=1), devices_per_node=4)
    plan = search(graph, prof, PlanOptions(global_batch=4, dtype="float32", top_k=0, workers=1,
                                           pins=parse_pins(["cp=2", "tp=2,dp=1"]))).best
    assert (plan.mesh.cp, plan.mesh.tp, plan.mesh.dp) == (2, 2, 1)
    text = plan_to_yaml(plan)
    assert yaml.safe_load(text)["mesh"] == {"pp": 1, "dp": 1, "ep": 1, "cp": 2, "tp": 2}
    assert plan_from_yaml(text).mesh == plan.mesh
    shown = render_plan(plan, width=200)
    assert "pp=1 dp=1 cp=2 tp=2" in shown and "cp groups of ranks 2 apart, e.g. [0, 2]" in shown
    attn = next(o for o in plan.op_shardings if o.op == "sdpa")
    assert attn.comm in ("cp_ring", "cp_all_gather") and attn.comm_s > 0  # the exchange's cost is on the op
    assert "context parallel: cp=2" in explain_node(plan, attn.node)


def test_a_cp_rank_is_costed_at_its_own_share_of_the_tokens() -> None:
    """gpt-tiny, 8 sequences of 16 tokens on 8 A100s: a cp=8 rank runs 8 sequences of 2 tokens, a dp=8 rank one of
    16, the same tokens, FLOPs and kernel launches per op; every op here is launch-bound, so their compute is the
    same (a cp table scaled from the whole micro-batch's by 1/cp once made cp=8 2.4x faster and the planner's
    pick), and cp's K/V exchange makes it the slower plan."""
    spec = build("gpt-tiny", batch=8, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, model_name="gpt-tiny")
    prof = load_builtin("dgx-a100-80gb", nodes=1)
    opts = {"global_batch": 8, "dtype": "float32", "top_k": 0, "workers": 1}
    # the same gradient sync for both (ZeRO 0's bucket copies are compute too)
    cp8 = search(graph, prof, PlanOptions(pins={"cp": 8, "zero": 0}, **opts)).best  # type: ignore[arg-type]
    dp8 = search(graph, prof, PlanOptions(pins={"dp": 8, "zero": 0}, **opts)).best  # type: ignore[arg-type]
    assert cp8.mesh.cp == 8 and dp8.mesh.dp == 8 and cp8.micro_batch == 8 and dp8.micro_batch == 1
    assert cp8.time.compute == pytest.approx(dp8.time.compute, rel=0.02)
    assert cp8.time.total > dp8.time.total
    assert search(graph, prof, PlanOptions(**opts)).best.mesh.cp == 1  # type: ignore[arg-type]
