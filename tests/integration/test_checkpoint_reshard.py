"""Tier (c): a checkpoint saved under one plan loads under another with a different mesh, exactly.

One 4-rank gloo spawn walks a tiny GPT through four plans, each built with the runtime's ``build_program``:

    dp=4 (FSDP2, ZeRO-3) -> dp=2 x tp=2 (FSDP2 x DTensor, fused qkv chunk-interleaved) -> pp=2 x tp=2 -> dp=4 (ZeRO-0)

In each plan the program is built from a *different* random initialization, so only the checkpoint can make the
state right; it trains one AdamW step, is gathered to full model-layout tensors (parameters and every optimizer
state: exp_avg, exp_avg_sq, step), saved, and the next plan loads it.  Gathered state after the load must equal the
gathered state before the save bit for bit (``torch.equal``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harness import spawn  # at module level: tests/conftest.py groups this module with the other spawning ones

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks

PLANS: list[dict[str, Any]] = [
    dict(name="dp4-zero3", dp=4, zero=3),
    dict(name="dp2-tp2-zero1", dp=2, tp=2, zero=1),
    dict(name="pp2-tp2", pp=2, tp=2, num_microbatches=2),
    dict(name="dp4-zero0", dp=4),
]
BATCH, SEQ = 4, 16


def _full(t: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    from autopar.codegen.runtime.tensor_parallel import unpermute_chunks

    full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    if chunks > 1 and full.dim() > 0:
        full = unpermute_chunks(full, chunks, tp)
    return full.detach().cpu().clone()


def gather_state(prog: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state of the program as full model-layout tensors (collective; on all ranks)."""
    chunks, tp = prog._chunks, prog.plan.mesh.tp
    local: dict[str, torch.Tensor] = {}
    for fqn, p in prog.named_parameters():
        c = chunks.get(fqn, 1)
        local[f"param/{fqn}"] = _full(p, c, tp)
        for k, v in sorted(opt.state[p].items()):
            local[f"{k}/{fqn}"] = _full(v, c, tp) if isinstance(v, torch.Tensor) else torch.tensor(v)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local if prog.coords[1:] == (0, 0, 0) else {})
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def reshard_worker(rank: int, root: str) -> list[dict[str, Any]]:
    from autopar import ir
    from autopar.codegen.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from autopar.codegen.runtime.program import build_program
    from autopar.zoo import build

    from harness import make_plan

    spec = build("gpt-tiny", batch=BATCH, device="cpu", seq=SEQ, seed=0)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    target = spec.make_target(BATCH, "cpu")
    history: list[dict[str, Any]] = []
    for i, cfg in enumerate(PLANS):
        cfg = dict(cfg)
        name = cfg.pop("name")
        dp, nmb = cfg.get("dp", 1), cfg.get("num_microbatches", 1)
        plan = make_plan(graph, micro_batch=BATCH // (dp * nmb), model="gpt-tiny", **cfg)
        fresh = build("gpt-tiny", batch=BATCH, device="cpu", seq=SEQ, seed=100 + i)   # wrong weights on purpose
        prog = build_program(plan, fresh, loss_fn=spec.loss_fn, example_inputs=spec.example_inputs, graph=graph)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-2, weight_decay=0.1)
        rec: dict[str, Any] = {"name": name}
        if i:
            found = latest_checkpoint(root)
            assert found is not None
            rec["loaded_step"] = load_checkpoint(prog, opt, found[0])
            rec["after_load"] = gather_state(prog, opt)
        prog.step(spec.example_inputs, target)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["before_save"] = gather_state(prog, opt)
        save_checkpoint(prog, opt, i + 1, root, extra={"plan": name})
        history.append(rec)
        dist.barrier()
    return history if rank == 0 else []


def test_reshard_round_trip_across_three_plan_changes(tmp_path: Any) -> None:
    from autopar.codegen.checkpoint import latest_checkpoint

    history = spawn(reshard_worker, 4, str(tmp_path / "ckpt"))[0]
    assert [h["name"] for h in history] == [p["name"] for p in PLANS]
    for prev, cur in zip(history, history[1:]):
        assert cur["loaded_step"] == history.index(prev) + 1
        saved, loaded = prev["before_save"], cur["after_load"]
        assert set(saved) == set(loaded), set(saved) ^ set(loaded)
        assert any(k.startswith("exp_avg_sq/") for k in saved) and any(k.startswith("step/") for k in saved)
        bad = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        assert not bad, f"{prev['name']} -> {cur['name']}: state differs after the round trip: {bad[:5]}"
    found = latest_checkpoint(tmp_path / "ckpt")
    assert found is not None and found[1] == len(PLANS)
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
