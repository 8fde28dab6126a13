"""Models from other training stacks, end to end with no wrapper (issue #16): torchtitan 0.3's Llama 3 and timm's
``vit_base_patch16_224`` / ``resnet50``, built by their own builders with their own initialization, called with a
positional input and a loss outside the model (``loss_fn``).  Each plan trains 5 SGD steps on gloo CPU ranks
(float32); every step's loss must match the caller's own model trained in one process to 1e-5 relative.

timm imports torchvision, and the CPU build of torch 2.13 on these machines has no matching torchvision, so the timm
cases skip here (with the import error as the reason) and run wherever timm imports.  At real sizes (meta device):
trace with exact parameter counts and plan on 1 and 8 DGX H100 nodes.  ``torch-convnet``, a plain convolutional
model, runs the same fx-captured path as timm's (conv and BatchNorm modules, optional arguments) everywhere.

The models' 2-rank runs share one spawned group, and their 4-rank hybrids another (``runs``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar import ir
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin

from ecosystem_models import REAL, TINY, B, available, loss_fn, tiny
from harness import JobResults, planned, program_losses, sgd_losses, spawn_jobs

MULTIPROCESS = pytest.mark.multiprocess
"""Every test but the planning at real sizes (single-process, it runs beside the multi-process ones under xdist)."""

STEPS, LR, RTOL = 5, 0.02, 1e-5
MESHES = {"dp2": {"dp": 2, "tp": 1, "pp": 1}, "tp2": {"dp": 1, "tp": 2, "pp": 1}, "pp2": {"dp": 1, "tp": 1, "pp": 2},
          "pp2-tp2": {"dp": 1, "tp": 2, "pp": 2}, "dp2-tp2": {"dp": 2, "tp": 2, "pp": 1}}
RUNS = {"torch-convnet": (("dp2", "tp2"), None),
        "torch-gated": (("dp2", "tp2", "pp2"), None),
        "torchtitan-llama3": (("dp2", "tp2", "pp2"), "pp2-tp2"),
        "timm-vit": (("dp2", "tp2", "pp2"), "dp2-tp2"),
        "timm-resnet50": (("dp2", "tp2", "pp2"), "dp2-tp2")}
"""Per model: the 2-rank meshes and the 4-rank hybrid.  ``torch-convnet`` is the fx-captured path (nn.Conv2d and
nn.BatchNorm2d modules, an optional forward argument) that the timm models take, in a model that imports here."""


def _skip_unavailable(name: str) -> None:
    why = available(name)
    if why:
        pytest.skip(why)


def _plan(graph: ir.Graph, mesh: dict[str, int]) -> ir.Plan:
    return planned(graph, mesh, B)


def _reference(name: str) -> list[float]:
    model, batch = tiny(name)
    return sgd_losses(model, lambda m, step: loss_fn(m(*batch(step)[:1]), batch(step)[1]), STEPS, LR)


def _train(rank: int, name: str, cases: list[tuple[str, ir.Plan]], graph: ir.Graph) -> dict[str, list[float] | str]:
    from autopar.codegen.runtime.program import build_program

    out: dict[str, list[float] | str] = {}
    for mesh, plan in cases:
        model, batch = tiny(name)
        before = copy.deepcopy(model.state_dict())
        prog = build_program(plan, model, loss_fn=loss_fn, example_inputs=batch(0)[0], graph=graph,
                             sync_batchnorm=True)
        losses = program_losses(prog, batch, STEPS, LR)
        untouched = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        out[mesh] = losses if untouched else "the caller's model was modified"
    return out


def _check(name: str, results: dict[str, list[float] | str]) -> None:
    ref = _reference(name)
    bad = [f"{name}/{mesh}: {got} vs {ref}" for mesh, got in results.items()
           if isinstance(got, str) or any(abs(a - b) > RTOL * abs(b) for a, b in zip(got, ref))]
    assert not bad, "\n".join(bad)


def _graph_and_plans(name: str) -> tuple[ir.Graph, dict[str, ir.Plan]]:
    model, batch = tiny(name)
    graph = ir.trace(model, batch(0)[0], model_name=name)
    meshes = [*RUNS[name][0], *([RUNS[name][1]] if RUNS[name][1] else [])]
    return graph, {m: _plan(graph, MESHES[m]) for m in meshes}


@pytest.fixture(scope="module")
def planned_models() -> dict[str, tuple[ir.Graph, dict[str, ir.Plan]] | Exception]:
    """Each model that imports here, traced and planned under its meshes (or the error that stopped it, raised by
    that model's test alone)."""
    out: dict[str, tuple[ir.Graph, dict[str, ir.Plan]] | Exception] = {}
    for name in sorted(TINY):
        if not available(name):
            try:
                out[name] = _graph_and_plans(name)
            except Exception as e:  # noqa: BLE001 - re-raised in the model's own test
                out[name] = e
    return out


@pytest.fixture(scope="module")
def runs(planned_models: dict[str, tuple[ir.Graph, dict[str, ir.Plan]] | Exception]) -> dict[int, JobResults]:
    """Per world size, one spawned group running every model's plans (a job per model)."""
    ok = {name: v for name, v in planned_models.items() if not isinstance(v, Exception)}
    two = {name: (_train, (name, [(m, plans[m]) for m in RUNS[name][0]], g)) for name, (g, plans) in ok.items()}
    four = {name: (_train, (name, [(RUNS[name][1], plans[RUNS[name][1]])], g))
            for name, (g, plans) in ok.items() if RUNS[name][1]}
    return {2: spawn_jobs(2, two), 4: spawn_jobs(4, four)}


@MULTIPROCESS
@pytest.mark.parametrize("name", sorted(TINY))
def test_runs_match_one_process(name: str, request: pytest.FixtureRequest) -> None:
    _skip_unavailable(name)
    model, _ = tiny(name)
    planned_model = request.getfixturevalue("planned_models")[name]
    if isinstance(planned_model, Exception):
        raise planned_model
    graph = planned_model[0]
    assert graph.num_params == sum({id(p): p.numel() for p in model.parameters()}.values())
    if name == "torch-gated":  # neither front end captures the gates: each is an opaque region, run replicated
        assert [p for p, _ in graph.opaque] == [f"blocks.{i}.gate" for i in range(4)], graph.opaque
        assert sum(n.op == "opaque" for n in graph.nodes) == 4 and not graph.unknown_ops
    runs = request.getfixturevalue("runs")
    results = runs[2][name]
    assert results[0] == results[1]
    _check(name, results[0])
    if RUNS[name][1]:
        _check(name, runs[4][name][0])


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_sizes_trace_and_plan_on_meta(name: str) -> None:
    _skip_unavailable(name)
    build, published = REAL[name]
    model, x = build()
    graph = ir.trace(model, x, model_name=name)
    assert graph.num_params == published == sum({id(p): p.numel() for p in model.parameters()}.values())
    for nodes in (1, 8):
        plan = search(graph, load_builtin("dgx-h100", nodes=nodes),
                      PlanOptions(global_batch=256 * nodes, workers=1, top_k=0)).best
        assert plan.world_size == 8 * nodes and plan.time.total > 0
        if published < 300_000_000:  # plain data parallelism for tens of millions of parameters
            assert plan.mesh.pp == plan.mesh.tp == 1 and plan.zero <= 1, (name, nodes, plan.mesh, plan.zero)
