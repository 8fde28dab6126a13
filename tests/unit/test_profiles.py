"""Schema, built-in profiles and cost model tests (pure, fast)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.profiles import (
    COLLECTIVES,
    AlphaBeta,
    ClusterProfile,
    CostModel,
    DeviceProfile,
    EfficiencyPoint,
    GroupSpan,
    LinkProfile,
    ProfileError,
    builtin_names,
    collective_factor,
    dump_profile,
    group_span,
    load_builtin,
    load_profile,
    loads_profile,
    profile_to_dict,
    save_profile,
    with_nodes,
)
from autopar.profiles.cost import in_step, interp_alpha_beta
from autopar.profiles.fit import fit_alpha_beta


def _link(level: str, alpha: float, bw: float, sizes: tuple[int, ...] = (2, 8)) -> LinkProfile:
    def tab(kind: str) -> tuple[AlphaBeta, ...]:
        gs = (2,) if kind == "p2p" else sizes
        return tuple(AlphaBeta(group_size=g, alpha_s=alpha, busbw=bw, source="synthetic") for g in gs)

    return LinkProfile(level=level, **{k: tab(k) for k in COLLECTIVES})  # type: ignore[arg-type]


def synthetic(nodes: int = 2, dpn: int = 8, intra_bw: float = 100e9, inter_bw: float = 40e9) -> ClusterProfile:
    dev = DeviceProfile(
        name="synthetic",
        memory_bytes=10**10,
        peak_flops={"float32": 1e13, "bfloat16": 1e14},
        matmul_efficiency={
            "default": (
                EfficiencyPoint(flops=1e6, efficiency=0.05),
                EfficiencyPoint(flops=1e9, efficiency=0.5),
                EfficiencyPoint(flops=1e12, efficiency=0.8),
            )
        },
        memory_bandwidth=1e12,
        launch_overhead_s=5e-6,
        sources={"name": "synthetic"},
    )
    links = {"intra_node": _link("intra_node", 1e-5, intra_bw)}
    if nodes > 1:
        links["inter_node"] = _link("inter_node", 3e-5, inter_bw, sizes=(2, 4))
    return ClusterProfile(
        schema_version=1, name="syn", source="test", nodes=nodes, devices_per_node=dpn, device=dev, links=links
    )


# ---------------------------------------------------------------------------------------------------- schema


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_round_trip(name: str, tmp_path) -> None:
    prof = load_builtin(name)
    assert loads_profile(dump_profile(prof)) == prof
    path = save_profile(prof, tmp_path / "p.yaml")
    assert load_profile(path) == prof


def test_synthetic_round_trip() -> None:
    prof = synthetic()
    assert loads_profile(dump_profile(prof)) == prof


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_every_number_has_a_source(name: str) -> None:
    prof = load_builtin(name)
    dev = profile_to_dict(prof)["device"]
    numeric = [k for k, v in dev.items() if k != "sources" and not isinstance(v, str)]
    for field in numeric:
        assert dev["sources"].get(field), f"{name}: device.{field} has no source"
    for level, link in prof.links.items():
        for kind in COLLECTIVES:
            for p in link.table(kind):
                assert p.source, f"{name}: links.{level}.{kind} group {p.group_size} has no source"


def test_builtin_datasheet_numbers() -> None:
    a100, h100, h200 = (load_builtin(n) for n in ("dgx-a100-80gb", "dgx-h100", "h200"))
    assert a100.device.peak_flops["bfloat16"] == 312e12 and a100.device.peak_flops["float32"] == 19.5e12
    assert a100.device.peak_flops["tf32"] == 156e12
    assert h100.device.peak_flops["bfloat16"] == pytest.approx(989e12, rel=0.01)
    assert h200.device.peak_flops == h100.device.peak_flops
    assert h200.device.memory_bytes == 141_000_000_000
    assert h200.device.memory_bandwidth > h100.device.memory_bandwidth
    for p in (a100, h100, h200):
        assert (p.nodes, p.devices_per_node) == (1, 8)


def _bad(mutate) -> str:
    d = profile_to_dict(load_builtin("dgx-a100-80gb", nodes=2))
    mutate(d)
    with pytest.raises(ProfileError) as e:
        loads_profile(yaml.safe_dump(d))
    return str(e.value)


def test_negative_alpha_names_field() -> None:
    msg = _bad(lambda d: d["links"]["inter_node"]["all_reduce"][0].__setitem__("alpha_s", -1))
    assert msg.startswith("links.inter_node.all_reduce[0].alpha_s: expected a non-negative number, got -1")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["device"].pop("memory_bandwidth"), "device.memory_bandwidth"),
        (lambda d: d["device"].__setitem__("memory_bandwidth", "fast"), "device.memory_bandwidth"),
        (lambda d: d["device"]["peak_flops"].__setitem__("bfloat16", -3.0), "device.peak_flops.bfloat16"),
        (lambda d: d["device"]["peak_flops"].__setitem__("int3", 1.0), "device.peak_flops.int3"),
        (lambda d: d.__setitem__("nodes", 0), "nodes"),
        (lambda d: d.__setitem__("nodes", 1.5), "nodes"),
        (lambda d: d.__setitem__("schema_version", 99), "schema_version"),
        (lambda d: d.__setitem__("colour", "red"), "colour"),
        (lambda d: d["device"].__setitem__("colour", "red"), "device.colour"),
        (lambda d: d["links"]["intra_node"].pop("p2p"), "links.intra_node.p2p"),
        (lambda d: d["links"]["intra_node"]["all_gather"][0].__setitem__("busbw", 0), "links.intra_node.all_gather[0].busbw"),
        (lambda d: d["links"].pop("inter_node"), "links.inter_node"),
        (lambda d: d["links"].__setitem__("rack", {}), "links.rack"),
        (lambda d: d["device"]["matmul_efficiency"]["default"][0].__setitem__("efficiency", 1.5),
         "device.matmul_efficiency.default[0].efficiency"),
        (lambda d: d["device"]["matmul_efficiency"]["default"].reverse(), "device.matmul_efficiency.default[1].flops"),
        (lambda d: d["device"].__setitem__("sustained_fraction", 1.2), "device.sustained_fraction"),
        (lambda d: d["device"].__setitem__("sustained_fraction", 0), "device.sustained_fraction"),
    ],
)
def test_invalid_profile_names_field(mutate, field: str) -> None:
    msg = _bad(mutate)
    assert msg.startswith(field + ":"), msg


def test_load_profile_file_errors(tmp_path) -> None:
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("schema_version: 1\nname: x\n")
    with pytest.raises(ProfileError, match="device: missing required field"):
        load_profile(p)


def test_yaml12_floats_are_numbers() -> None:
    text = dump_profile(load_builtin("h200")).replace("989400000000000.0", "9.894e14")
    assert loads_profile(text).device.peak_flops["bfloat16"] == 9.894e14


def test_with_nodes() -> None:
    a100 = load_builtin("a100")
    big = with_nodes(a100, 128)
    assert (big.nodes, big.world_size, big.device, big.links) == (128, 1024, a100.device, a100.links)
    assert load_builtin("dgx-h100", nodes=4).nodes == 4
    single = dataclasses.replace(a100, links={"intra_node": a100.links["intra_node"]})
    with pytest.raises(ProfileError, match="links.inter_node"):
        with_nodes(single, 2)
    with pytest.raises(ValueError):
        with_nodes(a100, 0)
    with pytest.raises(ValueError, match="unknown built-in"):
        load_builtin("tpu")


# ---------------------------------------------------------------------------------------------------- acceptance


def test_a100_allreduce_busbw_matches_public_measurement() -> None:
    """nccl-tests all_reduce_perf on 8x A100 (DGX A100): ~230 GB/s busbw at 8 GB."""
    cm = CostModel(load_builtin("dgx-a100-80gb"))
    busbw = cm.bus_bandwidth("all_reduce", 8 * 2**30, GroupSpan(devices_per_node=8, nodes=1))
    assert abs(busbw / 230e9 - 1) < 0.15, busbw


# ---------------------------------------------------------------------------------------------------- cost model


def test_op_time_forms() -> None:
    cm = CostModel(synthetic())
    # memory bound: bytes / bw + launch
    assert cm.op_time(1.0, 1e9, "float32", "pointwise") == pytest.approx(1e9 / 1e12 + 5e-6)
    # compute bound at a table point: flops / (peak * eff) + launch
    assert cm.op_time(1e12, 1.0, "bfloat16", "matmul") == pytest.approx(1e12 / (1e14 * 0.8) + 5e-6)
    assert cm.op_time(1e9, 1.0, "bf16", "matmul") == pytest.approx(1e9 / (1e14 * 0.5) + 5e-6)
    assert cm.op_time(1e12, 1e12, "float32", "view") == 0.0
    # shape form equals flops/bytes form
    assert cm.matmul_time(m=64, n=32, k=16, dtype="float32") == pytest.approx(
        cm.op_time(2 * 64 * 32 * 16, 4 * (64 * 16 + 16 * 32 + 64 * 32), "float32", "matmul")
    )
    # a sustained fraction stretches kernel time, not the launch overhead
    slow = synthetic()
    slow = dataclasses.replace(slow, device=dataclasses.replace(slow.device, sustained_fraction=0.5))
    assert CostModel(slow).op_time(1.0, 1e9, "float32", "pointwise") == pytest.approx(2e9 / 1e12 + 5e-6)
    assert CostModel(slow).op_time(1e12, 1.0, "bfloat16", "matmul") == pytest.approx(2e12 / (1e14 * 0.8) + 5e-6)
    with pytest.raises(ValueError, match="float16"):
        cm.op_time(1.0, 1.0, "float16", "matmul")
    with pytest.raises(ValueError, match="op kind"):
        cm.op_time(1.0, 1.0, "float32", "magic")


@settings(max_examples=60, deadline=None)
@given(
    st.floats(1.0, 1e15),
    st.floats(1.0, 1e15),
    st.floats(0.0, 1e12),
    st.sampled_from(["matmul", "pointwise", "attention", "norm"]),
)
def test_op_time_monotone(f1: float, f2: float, b: float, kind: str) -> None:
    cm = CostModel(load_builtin("dgx-a100-80gb"))
    lo, hi = sorted((f1, f2))
    assert cm.op_time(lo, b, "bfloat16", kind) <= cm.op_time(hi, b, "bfloat16", kind) * (1 + 1e-12)
    assert cm.op_time(lo, b, "bfloat16", kind) <= cm.op_time(lo, b * 2 + 1, "bfloat16", kind)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("g", [2, 5, 8])
def test_intra_collective_is_alpha_plus_n_beta(kind: str, g: int) -> None:
    cm = CostModel(synthetic())
    for s in (0.0, 1e3, 1e6, 1e9):
        assert cm.collective_time(kind, s, g) == pytest.approx(1e-5 + collective_factor(kind, g) * s / 100e9)


def test_collective_factors() -> None:
    assert collective_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert collective_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert collective_factor("p2p", 2) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.floats(0, 1e11), st.floats(0, 1e11), st.sampled_from(COLLECTIVES), st.sampled_from([2, 4, 8, 16, 32]))
def test_collective_monotone_in_size(s1: float, s2: float, kind: str, g: int) -> None:
    cm = CostModel(synthetic(nodes=4))
    lo, hi = sorted((s1, s2))
    assert cm.collective_time(kind, lo, g) <= cm.collective_time(kind, hi, g)


def test_hierarchical_slowest_level_dominates() -> None:
    cm = CostModel(synthetic(nodes=4, dpn=8, intra_bw=100e9, inter_bw=40e9))
    s = 1e9
    full = GroupSpan(devices_per_node=8, nodes=2)  # 16 ranks, all NICs: inter 40 GB/s dominates
    assert cm.collective_time("all_reduce", s, span=full) == pytest.approx(
        1e-5 + 3e-5 + collective_factor("all_reduce", 16) * s / 40e9
    )
    one = GroupSpan(devices_per_node=1, nodes=4)  # one device per node: one NIC of 8
    assert cm.collective_time("all_reduce", s, span=one) == pytest.approx(
        3e-5 + collective_factor("all_reduce", 4) * s / (40e9 / 8)
    )
    # a fast network makes the intra level the bottleneck
    fast = CostModel(synthetic(nodes=2, intra_bw=100e9, inter_bw=800e9))
    assert fast.collective_time("all_gather", s, span=full) == pytest.approx(
        1e-5 + 3e-5 + collective_factor("all_gather", 16) * s / 100e9
    )
    # crossing nodes is never cheaper than staying inside one
    assert cm.collective_time("all_reduce", s, 8) < cm.collective_time("all_reduce", s, 16)
    assert cm.p2p_time(s, intra_node=True) < cm.p2p_time(s, intra_node=False)
    assert cm.p2p_time(s, intra_node=False) == pytest.approx(3e-5 + s / 40e9)
    assert cm.collective_time("all_reduce", s, 1) == 0.0


def test_errors_for_spans_outside_profile() -> None:
    single = CostModel(synthetic(nodes=1))
    with pytest.raises(ValueError, match="does not fit"):
        single.collective_time("all_reduce", 1e6, 16)
    one_level = dataclasses.replace(synthetic(nodes=1), links={"intra_node": synthetic().links["intra_node"]})
    with pytest.raises(ValueError, match="no inter_node"):
        CostModel(one_level).p2p_time(1e6, intra_node=False)
    with pytest.raises(ValueError, match="does not match"):
        single.collective_time("all_reduce", 1e6, 4, span=GroupSpan(devices_per_node=2, nodes=1))


def test_group_span() -> None:
    assert group_span(8, 1, 8) == GroupSpan(devices_per_node=8, nodes=1)
    assert group_span(4, 1, 8) == GroupSpan(devices_per_node=4, nodes=1)
    assert group_span(16, 1, 8) == GroupSpan(devices_per_node=8, nodes=2)
    assert group_span(4, 8, 8) == GroupSpan(devices_per_node=1, nodes=4)  # dp over tp=8
    assert group_span(4, 2, 8) == GroupSpan(devices_per_node=4, nodes=1)  # dp=4 over tp=2
    assert group_span(8, 2, 8) == GroupSpan(devices_per_node=4, nodes=2)
    assert group_span(1, 64, 8) == GroupSpan(devices_per_node=1, nodes=1)
    with pytest.raises(ValueError):
        group_span(0, 1, 8)


def test_group_size_interpolation() -> None:
    pts = (
        AlphaBeta(group_size=2, alpha_s=1e-5, busbw=100e9),
        AlphaBeta(group_size=8, alpha_s=4e-5, busbw=200e9),
    )
    assert interp_alpha_beta(pts, 2) == (1e-5, 100e9)
    a, bw = interp_alpha_beta(pts, 5)
    assert a == pytest.approx(2.5e-5) and bw == pytest.approx(150e9)
    a, bw = interp_alpha_beta(pts, 64)
    assert a == pytest.approx(4e-5 * 2) and bw == 200e9  # log2(64)/log2(8) = 2


def test_fit_recovers_alpha_beta() -> None:
    sizes = [2.0**i for i in range(10, 27, 2)]
    times = [2e-4 + s * 1e-9 for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(2e-4, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6)
    alpha, beta = fit_alpha_beta([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])  # decreasing data: constrained, finite
    assert alpha >= 0 and beta > 0 and math.isfinite(beta)


def test_exit_without_finalization_flushes_and_keeps_the_exit_code() -> None:
    """A rank leaving through os._exit still delivers its buffered output (stdout is a pipe: block-buffered) and
    its exit status; the logging handlers are flushed too."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a rank's pipe is
    code = ("import logging, sys\n"
            "from autopar.profiles.profiler import exit_without_finalization\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s', stream=sys.stdout)\n"
            "print('step 0', end=' ')\n"
            "logging.getLogger('x').info('saved')\n"
            "sys.stderr.write('err')\n"
            "exit_without_finalization(3)\n"
            "print('never')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 3
    assert r.stdout == "step 0 saved\n"
    assert r.stderr == "err"


def _with_in_step_points(prof: ClusterProfile, groups: int, alpha: float, bw: float) -> ClusterProfile:
    """``prof`` whose intra-node tables add, at every group size, a point measured with ``groups`` groups in step."""
    link = prof.links["intra_node"]

    def tab(kind: str) -> tuple[AlphaBeta, ...]:
        pts = link.table(kind)
        if kind == "p2p":
            return pts
        extra = [AlphaBeta(group_size=p.group_size, alpha_s=alpha, busbw=bw, groups=groups) for p in pts]
        return tuple(sorted([*pts, *extra], key=lambda p: (p.group_size, p.groups)))

    links = {**prof.links, "intra_node": LinkProfile(level="intra_node", **{k: tab(k) for k in COLLECTIVES})}
    return dataclasses.replace(prof, links=links)  # type: ignore[arg-type]


def test_points_measured_in_step_round_trip_and_validate() -> None:
    prof = _with_in_step_points(synthetic(nodes=1, dpn=4), 2, 2e-3, 1e9)
    again = loads_profile(dump_profile(prof))
    assert again.links["intra_node"].table("all_reduce") == prof.links["intra_node"].table("all_reduce")
    assert [p.groups for p in again.links["intra_node"].table("all_reduce")] == [1, 2, 1, 2]
    assert "groups" not in profile_to_dict(synthetic())["links"]["intra_node"]["all_reduce"][0]
    d = profile_to_dict(prof)
    d["links"]["intra_node"]["all_reduce"].pop(0)  # size 2 left with its in-step point only
    with pytest.raises(ProfileError, match="groups-1 point per size"):
        loads_profile(yaml.safe_dump(d))


def test_in_step_moves_toward_the_point_with_most_groups() -> None:
    pts = (AlphaBeta(group_size=2, alpha_s=1e-3, busbw=4e9), AlphaBeta(group_size=2, alpha_s=4e-3, busbw=1e9, groups=4),
           AlphaBeta(group_size=4, alpha_s=2e-3, busbw=2e9))
    assert in_step(pts, 1) == (pts[0], pts[2])
    assert interp_alpha_beta(pts, 2, 4) == pytest.approx((4e-3, 1e9))
    assert interp_alpha_beta(pts, 2, 8) == pytest.approx((4e-3, 1e9))  # capped at what was measured
    assert interp_alpha_beta(pts, 2, 2) == pytest.approx((2e-3, 3e9))  # a third of the way from 1 group to 4
    assert interp_alpha_beta(pts, 4, 4) == pytest.approx((2e-3, 2e9))  # no in-step point at 4: as alone


def test_dp_groups_of_a_stage_are_charged_in_step() -> None:
    """On 4 ranks a dp=2 x tp=2 stage's two dp groups all-reduce at once (the in-step point); pp=2 x dp=2's stage
    holds one dp group (alone); 8 GPUs a node with dp=4 x tp=2: two dp groups of 4 per node."""
    prof = _with_in_step_points(synthetic(nodes=1, dpn=4), 2, 3e-3, 1e9)
    cost = CostModel(prof)
    assert cost.span(2, 2, stage=4) == GroupSpan(devices_per_node=2, nodes=1, groups=2)
    assert cost.span(2, 1, stage=2).groups == 1 and cost.span(2, 2).groups == 1
    alone, at_once = (cost.collective_time("all_reduce", 2**20, span=cost.span(2, stride, stage=stage))
                      for stride, stage in ((1, 2), (2, 4)))
    assert alone == pytest.approx(1e-5 + 2**20 / 100e9) and at_once == pytest.approx(3e-3 + 2**20 / 1e9)
    assert CostModel(synthetic(nodes=2)).span(4, 2, stage=8).groups == 2
    assert CostModel(synthetic(nodes=2)).span(16, 8, stage=128).groups == 8  # one per node: inter-node, no table


@pytest.mark.parametrize("ranks, passes", [(4, {2: ["group", "world"], 4: ["group"]}),
                                           (3, {2: ["group"], 3: ["group"]}),
                                           (5, {2: ["group", "sub"], 4: ["group"], 5: ["group"]})])
def test_link_blocks_measure_alone_then_in_step(fake_world, monkeypatch: pytest.MonkeyPatch, ranks: int,
                                                passes: dict[int, list[str]]) -> None:
    """A group size with several disjoint blocks is measured twice: block 0 alone (its own barrier starts each
    sample), then every whole block in step (one barrier of them all: the world, or the ranks before the left-over
    ones), stored as a ``groups: 1`` and a ``groups: blocks`` point."""
    import torch
    import torch.distributed as dist

    from autopar.profiles import profiler

    fake_world(ranks)
    seen: dict[int, list[str]] = {}

    def record(kind, nbytes, group, group_size, device, repeats, warmup, start=None):  # noqa: ANN001, ANN202
        tag = "group" if start is None else "world" if start is dist.group.WORLD else "sub"
        if tag == "sub":
            assert dist.get_process_group_ranks(start) == list(range(ranks // group_size * group_size))
        if kind == "all_reduce" and nbytes == 1024:
            seen.setdefault(group_size, []).append(tag)
        return (1e-4 if tag == "group" else 1e-3) + nbytes / 1e9

    monkeypatch.setattr(profiler, "time_collective", record)
    opts = profiler.ProfileOptions(ranks=ranks, quick=True, message_sizes=(1024, 65536), progress=False)
    tables = profiler._measure_links(opts, torch.device("cpu"), 0, None)["tables"]
    assert seen == passes
    got = [(e["group_size"], e.get("groups", 1), round(e["alpha_s"], 6)) for e in tables["all_reduce"]]
    assert got == [(g, n, 1e-4 if n == 1 else 1e-3) for g, tags in passes.items()
                   for n in ([1, ranks // g] if len(tags) > 1 else [1])]


def test_in_step_samples_count_the_slowest_rank_of_every_group(fake_world, monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups measured in step keep the slowest rank of them all (a step waits for the slowest group); a group
    measured alone, its own slowest rank."""
    import torch
    import torch.distributed as dist

    from autopar.profiles.profiler import time_collective

    fake_world(4)
    pair = dist.new_group([0, 1])
    reduced: list[object] = []
    real = dist.all_reduce

    def spy(t, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001, ANN202
        if t.dtype == torch.float64:  # the samples' reduction; the timed collective is float32
            reduced.append(group)
        return real(t, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", spy)
    cpu = torch.device("cpu")
    time_collective("all_reduce", 4096, pair, 2, cpu, 2, 1)
    time_collective("all_reduce", 4096, pair, 2, cpu, 2, 1, start=dist.group.WORLD)
    assert reduced == [pair, dist.group.WORLD]
