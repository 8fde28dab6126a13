"""Tier (c) for plans *the planner emits*: ``autopar.planner.search`` plans for gpt-tiny and llama-tiny on 2- and
4-device
clusters run on gloo CPU ranks with parity against the single-process step (loss and SGD-updated parameters to 1e-5
relative in fp32, as tests/test_codegen_parity.py checks hand-made Megatron plans).

Tiny models on real cluster profiles plan as plain Megatron or pure dp, so synthetic profiles make the interesting
strategies optimal: slow memory and no launch overhead make norms and pointwise ops worth sharding (sequence
parallelism, Korthikanti et al. 2022), nearly free collectives make every placement cheap (all-to-alls,
batch-split linears, interleaved ``S(d)[k]`` weights), and a device memory between the two pipeline ranks' needs
makes only the rank with more micro-batches in flight recompute.  Pins fix tp/pp/dp, the schedule and ZeRO.
:func:`test_plans_have_the_features` asserts each plan really contains what its name says, so the parity tests
cannot silently degrade to replicate-only plans.  Each world size is one spawn running every plan of both models.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest

from autopar import ir
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin
from autopar.profiles.schema import COLLECTIVES, ClusterProfile
from autopar.zoo import build

from harness import parity_worker, spawn

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks

MODELS = ["gpt-tiny", "llama-tiny"]
BATCH, SEQ = 8, 16
RTOL = 1e-5
"""Acceptance: loss and updated parameters to 1e-5 relative (fp32)."""
GRAD_RTOL = 1e-3
"""The update itself (the gradient at SGD lr 1) differs by fp32 reduction order (see test_codegen_parity.py)."""

Plans = dict[str, ir.Plan]


# ---- clusters -------------------------------------------------------------------------------------------------------
def _profile(devices: int, *, memory_bandwidth: float | None = None, alpha_s: float | None = None,
             busbw: float | None = None, memory_bytes: int | None = None) -> ClusterProfile:
    """One node of ``devices`` A100s, optionally with other memory bandwidth, launch overhead ~0, collective costs."""
    base = load_builtin("dgx-a100-80gb", nodes=1)
    dev = base.device
    if memory_bandwidth is not None:
        dev = dataclasses.replace(dev, memory_bandwidth=memory_bandwidth, launch_overhead_s=1e-9)
    if memory_bytes is not None:
        dev = dataclasses.replace(dev, memory_bytes=memory_bytes)
    links = dict(base.links)
    if alpha_s is not None:
        links = {lvl: dataclasses.replace(lp, **{k: tuple(dataclasses.replace(ab, alpha_s=alpha_s, busbw=busbw)
                                                          for ab in lp.table(k)) for k in COLLECTIVES})
                 for lvl, lp in base.links.items()}
    return dataclasses.replace(base, devices_per_node=devices, device=dev, links=links)


def _seq_parallel(devices: int) -> ClusterProfile:
    """Memory-bound norms (1 GB/s) and cheap collectives: sequence parallelism wins."""
    return _profile(devices, memory_bandwidth=1e9, alpha_s=1e-6, busbw=1e11)


def _free_comm(devices: int) -> ClusterProfile:
    """Collectives cost ~nothing: the solver picks placements the runtime must honour exactly as given."""
    return _profile(devices, memory_bandwidth=1e9, alpha_s=1e-9, busbw=1e15)


# ---- planning -------------------------------------------------------------------------------------------------------
def _graph(model: str) -> ir.Graph:
    spec = build(model, batch=BATCH, device="cpu", seq=SEQ, seed=0)
    return ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name=model)


def _plan(graph: ir.Graph, profile: ClusterProfile, **pins: int | str) -> ir.Plan:
    return search(graph, profile, PlanOptions(global_batch=BATCH, dtype="float32", pins=pins, top_k=0)).best


def _mixed_recompute(graph: ir.Graph, profile: ClusterProfile, **pins: int | str) -> ir.Plan:
    """A 1F1B plan on a device memory halfway between what its two pipeline ranks need without recomputation: the
    first rank (more micro-batches in flight) must recompute, the last need not."""
    need = [s.memory.total for s in _plan(graph, profile, recompute="none", **pins).stages]
    assert max(need) > min(need), need
    cap = int((max(need) + min(need)) / 2)
    return _plan(graph, dataclasses.replace(profile, device=dataclasses.replace(profile.device, memory_bytes=cap)),
                 **pins)


def _kv_gathered(graph: ir.Graph, plan: ir.Plan) -> ir.Plan:
    """``plan`` with Llama's key/value projections sharded contiguously (``S(0)``, which splits a head when tp does
    not divide the kv heads) and their outputs all-gathered before the head view: a layout the planner picks when
    the gather is cheap. Plans without such projections (GPT's fused qkv) come back unchanged."""
    kv = {ps.pattern for ps in plan.param_shardings if re.search(r"attn\.w[kv]\.weight$", ps.pattern)}
    if not kv:
        return plan
    lin = {n.name for n in graph.nodes if n.op == "linear"
           and any(ps.matches(p) for ps in plan.param_shardings if ps.pattern in kv for p in n.params)}
    ops = []
    for o in plan.op_shardings:
        n = graph.node(o.node)
        if o.node in lin:
            o = dataclasses.replace(o, strategy="column", inputs=("R",), output=f"S({len(n.out.shape) - 1})")
        elif n.kind == "view" and set(n.activation_inputs) & lin:
            o = dataclasses.replace(o, strategy="replicate", inputs=("R",), output="R", comm="fwd:all_gather")
        ops.append(o)
    params = tuple(dataclasses.replace(ps, placement="S(0)") if ps.pattern in kv else ps for ps in plan.param_shardings)
    return dataclasses.replace(plan, param_shardings=params, op_shardings=tuple(ops))


def _hetero_split(graph: ir.Graph) -> ir.Plan:
    """The best pipeline split across an A100 and an H100 (one device each, issue 15): its stages are tagged with
    their device types, and it runs here as an ordinary pp=2 plan."""
    from autopar.planner.hetero import best_by_kind
    from autopar.profiles.hetero import HeteroProfile, NodeGroup, load_cluster

    h100 = dataclasses.replace(load_builtin("dgx-h100", nodes=1), devices_per_node=1)
    prof = HeteroProfile(schema_version=1, name="a100-h100", source="test", inter_group=load_cluster(
        "a100-h100").inter_group, groups=(NodeGroup(name="a100", profile=_profile(1)), NodeGroup(name="h100",
                                                                                                  profile=h100)))
    return best_by_kind(graph, prof, PlanOptions(global_batch=BATCH, dtype="float32", top_k=0))[0]["split"][0]


PLANNERS: dict[str, tuple[int, Callable[[ir.Graph], ir.Plan]]] = {
    # name: (world size, graph -> plan)
    "tp2-seqpar-selective": (2, lambda g: _plan(g, _seq_parallel(2), tp=2, recompute="selective")),
    "tp2-free-comm": (2, lambda g: _plan(g, _free_comm(2), tp=2)),
    "pp2-1f1b-mixed-recompute": (2, lambda g: _mixed_recompute(g, _profile(2), pp=2, schedule="1f1b",
                                                                micro_batch=1)),
    "pp2-interleaved": (2, lambda g: _plan(g, _profile(2), pp=2, schedule="interleaved_1f1b")),
    "dp2-zero3": (2, lambda g: _plan(g, _profile(2), dp=2, zero=3)),
    "pp2-hetero-split": (2, _hetero_split),
    "pp2-tp2-seqpar-mixed-recompute-mb1": (4, lambda g: _mixed_recompute(g, _seq_parallel(4), pp=2, tp=2,
                                                                          schedule="1f1b", micro_batch=1)),
    "pp2-tp2-seqpar-interleaved": (4, lambda g: _plan(g, _seq_parallel(4), pp=2, tp=2,
                                                      schedule="interleaved_1f1b")),
    "dp2-tp2-seqpar-zero3": (4, lambda g: _plan(g, _seq_parallel(4), dp=2, tp=2, zero=3)),
    "tp4": (4, lambda g: _plan(g, _profile(4), tp=4)),
    "tp4-kv-gathered": (4, lambda g: _kv_gathered(g, _plan(g, _profile(4), tp=4))),
}


# ---- what each plan must contain ------------------------------------------------------------------------------------
def _token_sharded_norm(p: ir.Plan, g: ir.Graph) -> bool:
    """Some LayerNorm / RMSNorm op consumes its input sharded on the sequence (Megatron's sequence parallelism) or
    the batch dim: both cost the same, the solver picks either."""
    return any(g.node(o.node).module_type.endswith("Norm") and o.inputs[:1] in (("S(0)",), ("S(1)",))
               for o in p.op_shardings)


def _comm(p: ir.Plan, kind: str) -> bool:
    return any(kind in o.comm for o in p.op_shardings)


def _interleaved_param(p: ir.Plan) -> bool:
    return any(re.fullmatch(r"S\(\d\)\[\d+\]", s.placement) for s in p.param_shardings)


def _embedding_sharded(p: ir.Plan) -> bool:
    return any(s.pattern in ("wte.weight", "embed.weight") and s.placement != "R" for s in p.param_shardings)


def _head_row_parallel(p: ir.Plan) -> bool:
    return any(o.node == "lm_head" and o.strategy == "row" and o.output == "P" for o in p.op_shardings)


def _recompute_differs(p: ir.Plan) -> bool:
    return len({s.recompute for s in p.stages}) > 1


def _sp(p: ir.Plan, g: ir.Graph) -> bool:
    return _token_sharded_norm(p, g) and _comm(p, "reduce_scatter") and _embedding_sharded(p)


FEATURES: dict[str, Callable[[ir.Plan, ir.Graph], bool]] = {
    "tp2-seqpar-selective": lambda p, g: _sp(p, g) and p.stages[0].recompute == "selective",
    "tp2-free-comm": lambda p, g: (_comm(p, "all_to_all") and _embedding_sharded(p)
                                   and {"S(0)", "S(1)", "S(2)", "P"} <= {o.output for o in p.op_shardings}),
    "pp2-1f1b-mixed-recompute": lambda p, g: p.mesh.pp == 2 and p.schedule == "1f1b" and _recompute_differs(p),
    "pp2-interleaved": lambda p, g: p.schedule == "interleaved_1f1b" and len(p.stages) == 4,
    "dp2-zero3": lambda p, g: p.mesh.dp == 2 and p.zero == 3,
    "pp2-hetero-split": lambda p, g: p.mesh.pp == 2 and {s.device_group for s in p.stages} == {"a100", "h100"},
    "pp2-tp2-seqpar-mixed-recompute-mb1": lambda p, g: _sp(p, g) and _recompute_differs(p) and p.micro_batch == 1,
    "pp2-tp2-seqpar-interleaved": lambda p, g: _sp(p, g) and p.schedule == "interleaved_1f1b",
    "dp2-tp2-seqpar-zero3": lambda p, g: _sp(p, g) and p.mesh.dp == 2 and p.zero == 3,
    "tp4": lambda p, g: p.mesh.tp == 4 and _interleaved_param(p),
    "tp4-kv-gathered": lambda p, g: p.mesh.tp == 4 and (g.model_name != "llama-tiny" or (
        p.placement_of("layers.0.attn.wv.weight") == "S(0)" and _comm(p, "all_gather"))),
}
MODEL_FEATURES: dict[str, Callable[[ir.Plan], bool]] = {  # on the sequence-parallel plans
    # GPT: fused qkv in interleaved S(0)[3], vocabulary-parallel embedding (tied with the head)
    "gpt-tiny": lambda p: (p.placement_of("blocks.0.attn.qkv.weight") == "S(0)[3]"
                           and p.placement_of("wte.weight") == "S(0)"),
    # Llama: embedding sharded on the hidden dim, LM head row parallel with a partial output
    "llama-tiny": lambda p: p.placement_of("embed.weight") == "S(1)" and _head_row_parallel(p),
}


@pytest.fixture(scope="module")
def graphs() -> dict[str, ir.Graph]:
    return {m: _graph(m) for m in MODELS}


@pytest.fixture(scope="module")
def plans(graphs: dict[str, ir.Graph]) -> dict[str, Plans]:
    return {name: {m: make(graphs[m]) for m in MODELS} for name, (_, make) in PLANNERS.items()}


def _configs(plans: dict[str, Plans], world: int) -> list[dict]:
    return [dict(name=name, plan=plans[name], count_comms=True) for name, (w, _) in PLANNERS.items() if w == world]


def _check(results: dict[str, dict], plans: dict[str, Plans], world: int) -> None:
    assert set(results) == {f"{m}/{c['name']}" for m in MODELS for c in _configs(plans, world)}
    bad = {k: v for k, v in results.items() if v["loss"] > RTOL or v["param"] > RTOL or v["update"] > GRAD_RTOL}
    assert not bad, f"parity violated: {bad}"
    for key, res in results.items():
        model, name = key.split("/")
        plan = plans[name][model]
        if plan.mesh.tp > 1 and plan.mesh.pp == 1:  # the runtime issued the plan's kinds of tp collectives
            want = {k for k in ("reduce_scatter", "all_reduce") if _comm(plan, "fwd:" + k)}
            assert want <= set(res["comms"]), (key, want, res["comms"])


def test_plans_have_the_features(plans: dict[str, Plans], graphs: dict[str, ir.Graph]) -> None:
    for name, per_model in plans.items():
        for model, plan in per_model.items():
            assert plan.mesh.world_size == PLANNERS[name][0]
            assert FEATURES[name](plan, graphs[model]), f"{model} {name}: the planner no longer emits the feature"
            if "seqpar" in name:
                assert MODEL_FEATURES[model](plan), f"{model} {name}: model-specific placements missing"


@pytest.fixture(scope="module")
def two_rank_results(plans: dict[str, Plans]) -> dict[str, dict]:
    return spawn(parity_worker, 2, _configs(plans, 2), MODELS, BATCH, SEQ)[0]


@pytest.fixture(scope="module")
def four_rank_results(plans: dict[str, Plans]) -> dict[str, dict]:
    return spawn(parity_worker, 4, _configs(plans, 4), MODELS, BATCH, SEQ)[0]


def test_planner_plans_parity_two_ranks(two_rank_results: dict[str, dict], plans: dict[str, Plans]) -> None:
    _check(two_rank_results, plans, 2)


def test_planner_plans_parity_four_ranks(four_rank_results: dict[str, dict], plans: dict[str, Plans]) -> None:
    _check(four_rank_results, plans, 4)


def test_program_exposes_chunks_and_buffers(fake_world, plans: dict[str, Plans], graphs: dict[str, ir.Graph]) -> None:
    """``ParallelProgram.chunks`` names the interleaved (fused qkv) parameters; ``named_buffers`` uses model FQNs."""
    from autopar.codegen.runtime.program import build_program

    fake_world(2)
    for model in MODELS:
        spec = build(model, batch=BATCH, device="cpu", seq=SEQ, seed=0)
        prog = build_program(plans["tp2-seqpar-selective"][model], spec, graph=graphs[model])
        want = {f"blocks.{i}.attn.qkv.{p}": 3 for i in range(2) for p in ("weight", "bias")} if model == "gpt-tiny" else {}
        assert prog.chunks == want
        assert prog.chunks == prog._chunks  # codegen.checkpoint's older accessor stays in sync
        names = [n for n, _ in prog.named_buffers()]
        assert names == [n for n, _ in spec.model.named_buffers()]
        assert list(prog.named_buffers(persistent_only=True)) == []  # Llama's RoPE tables are not persistent
