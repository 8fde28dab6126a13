"""Data-parallel collectives and their overlap (planner.inter_op.dpcomm), ring latency at scale, causal attention
costing, the FSDP2 mixed-precision policy the runtime takes from the plan, and ZeRO 0's overlapped gradient sync."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autopar.codegen.runtime import data_parallel as dpm
from autopar.planner.inter_op.dpcomm import bucket_host_s, dp_comm, overlap_step
from autopar.profiles.builtin import load_builtin
from autopar.profiles.cost import RING_HOP_S, CostModel
from autopar.profiles.schema import ProfileError, dump_profile, loads_profile


def _cost(nodes: int = 64, kappa: float | None = None) -> CostModel:
    prof = load_builtin("dgx-a100-80gb", nodes=nodes)
    if kappa is not None:
        prof = dataclasses.replace(prof, device=dataclasses.replace(prof.device, overlap_slowdown=kappa))
    return CostModel(prof)


def _z3(cost: CostModel, **kw: float) -> object:
    args = {"params": 1e9, "units": 32, "fwd_s": 1.0, "bwd_s": 2.0, "num_microbatches": 1, "dp": 512, "tp": 1,
            "zero": 3, "param_item": 2, "reduce_item": 4}
    args.update(kw)
    return dp_comm(cost, **args)  # type: ignore[arg-type]


def test_per_unit_collectives_pay_latency_per_unit() -> None:
    cost = _cost()
    span = cost.span(512, 1)
    few, many = _z3(cost, units=8), _z3(cost, units=64)
    # the same bytes in more units: every unit pays the ring latency once more
    ag = lambda n: n * cost.collective_time("all_gather", 1e9 * 2 / n, span=span)
    rs = lambda n: n * cost.collective_time("reduce_scatter", 1e9 * 4 / n, span=span)
    assert few.collective_s == pytest.approx(2 * ag(8) + rs(8))
    assert many.collective_s == pytest.approx(2 * ag(64) + rs(64))
    assert many.collective_s > few.collective_s
    # with compute to hide under, only the first gather and the last reduce-scatter of a pass are exposed, and
    # smaller units expose less of them
    assert many.exposed_s < few.exposed_s
    assert few.exposed_s == pytest.approx(2 * ag(8) / 8 + rs(8) / 8)


def test_ring_latency_grows_with_ranks() -> None:
    cost = _cost(nodes=512)
    t = [cost.collective_time("all_gather", 1.0, span=cost.span(8 * m, 1)) for m in (64, 128, 256)]
    assert t[1] - t[0] == pytest.approx(RING_HOP_S * 8 * 64, rel=1e-6)
    assert t[2] - t[1] == pytest.approx(RING_HOP_S * 8 * 128, rel=1e-6)
    # all-reduce (tree at scale) stays logarithmic
    ar = [cost.collective_time("all_reduce", 1.0, span=cost.span(8 * m, 1)) for m in (64, 256)]
    assert ar[1] - ar[0] < (t[2] - t[0]) / 10


def test_overlap_slows_compute() -> None:
    assert overlap_step(1.0, 0.5, 0.0) == (0.0, 0.0)
    assert overlap_step(1.0, 0.5, 0.2) == (0.0, pytest.approx(0.1))
    assert overlap_step(1.0, 3.0, 0.2) == (pytest.approx(2.0), 0.0)  # comm-bound: the step is the collective
    free, slowed = _z3(_cost(kappa=0.0)), _z3(_cost(kappa=0.3))
    assert free.contention_s == 0.0 and slowed.contention_s > 0.0
    assert slowed.exposed_s == pytest.approx(free.exposed_s)
    hidden = slowed.collective_s - slowed.exposed_s
    assert slowed.contention_s == pytest.approx(0.3 * hidden, rel=1e-6)


def test_link_sharing_in_backward() -> None:
    cost = _cost(kappa=0.0)
    span = cost.span(512, 1)
    n = 32
    ag = cost.collective_time("all_gather", 1e9 * 2 / n, span=span)
    rs = cost.collective_time("reduce_scatter", 1e9 * 4 / n, span=span)
    b = (max(ag, rs) + ag + rs) / 2 * n  # per-unit backward longer than either collective, shorter than both
    got = _z3(cost, fwd_s=10.0, bwd_s=b)
    per_unit = b / n
    expected = ag + rs + ag + (n - 1) * (ag + rs - per_unit)  # first fwd gather, first bwd gather, last RS, steps
    assert got.exposed_s == pytest.approx(expected)


def test_no_overlap_and_ddp() -> None:
    cost = _cost()
    serial = _z3(cost, overlap=False)
    assert serial.exposed_s == pytest.approx(serial.collective_s) and serial.contention_s == 0.0
    flat = dp_comm(cost, params=1e9, units=32, fwd_s=1.0, bwd_s=2.0, num_microbatches=4, dp=512, tp=1, zero=0,
                   param_item=2, reduce_item=2, overlap=False)
    assert flat.exposed_s == pytest.approx(cost.collective_time("all_reduce", 2e9, span=cost.span(512, 1)))
    bucketed = dp_comm(cost, params=1e9, units=32, fwd_s=1.0, bwd_s=2.0, num_microbatches=4, dp=512, tp=1,
                       zero=0, param_item=2, reduce_item=2)
    assert bucketed.exposed_s < flat.exposed_s  # only the last bucket's all-reduce is exposed
    assert dp_comm(cost, params=1e9, units=4, fwd_s=1.0, bwd_s=2.0, num_microbatches=1, dp=1, tp=1, zero=3,
                   param_item=2, reduce_item=4).total_s == 0.0


def test_zero0_charges_its_bucket_copies_as_compute() -> None:
    """ZeRO 0's flatten, in-place average and copy back (``data_parallel._flat_grads`` / ``_unflatten_into``) read
    and write the gradients three times: host work on the rank's timeline, so ``eager_s``; more buckets (the
    overlapped sync, one per unit) pay more ops, and where views cost eager time (CPU profiles) more tensors more."""
    cost = _cost()
    dev = cost.profile.device
    kw = {"params": 1e9, "units": 32, "fwd_s": 1.0, "bwd_s": 2.0, "num_microbatches": 4, "dp": 8, "tp": 1,
          "zero": 0, "param_item": 2, "reduce_item": 4, "param_tensors": 300}
    flat, bucketed = dp_comm(cost, overlap=False, **kw), dp_comm(cost, **kw)  # type: ignore[arg-type]
    traffic = 6 * 4e9 / dev.memory_bandwidth / dev.sustained_fraction
    assert traffic < flat.eager_s == pytest.approx(bucket_host_s(cost, 4e9, 300, 1))
    assert flat.eager_s < traffic * 1.01  # GPU: a few launches against gigabytes of copies
    assert bucketed.eager_s == pytest.approx(bucket_host_s(cost, 4e9, 300, 32)) and bucketed.eager_s > flat.eager_s
    assert flat.total_s == pytest.approx(flat.exposed_s + flat.eager_s) and bucket_host_s(cost, 0.0, 300, 1) == 0.0
    assert dp_comm(cost, **{**kw, "dp": 1}).eager_s == 0.0  # type: ignore[arg-type]
    view = dataclasses.replace(dev, op_overhead={**dev.op_overhead, "view": 0.5})
    cpu = CostModel(dataclasses.replace(cost.profile, device=view))
    more = bucket_host_s(cpu, 4e9, 600, 1) - bucket_host_s(cpu, 4e9, 300, 1)
    assert more == pytest.approx(300 * 3 * 0.5 * dev.launch_overhead_s)


def test_fsdp2_charges_its_copies_and_their_launches_where_not_measured() -> None:
    """FSDP2 copies each gathered unit in and out and each reduce-scatter's input in (``_fsdp_collectives``): bytes
    at HBM bandwidth each micro-batch, ZeRO 3's second gather included, and one launch per copy kernel on a profile
    without FSDP2's measured per-unit work."""
    cost = _cost()
    dev = cost.profile.device
    z1, z3 = _z3(cost, zero=1, overlap=False), _z3(cost, overlap=False)
    per_mb = lambda gathers: 2 * 1e9 * (1 + 1 / 512) * (gathers * 2 + 4) / dev.memory_bandwidth  # noqa: E731
    launches = 32 * cost.op_overhead("pointwise")
    assert z1.eager_s == pytest.approx(per_mb(1) / dev.sustained_fraction + 4 * launches)
    assert z3.eager_s == pytest.approx(per_mb(2) / dev.sustained_fraction + 6 * launches)
    measured = dataclasses.replace(dev, runtime_overhead={"fsdp_unit": 0.0, "fsdp_tensor": 0.0})
    got = _z3(CostModel(dataclasses.replace(cost.profile, device=measured)), zero=1, overlap=False)
    assert got.eager_s == pytest.approx(per_mb(1) / dev.sustained_fraction)


def test_per_tensor_collectives_and_regather() -> None:
    cost = _cost()
    unit = _z3(cost, overlap=False)
    per_tensor = _z3(cost, overlap=False, per_unit=12.0)
    regather = _z3(cost, overlap=False, per_unit=12.0, recompute_regather=True)
    assert per_tensor.collective_s > unit.collective_s  # 12 latencies per unit instead of one
    assert regather.collective_s > per_tensor.collective_s  # a third all-gather for the recomputed forward


def test_list_form_collectives_pay_hbm_passes_and_one_copy_launch_per_rank() -> None:
    """Per-tensor collectives through torch.distributed's list API (DeepSpeed 2021): a gather moves its bytes 3 more
    times through HBM, a reduce-scatter 4 more times and launches one copy kernel per rank before it starts."""
    cost = _cost(nodes=256)
    dev = cost.profile.device
    args = {"overlap": False, "per_unit": 12.0, "units": 32, "num_microbatches": 1}
    plain = _z3(cost, list_form=False, **args)
    listed = _z3(cost, list_form=True, **args)
    assert _z3(cost, **args).collective_s == pytest.approx(listed.collective_s)  # per_unit > 1 means list form
    hbm = (2 * 3 * 1e9 * 2 + 4 * 1e9 * 4) / dev.memory_bandwidth  # two gathers of fp16, one fp32 reduce-scatter
    launches = 32 * 12 * 512 * dev.launch_overhead_s  # every reduce-scatter: one copy per rank first
    span = cost.span(512, 1)
    tail = max(512 * dev.launch_overhead_s - cost.collective_time("all_gather", 1e9 * 2 / 32 / 12, span=span), 0.0)
    assert listed.collective_s - plain.collective_s == pytest.approx(hbm + launches + 2 * 32 * 12 * tail)
    # the copy launches grow with the group, not with the bytes
    big = _z3(cost, list_form=True, dp=2048, **args)
    assert big.collective_s - _z3(cost, list_form=False, dp=2048, **args).collective_s > \
        listed.collective_s - plain.collective_s + 32 * 12 * 1536 * dev.launch_overhead_s * 0.99
    # FSDP2's coalesced unit collectives are not list-form
    assert _z3(cost, overlap=False).collective_s == pytest.approx(_z3(cost, overlap=False, list_form=False).collective_s)


def test_causal_attention_uses_its_curve() -> None:
    cost = CostModel(load_builtin("dgx-h100"))
    flops = 1e12
    short, long = (cost.op_time(flops, 0.0, "bfloat16", "causal_attention", seq) for seq in (1024, 8192))
    assert short > long  # longer sequences run the kernel closer to peak
    dev = cost.profile.device
    assert long == pytest.approx(flops / (dev.peak_flops["bfloat16"] * 0.33) / dev.sustained_fraction
                                 + dev.launch_overhead_s)


def test_causal_attention_curve_per_head_dim() -> None:
    """A measured table holds one curve per head dimension: an op is read on the curve of the nearest one (by
    ratio), an unknown head dimension on the largest; the schema round-trips it and refuses mixed or interleaved
    curves."""
    from autopar.profiles.cost import interp_seq_efficiency
    from autopar.profiles.schema import SeqEfficiencyPoint

    pts = tuple(SeqEfficiencyPoint(seq=s, efficiency=e, head_dim=hd)
                for hd, curve in ((16, ((32, 0.1), (512, 0.3))), (64, ((32, 0.2), (512, 0.5)))) for s, e in curve)
    assert interp_seq_efficiency(pts, 32, 16) == 0.1
    assert interp_seq_efficiency(pts, 512, 128) == 0.5  # nearest: 64
    assert interp_seq_efficiency(pts, 32, 24) == 0.1  # 24/16 < 64/24
    assert interp_seq_efficiency(pts, 32, None) == 0.2
    assert interp_seq_efficiency(pts, 128, 16) == pytest.approx(0.2)  # half way in log(seq)
    prof = load_builtin("dgx-h100")
    measured = dataclasses.replace(prof, device=dataclasses.replace(prof.device, causal_attention_efficiency=pts))
    text = dump_profile(measured)
    assert loads_profile(text).device.causal_attention_efficiency == pts
    cost = CostModel(measured)
    assert cost.op_time(1e9, 0.0, "bfloat16", "causal_attention", 32, 16) > \
        cost.op_time(1e9, 0.0, "bfloat16", "causal_attention", 32, 64)
    point = "  - seq: 32\n    efficiency: 0.1\n"
    mixed = text.replace(point + "    head_dim: 16\n", point, 1)
    assert mixed != text
    with pytest.raises(ProfileError, match="every point gives head_dim or none"):
        loads_profile(mixed)
    d = measured.device
    apart = (pts[0], pts[2], pts[1], pts[3])  # 16, 64, 16, 64
    with pytest.raises(ProfileError, match="of one head_dim contiguous"):
        loads_profile(dump_profile(dataclasses.replace(
            measured, device=dataclasses.replace(d, causal_attention_efficiency=apart))))


def test_profile_overlap_slowdown_validated() -> None:
    prof = load_builtin("dgx-a100-80gb")
    text = dump_profile(prof)
    assert loads_profile(text).device == prof.device  # round trip keeps the new fields
    with pytest.raises(ProfileError, match="overlap_slowdown"):
        loads_profile(text.replace("overlap_slowdown: 0.19", "overlap_slowdown: 1.5"))


def test_mixed_precision_policy_from_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    pol = dpm.mp_policy("bfloat16", "float32")
    assert pol.param_dtype == torch.bfloat16 and pol.reduce_dtype == torch.float32
    assert dpm.mp_policy("float32").param_dtype is None
    assert dpm.mp_policy("bfloat16", "bfloat16").reduce_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        dpm.mp_policy("int8")
    calls = []
    monkeypatch.setattr(dpm, "fully_shard", lambda mod, **kw: calls.append((mod, kw)))
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    stage = nn.Sequential(*blocks)
    dpm.apply_fsdp([stage], [blocks], None, 3, policy=pol)  # type: ignore[arg-type]
    assert [m for m, _ in calls] == [*blocks, stage]
    assert all(kw["mp_policy"] is pol and kw["reshard_after_forward"] for _, kw in calls)


def test_the_steps_loss_all_reduce_is_charged_once_over_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime all-reduces the loss over the whole world every step (``_reduce_loss``): a plan's exposed
    communication holds one one-float all-reduce over every rank, and a one-rank plan none."""
    from test_calibrate import _graph, cpu_like

    from autopar.planner.inter_op import evaluate
    from autopar.planner.options import PlanOptions
    from autopar.planner.search import search

    g, prof = _graph("gpt-tiny"), cpu_like(4)
    opts = PlanOptions(global_batch=8, dtype="float32", top_k=0, pins={"pp": 2, "dp": 2, "tp": 1}, workers=1)
    charged = search(g, prof, opts).best.time
    monkeypatch.setattr(evaluate, "_loss_sync", lambda cost, world: 0.0)
    free = search(g, prof, opts).best.time
    want = CostModel(prof).collective_time("all_reduce", 4, group_size=4)
    assert charged.exposed_comm - free.exposed_comm == pytest.approx(want)
    assert charged.total - free.total == pytest.approx(want)
    monkeypatch.undo()
    assert evaluate._loss_sync(CostModel(prof), 1) == 0.0


def test_zero0_buckets_go_out_during_the_last_backward_one_per_unit(fake_world, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    """ZeRO 0's gradient sync as the cost model describes it: one all-reduce per unit, issued once the unit's
    gradients are final (the last micro-batch's backward), so the last layer's goes out before the first layer's
    backward runs; nothing while the first micro-batch runs or outside a step; the averages written back (a fake
    world of 2: each all-reduce returns the rank's own values, so every gradient is halved)."""
    import torch.distributed as dist

    fake_world(2)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    units = [list(layers[i].parameters()) for i in (0, 2, 4)]
    issued: list[int] = []
    real = dist.all_reduce

    def counted(t: torch.Tensor, *a: object, **k: object) -> object:
        issued.append(t.numel())
        return real(t, *a, **k)

    monkeypatch.setattr(dist, "all_reduce", counted)
    sync = dpm.GradSync(units, dist.group.WORLD, microbatches=2)
    at_first_layer: list[int] = []
    layers[0].register_full_backward_pre_hook(lambda m, g: at_first_layer.append(len(issued)))
    x = torch.randn(6, 4, requires_grad=True)
    layers(x).sum().backward()  # outside a step: not counted
    for p in layers.parameters():
        p.grad = None
    with sync.armed():
        for part in x.chunk(2):
            layers(part).sum().backward()
            if len(at_first_layer) == 2:
                assert issued == [], "a bucket went out before the last micro-batch"
    # one per unit in backward order; the last two layers' both before the first layer's backward ran
    assert issued == [8 * 2 + 2, 8 * 8 + 8, 4 * 8 + 8], issued
    assert at_first_layer[-1] == 2
    local = [p.grad.clone() for p in layers.parameters()]
    sync.finish()
    assert len(issued) == 3  # nothing left for the end of the step
    for p, g in zip(layers.parameters(), local):
        assert torch.equal(p.grad, g / 2)


def test_zero0_sync_falls_back_when_a_gradient_accumulates_after_its_bucket_went_out(fake_world) -> None:
    """A parameter accumulated more often than the step's micro-batches (used by two of a rank's chunks) had its
    bucket issued too early: the step then all-reduces every gradient as it finally is."""
    import torch.distributed as dist

    fake_world(2)
    lin = nn.Linear(3, 3)
    sync = dpm.GradSync([list(lin.parameters())], dist.group.WORLD, microbatches=2)
    with sync.armed():
        for _ in range(3):
            lin(torch.randn(2, 3)).sum().backward()
    final = [p.grad.clone() for p in lin.parameters()]
    sync.finish()
    assert all(torch.equal(p.grad, g / 2) for p, g in zip(lin.parameters(), final))


def test_planner_picks_the_zero0_sync_mode_predicted_faster_and_the_plan_records_it() -> None:
    """Auto (``overlap_grad_sync=None``): on CPU-like ranks, where every all-reduce pays ~0.3 ms of latency, one
    all-reduce after the backward beats a bucket per layer group; on A100s a 1.3B model's buckets hide behind the
    backward.  The plan records the mode (the runtime runs it) and a forced mode predicts what it costs."""
    from test_calibrate import _graph, cpu_like

    from autopar import ir
    from autopar.planner.options import PlanOptions
    from autopar.planner.search import search
    from autopar.zoo import build

    def plan(prof: object, graph: object, batch: int, **kw: object) -> object:
        return search(graph, prof, PlanOptions(global_batch=batch, dtype="float32", top_k=0, workers=1,  # type: ignore
                                               pins={"pp": 1, "dp": 2, "tp": 1, "zero": 0}, **kw)).best  # type: ignore

    g = _graph("gpt-tiny")
    auto, after, buckets = (plan(cpu_like(), g, 8, overlap_grad_sync=v) for v in (None, False, True))
    assert (auto.overlap_grad_sync, after.overlap_grad_sync, buckets.overlap_grad_sync) == (False, False, True)
    assert auto.time.total == after.time.total < buckets.time.total
    big = dataclasses.replace(load_builtin("dgx-a100-80gb", nodes=1), devices_per_node=2)
    spec = build("gpt3-1.3b", batch=1, device="meta")
    g13 = ir.trace(spec.model, spec.example_inputs, model_name="gpt3-1.3b")
    assert plan(big, g13, 16).overlap_grad_sync is True
