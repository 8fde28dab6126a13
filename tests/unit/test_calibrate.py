"""``autopar calibrate``'s mechanics without processes: factor application, the fit, attribution, the sidecar CLI.

Every fit here is checked on data it was *not* fitted to: synthetic measurements are generated from a profile with
known factors, the fit sees one set of ops/plans, and the check uses another.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from autopar import ir
from autopar.planner.calibrate import (
    RunMeasurement,
    calibrate,
    calibrate_loop,
    compose,
    determined,
    link_groups,
    load_factors,
    observation,
    predict,
    shardings,
)
from autopar.planner.cli import main
from autopar.planner.options import PlanOptions
from autopar.planner.run.attribution import attribute, category
from autopar.planner.search import search
from autopar.profiles import (
    COLLECTIVES,
    AlphaBeta,
    ClusterProfile,
    CostModel,
    DeviceProfile,
    EfficiencyPoint,
    LinkProfile,
    load_profile,
    save_profile,
)
from autopar.profiles.refit import OVERLAP_FIELD, apply_factors, factor_names, fit_factors, provenance
from autopar.zoo import build

NOISE_FREE = 1e-3
"""The prior of a fit to synthetic runs, which carry no measurement noise: the data alone determine the factors
(the default prior, for measured runs, pulls factors the data move by little back toward the base profile)."""


def cpu_like(ranks: int = 2) -> ClusterProfile:
    """A small CPU-rank-like profile: slow collectives, 100 GFLOP/s."""
    ab = {k: tuple(AlphaBeta(group_size=g, alpha_s=3e-4, busbw=5e8) for g in ((2,) if k == "p2p" else (2, ranks)
                                                                              if ranks > 2 else (2,)))
          for k in COLLECTIVES}
    dev = DeviceProfile(name="cpu-like", memory_bytes=8 * 2**30, peak_flops={"float32": 1e11, "bfloat16": 1e11},
                        matmul_efficiency={"default": (EfficiencyPoint(flops=1e5, efficiency=0.2),
                                                       EfficiencyPoint(flops=1e8, efficiency=1.0))},
                        memory_bandwidth=2e10, launch_overhead_s=4e-6, vector_flops=5e10)
    return ClusterProfile(schema_version=1, name="cpu-like", source="synthetic", nodes=1, devices_per_node=ranks,
                          device=dev, links={"intra_node": LinkProfile(level="intra_node", **ab)})  # type: ignore


def test_apply_factors_scales_each_term() -> None:
    base = cpu_like()
    f = {"matmul": 2.0, "memory": 4.0, "overhead": 3.0, "all_reduce.alpha": 5.0, "all_reduce.beta": 0.5}
    new, old = CostModel(apply_factors(base, f)), CostModel(base)
    o_old, o_new = base.device.launch_overhead_s, 3.0 * base.device.launch_overhead_s
    # compute-bound matmul: its math doubles, the overhead triples
    assert new.op_time(1e9, 1.0, "float32", "matmul") - o_new == pytest.approx(
        2 * (old.op_time(1e9, 1.0, "float32", "matmul") - o_old))
    # memory-bound pointwise op: bytes / bandwidth x4
    assert new.op_time(1.0, 1e8, "float32", "pointwise") - o_new == pytest.approx(
        4 * (old.op_time(1.0, 1e8, "float32", "pointwise") - o_old))
    a_old, a_new = old.collective_time("all_reduce", 0, 2), new.collective_time("all_reduce", 0, 2)
    assert a_new == pytest.approx(5 * a_old)
    b_old = old.collective_time("all_reduce", 1e7, 2) - a_old
    assert new.collective_time("all_reduce", 1e7, 2) - a_new == pytest.approx(0.5 * b_old)
    assert new.collective_time("all_to_all", 1e7, 2) == old.collective_time("all_to_all", 1e7, 2)
    # link factors act on every collective, per-collective ones on top of them; p2p only takes its own
    linked = CostModel(apply_factors(base, {"link.alpha": 2.0, "link.beta": 3.0, "p2p.alpha": 1.5}))
    for kind in ("all_to_all", "all_gather", "reduce_scatter"):
        t0, t1 = old.collective_time(kind, 0, 2), linked.collective_time(kind, 0, 2)
        assert t1 == pytest.approx(2 * t0)
        assert linked.collective_time(kind, 1e7, 2) - t1 == pytest.approx(3 * (old.collective_time(kind, 1e7, 2) - t0))
    assert linked.p2p_time(0) == pytest.approx(1.5 * old.p2p_time(0))
    assert linked.p2p_time(1e7) - linked.p2p_time(0) == pytest.approx(old.p2p_time(1e7) - old.p2p_time(0))
    assert apply_factors(base, {}) == base
    with pytest.raises(ValueError, match="unknown factor"):
        apply_factors(base, {"bogus": 2.0})
    with pytest.raises(ValueError, match="positive"):
        apply_factors(base, {"matmul": 0.0})


def test_overlap_is_a_clamped_shift_when_the_schema_has_it() -> None:
    base = cpu_like()
    if not hasattr(base.device, OVERLAP_FIELD):
        pytest.skip("the profile schema has no overlap field")
    assert "overlap" in factor_names(("all_reduce",), base)
    assert getattr(apply_factors(base, {"overlap": 1.25}).device, OVERLAP_FIELD) == pytest.approx(0.25)
    assert getattr(apply_factors(base, {"overlap": 0.5}).device, OVERLAP_FIELD) == 0.0
    assert getattr(apply_factors(base, {"overlap": 9.0}).device, OVERLAP_FIELD) == 1.0


def _op_times(prof: ClusterProfile, ops: list[tuple[float, float, str]], colls: list[tuple[str, float]]) -> list[float]:
    cm = CostModel(prof)
    return [cm.op_time(f, b, "float32", k) for f, b, k in ops] + [cm.collective_time(k, s, 2) for k, s in colls]


def test_fit_recovers_known_factors_and_predicts_other_sizes() -> None:
    base = cpu_like()
    truth = {"matmul": 3.0, "vector": 1.0, "memory": 2.0, "overhead": 7.0, "all_reduce.alpha": 2.0,
             "all_reduce.beta": 1.5}
    fit_ops = [(2e5, 1e4, "matmul"), (5e7, 2e5, "matmul"), (3e8, 1e6, "matmul"), (1e3, 4e6, "pointwise"),
               (1e2, 1e3, "norm"), (1e3, 3e7, "softmax")]
    fit_colls = [("all_reduce", 1e3), ("all_reduce", 1e7)]
    held_ops = [(1e8, 3e5, "matmul"), (4e6, 1e4, "matmul"), (1e4, 1e7, "pointwise"), (1e4, 3e5, "reduction")]
    held_colls = [("all_reduce", 3e5), ("all_reduce", 4e7)]
    measured = _op_times(apply_factors(base, truth), fit_ops, fit_colls)

    fit = fit_factors(list(truth), lambda k: _op_times(apply_factors(base, k), fit_ops, fit_colls), measured,
                      prior=1e-8, iterations=40)
    for k in ("matmul", "memory", "overhead", "all_reduce.alpha", "all_reduce.beta"):
        assert fit.factors[k] == pytest.approx(truth[k], rel=0.02), k
    # no op is compute-bound at vector rate, so vector is not determined by these data and stays at 1
    assert fit.factors["vector"] == pytest.approx(1.0, abs=0.02) and not fit.determined["vector"]
    got = _op_times(apply_factors(base, fit.factors), held_ops, held_colls)
    want = _op_times(apply_factors(base, truth), held_ops, held_colls)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=0.02)


def test_fit_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="distinct"):
        fit_factors(["a", "a"], lambda k: [1.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        fit_factors(["a"], lambda k: [1.0, 2.0], [1.0])


def test_attribution_outermost_category_wins() -> None:
    events = [
        ("aten::linear", 0.000, 0.010, None),
        ("aten::addmm", 0.001, 0.009, 0),                  # matmul inside linear: counted once, as matmul
        ("Redistribute", 0.010, 0.020, None),
        ("c10d::allreduce_", 0.011, 0.019, 2),             # a DTensor collective: comm
        ("c10d::barrier", 0.020, 0.025, None),             # the worker's step barrier: idle
        ("c10d::recv_", 0.025, 0.030, None),               # pipeline wait
        ("Optimizer.step#AdamW.step", 0.030, 0.038, None),
        ("aten::add_", 0.031, 0.032, 6),                   # inside the optimizer: not compute
    ]
    a = attribute(events, window_s=0.080, steps=2)
    assert a["step"] == pytest.approx(0.040)
    assert a["matmul"] == pytest.approx(0.005)
    assert a["comm"] == pytest.approx(0.004)
    assert a["idle"] == pytest.approx(0.0025)
    assert a["p2p"] == pytest.approx(0.0025)
    assert a["optimizer"] == pytest.approx(0.004)
    assert a["compute"] == pytest.approx(0.040 - 0.004 - 0.0025 - 0.0025 - 0.004)
    # a second thread (CUDA autograd's device thread) with a matmul overlapping one above: the union counts
    other = [("autograd::engine::evaluate_function: MmBackward0", 0.004, 0.012, None), ("aten::mm", 0.004, 0.012, 8),
             ("gloo:all_reduce", 0.011, 0.019, None)]
    b = attribute(events + other, window_s=0.080, steps=2)
    assert b["matmul"] == pytest.approx((0.012 - 0.000) / 2) and b["comm"] == pytest.approx(a["comm"])
    assert category("_c10d_functional::all_gather_into_tensor") == "comm"
    assert category("aten::gelu") is None
    with pytest.raises(ValueError, match="parent"):
        attribute([("x", 0.0, 1.0, 3)], 1.0, 1)


def test_attribution_counts_an_async_collectives_wait() -> None:
    # an async all-reduce returns at 0.011; the host waits (no event) until 0.020, then computes; a recv likewise
    main = [("c10d::allreduce_", 0.010, 0.011, None, 1), ("aten::add", 0.020, 0.021, None, 1),
            ("c10d::recv_", 0.030, 0.031, None, 1), ("aten::mul", 0.040, 0.041, None, 1)]
    other = [("aten::mm", 0.012, 0.018, None, 2)]  # another thread's work does not end the main thread's wait
    a = attribute(main + other, window_s=0.050, steps=1)
    assert a["comm"] == pytest.approx(0.010) and a["p2p"] == pytest.approx(0.010)
    assert a["matmul"] == pytest.approx(0.006) and a["compute"] == pytest.approx(0.030)


def _graph(name: str) -> ir.Graph:
    spec = build(name, batch=1, device="meta", seq=16)
    return ir.verify(ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name=name))


def _synthetic_run(plan: ir.Plan, truth_plan: ir.Plan) -> RunMeasurement:
    """A run measured as the truth profile predicts it (critical rank = every rank)."""
    c, mm, comm, opt, total = observation(truth_plan)
    rank = {"compute": c, "comm": comm, "p2p": truth_plan.time.bubble, "idle": 0.0, "optimizer": opt,
            "matmul": mm, "step": total}
    return RunMeasurement(plan_path="synthetic.yaml", model=plan.model, mesh=(plan.mesh.pp, plan.mesh.dp,
                          plan.mesh.tp), step_s=total, ranks=[rank] * plan.world_size)


def test_calibrate_on_dp_and_tp_predicts_a_held_out_pipeline_plan() -> None:
    graph, base = _graph("gpt-tiny"), cpu_like()
    truth = apply_factors(base, {"matmul": 4.0, "memory": 3.0, "overhead": 6.0, "all_reduce.alpha": 2.0})

    def plan(prof: ClusterProfile, **pins: int) -> ir.Plan:
        return search(graph, prof, PlanOptions(global_batch=8, dtype="float32", top_k=0, workers=1, pins=pins)).best

    runs = []
    for pins in ({"pp": 1, "dp": 2, "tp": 1, "zero": 0}, {"pp": 1, "dp": 1, "tp": 2}):
        p = plan(base, **pins)
        runs.append((p, graph, _synthetic_run(p, predict(graph, truth, p))))
    names = ["matmul", "memory", "overhead", "all_reduce.alpha", "all_reduce.beta"]
    fit = calibrate(base, runs, names=names)
    fitted = provenance(base, fit, "synthetic dp=2 and tp=2 runs")
    assert "calibrated" in fitted.source and "fitted by autopar calibrate" in fitted.device.sources["peak_flops"]
    # held out: a pipeline plan, never seen by the fit
    held = plan(base, pp=2, dp=1, tp=1)
    want, before, got = (predict(graph, p, held).time.total for p in (truth, base, fitted))
    assert abs(got / want - 1) < 0.10 < abs(before / want - 1)


def test_factors_the_runs_cannot_determine_are_left_at_one() -> None:
    """A factor that moves no observation by 5% of its step at x10 or x0.1 is not fitted: the measured bandwidth term
    of messages far below the link's noise (gloo on shared cores) was fitted to x10 this way, and carried to the
    4-rank profile it predicted collectives 2.3x too slow.  The move counts in proportion to what is measured, so that
    a base profile far from the machine (an A100's against a CPU) still has its compute fitted."""
    def observe(f: dict[str, float]) -> list[float]:  # step 1.0: "big" is most of it, "tiny" 0.1%
        return [0.9 * f.get("big", 1.0) + 0.001 * f.get("tiny", 1.0), 1.0]

    assert determined(["big", "tiny"], observe, [1.0, 1.0]) == ["big"]
    assert determined(["tiny"], lambda f: [0.05 * f.get("tiny", 1.0)], [1.0]) == ["tiny"]  # 0.45 at x10
    assert determined(["tiny"], lambda f: [0.001 * f.get("tiny", 1.0)], [1.0]) == []
    # a base profile far from the machine: the factor's term is predicted at 0.1% of the step but measured at 80%;
    # the move counts in proportion to the measurement (x10 moves that observation by 9 times itself)
    assert determined(["tiny"], lambda f: [0.001 * f.get("tiny", 1.0)], [1.0], measured=[0.8]) == ["tiny"]
    assert determined(["tiny"], lambda f: [0.001 * f.get("tiny", 1.0)], [1.0], measured=[None]) == []  # as predicted
    assert determined(["big", "tiny"], observe, [1.0, 1.0], measured=[0.9, 1.0]) == ["big"]


def test_dtensor_dispatch_is_charged_under_tp_only_and_fitted_from_a_tp_run() -> None:
    """The ``dtensor`` factor: every op of a tensor-parallel stage (views included) pays DTensor's dispatch on top
    of a plain op's overhead; a dp-only plan is unchanged.  Fitted on synthetic dp=2 and tp=2 runs, it predicts a
    held-out dp=2 x tp=2 plan on 4 ranks (factors carried to the 4-rank profile)."""
    graph, base, base4 = _graph("gpt-tiny"), cpu_like(), cpu_like(4)
    slow = apply_factors(base, {"dtensor": 5.0})
    assert slow.device.sharded_op_overhead == 5.0
    assert CostModel(slow).sharded_op_extra() == pytest.approx(4 * base.device.launch_overhead_s)
    assert CostModel(base).sharded_op_extra() == 0.0

    def plan(prof: ClusterProfile, batch: int = 8, **pins: int) -> ir.Plan:
        opts = PlanOptions(global_batch=batch, dtype="float32", top_k=0, workers=1, pins=pins)
        return search(graph, prof, opts).best

    dp, tp = plan(base, pp=1, dp=2, tp=1, zero=0), plan(base, pp=1, dp=1, tp=2)
    assert predict(graph, slow, dp).time.total == predict(graph, base, dp).time.total
    assert predict(graph, slow, tp).time.compute > predict(graph, base, tp).time.compute
    truth = {"overhead": 3.0, "dtensor": 8.0}
    runs = [(p, graph, _synthetic_run(p, predict(graph, apply_factors(base, truth), p))) for p in (dp, tp)]
    fit = calibrate(base, runs, names=["overhead", "dtensor"], prior=NOISE_FREE)
    assert fit.factors["dtensor"] == pytest.approx(8.0, rel=0.05) and fit.determined["dtensor"]
    held = plan(base4, pp=1, dp=2, tp=2)
    want, before, got = (predict(graph, apply_factors(base4, f), held).time.total
                         for f in (truth, {}, fit.factors))
    assert abs(got / want - 1) < 0.05 < abs(before / want - 1)


def test_compose_equals_applying_twice() -> None:
    base = dataclasses.replace(cpu_like(), device=dataclasses.replace(cpu_like().device, **{OVERLAP_FIELD: 0.1})) \
        if hasattr(cpu_like().device, OVERLAP_FIELD) else cpu_like()
    b = getattr(base.device, OVERLAP_FIELD, 0.0)
    for first, then in (({"matmul": 2.0, "overlap": 1.2}, {"matmul": 3.0, "overlap": 1.1, "memory": 0.5}),
                        ({"overlap": 0.5}, {"overlap": 1.3}), ({"overlap": 0.2}, {"overlap": 0.3})):
        if not hasattr(base.device, OVERLAP_FIELD):
            first, then = ({k: v for k, v in d.items() if k != "overlap"} for d in (first, then))
        twice = apply_factors(apply_factors(base, first), then)
        once = apply_factors(base, compose(first, then, b))
        assert CostModel(once).op_time(1e9, 1e6, "float32", "matmul") == pytest.approx(
            CostModel(twice).op_time(1e9, 1e6, "float32", "matmul"))
        assert getattr(once.device, OVERLAP_FIELD, 0.0) == pytest.approx(getattr(twice.device, OVERLAP_FIELD, 0.0))


def test_calibrate_loop_remeasures_plans_the_fit_reshards() -> None:
    graph, base = _graph("gpt-tiny"), cpu_like()
    # a machine whose compute is far slower than the base says: tp=2 should shard once the fit knows it
    truth = apply_factors(base, {"matmul": 30.0, "memory": 30.0, "overhead": 3.0})
    p = search(graph, base, PlanOptions(global_batch=8, dtype="float32", top_k=0, workers=1,
                                        pins={"pp": 1, "dp": 1, "tp": 2})).best
    calls: list[int] = []

    def remeasure(q: ir.Plan, it: int) -> RunMeasurement:
        calls.append(it)
        return _synthetic_run(q, predict(graph, truth, q))

    runs = [(p, graph, _synthetic_run(p, predict(graph, truth, p)))]
    _, total, final = calibrate_loop(base, runs, iterations=3, remeasure=remeasure)
    fitted = apply_factors(base, total)
    q = final[0][0]
    assert shardings(predict(graph, fitted, q)) == shardings(q) or len(calls) == 2
    if shardings(predict(graph, truth, p)) != shardings(p):  # the truth reshards: the loop must have re-measured
        assert calls and shardings(q) != shardings(p)
    got, want = predict(graph, fitted, q).time.total, predict(graph, truth, q).time.total
    assert got == pytest.approx(want, rel=0.1)


def test_cli_apply_carries_factors_to_another_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base4 = tmp_path / "base4.yaml"
    save_profile(cpu_like(4), base4)
    sidecar = tmp_path / "fit.yaml.calibration.json"
    sidecar.write_text(json.dumps({"factors": {"matmul": 2.0, "all_reduce.beta": 3.0}}))
    out = tmp_path / "fitted4.yaml"
    assert main(["calibrate", "--apply", str(sidecar), "--cluster", str(base4), "-o", str(out)]) == 0
    got = load_profile(out)
    assert got.devices_per_node == 4 and got.name == "cpu-like-calibrated"
    assert got.device.peak_flops["float32"] == pytest.approx(0.5e11)
    assert [p.busbw for p in got.links["intra_node"].all_reduce] == pytest.approx([5e8 / 3] * 2)
    assert load_factors(sidecar) == {"matmul": 2.0, "all_reduce.beta": 3.0}
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="sidecar"):
        load_factors(bad)
    assert main(["calibrate", "--cluster", str(base4), "-o", str(out)]) == 2
    assert "needs plan YAMLs" in capsys.readouterr().err
    assert math.isfinite(dataclasses.asdict(got.device)["memory_bandwidth"])
    # a sidecar that records the link-table points its runs exercised: the others keep the profile's measurement
    sidecar.write_text(json.dumps({"factors": {"all_reduce.beta": 3.0}, "link_groups": [["intra_node", 2]]}))
    assert main(["calibrate", "--apply", str(sidecar), "--cluster", str(base4), "-o", str(out)]) == 0
    assert [p.busbw for p in load_profile(out).links["intra_node"].all_reduce] == pytest.approx([5e8 / 3, 5e8])


def test_link_factors_rescale_only_the_group_sizes_the_fitted_runs_used() -> None:
    """A fit on 2-rank runs says nothing about 4-rank collectives (on a CPU node with more ranks than cores their
    latency is mostly scheduling): carried to a 4-rank profile, the link factors rescale its 2-rank points only."""
    two, four = cpu_like(2), cpu_like(4)
    graph = _graph("gpt-tiny")

    def plan(prof: ClusterProfile, **pins: int) -> ir.Plan:
        return search(graph, prof, PlanOptions(global_batch=8, dtype="float32", top_k=0, workers=1, pins=pins)).best

    dp, tp = plan(two, pp=1, dp=2, tp=1, zero=0), plan(two, pp=1, dp=1, tp=2)
    assert link_groups([dp, tp], two) == {("intra_node", 2)}
    assert link_groups([plan(four, pp=2, dp=2, tp=1)], four) == {("intra_node", 2), ("intra_node", 4)}
    got = apply_factors(four, {"link.alpha": 3.0, "link.beta": 2.0}, link_groups={("intra_node", 2)})
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        at2, at4 = got.links["intra_node"].table(kind)
        assert (at2.alpha_s, at2.busbw) == pytest.approx((3 * 3e-4, 5e8 / 2))
        assert (at4.alpha_s, at4.busbw) == (3e-4, 5e8)
    assert apply_factors(four, {"link.alpha": 3.0}).links["intra_node"].all_reduce[1].alpha_s == pytest.approx(9e-4)



@pytest.mark.parametrize("pins", [{"pp": 1, "dp": 2, "tp": 1}, {"pp": 2, "dp": 1, "tp": 1},
                                  {"pp": 1, "dp": 1, "tp": 2}])
def test_a_plan_reports_the_matmul_part_of_its_compute(pins: dict) -> None:
    """``TimeBreakdown.matmul`` (what the fit compares with the attribution's ``matmul``) is the time of the matmul-like
    ops: slower GEMMs move it and compute by the same seconds, and a full recomputation adds the forward's GEMMs."""
    graph, base = _graph("gpt-tiny"), cpu_like()

    def plan(prof: ClusterProfile, recompute: str = "none") -> ir.Plan:
        # one gradient-sync mode for both profiles: ZeRO 0's bucket copies differ between the two
        opts = PlanOptions(global_batch=8, dtype="float32", top_k=0, workers=1, overlap_grad_sync=True,
                           pins={**pins, "micro_batch": 2, "recompute": recompute})
        return search(graph, prof, opts).best

    t, slow = plan(base).time, plan(apply_factors(base, {"matmul": 3.0})).time
    assert 0.0 < t.matmul < t.compute
    assert slow.matmul > 1.5 * t.matmul
    assert slow.compute - slow.matmul == pytest.approx(t.compute - t.matmul, rel=1e-9)
    full = plan(base, "full").time
    assert t.matmul < full.matmul < 2 * t.matmul  # forward GEMMs again, fewer than the forward + backward ones
