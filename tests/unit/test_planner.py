"""Tier (b), quick cases: the planner on small meta-device models, pins, determinism, the partitioner against brute
force. The real-size cases (tens to hundreds of billions of parameters) are in
tests/integration/test_planner_at_scale.py."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from autopar import ir
from autopar.ir.plan import plan_from_yaml, plan_to_yaml
from autopar.planner.inter_op.partition import minmax_partition
from autopar.planner.options import PlanOptions, parse_pins
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin
from autopar.zoo import build


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
    # the YAML round-trips exactly, apart from the search's wall time, which plans do not store (byte-identical
    # plans across runs)
    assert plan_from_yaml(plan_to_yaml(p)) == replace(p, solver=replace(p.solver, wall_s=0.0))


def test_pins_are_respected_and_validated(gpt2: ir.Graph) -> None:
    prof = load_builtin("dgx-a100-80gb", nodes=1)
    p = search(gpt2, prof, PlanOptions(global_batch=64, pins=parse_pins(["tp=2,schedule=1f1b", "pp=2"]))).best
    assert (p.mesh.tp, p.mesh.pp, p.schedule) == (2, 2, "1f1b")
    assert "tp=2" in p.pins
    with pytest.raises(ValueError, match="does not divide"):
        search(gpt2, prof, PlanOptions(global_batch=64, pins={"tp": 3}))
    with pytest.raises(ValueError, match="unknown pin"):
        parse_pins(["tq=2"])
    assert parse_pins(["ep=2 ", "cp=4,dp=4"]) == {"ep": 2, "cp": 4, "dp": 4}
    with pytest.raises(ValueError, match="pin ep=3 must divide pin dp=4"):
        PlanOptions(global_batch=64, pins=parse_pins(["ep=3", "dp=4"]))
    with pytest.raises(ValueError, match="positive integer"):
        parse_pins(["cp=0"])


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
