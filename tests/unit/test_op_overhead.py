"""Per-op-kind eager overhead (``DeviceProfile.op_overhead``) and the time-sliced device of an oversubscribed CPU
node (``profiles.profiler.oversubscribed``): the cost model's charge per kind, the profile schema, the profiler's
measurement, and the calibration mechanics they serve (one overhead factor fitted on one model carries to another
model whose ops are of other kinds).  Synthetic profiles and runs only: nothing here is timed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_calibrate import _graph, _synthetic_run, cpu_like  # the calibration tests' synthetic profile and runs

from autopar import ir
from autopar.planner.calibrate import calibrate, predict
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles import (
    ClusterProfile,
    CostModel,
)
from autopar.profiles.profiler import _op_overheads, oversubscribed
from autopar.profiles.refit import apply_factors
from autopar.profiles.schema import ProfileError, profile_from_dict, profile_to_dict

TABLE = {"matmul": 3.0, "norm": 2.0, "attention": 4.0, "pointwise": 0.5, "reduction": 0.5, "view": 0.25,
         "other": 1.0, "embedding": 2.0}


def with_table(prof: ClusterProfile, table: dict[str, float]) -> ClusterProfile:
    return dataclasses.replace(prof, device=dataclasses.replace(prof.device, op_overhead=dict(table)))


def test_op_time_charges_each_kinds_measured_overhead() -> None:
    base = cpu_like()
    lo = base.device.launch_overhead_s
    plain, kinded = CostModel(base), CostModel(with_table(base, TABLE))
    assert plain.op_time(0, 0, "float32", "view") == 0.0  # no table: views free, every other kind one launch
    assert plain.op_time(0, 0, "float32", "pointwise") == pytest.approx(lo)
    for kind, ratio in TABLE.items():
        assert kinded.op_time(0, 0, "float32", kind) == pytest.approx(lo * ratio)
    assert kinded.op_time(0, 0, "float32", "causal_attention") == pytest.approx(lo * TABLE["attention"])
    assert kinded.op_time(0, 0, "float32", "softmax") == pytest.approx(lo)  # not measured: one launch
    # the arithmetic is unchanged; only the fixed part differs
    t_plain, t_kind = (c.op_time(1e9, 1e6, "float32", "matmul") for c in (plain, kinded))
    assert t_kind - t_plain == pytest.approx(lo * (TABLE["matmul"] - 1))
    # the overhead factor scales every kind (the table is in launch_overhead_s units)
    slow = CostModel(apply_factors(with_table(base, TABLE), {"overhead": 3.0}))
    assert slow.op_time(0, 0, "float32", "view") == pytest.approx(3 * lo * TABLE["view"])


def test_schema_round_trips_and_checks_op_overhead() -> None:
    prof = with_table(cpu_like(), TABLE)
    d = profile_to_dict(prof)
    assert d["device"]["op_overhead"] == TABLE
    assert profile_from_dict(d).device.op_overhead == TABLE
    assert "op_overhead" not in profile_to_dict(cpu_like())["device"]
    for bad in ({"matmull": 1.0}, {"matmul": -1.0}):
        d["device"]["op_overhead"] = bad
        with pytest.raises(ProfileError, match="op_overhead"):
            profile_from_dict(d)


def test_views_cost_their_overhead_in_a_plan() -> None:
    graph, base = _graph("gpt-tiny"), cpu_like()
    # ZeRO 1: ZeRO 0's gradient buckets would add three views per parameter tensor (dpcomm.bucket_host_s)
    opts = PlanOptions(global_batch=8, dtype="float32", top_k=0, workers=1,
                       pins={"pp": 1, "dp": 2, "tp": 1, "zero": 1})
    p0 = search(graph, base, opts).best
    ones = {k: 1.0 for k in TABLE if k != "view"}
    assert predict(graph, with_table(base, ones), p0).time.total == pytest.approx(p0.time.total)  # the default
    views = sum(1 for n in graph.nodes if n.kind == "view")
    more = predict(graph, with_table(base, {**ones, "view": 1.0}), p0)
    # each view: forward, and backward where it carries a gradient
    extra = (more.time.compute - p0.time.compute) / base.device.launch_overhead_s
    assert views <= extra <= 2 * views


def test_one_overhead_factor_carries_to_a_model_of_other_op_kinds() -> None:
    """Fitted on gpt-tiny alone, the ``overhead`` factor predicts llama-tiny (many cheap pointwise ops and views)
    when the profile knows each kind's cost; with one cost for every op it over-charges llama-tiny's small ops."""
    gpt, llama = _graph("gpt-tiny"), _graph("llama-tiny")
    base = cpu_like()
    truth = apply_factors(with_table(base, TABLE), {"overhead": 20.0})

    def plan(graph: ir.Graph, prof: ClusterProfile, batch: int, **pins: int) -> ir.Plan:
        return search(graph, prof, PlanOptions(global_batch=batch, dtype="float32", top_k=0, workers=1,
                                               pins=pins)).best

    def fit_and_check(prof: ClusterProfile) -> float:
        runs = []
        for batch in (4, 16):
            p = plan(gpt, prof, batch, pp=1, dp=2, tp=1, zero=0)
            runs.append((p, gpt, _synthetic_run(p, predict(gpt, truth, p))))
        fit = calibrate(prof, runs, names=["overhead", "matmul"])
        held = plan(llama, prof, 8, pp=2, dp=1, tp=1)
        want = predict(llama, truth, held).time.total
        return predict(llama, apply_factors(prof, fit.factors), held).time.total / want

    assert abs(fit_and_check(with_table(base, TABLE)) - 1) < 0.05
    assert fit_and_check(base) > 1.3  # one cost per op, fitted on gpt-tiny: llama-tiny over-predicted


def test_oversubscribed_device_slows_every_device_time_not_the_links() -> None:
    base = with_table(cpu_like(), TABLE)
    sliced = oversubscribed(base, 2.0)
    a, b = CostModel(base), CostModel(sliced)
    for args in ((1e9, 1e6, "float32", "matmul"), (1e6, 1e9, "float32", "pointwise"), (0, 0, "float32", "view"),
                 (1e7, 1e7, "float32", "norm")):
        assert b.op_time(*args) == pytest.approx(2 * a.op_time(*args))
    assert b.collective_time("all_reduce", 1e6, group_size=2) == a.collective_time("all_reduce", 1e6, group_size=2)
    assert "time-sliced" in sliced.device.sources["launch_overhead_s"]
    assert sliced.device.shared_cores is None  # measured: waiting ranks leave computing ones no faster
    with pytest.raises(ValueError):
        oversubscribed(base, 0.0)


def test_shared_cores_speed_up_a_pipelines_lone_stages_only() -> None:
    """A profile that states ``shared_cores`` (4 ranks time-slicing 2 cores): a pp=2 x dp=2 plan's stages compute
    alone in the fill, GPipe's turn and the drain, where they get the cores the other stage leaves; a plan without
    pipeline stages keeps every rank computing, and is predicted as with the uniformly slowed device alone."""
    uniform = oversubscribed(with_table(cpu_like(4), TABLE), 2.0)
    sliced = dataclasses.replace(uniform, device=dataclasses.replace(uniform.device, shared_cores=2.0))
    assert profile_from_dict(profile_to_dict(sliced)).device.shared_cores == 2.0
    assert "shared_cores" not in profile_to_dict(uniform)["device"]
    g = _graph("gpt-tiny")
    for pins, faster in (({"pp": 2, "dp": 2, "tp": 1}, True), ({"pp": 1, "dp": 2, "tp": 2}, False)):
        opts = PlanOptions(global_batch=8, dtype="float32", top_k=0, workers=1,
                           pins={**pins, "micro_batch": 2, "schedule": "gpipe"})
        plan = search(g, uniform, opts).best
        a, b = predict(g, uniform, plan).time, predict(g, sliced, plan).time
        if faster:  # the bubble and the busiest rank's compute both shrink; the rest of the step does not
            assert b.total < a.total and b.compute < a.compute and b.optimizer == a.optimizer
        else:
            assert b.total == a.total


def test_profiler_measures_every_kind() -> None:
    torch.set_num_threads(1)
    out = _op_overheads(torch.device("cpu"), lambda: None, repeats=1, per_pass=4e-6, ops=2)
    assert set(out) == {"matmul", "norm", "attention", "pointwise", "reduction", "view", "other", "embedding"}
    assert all(v >= 0 for v in out.values())
    profile_from_dict({**profile_to_dict(cpu_like()),
                       "device": {**profile_to_dict(cpu_like())["device"], "op_overhead": out}})


def test_paired_extra_cancels_the_machine_speed_moving_between_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two measured costs, 2 ms and 1 ms a call, while the machine runs at half speed for the second half of the
    measurement (a shared VM's slow phase): timed apart (the cheaper one first, the median of each), the difference
    would come out 4 - 1 = 3 ms; paired, it is 1 ms where the speed is steady and 2 ms in the slow phase."""
    from autopar.profiles import eager

    clock, calls = [0.0], [0]

    def work(ms: float):  # noqa: ANN202 - a fake workload on the fake clock
        def f() -> None:
            calls[0] += 1
            clock[0] += ms * 1e-3 * (2.0 if calls[0] > 60 else 1.0)
        return f

    monkeypatch.setattr(eager.time, "perf_counter", lambda: clock[0])
    extra = eager._paired_extra(work(2.0), work(1.0), lambda: None, repeats=9, inner=5, warmup=1)
    assert calls[0] == 2 + 9 * 2 * 5  # the warm-up, then 9 pairs of 5 calls each
    assert 1e-3 <= extra <= 2e-3
    clock[0], calls[0] = 0.0, -10_000  # steady speed: exactly the difference
    assert eager._paired_extra(work(2.0), work(1.0), lambda: None, repeats=5) == pytest.approx(1e-3)
    assert eager._paired_extra(work(1.0), work(2.0), lambda: None, repeats=5) == 0.0  # never negative


def test_vector_rate_counts_flops_as_the_ir_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vector_flops`` on CPU: each op's FLOPs as ``ir.ops`` counts them over its time less the bare op's fixed
    cost, and the median over the ops (a fake timer: every op takes 1 ms + 0.1 ms overhead)."""
    from autopar.ir.ops import OP_RULES
    from autopar.profiles import rates

    timed: list[str] = []

    def fake_time(fn, sync, repeats, inner, warmup=1):  # noqa: ANN001, ANN202
        timed.append(fn.__name__)
        return 1.1e-3

    monkeypatch.setattr(rates, "_time_calls", fake_time)
    numel = 1 << 12
    rate, by_op = rates.vector_rate(torch.device("cpu"), lambda: None, repeats=1, overhead=1e-4, numel=numel)
    assert set(by_op) == set(rates.VECTOR_OPS) and len(timed) == len(by_op)
    for name, r in by_op.items():  # the per-element count the profiler uses is the IR's
        assert r == pytest.approx(OP_RULES[name].per_elem * numel / 1e-3), name
    assert rate == pytest.approx(4.0 * numel / 1e-3)  # median of 5, 5, 4, 4, 4, 1, 1
    real, _ = rates.vector_rate(torch.device("cpu"), lambda: None, repeats=1, overhead=0.0, numel=1 << 10)
    assert real > 0
