"""Heterogeneous clusters (issue 15): profiles of node groups, the per-device-type stage partition, and plans whose
pipeline stages run on different device types."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from autopar.planner.inter_op.partition import (
    minmax_partition_hetero,
    partition_stages,
    partition_stages_hetero,
)
from autopar.profiles.builtin import load_builtin
from autopar.profiles.hetero import HeteroProfile, load_cluster, loads_cluster, pools
from autopar.profiles.schema import ProfileError, dump_profile

HETERO = """
schema_version: 1
name: mixed
groups:
  - {name: old, profile: dgx-a100-80gb, nodes: 2}
  - {name: new, profile: dgx-h100, nodes: 1}
inter_group: {alpha_s: 5.0e-6, busbw: 23.0e9, source: test}
"""


def test_builtin_hetero_profile_and_pools():
    prof = load_cluster("a100-h100")
    assert isinstance(prof, HeteroProfile)
    assert (prof.nodes, prof.world_size, prof.devices_per_node) == (32, 256, 8)
    got = pools(prof)
    assert [(p.name, p.profile.name, p.nodes, p.profile.nodes) for p in got] == [
        ("a100", "dgx-a100-80gb", 16, 16), ("h100", "dgx-h100", 16, 16)]
    # the inter-group link is the slower side's NIC (HDR), slower than the H100 group's own NDR p2p
    h100_inter = load_builtin("dgx-h100").links["inter_node"].p2p[0].busbw
    assert prof.inter_group.busbw < h100_inter
    with pytest.raises(ValueError, match="cannot resize"):
        load_cluster("a100-h100", nodes=8)


def test_single_type_profiles_load_unchanged(tmp_path):
    plain = load_builtin("dgx-h100", 4)
    assert load_cluster("dgx-h100", 4) == plain
    assert pools(plain) == [("dgx-h100", plain, 4)]
    path = tmp_path / "p.yaml"
    path.write_text(dump_profile(load_builtin("dgx-a100-80gb")))
    assert load_cluster(path) == load_builtin("dgx-a100-80gb")


def test_hetero_profile_from_file_inline_and_errors(tmp_path):
    prof = loads_cluster(HETERO)
    assert [g.nodes for g in prof.groups] == [2, 1] and prof.group("new").profile.device.name.startswith("NVIDIA H100")
    # a group's profile by path (relative to the file) or inline
    (tmp_path / "a100.yaml").write_text(dump_profile(load_builtin("dgx-a100-80gb")))
    (tmp_path / "c.yaml").write_text(HETERO.replace("profile: dgx-a100-80gb", "profile: a100.yaml"))
    assert load_cluster(tmp_path / "c.yaml").groups[0].profile.device == prof.groups[0].profile.device
    for bad, msg in ((HETERO.replace("nodes: 1}", "nodes: 0}"), r"groups\[1\].nodes"),
                     (HETERO.replace("name: new", "name: old"), r"groups\[1\].name"),
                     (HETERO.replace("busbw: 23.0e9", "busbw: -1"), r"inter_group.busbw"),
                     (HETERO.replace("profile: dgx-h100", "profile: nope"), r"groups\[1\].profile"),
                     (HETERO.replace("inter_group", "inter_grup"), "inter_grup")):
        with pytest.raises(ProfileError, match=msg):
            loads_cluster(bad)


def _brute(times, mems, acts, out, pp, rank_group, caps, flight, p2p):
    n, best = len(times[0]), math.inf
    for cuts in itertools.combinations(range(1, n), pp - 1):
        b = [0, *cuts, n]
        ts, ok = [], True
        for k in range(pp):
            g, i, j = rank_group[k], b[k], b[k + 1]
            ok &= sum(mems[g][i:j]) + flight(k) * sum(acts[g][i:j]) <= caps[g]
            ts.append(sum(times[g][i:j]) + (p2p(out[j - 1], k) if k < pp - 1 else 0.0))
        if ok:
            best = min(best, max(ts))
    return best


def test_hetero_partition_matches_brute_force_and_homogeneous_dp():
    rng = random.Random(3)
    for _ in range(150):
        n = rng.randint(2, 8)
        pp = rng.randint(1, min(n, 4))
        times = [[rng.random() for _ in range(n)] for _ in range(2)]
        mems, acts = [[rng.random() for _ in range(n)]] * 2, [[rng.random() for _ in range(n)]] * 2
        out = [rng.random() for _ in range(n)]
        rank_group, caps = [rng.randint(0, 1) for _ in range(pp)], [rng.uniform(1, 4), rng.uniform(1, 4)]
        flight = lambda k, pp=pp: pp - k  # noqa: E731
        p2p = lambda b, k, rg=rank_group: b * (0.3 if k + 1 < len(rg) and rg[k] != rg[k + 1] else 0.1)  # noqa: E731
        got = partition_stages_hetero(times, mems, acts, out, pp=pp, rank_group=rank_group, capacity=caps,
                                      p2p=p2p, in_flight=flight)
        want = _brute(times, mems, acts, out, pp, rank_group, caps, flight, p2p)
        assert got.feasible == (want < math.inf)
        if got.feasible:
            assert got.bottleneck_s == pytest.approx(want, rel=1e-12)
            for k, (i, j) in enumerate(got.boundaries):  # each stage is costed on its own device type
                link = p2p(out[j - 1], k) if k < pp - 1 else 0.0
                assert got.stage_time[k] == pytest.approx(sum(times[rank_group[k]][i:j]) + link)
        # one device type: exactly the homogeneous partition
        same = partition_stages_hetero([times[0]], [mems[0]], [acts[0]], out, pp=pp, rank_group=[0] * pp,
                                       capacity=[caps[0]], p2p=p2p, in_flight=flight)
        homo = partition_stages(times[0], mems[0], acts[0], out, pp=pp, capacity=caps[0], p2p=p2p, in_flight=flight)
        assert same == homo
        # screening's greedy: a valid split, never better than the optimum of time alone
        stage_group = [rank_group[k] for k in range(pp)]
        cuts = minmax_partition_hetero(times, stage_group)
        assert cuts[0][0] == 0 and cuts[-1][1] == n and all(a < b for a, b in cuts)


def test_faster_device_gets_more_layers():
    slow, fast = [1.0] * 12, [1 / 3] * 12
    part = partition_stages_hetero([slow, fast], [[0.0] * 12] * 2, [[0.0] * 12] * 2, [0.0] * 12, pp=2,
                                   rank_group=[0, 1], capacity=[1.0, 1.0])
    assert part.boundaries == ((0, 3), (3, 12))
    # memory: the fast device cannot hold 9 groups, so it gets fewer
    part = partition_stages_hetero([slow, fast], [[1.0] * 12] * 2, [[0.0] * 12] * 2, [0.0] * 12, pp=2,
                                   rank_group=[0, 1], capacity=[12.0, 7.0])
    assert part.boundaries == ((0, 5), (5, 12))


def test_gpt3_175b_split_across_a100_and_h100_beats_either_group_alone():
    """Issue 15 acceptance: a heterogeneous pipeline plan for GPT-3 175B on 16 A100 + 16 H100 nodes is predicted
    faster than the best plan on either group alone (planner only; the same numbers benchmarks/hetero.py prints)."""
    from dataclasses import replace

    from autopar import ir
    from autopar.ir.plan import plan_from_yaml, plan_to_yaml
    from autopar.planner.hetero import best_by_kind
    from autopar.planner.options import PlanOptions
    from autopar.zoo import build

    spec = build("gpt3-175b", batch=1, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, model_name="gpt3-175b")
    prof = load_cluster("a100-h100")
    opts = PlanOptions(global_batch=1536, workers=1, top_k=2)
    kinds, _ = best_by_kind(graph, prof, opts)
    split, a100, h100 = kinds["split"][0], kinds["a100"][0], kinds["h100"][0]
    assert split.samples_per_s > h100.samples_per_s > a100.samples_per_s
    assert split.samples_per_s < a100.samples_per_s + h100.samples_per_s  # no free lunch: at most the sum
    assert [g.name for g in split.device_groups] in (["a100", "h100"], ["h100", "a100"])
    per_rank = split.world_size // split.mesh.pp
    for g in split.device_groups:  # every group holds whole pipeline ranks, stages within its device's memory
        assert g.nodes * split.devices_per_node % per_rank == 0
    for st in split.stages:
        assert st.memory.total <= prof.group(st.device_group).profile.device.memory_bytes
    # stage sizes follow device speed: an H100 stage holds more layer groups than an A100 stage
    size = {g: [s.layer_end - s.layer_start for s in split.stages if s.device_group == g] for g in ("a100", "h100")}
    assert min(size["h100"]) > max(size["a100"][1:])  # (the first A100 stage also holds the embeddings)
    assert all(s.device_group == "h100" for s in h100.stages) and h100.device_groups[0].nodes == 16
    # the plan file records per-stage device groups and reads back; a homogeneous plan's YAML does not name them
    text = plan_to_yaml(split)
    assert "device_group: h100" in text
    assert plan_from_yaml(text) == replace(split, solver=replace(split.solver, wall_s=0.0))
    plain = replace(a100, device_groups=(), stages=tuple(replace(s, device_group="") for s in a100.stages))
    assert "device_group" not in plan_to_yaml(plain)


def test_plan_device_groups_are_validated():
    from dataclasses import replace

    from autopar.ir.plan import DeviceGroup, MeshPlan, Plan, StagePlan

    stages = tuple(StagePlan(index=i, layer_start=i, layer_end=i + 1, device_group=g)
                   for i, g in enumerate(("a", "a", "b", "b")))
    groups = (DeviceGroup(name="a", device="A", nodes=1), DeviceGroup(name="b", device="B", nodes=1))
    plan = Plan(model="m", graph_fingerprint="f", num_params=1, cluster="c", nodes=2, devices_per_node=2,
                global_batch=4, micro_batch=1, num_microbatches=4, mesh=MeshPlan(pp=4), stages=stages,
                device_groups=groups)
    with pytest.raises(ValueError, match="stages.1.device_group"):
        replace(plan, stages=(stages[0], replace(stages[1], device_group="b"), *stages[2:]))
    with pytest.raises(ValueError, match="nodes in all"):
        replace(plan, device_groups=groups[:1])
    with pytest.raises(ValueError, match="no device_groups"):
        replace(plan, device_groups=())


def test_show_and_explain_name_the_device_groups():
    from dataclasses import replace

    from autopar import ir
    from autopar.planner.hetero import best_by_kind
    from autopar.planner.options import PlanOptions
    from autopar.planner.report import explain_node, render_plan
    from autopar.profiles.hetero import NodeGroup
    from autopar.zoo import build

    spec = build("gpt-tiny", batch=1, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, model_name="gpt-tiny")
    one = [load_builtin(n, 1) for n in ("dgx-a100-80gb", "dgx-h100")]
    one = [replace(p, devices_per_node=1) for p in one]
    prof = HeteroProfile(schema_version=1, name="a100-h100", source="test", inter_group=load_cluster(
        "a100-h100").inter_group, groups=(NodeGroup(name="a100", profile=one[0]), NodeGroup(name="h100",
                                                                                             profile=one[1])))
    split = best_by_kind(graph, prof, PlanOptions(global_batch=8, workers=1, top_k=0))[0]["split"][0]
    shown = render_plan(split, width=200)
    assert "device groups" in shown and " device " in shown
    for st in split.stages:  # each stage's row names its device group
        assert any(line.split()[:2] == [str(st.index), st.device_group] for line in shown.splitlines())
    linear = next(n.name for n in graph.nodes if n.op == "linear")
    # alternatives are listed for tp > 1: the same stages on two devices per node, tp=2
    text = explain_node(replace(split, devices_per_node=2, mesh=replace(split.mesh, tp=2)), linear, graph=graph)
    assert "on a100 (NVIDIA A100" in text and "on h100 (NVIDIA H100" in text
