"""The training runtime's eager work beyond the model's ops (``DeviceProfile.runtime_overhead``): the optimizer's
per-tensor step (on plain and on DTensor parameters), FSDP2's hooks per unit and parameter tensor, and the
pipeline schedule's work per chunk and micro-batch.  What the cost model charges for each, where (which plans), the
schema, the ``fsdp`` calibration factor, and the profiler's measurement.  Synthetic profiles, except the last test,
which runs the measurement (one spawned process) and checks only its form."""

from __future__ import annotations

import dataclasses

import pytest
from test_calibrate import NOISE_FREE, _graph, _synthetic_run, cpu_like  # the calibration tests' synthetic runs
from test_intra_op import _trace_gpt

from autopar.planner.calibrate import calibrate, predict
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles import ClusterProfile, CostModel
from autopar.profiles.builtin import load_builtin
from autopar.profiles.refit import apply_factors
from autopar.profiles.schema import OP_KINDS, ProfileError, profile_from_dict, profile_to_dict

RUNTIME = {"optimizer_tensor": 12.0, "optimizer_dtensor": 60.0, "fsdp_unit": 150.0, "fsdp_tensor": 12.0,
           "pipeline_microbatch": 80.0}


def with_runtime(prof: ClusterProfile, table: dict[str, float]) -> ClusterProfile:
    return dataclasses.replace(prof, device=dataclasses.replace(prof.device, runtime_overhead=dict(table)))


def plan(prof: ClusterProfile, batch: int = 8, **pins: int | str):
    return search(_graph("gpt-tiny"), prof, PlanOptions(global_batch=batch, dtype="float32", top_k=0, workers=1,
                                                          pins=pins)).best  # type: ignore[arg-type]


def test_cost_model_terms() -> None:
    base = cpu_like()
    lo = base.device.launch_overhead_s
    none = CostModel(base)
    assert none.optimizer_eager(28, dtensor=True) == 0.0 and none.fsdp_eager(4, 28) == 0.0  # GPU-like: not charged
    cost = CostModel(with_runtime(base, RUNTIME))
    assert cost.optimizer_eager(28, dtensor=False) == pytest.approx(28 * 12.0 * lo)
    assert cost.optimizer_eager(28, dtensor=True) == pytest.approx(28 * 60.0 * lo)  # DTensor's dispatch per op
    plain_only = CostModel(with_runtime(base, {"optimizer_tensor": 12.0}))  # DTensor not measured: the plain cost
    assert plain_only.optimizer_eager(28, dtensor=True) == pytest.approx(28 * 12.0 * lo)
    assert cost.fsdp_eager(4, 28) == pytest.approx((4 * 150.0 + 28 * 12.0) * lo)
    assert cost.runtime_overhead("pipeline_microbatch") == pytest.approx(80.0 * lo)


def test_fsdp_eager_is_charged_as_compute_of_zero1_plans_only() -> None:
    base = cpu_like()
    lo = base.device.launch_overhead_s
    unit_only = with_runtime(base, {"fsdp_unit": 150.0})
    # against a profile that measured FSDP2's per-unit work as 0 (one that did not pays its copy launches instead)
    zero_unit = with_runtime(base, {"fsdp_unit": 0.0})
    a, b = plan(zero_unit, zero=1, dp=2, tp=1, pp=1), plan(unit_only, zero=1, dp=2, tp=1, pp=1)
    assert a.zero == b.zero == 1 and a.num_microbatches == b.num_microbatches
    units = sum(s.layer_end - s.layer_start for s in a.stages)
    extra = a.num_microbatches * units * 150.0 * lo
    assert b.time.compute - a.time.compute == pytest.approx(extra, rel=1e-6)
    assert b.time.total - a.time.total == pytest.approx(extra, rel=1e-6)
    # per tensor: linear in the per-tensor cost
    t1, t2 = (plan(with_runtime(base, {"fsdp_unit": 0.0, "fsdp_tensor": x}), zero=1, dp=2, tp=1, pp=1)
              for x in (10.0, 20.0))
    assert t2.time.compute - a.time.compute == pytest.approx(2 * (t1.time.compute - a.time.compute), rel=1e-6)
    assert t1.time.compute > a.time.compute
    # ZeRO-0 runs no FSDP2: unchanged to the bit
    z0, z0f = plan(base, zero=0, dp=2, tp=1, pp=1), plan(with_runtime(base, RUNTIME), zero=0, dp=2, tp=1, pp=1)
    assert z0f.time.compute == z0.time.compute and z0f.time.exposed_comm == z0.time.exposed_comm


def test_optimizer_eager_per_tensor_and_dtensor_dispatch() -> None:
    base = cpu_like()
    lo = base.device.launch_overhead_s
    opt_only = {"optimizer_tensor": 12.0, "optimizer_dtensor": 60.0}
    a, b = plan(base, zero=0, dp=2, tp=1, pp=1), plan(with_runtime(base, opt_only), zero=0, dp=2, tp=1, pp=1)
    tensors = (b.time.optimizer - a.time.optimizer) / (12.0 * lo)  # plain tensors: no DTensor dispatch
    assert tensors == pytest.approx(round(tensors)) and round(tensors) >= 10
    # tensor parallelism (DTensor parameters) and FSDP (sharded DTensors) also pay DTensor's dispatch per op
    for pins in ({"tp": 2, "dp": 1}, {"zero": 1, "dp": 2, "tp": 1}):
        p0 = plan(base, pp=1, **pins)  # type: ignore[arg-type]
        p1 = plan(with_runtime(base, opt_only), pp=1, **pins)  # type: ignore[arg-type]
        assert p1.time.optimizer - p0.time.optimizer == pytest.approx(round(tensors) * 60.0 * lo, rel=1e-6)


def test_pipeline_microbatch_work_lengthens_pipelines_only() -> None:
    base = cpu_like()
    pm = 80.0 * base.device.launch_overhead_s
    prof = with_runtime(base, {"pipeline_microbatch": 80.0})
    pins = {"pp": 2, "dp": 1, "tp": 1, "schedule": "1f1b", "micro_batch": 2}
    a, b = plan(base, **pins), plan(prof, **pins)  # type: ignore[arg-type]
    m = a.num_microbatches
    assert m == b.num_microbatches == 4
    # every chunk pays it once per micro-batch; a 1F1B pipeline's critical path holds m + pp - 1 chunk slots
    assert m * pm <= b.time.total - a.time.total <= (m + 2) * pm * 1.000001
    one = {"pp": 1, "dp": 2, "tp": 1, "zero": 0}
    assert plan(prof, **one).time.total == plan(base, **one).time.total  # type: ignore[arg-type]


def test_pipeline_work_per_schedule_and_microbatch_count() -> None:
    """Measured cases (``pipeline_<schedule>_<m>``) are interpolated in log2(m) within a schedule and clamped at the
    ends; interleaved 1F1B reads 1F1B's; without them every plan pays ``pipeline_microbatch``; a plan's prediction
    follows its own schedule and micro-batch count."""
    base = cpu_like()
    lo = base.device.launch_overhead_s
    table = {"pipeline_microbatch": 80.0, "pipeline_gpipe_1": 20.0, "pipeline_gpipe_2": 40.0,
             "pipeline_gpipe_8": 100.0, "pipeline_1f1b_2": 30.0, "pipeline_1f1b_8": 80.0}
    cost = CostModel(with_runtime(base, table))
    for kind, m, units in (("gpipe", 1, 20.0), ("gpipe", 2, 40.0), ("gpipe", 4, 70.0), ("gpipe", 64, 100.0),
                           ("1f1b", 1, 30.0), ("1f1b", 4, 55.0), ("interleaved_1f1b", 8, 80.0)):  # as 1F1B
        assert cost.pipeline_overhead(kind, m) == pytest.approx(units * lo), (kind, m)
    own = CostModel(with_runtime(base, {**table, "pipeline_interleaved_1f1b_2": 50.0}))
    assert own.pipeline_overhead("interleaved_1f1b", 8) == pytest.approx(50.0 * lo)  # its own case, clamped
    legacy = CostModel(with_runtime(base, {"pipeline_microbatch": 80.0}))
    assert legacy.pipeline_overhead("gpipe", 1) == pytest.approx(80.0 * lo)
    assert CostModel(base).pipeline_overhead("gpipe", 1) == 0.0
    pins = {"pp": 2, "dp": 1, "tp": 1, "schedule": "gpipe", "micro_batch": 8}  # one micro-batch
    a, b = plan(base, **pins), plan(with_runtime(base, table), **pins)  # type: ignore[arg-type]
    c = plan(with_runtime(base, {"pipeline_microbatch": 80.0}), **pins)  # type: ignore[arg-type]
    assert a.num_microbatches == 1
    # both chunks pay it once each on the critical path (GPipe, one micro-batch: m + pp - 1 = 2 chunk slots)
    assert b.time.total - a.time.total == pytest.approx(2 * 20.0 * lo, rel=1e-6)
    assert c.time.total - a.time.total == pytest.approx(2 * 80.0 * lo, rel=1e-6)


def test_pipeline_resume_adds_to_every_chunk_slot_of_pipelines_only() -> None:
    """``pipeline_resume`` (a stage's compute resumed after each wait for its neighbour) is charged per chunk and
    micro-batch on top of the schedule's measured case, or of ``pipeline_microbatch`` without cases; plans without
    pipeline stages do not pay it."""
    base = cpu_like()
    lo = base.device.launch_overhead_s
    table = {"pipeline_microbatch": 80.0, "pipeline_gpipe_1": 20.0, "pipeline_1f1b_8": 60.0}
    plain, resumed = CostModel(with_runtime(base, table)), CostModel(with_runtime(base, {**table,
                                                                                         "pipeline_resume": 50.0}))
    for kind, m in (("gpipe", 1), ("1f1b", 8), ("1f1b", 2), ("interleaved_1f1b", 4)):
        assert resumed.pipeline_overhead(kind, m) - plain.pipeline_overhead(kind, m) == pytest.approx(50.0 * lo)
    legacy = CostModel(with_runtime(base, {"pipeline_microbatch": 80.0, "pipeline_resume": 50.0}))
    assert legacy.pipeline_overhead("gpipe", 1) == pytest.approx(130.0 * lo)
    assert CostModel(with_runtime(base, {"pipeline_resume": 50.0})).pipeline_overhead("gpipe", 1) == \
        pytest.approx(50.0 * lo)
    pins = {"pp": 2, "dp": 1, "tp": 1, "schedule": "gpipe", "micro_batch": 8}  # one micro-batch: 2 chunk slots
    a = plan(with_runtime(base, table), **pins)  # type: ignore[arg-type]
    b = plan(with_runtime(base, {**table, "pipeline_resume": 50.0}), **pins)  # type: ignore[arg-type]
    assert a.num_microbatches == b.num_microbatches == 1
    assert b.time.total - a.time.total == pytest.approx(2 * 50.0 * lo, rel=1e-6)
    one = {"pp": 1, "dp": 2, "tp": 1, "zero": 0}
    assert plan(with_runtime(base, {**table, "pipeline_resume": 50.0}), **one).time.total == \
        plan(with_runtime(base, table), **one).time.total  # type: ignore[arg-type]
    d = profile_to_dict(with_runtime(base, {"pipeline_resume": 50.0}))
    assert profile_from_dict(d).device.runtime_overhead == {"pipeline_resume": 50.0}


@pytest.mark.parametrize(("ranks", "cores", "speedup"), [(2, 2, 1.0), (2, 8, 1.0), (4, 4, 1.0), (4, 2, 2.0),
                                                        (8, 2, 2.0), (3, 2, 1.5), (2, 1, 2.0), (4, 0, 1.0)])
def test_handover_speedup_is_the_simulators_processor_sharing(ranks: int, cores: float, speedup: float) -> None:
    """What ``resume_penalty`` takes out of its back-to-back baseline where ranks outnumber cores: half the ranks
    computing (a handover) against all of them, as ``SharedCores.speeds`` shares the cores."""
    from autopar.planner.inter_op.schedule import SharedCores
    from autopar.profiles.syncs import handover_speedup

    assert handover_speedup(ranks, cores) == pytest.approx(speedup)
    if cores and ranks % 2 == 0:  # the simulator's own speed-up for a node whose half waits
        shared = SharedCores(cores=cores, ranks_per_node=ranks, stage_ranks=(((0, ranks // 2),), ((0, ranks // 2),)))
        assert shared.speeds([True, False])[0] == pytest.approx(speedup)


def test_loss_sync_is_the_measured_one_when_it_spans_the_profile() -> None:
    base = cpu_like(4)
    lo = base.device.launch_overhead_s
    cost, bare = CostModel(with_runtime(base, {"loss_sync": 300.0})), CostModel(base)
    assert cost.loss_sync(4) == pytest.approx(300.0 * lo)
    assert cost.loss_sync(2) == bare.loss_sync(2) == bare.collective_time("all_reduce", 4, group_size=2)
    assert cost.loss_sync(1) == 0.0
    pins = {"pp": 1, "dp": 4, "tp": 1, "zero": 0}
    a, b = plan(base, **pins), plan(with_runtime(base, {"loss_sync": 300.0}), **pins)  # type: ignore[arg-type]
    assert b.time.total - a.time.total == pytest.approx(300.0 * lo - bare.loss_sync(4), rel=1e-6)


def test_fitted_overhead_leaves_the_measured_synchronizations_in_seconds() -> None:
    """The ``overhead`` factor rescales per-op eager costs measured by micro-benchmarks; the loss sync and the
    pipeline schedules are timed as a step meets them (like a pipeline's p2p) and keep their seconds."""
    base = with_runtime(cpu_like(2), {**RUNTIME, "loss_sync": 100.0, "pipeline_gpipe_1": 40.0,
                                      "pipeline_1f1b_8": 90.0, "pipeline_resume": 30.0})
    a = CostModel(base)
    for factors in ({"overhead": 2.5}, {"overhead": 2.5, "fsdp": 3.0}):
        b = CostModel(apply_factors(base, factors))
        assert b.loss_sync(2) == pytest.approx(a.loss_sync(2))
        for kind, m in (("gpipe", 1), ("1f1b", 8), ("1f1b", 2)):
            assert b.pipeline_overhead(kind, m) == pytest.approx(a.pipeline_overhead(kind, m))
        assert b.runtime_overhead("pipeline_microbatch") == pytest.approx(a.runtime_overhead("pipeline_microbatch"))
        assert b.optimizer_eager(28, dtensor=False) == pytest.approx(2.5 * a.optimizer_eager(28, dtensor=False))
        assert b.fsdp_eager(4, 28) == pytest.approx(2.5 * factors.get("fsdp", 1.0) * a.fsdp_eager(4, 28))


def test_schema_and_fsdp_factor() -> None:
    prof = with_runtime(cpu_like(), RUNTIME)
    d = profile_to_dict(prof)
    assert d["device"]["runtime_overhead"] == RUNTIME
    assert profile_from_dict(d).device.runtime_overhead == RUNTIME
    assert "runtime_overhead" not in profile_to_dict(cpu_like())["device"]
    for bad in ({"fsdp_units": 1.0}, {"fsdp_unit": -1.0}):
        d["device"]["runtime_overhead"] = bad
        with pytest.raises(ProfileError, match="runtime_overhead"):
            profile_from_dict(d)
    scaled = apply_factors(prof, {"fsdp": 2.0}).device.runtime_overhead
    assert scaled == {k: v * (2.0 if k.startswith("fsdp_") else 1.0) for k, v in RUNTIME.items()}


def test_calibrate_fits_fsdp_factor_only_with_an_fsdp_run() -> None:
    """Mechanics: runs synthesised from a truth profile whose FSDP2 hooks cost 3x the base's measurement; the fit
    recovers the factor from a ZeRO-1 run, and has no ``fsdp`` factor without one."""
    graph = _graph("gpt-tiny")
    base = with_runtime(cpu_like(), RUNTIME)
    truth = apply_factors(base, {"fsdp": 3.0, "overhead": 1.5})
    pins = ({"pp": 1, "dp": 2, "tp": 1, "zero": 0}, {"pp": 1, "dp": 2, "tp": 1, "zero": 1})
    runs = []
    for p in pins:
        pl = plan(base, **p)  # type: ignore[arg-type]
        runs.append((pl, graph, _synthetic_run(pl, predict(graph, truth, pl))))
    fit = calibrate(base, runs, names=["overhead", "fsdp"], prior=NOISE_FREE)
    assert fit.factors["fsdp"] == pytest.approx(3.0, rel=0.05)
    assert fit.factors["overhead"] == pytest.approx(1.5, rel=0.05)
    assert "fsdp" in calibrate(base, runs).factors
    assert "fsdp" not in calibrate(base, runs[:1]).factors


def test_profiler_measures_runtime_overheads() -> None:
    from autopar.profiles.profiler import measure_runtime_overheads

    got, sharded = measure_runtime_overheads(repeats=1)
    assert set(got) == {*RUNTIME, "redistribute", "step"}
    assert got["redistribute"] > 0  # DTensor's resharding, on a fake two-rank group (profiles.redistribute)
    assert got["step"] >= 0  # the loop's fixed work per step (profiles.loop)
    assert all(v >= 0.0 for v in got.values())
    # DTensor's dispatch per op kind: measured for the kinds a transformer's tensor-parallel region runs
    assert {"matmul", "pointwise", "view", "norm"} <= set(sharded) <= set(OP_KINDS), sharded
    assert all(v >= 0.0 for v in sharded.values()) and sharded["matmul"] > 0, sharded
    assert got["optimizer_tensor"] > 0 and got["optimizer_dtensor"] > 0


def test_dtensor_dispatch_is_charged_per_op_kind_and_scaled_by_the_fitted_factor() -> None:
    base = cpu_like()
    table = {"matmul": 20.0, "pointwise": 2.0, "view": 1.0}
    measured = dataclasses.replace(base, device=dataclasses.replace(base.device, dtensor_op_overhead=table))
    launch = base.device.launch_overhead_s
    cost = CostModel(measured)
    assert cost.sharded_op_extra("matmul") == pytest.approx(20.0 * launch)
    assert cost.sharded_op_extra("pointwise") == pytest.approx(2.0 * launch)
    assert cost.sharded_op_extra("norm") == pytest.approx(23.0 / 3 * launch)  # not measured: the table's mean
    assert CostModel(apply_factors(measured, {"dtensor": 1.5})).sharded_op_extra("matmul") == pytest.approx(30 * launch)
    assert CostModel(base).sharded_op_extra("matmul") == 0.0  # no table, sharded_op_overhead 1: no extra
    assert CostModel(apply_factors(base, {"dtensor": 3.0})).sharded_op_extra("view") == pytest.approx(2.0 * launch)
    assert profile_from_dict(profile_to_dict(measured)).device.dtensor_op_overhead == table
    with pytest.raises(ProfileError, match="dtensor_op_overhead"):
        d = profile_to_dict(measured)
        d["device"]["dtensor_op_overhead"]["warp"] = 1.0
        profile_from_dict(d)
    # a tensor-parallel plan pays it per op: a pointwise-heavy table costs the tp=2 plan less than a matmul-heavy one
    heavy = dataclasses.replace(base, device=dataclasses.replace(base.device, dtensor_op_overhead={
        "matmul": 40.0, "pointwise": 1.0, "view": 1.0}))
    light = dataclasses.replace(base, device=dataclasses.replace(base.device, dtensor_op_overhead={
        "matmul": 1.0, "pointwise": 1.0, "view": 1.0}))
    t_heavy, t_light = (plan(p, tp=2, dp=1, pp=1).time.compute for p in (heavy, light))
    assert t_heavy > t_light


def test_dtensor_dispatch_is_charged_per_pass_as_the_profiler_measures_it() -> None:
    """Forward once, and once per backward kernel: a linear's two GEMMs (the profiler divides its matmul chain by 3
    passes), one for a pointwise op (its chain: one product forward, one backward); not charged without tp."""
    from autopar.planner.intra_op.solve import strategy_costs

    graph, base = _graph("gpt-tiny"), cpu_like()
    table = dataclasses.replace(base, device=dataclasses.replace(base.device, dtensor_op_overhead={
        "matmul": 10.0, "pointwise": 4.0, "view": 1.0}))
    launch = base.device.launch_overhead_s
    linear = next(n for n in graph.nodes if n.kind == "matmul" and n.params)
    add = next(n for n in graph.nodes if n.kind == "pointwise" and n.op == "add")

    def extra(node: object, tp: int) -> tuple[float, float]:
        (_, f0, b0, _), (_, f1, b1, _) = (strategy_costs(graph, node, tp=tp, cost=CostModel(p), tp_span=CostModel(
            p).span(tp, 1), dtype="float32")[0] for p in (base, table))
        return f1 - f0, b1 - b0

    assert extra(linear, 2) == pytest.approx((10 * launch, 2 * 10 * launch))
    assert extra(add, 2) == pytest.approx((4 * launch, 4 * launch))
    assert extra(linear, 1) == (0.0, 0.0)


def test_a_resharding_pays_dtensors_eager_work_as_compute() -> None:
    """``runtime_overhead["redistribute"]``: every tensor-parallel conversion (collective or local slice) costs
    DTensor's measured work per pass on top of its collective, as compute of the rank (the attribution counts the
    Python of ``Redistribute`` as compute, its collective as communication); scaled by the fitted ``overhead`` and
    ``dtensor`` factors like DTensor's per-op dispatch; 0 where not measured (GPU profiles)."""
    from autopar.planner.intra_op.coster import _Coster
    from autopar.planner.intra_op.solve import solve_group

    base = cpu_like()
    lo = base.device.launch_overhead_s
    prof = with_runtime(base, {"redistribute": 5.0})
    assert CostModel(base).redistribute_overhead() == 0.0
    k = base.device.sharded_op_overhead
    assert CostModel(prof).redistribute_overhead() == pytest.approx(5.0 * lo * k)
    assert CostModel(apply_factors(prof, {"dtensor": 2.0, "overhead": 3.0})).redistribute_overhead() == \
        pytest.approx(30.0 * lo * k)
    graph = _graph("gpt-tiny")
    cost = CostModel(prof)
    co = _Coster(graph, cost, cost.span(2), 2, "float32", 8.0)
    o = 5.0 * lo * k
    assert co.convert("S(1)", "R", 1e6) == (pytest.approx(co.coll("all_gather", 1e6) + o), "all_gather")
    assert co.convert("R", "S(1)", 1e6) == (pytest.approx(o), "")  # a local slice: DTensor's work alone
    assert co.convert("S(1)", "S(1)", 1e6) == (0.0, "")
    assert profile_from_dict(profile_to_dict(prof)).device.runtime_overhead == {"redistribute": 5.0}
    # a Megatron-sharded block (gpt2-medium shapes on A100s): the same shardings and communication, and compute
    # larger by whole conversions (two all-reduces each way at least)
    gpu = load_builtin("dgx-a100-80gb")
    big, block = _trace_gpt(1024, 16, 1024), None
    block = big.blocks()[0]
    a, b = (solve_group(big, block, tp=8, cost=CostModel(p), tp_span=CostModel(p).span(8))
            for p in (gpu, with_runtime(gpu, {"redistribute": 5.0})))
    o = 5.0 * gpu.device.launch_overhead_s * gpu.device.sharded_op_overhead
    assert a.strategies == b.strategies
    assert (b.fwd_comm_s, b.bwd_comm_s) == pytest.approx((a.fwd_comm_s, a.bwd_comm_s))
    conversions = (b.fwd_compute_s + b.bwd_compute_s - a.fwd_compute_s - a.bwd_compute_s) / o
    assert conversions == pytest.approx(round(conversions), abs=1e-6) and round(conversions) >= 4
    assert sum(x.compute_s for x in b.op_shardings) - sum(x.compute_s for x in a.op_shardings) == \
        pytest.approx(conversions * o)


@pytest.mark.parametrize("pins", [{"pp": 1, "dp": 2, "tp": 1}, {"pp": 2, "dp": 1, "tp": 1},
                                  {"pp": 1, "dp": 1, "tp": 2}])
def test_the_loops_work_per_step_is_compute_once_per_step(pins: dict) -> None:
    """``runtime_overhead["step"]`` (the loss, autograd's start, the optimizer's fixed path): once per step on every
    rank, whatever the micro-batches, as compute; scaled by the fitted ``overhead`` factor."""
    base = with_runtime(cpu_like(), {"fsdp_unit": 0.0})
    lo = base.device.launch_overhead_s
    looped = with_runtime(base, {"fsdp_unit": 0.0, "step": 40.0})
    for mb in (4, 1):
        a, b = (plan(p, zero=0, micro_batch=mb, **pins) for p in (base, looped))
        assert b.time.compute - a.time.compute == pytest.approx(40.0 * lo, rel=1e-6)
        assert b.time.total - a.time.total == pytest.approx(40.0 * lo, rel=1e-6)
    c = plan(apply_factors(looped, {"overhead": 2.0}), zero=0, micro_batch=4, **pins)
    d = plan(apply_factors(base, {"overhead": 2.0}), zero=0, micro_batch=4, **pins)
    assert c.time.compute - d.time.compute == pytest.approx(80.0 * lo, rel=1e-6)
