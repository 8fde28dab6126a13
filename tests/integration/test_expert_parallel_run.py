"""Expert parallelism on CPU ranks (issue 14): ep=2 (2 ranks; ZeRO 0 and 1), ep=2 x edp=2 (4 ranks, dp=4; ZeRO 0,
1 and 3) and the planner's ep=2 plans with cp=2 and with pp=2 (4 ranks, ZeRO-1) train the sparse MoE with the
losses and the parameters (expert weights included) of one process; a tiny
Hugging Face Mixtral trains under ep=2; the all_to_all calls are the ones the cost model charges (also in a step of
2 micro-batches under ZeRO-1, counted by :func:`harness.comm_mode`); a checkpoint saved
under ep=2 with ZeRO-1 loads under ep=1 (dp=2, ZeRO 0) bit for bit, and back."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

from autopar import ir

from harness import collective_counts, comm_mode, make_plan, planned, program_losses, sgd_losses, spawn
from outside_models import tiny

pytestmark = pytest.mark.multiprocess

MODEL, B, STEPS, LR = "sparse-moe-tiny", 8, 5, 0.5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 64, (B, 16), generator=g)
    return x, x.clone()  # learnable (copy the token), so the losses move


_GRAPH: dict[str, ir.Graph] = {}


def _zoo(dp: int, ep: int, zero: int = 0, n_micro: int = 1):  # -> (spec, graph, plan)
    from autopar.zoo import build

    spec = build(MODEL, batch=B, device="cpu", seed=0)
    if MODEL not in _GRAPH:
        _GRAPH[MODEL] = ir.trace(spec.model, spec.example_inputs, model_name=MODEL)
    g = _GRAPH[MODEL]
    plan = make_plan(g, dp=dp, micro_batch=B // dp // n_micro, num_microbatches=n_micro, zero=zero)
    return spec, g, dataclasses.replace(plan, mesh=ir.MeshPlan(dp=dp, ep=ep))


def _train(prog: object) -> tuple[list[float], int]:
    """SGD steps of the sparse MoE: (losses, all_to_all calls of the first step)."""
    opt = torch.optim.SGD(prog.parameters(), lr=LR)  # type: ignore[attr-defined]
    losses, a2a = [], 0
    for step in range(STEPS):
        with comm_mode() if step == 0 else contextlib.nullcontext() as cm:
            losses.append(prog.step(*_batch(step)))  # type: ignore[attr-defined]
        if step == 0:  # the counts exchange (c10d alltoall_base) and the differentiable dispatch/combine
            counts = collective_counts(cm)
            a2a = counts.get("alltoall_base", 0) + counts.get("all_to_all_single", 0)
        opt.step()
        opt.zero_grad()
    return losses, a2a


def _two_ranks(rank: int, root: str) -> dict[str, object]:
    from autopar.codegen.checkpoint import load_checkpoint, save_checkpoint
    from autopar.codegen.runtime.program import build_program

    out: dict[str, object] = {}
    spec, g, plan = _zoo(2, 2)
    prog = build_program(plan, spec, graph=g)
    out["zoo"], out["a2a"] = _train(prog)
    params = prog.gathered_state_dict()  # the expert weights' updates too, not only the losses
    out["zoo_params"] = params if rank == 0 else None
    # ZeRO-1 (experts FSDP-sharded over their 1-rank edp group), 2 micro-batches of 2 samples per rank
    spec, g, plan = _zoo(2, 2, zero=1, n_micro=2)
    z1 = build_program(plan, spec, graph=g)
    out["zoo_z1"], out["a2a_z1"] = _train(z1)
    z1_params = z1.gathered_state_dict()
    out["zoo_z1_params"] = z1_params if rank == 0 else None
    # Hugging Face Mixtral (grouped_mm_fallback experts, torch.export capture) under ep=2
    model, batch = tiny("mixtral")
    hg = ir.trace(model, batch(0), model_name="mixtral")
    hplan = dataclasses.replace(make_plan(hg, dp=2, micro_batch=2), mesh=ir.MeshPlan(dp=2, ep=2))
    hprog = build_program(hplan, model, example_inputs=batch(0), graph=hg)
    out["hf"] = program_losses(hprog, batch, STEPS, LR)
    hparams = hprog.gathered_state_dict()
    out["hf_params"] = hparams if rank == 0 else None
    # checkpoint: Adam under ep=2 with ZeRO-1, saved; loaded under ep=1 (dp=2, ZeRO 0)
    spec, g, plan = _zoo(2, 2, zero=1)
    saved = build_program(plan, spec, graph=g)
    opt = torch.optim.Adam(saved.parameters(), lr=1e-2)
    for step in range(2):
        saved.step(*_batch(step))
        opt.step()
        opt.zero_grad()
    save_checkpoint(saved, opt, 2, root)
    before = saved.gathered_state_dict()
    loaded = build_program(dataclasses.replace(plan, mesh=ir.MeshPlan(dp=2), zero=0), spec, graph=g)
    opt2 = torch.optim.Adam(loaded.parameters(), lr=1e-2)
    load_checkpoint(loaded, opt2, os.path.join(root, "step_00000002"))
    after = loaded.gathered_state_dict()
    out["bitwise"] = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    for prog, o in ((saved, opt), (loaded, opt2)):  # one more step each: the Adam moments came along too
        prog.step(*_batch(2))
        o.step()
    a, b = saved.gathered_state_dict(), loaded.gathered_state_dict()
    out["next_step"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    save_checkpoint(loaded, opt2, 3, root)  # and back: saved under ep=1, loaded under ep=2 with ZeRO-1
    back = build_program(plan, spec, graph=g)
    load_checkpoint(back, torch.optim.Adam(back.parameters(), lr=1e-2), os.path.join(root, "step_00000003"))
    c = back.gathered_state_dict()
    out["bitwise_back"] = sorted(b) == sorted(c) and all(torch.equal(b[k], c[k]) for k in b)
    return out


def _four_ranks(rank: int, planned_: dict[str, ir.Plan]) -> list[tuple[list[float], object, int]]:
    """dp=4 x ep=2 with ZeRO 0, 1 and 3 (experts sharded over their 2-rank edp group, the rest over dp=4), and the
    planner's ep=2 plans with cp=2 and with pp=2 (ZeRO-1): (losses, gathered params on rank 0, elements held)."""
    from torch.distributed.tensor import DTensor

    from autopar.codegen.runtime.program import build_program

    out: list[tuple[list[float], object, int]] = []
    for zero in (0, 1, 3, "cp", "pp"):
        spec, g, plan = _zoo(4, 2, zero=zero) if isinstance(zero, int) else (*_zoo(4, 2)[:2], planned_[zero])
        prog = build_program(plan, spec, graph=g)
        losses = program_losses(prog, _batch, STEPS, LR)
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in prog.parameters())
        params = prog.gathered_state_dict()
        out.append((losses, params if rank == 0 else None, held))
    return out


def _same_params(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ref) <= set(got)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, atol=2e-6, rtol=1e-5, msg=k)


def test_expert_parallel_parity_counts_and_checkpoint(tmp_path: os.PathLike[str]) -> None:
    from autopar.planner.inter_op.expert import ep_cost, moe_regions
    from autopar.planner.inter_op.memory import memory_breakdown
    from autopar.profiles.builtin import load_builtin
    from autopar.profiles.cost import CostModel
    from autopar.zoo import build

    spec = build(MODEL, batch=B, device="cpu", seed=0)
    ref = sgd_losses(spec.model, lambda m, s: spec.loss_fn(m(_batch(s)[0]), _batch(s)[1]), STEPS, LR)
    hf_model, hf_batch = tiny("mixtral")
    hf_ref = sgd_losses(hf_model, lambda m, s: m(**hf_batch(s)).loss, STEPS, LR)

    two = spawn(_two_ranks, 2, str(tmp_path))
    g = ir.trace(spec.model, spec.example_inputs, model_name=MODEL)
    mixed = {"cp": planned(g, {"dp": 2, "ep": 2, "cp": 2, "tp": 1, "pp": 1, "zero": 1}, B),
             "pp": planned(g, {"dp": 2, "ep": 2, "tp": 1, "pp": 2, "zero": 1}, B)}
    assert [(p.mesh.ep, p.mesh.cp, p.mesh.pp, p.zero) for p in mixed.values()] == [(2, 2, 1, 1), (2, 1, 2, 1)]
    four = spawn(_four_ranks, 4, mixed)
    for r in two:
        assert r["zoo"] == pytest.approx(ref, abs=1e-5), (r["zoo"], ref)
        assert r["hf"] == pytest.approx(hf_ref, abs=1e-5), (r["hf"], hf_ref)
        assert r["zoo_z1"] == pytest.approx(ref, abs=1e-5), (r["zoo_z1"], ref)
        assert r["bitwise"] is True and r["bitwise_back"] is True
        assert r["next_step"] < 1e-6
    for runs in four:
        for losses, _, _ in runs:
            assert losses == pytest.approx(ref, abs=1e-5), (losses, ref)
    # each rank holds (and keeps gradients and optimizer state for) what the memory model charges: ZeRO shards the
    # dense part over dp=4 and its 1/ep of the experts over the dp/ep=2 ranks holding the same ones
    experts = sum(r.elems for r in moe_regions(g))
    for i, zero in enumerate((0, 1, 3)):
        charged = memory_breakdown(param_elems=g.num_params - experts / 2, zero=zero, dp=4, mixed_precision=False,
                                   activations=0.0, capacity=1.0, expert_elems=experts / 2, ep=2).grads / 4
        assert sum(runs[i][2] for runs in four) / 4 == pytest.approx(charged), (zero, [r[i][2] for r in four])
    ref_params = {k: p.detach() for k, p in spec.model.named_parameters()}
    _same_params(two[0]["zoo_params"], ref_params)  # type: ignore[arg-type]
    _same_params(two[0]["zoo_z1_params"], ref_params)  # type: ignore[arg-type]
    for _, params, _ in four[0]:
        _same_params(params, ref_params)  # type: ignore[arg-type]
    _same_params(two[0]["hf_params"], {k: p.detach() for k, p in hf_model.named_parameters()})  # type: ignore
    assert ref[-1] < ref[0] - 1e-3  # the runs train
    # what the planner charges for the counted step (one micro-batch of 4 samples at ep=2)
    _, c = ep_cost(g, CostModel(load_builtin("dgx-h100", nodes=1)), ep=2, tp=1, cp=1, micro_batch=4, dtype="float32")
    assert len(moe_regions(g)) == 2 and c.calls == 10
    assert all(r["a2a"] == c.calls for r in two), [r["a2a"] for r in two]
    _, c2 = ep_cost(g, CostModel(load_builtin("dgx-h100", nodes=1)), ep=2, tp=1, cp=1, micro_batch=2, dtype="float32")
    assert all(r["a2a_z1"] == 2 * c2.calls for r in two), [r["a2a_z1"] for r in two]  # per micro-batch
