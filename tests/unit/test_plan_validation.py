"""A plan is validated completely before any process starts (issue 13).

Hand edits of valid plans (hypothesis mutates fields: batch split, mesh, nodes, stages, dtypes, placements, op
nodes, schedule) are either rejected at load or against the model with one line naming the field, or accepted and
then they run: a world-size-1 plan builds its program on a 1-rank gloo group and trains one step to a finite loss;
a pp=2 x tp=2 plan (4 ranks, not startable here) is rendered and its schedule simulated.  The listed cases of the
issue are checked one by one, and ``autopar run`` refuses them without starting torchrun.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar import ir
from autopar.ir.errors import SchemaError
from autopar.ir.plan import plan_from_yaml, plan_to_yaml
from autopar.ir.plan_check import check_plan_graph
from autopar.planner.cli import main

from harness import make_plan, megatron_shardings

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@cache
def _spec(batch: int) -> Any:
    from autopar.zoo import build

    return build("gpt-tiny", batch=batch, device="cpu")


@cache
def _graph() -> ir.Graph:
    from autopar.zoo import build

    meta = build("gpt-tiny", batch=2, device="meta")
    return ir.trace(meta.model, meta.example_inputs, frontend="fx", model_name="gpt-tiny")


@cache
def _base(kind: str) -> dict[str, Any]:
    g = _graph()
    if kind == "one":  # runs on one rank; shardings present (validated) though tp=1 applies none
        plan = make_plan(g, micro_batch=1, num_microbatches=2, model="gpt-tiny")
        ps, ops = megatron_shardings(g)
        plan = dataclasses.replace(plan, param_shardings=ps, op_shardings=ops)
    else:
        plan = make_plan(g, pp=2, tp=2, micro_batch=1, num_microbatches=4, model="gpt-tiny")
    return yaml.safe_load(plan_to_yaml(dataclasses.replace(plan, fused_kernels=False)))


_INTS = st.sampled_from([-3, -1, 0, 1, 2, 3, 4, 5, 7, 8, 16, 1000, 10**9, 10**30])
_PLACEMENTS = st.sampled_from(["R", "P", "S(0)", "S(1)", "S(2)", "S(3)", "S(7)", "S(0)[3]", "S(1)[2]", "S(0)[5]"])


def _paths(data: dict[str, Any]) -> list[tuple[tuple[Any, ...], st.SearchStrategy[Any]]]:
    out: list[tuple[tuple[Any, ...], st.SearchStrategy[Any]]] = []
    for k in ("global_batch", "micro_batch", "num_microbatches", "nodes", "devices_per_node", "virtual_stages",
              "zero"):
        out.append(((k,), _INTS))
    out += [(("dtype",), st.sampled_from(["float32", "bfloat16", "int8", "float64"])),
            (("reduce_dtype",), st.sampled_from(["float32", "bfloat16", "int8"])),
            (("schedule",), st.sampled_from(["1f1b", "gpipe", "interleaved_1f1b", "zb"])),
            (("mesh", "pp"), _INTS), (("mesh", "dp"), _INTS), (("mesh", "tp"), _INTS)]
    for i, _ in enumerate(data["stages"]):
        out += [(("stages", i, "layer_start"), _INTS), (("stages", i, "layer_end"), _INTS),
                (("stages", i, "recompute"), st.sampled_from(["none", "selective", "full", "some"]))]
    nodes = st.sampled_from([n.name for n in _graph().nodes][:40] + ["no_such_node"])
    for i, _ in enumerate(data["param_shardings"]):
        out += [(("param_shardings", i, "placement"), _PLACEMENTS),
                (("param_shardings", i, "pattern"), st.sampled_from(["blocks.*.nope.weight", "wte.weight", "*"]))]
    for i, op in enumerate(data["op_shardings"]):
        out += [(("op_shardings", i, "node"), nodes), (("op_shardings", i, "output"), _PLACEMENTS)]
        out += [(("op_shardings", i, "inputs", j), _PLACEMENTS) for j in range(len(op["inputs"]))]
    return out


@st.composite
def _mutated(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    data = copy.deepcopy(_base(kind))
    paths = _paths(data)
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 5)) == 0:  # a consistent batch split, or a dropped list entry
            if draw(st.booleans()):
                mb = draw(st.sampled_from([1, 2, 4]))
                data["micro_batch"], data["num_microbatches"] = mb, data["global_batch"] // data["mesh"]["dp"] // mb
            else:
                key = draw(st.sampled_from(["stages", "param_shardings", "op_shardings"]))
                if data[key]:
                    del data[key][draw(st.integers(0, len(data[key]) - 1))]
            continue
        path, values = draw(st.sampled_from(paths))
        target = data
        try:
            for k in path[:-1]:
                target = target[k]
            target[path[-1]] = draw(values)
        except (IndexError, KeyError):
            pass  # an earlier mutation removed the entry
    return data


def _verdict(data: dict[str, Any]) -> ir.Plan | None:
    """The plan if it is accepted (at load and against the model), else None after checking the one-line error."""
    try:
        plan = plan_from_yaml(yaml.safe_dump(data))
        check_plan_graph(plan, _graph())
    except SchemaError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000, str(e)
        return None
    return plan


@pytest.fixture(scope="module")
def one_rank() -> Any:
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@SETTINGS
@given(data=_mutated("one"))
def test_hand_edited_one_rank_plans_are_rejected_or_run(one_rank: None, data: dict[str, Any]) -> None:
    plan = _verdict(data)
    if plan is None:
        return
    from autopar.codegen.runtime.program import build_program

    spec = _spec(plan.global_batch)
    prog = build_program(plan, spec, loss_fn=spec.loss_fn, example_inputs=spec.example_inputs, graph=_graph(),
                         device=torch.device("cpu"), init="copy")
    loss = prog.step(spec.example_inputs, spec.make_target(plan.global_batch, "cpu"))
    assert math.isfinite(loss)


@SETTINGS
@given(data=_mutated("pp2tp2"))
def test_hand_edited_pp_tp_plans_are_rejected_or_evaluated(tmp_path_factory: pytest.TempPathFactory,
                                                           data: dict[str, Any]) -> None:
    plan = _verdict(data)
    if plan is None:
        return
    from autopar.planner.report import render_plan, schedule_trace

    assert render_plan(plan)
    assert schedule_trace(plan, tmp_path_factory.mktemp("t") / "trace.json") > 0


def _bad(**edits: Any) -> dict[str, Any]:
    data = copy.deepcopy(_base("one"))
    for path, v in edits.items():
        target = data
        keys = [int(k) if k.isdigit() else k for k in path.split("__")]
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = v
    return data


_CASES = {
    "layer_end past the model": ({"stages__0__layer_end": 99}, "stages.0.layer_end"),
    "missing suffix": ({"stages__0__layer_end": 3}, "stages.0.layer_end"),
    "missing prefix": ({"stages__0__layer_start": 1}, "layer group 0"),
    "negative micro-batches": ({"num_microbatches": -2}, "num_microbatches must be >= 1"),
    "negative nodes": ({"nodes": -1}, "nodes must be >= 1"),
    "global batch 0": ({"global_batch": 0, "micro_batch": 0}, "must be >= 1"),
    "virtual_stages 0": ({"virtual_stages": 0}, "virtual_stages must be >= 1"),
    "dtype int8": ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16"),
    "S(7)": ({"param_shardings__0__placement": "S(7)"}, "param_shardings.0.placement: placement S(7) shards dim 7"),
    "indivisible shard": ({"param_shardings__0__placement": "S(0)[5]"}, "does not divide"),
    "op naming no node": ({"op_shardings__0__node": "no_such_node"}, "op_shardings.0.node"),
    "huge nodes": ({"nodes": 10**30}, "beyond autopar's limit"),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_each_listed_hand_edit_is_rejected_with_one_line(case: str) -> None:
    edits, expect = _CASES[case]
    assert _verdict(_bad(**edits)) is None
    with pytest.raises(SchemaError, match=expect.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_plan_graph(plan_from_yaml(yaml.safe_dump(_bad(**edits))), _graph())


def test_run_refuses_bad_plans_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    def no_launch(*a: Any, **k: Any) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_base("one")))
    for name, argv in {
        "another model": [str(good), "--model", "llama-tiny"],
        "past the model": [str(_write(tmp_path / "a.yaml", _bad(stages__0__layer_end=99))), "--model", "gpt-tiny"],
        "no such node": [str(_write(tmp_path / "b.yaml", _bad(op_shardings__0__node="zz"))), "--model", "gpt-tiny"],
        "int8": [str(_write(tmp_path / "c.yaml", _bad(dtype="int8"))), "--model", "gpt-tiny"],
    }.items():
        assert main(["run", *argv, "--steps", "1"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("autopar: error: invalid plan") and err.count("\n") == 1, (name, err)
    assert "another model" in _last(capsys, [str(good), "--model", "llama-tiny"])


def _last(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    main(["run", *argv, "--steps", "1"])
    return capsys.readouterr().err


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path
