"""Tier (a): the Plan type — YAML round trip and validation with the offending field named."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from autopar.ir.errors import SchemaError
from autopar.ir.plan import (
    MemoryBreakdown,
    MeshPlan,
    OpSharding,
    ParamSharding,
    Plan,
    StagePlan,
    TimeBreakdown,
    plan_from_yaml,
    plan_to_yaml,
)


def make_plan(**over: object) -> Plan:
    mem = MemoryBreakdown(params=1e9, grads=1e9, optimizer=6e9, activations=3.5e9, other=1.6e9, capacity=80e9)
    base = dict(
        model="gpt-tiny", graph_fingerprint="abc123", num_params=1234, cluster="dgx-a100-80gb", nodes=2,
        devices_per_node=8, global_batch=64, micro_batch=2, num_microbatches=8, mesh=MeshPlan(pp=2, dp=4, tp=2),
        schedule="1f1b", zero=1, dtype="bfloat16",
        stages=(StagePlan(index=0, layer_start=0, layer_end=3, modules=("<prefix>", "blocks.0", "blocks.1"),
                          recompute="selective", fwd_s=0.01, bwd_s=0.02, memory=mem),
                StagePlan(index=1, layer_start=3, layer_end=5, modules=("blocks.2", "<suffix>"), fwd_s=0.011,
                          bwd_s=0.021, memory=mem)),
        param_shardings=(ParamSharding(pattern="blocks.*.attn.qkv.weight", placement="S(0)"),
                         ParamSharding(pattern="blocks.*.attn.proj.weight", placement="S(1)")),
        op_shardings=(OpSharding(node="linear_1", op="linear", strategy="row", inputs=("S(2)",), output="P",
                                 compute_s=1e-4, comm_s=2e-5, comm="all_reduce"),),
        time=TimeBreakdown(compute=1.0, exposed_comm=0.2, bubble=0.1, optimizer=0.01),
        samples_per_s=48.0, tflops_per_device=130.5, mfu=0.42, pins=("tp=2",), notes=("a note",),
    )
    base.update(over)
    return Plan(**base)  # type: ignore[arg-type]


def test_round_trip_is_lossless() -> None:
    p = make_plan()
    text = plan_to_yaml(p)
    q = plan_from_yaml(text)
    assert q == p
    assert plan_to_yaml(q) == text
    assert yaml.safe_load(text)["schema_version"] == 2
    assert yaml.safe_load(text)["mesh"] == {"pp": 2, "dp": 4, "ep": 1, "cp": 1, "tp": 2}


def test_ep_cp_round_trip_and_version_1_files() -> None:
    p = make_plan(mesh=MeshPlan(pp=2, dp=2, ep=2, cp=2, tp=2), num_microbatches=16)
    text = plan_to_yaml(p)
    assert plan_from_yaml(text) == p and plan_to_yaml(plan_from_yaml(text)) == text
    assert yaml.safe_load(text)["mesh"] == {"pp": 2, "dp": 2, "ep": 2, "cp": 2, "tp": 2}
    old = yaml.safe_load(plan_to_yaml(make_plan()))
    old["schema_version"] = 1
    del old["mesh"]["ep"], old["mesh"]["cp"]
    q = plan_from_yaml(yaml.safe_dump(old, sort_keys=False))
    assert q == make_plan() and (q.mesh.ep, q.mesh.cp, q.schema_version) == (1, 1, 2)
    old["mesh"]["cp"] = 2  # version 1 never had cp: a file naming it is not a version-1 plan
    with pytest.raises(SchemaError, match="mesh.cp"):
        plan_from_yaml(yaml.safe_dump(old))


def test_mesh_layout_tp_cp_dp_pp() -> None:
    m = MeshPlan(pp=2, dp=2, cp=2, tp=2)
    assert m.world_size == 16
    assert [m.coords(r) for r in (0, 1, 2, 4, 8, 15)] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
                                                         (1, 0, 0, 0), (1, 1, 1, 1)]
    assert all(m.rank(**m.coords(r)._asdict()) == r for r in range(16))
    with pytest.raises(ValueError, match="ep=3 must divide mesh.dp=4"):
        MeshPlan(dp=4, ep=3)
    with pytest.raises(ValueError, match="mesh.cp"):
        MeshPlan(cp=0)


def test_placement_patterns() -> None:
    p = make_plan()
    assert p.placement_of("blocks.7.attn.qkv.weight") == "S(0)"
    assert p.placement_of("blocks.7.attn.qkv.bias") == "R"
    assert p.placement_of("blocksX7.attn.qkv.weight") == "R"
    assert p.mesh.coords(p.mesh.rank(pp=1, dp=3, tp=1)) == (1, 3, 0, 1)


@pytest.mark.parametrize("path,value,field", [
    (("mesh", "tp"), 0, "mesh"),
    (("stages", 1, "recompute"), "some", "stages.1.recompute"),
    (("zero",), 5, "<root>"),
    (("param_shardings", 0, "placement"), "Shard(0)", "param_shardings.0"),
    (("global_batch",), "64", "global_batch"),
    (("time", "compute"), float("nan"), "time.compute"),
    (("stages", 0, "memory", "bogus"), 1, "stages.0.memory.bogus"),
    (("schema_version",), 99, "schema_version"),
])
def test_invalid_fields_are_named(path: tuple, value: object, field: str) -> None:
    data = yaml.safe_load(plan_to_yaml(make_plan()))
    node = data
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(SchemaError) as ei:
        plan_from_yaml(yaml.safe_dump(data))
    assert ei.value.field.startswith(field), (ei.value.field, str(ei.value))


def test_missing_field_and_garbage() -> None:
    data = yaml.safe_load(plan_to_yaml(make_plan()))
    del data["mesh"]
    with pytest.raises(SchemaError, match="mesh: missing required field"):
        plan_from_yaml(yaml.safe_dump(data))
    with pytest.raises(SchemaError, match="not valid YAML"):
        plan_from_yaml("mesh: [1, 2\n")
    with pytest.raises(SchemaError, match="expected a mapping"):
        plan_from_yaml("- 1\n- 2\n")


def test_inconsistent_plans_rejected() -> None:
    with pytest.raises(ValueError, match="does not equal global_batch"):
        make_plan(global_batch=65)
    with pytest.raises(ValueError, match="nodes\\*devices_per_node"):
        make_plan(nodes=3)
    with pytest.raises(ValueError, match="not where stage 0 ends"):
        p = make_plan()
        make_plan(stages=(p.stages[0], dataclasses.replace(p.stages[1], layer_start=4, layer_end=6)))


def test_compatibility_checks() -> None:
    p = make_plan()
    p.check_compatible(fingerprint="abc123", world_size=16)
    with pytest.raises(SchemaError, match="another model"):
        p.check_compatible(fingerprint="zzz")
    with pytest.raises(SchemaError, match="needs 16 devices but 8"):
        p.check_compatible(world_size=8)
