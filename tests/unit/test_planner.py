"""Tier (b): the planner on meta-device models rediscovers known-good strategies, and matches brute force."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from autopar import ir
from autopar.zoo import build
from autopar.ir.plan import plan_from_yaml, plan_to_yaml
from autopar.planner.costing import Candidate, minmax_partition, screen
from autopar.planner.options import PlanOptions, parse_pins
from autopar.planner.search import PlanInfeasibleError, _Tables, search
from autopar.profiles.builtin import load_builtin
from autopar.profiles.cost import CostModel


def _graph(name: str, seq: int | None = None) -> ir.Graph:
    spec = build(name, batch=1, device="meta", seq=seq)
    return ir.verify(ir.trace(spec.model, spec.example_inputs, model_name=name))


@pytest.fixture(scope="module")
def gpt2() -> ir.Graph:
    return _graph("gpt2-small")


def test_small_gpt_on_8_devices_is_pure_data_parallel(gpt2: ir.Graph) -> None:
    res = search(gpt2, load_builtin("dgx-a100-80gb", nodes=1), PlanOptions(global_batch=64))
    p = res.best
    assert (p.mesh.pp, p.mesh.dp, p.mesh.tp) == (1, 8, 1)
    assert all(s.recompute == "none" for s in p.stages)
    assert not p.param_shardings
    assert p.time.bubble == 0
    assert res.alternatives and all(a.time.total >= p.time.total for a in res.alternatives)
    assert plan_from_yaml(plan_to_yaml(p)) == p


def test_model_too_big_for_one_device_uses_tensor_parallel_inside_a_node() -> None:
    g = _graph("gpt3-13b")
    p = search(g, load_builtin("dgx-a100-80gb", nodes=1), PlanOptions(global_batch=32, zero_levels=(0,))).best
    assert p.mesh.tp > 1 and p.mesh.tp <= 8
    # Megatron's pattern, found by the solver: column-parallel qkv/fc1, row-parallel proj/fc2
    assert p.placement_of("blocks.3.attn.qkv.weight").startswith("S(0)")
    assert p.placement_of("blocks.3.mlp.fc1.weight") == "S(0)"
    assert p.placement_of("blocks.3.attn.proj.weight") == "S(1)"
    assert p.placement_of("blocks.3.mlp.fc2.weight") == "S(1)"
    assert max(s.memory.total for s in p.stages) <= 80 * 2**30 * 1.0001


def test_model_too_big_for_a_node_pipelines_across_nodes() -> None:
    g = _graph("gpt3-175b")
    p = search(g, load_builtin("dgx-a100-80gb", nodes=16), PlanOptions(global_batch=256, zero_levels=(0, 1))).best
    assert p.mesh.pp > 1
    assert p.mesh.tp <= 8  # tensor parallelism stays inside a node
    assert p.mesh.world_size == 128
    assert all(s.memory.total <= s.memory.capacity for s in p.stages)


def test_infeasible_names_smallest_cluster() -> None:
    g = _graph("gpt3-175b")
    with pytest.raises(PlanInfeasibleError, match=r"smallest cluster that fits is \d+ nodes"):
        search(g, load_builtin("dgx-a100-80gb", nodes=1), PlanOptions(global_batch=8))


def test_pins_are_respected_and_validated(gpt2: ir.Graph) -> None:
    prof = load_builtin("dgx-a100-80gb", nodes=1)
    p = search(gpt2, prof, PlanOptions(global_batch=64, pins=parse_pins(["tp=2,schedule=1f1b", "pp=2"]))).best
    assert (p.mesh.tp, p.mesh.pp, p.schedule) == (2, 2, "1f1b")
    assert "tp=2" in p.pins
    with pytest.raises(ValueError, match="does not divide"):
        search(gpt2, prof, PlanOptions(global_batch=64, pins={"tp": 3}))
    with pytest.raises(ValueError, match="unknown pin"):
        parse_pins(["tq=2"])


def test_search_is_deterministic(gpt2: ir.Graph) -> None:
    prof = load_builtin("dgx-a100-80gb", nodes=2)
    a = search(gpt2, prof, PlanOptions(global_batch=128)).best
    b = search(gpt2, prof, PlanOptions(global_batch=128)).best
    strip = lambda p: replace(p, solver=replace(p.solver, wall_s=0.0))  # noqa: E731
    assert strip(a) == strip(b)


def test_minmax_partition_matches_brute_force() -> None:
    import random

    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(1, 9), rng.randint(1, 5)
        times = [rng.choice([0.0, rng.random()]) for _ in range(n)]
        got = minmax_partition(times, k)
        if k > n:
            assert got is None
            continue
        assert got is not None and len(got) == k and got[0][0] == 0 and got[-1][1] == n
        assert all(a < b for a, b in got) and all(got[i][1] == got[i + 1][0] for i in range(k - 1))
        best = min(max(sum(times[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                   for cuts in itertools.combinations(range(1, n), k - 1))
        assert max(sum(times[a:b]) for a, b in got) == pytest.approx(best, abs=1e-9)


def test_search_finds_the_brute_force_optimum() -> None:
    """Enumerate every candidate of a small instance, evaluate each exactly (stage partition + schedule
    simulation, as for the search's finalists) and check the search returns the best of all of them."""
    from autopar.planner.assemble import build_plan

    g = _graph("llama-tiny")
    prof = load_builtin("dgx-a100-80gb", nodes=1)
    opts = PlanOptions(global_batch=16, top_k=0)
    best = search(g, prof, opts).best
    cost = CostModel(prof)
    tables = _Tables(g, cost, opts)
    world, n, gb = 8, len(g.layers), 16
    totals = []
    for tp, pp in itertools.product([1, 2, 4, 8], [1, 2, 4, 8]):
        if world % (tp * pp) or pp > n:
            continue
        dp = world // (tp * pp)
        for mb in [d for d in (1, 2, 4, 8, 16) if (gb // dp) % d == 0]:
            m = gb // dp // mb
            for sched, v in [("1f1b", 1), ("gpipe", 1)] + [("interleaved_1f1b", v) for v in (2, 3, 4)]:
                if (v > 1 and (pp == 1 or m % pp or pp * v > n)) or (sched == "1f1b" and 1 < pp and m < pp):
                    continue
                for rc, zero in itertools.product(("none", "selective", "full"), (0, 1, 2, 3)):
                    for lean, table in tables.variants(tp, mb):
                        c = Candidate(pp, dp, tp, mb, m, sched, v, zero, rc, lean)
                        s = screen(c, table, cost, dtype=opts.dtype, capacity=prof.device.memory_bytes,
                                   p2p_intra=True)
                        plan = build_plan(g, prof, opts, s, table, cost) if s is not None else None
                        if plan is not None:
                            totals.append(plan.time.total)
    assert len(totals) > 500
    assert best.time.total == pytest.approx(min(totals), rel=1e-9)


def test_schedule_trace_and_report(gpt2: ir.Graph, tmp_path) -> None:
    from autopar.planner.report import diff_plans, render_plan, schedule_trace

    prof = load_builtin("dgx-a100-80gb", nodes=1)
    p = search(gpt2, prof, PlanOptions(global_batch=64, pins={"pp": 2})).best
    text = render_plan(p)
    assert "pp=2" in text and "stages" in text
    n = schedule_trace(p, tmp_path / "t.json")
    assert n >= 2 * p.num_microbatches * 2
    json.loads((tmp_path / "t.json").read_text())
    q = search(gpt2, prof, PlanOptions(global_batch=64)).best
    assert "mesh.pp" in diff_plans(p, q)
    assert diff_plans(p, p) == "the plans are identical\n"
