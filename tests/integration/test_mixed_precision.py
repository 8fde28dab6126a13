"""bfloat16 plans compute under autocast with fp32 parameters, gradients and optimizer state (2 gloo ranks); with
FSDP2 (ZeRO 3) the gathers run in bf16 (MixedPrecisionPolicy from the plan) and the sharded state stays fp32.

Both tests' runs share one 2-rank group (``runs``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import ir
from autopar.codegen.runtime.program import build_program
from autopar.zoo import build

from harness import JobResults, make_plan, spawn_jobs

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks

CASES = [("gpt-tiny", {"dp": 2, "micro_batch": 2}), ("llama-tiny", {"pp": 2, "micro_batch": 2, "num_microbatches": 2}),
         ("gpt-tiny-z3", {"dp": 2, "micro_batch": 2, "zero": 3})]


@pytest.fixture(scope="module")
def runs() -> JobResults:
    return spawn_jobs(2, {"autocast": (_worker, (CASES,)), "fsdp_holdings": (_fsdp_holdings, ())})


def _worker(rank: int, cases: list) -> dict:
    out = {}
    for key, kw in cases:
        name = key.removesuffix("-z3")
        spec = build(name, batch=4, device="cpu", seed=0)
        graph = ir.trace(build(name, batch=4, device="meta").model, spec.example_inputs, model_name=name)
        losses, dtypes = [], set()
        for dtype in ("float32", "bfloat16"):
            prog = build_program(replace(make_plan(graph, **kw), dtype=dtype), spec, graph=graph)
            losses.append(prog.step(spec.example_inputs, spec.example_target))
            dtypes |= {str(p.dtype) for p in prog.parameters()} | {str(p.grad.dtype) for p in prog.parameters()
                                                                   if p.grad is not None}
        out[key] = (losses, dtypes)
    return out


def test_bfloat16_plans_use_autocast_with_fp32_master_state(runs: JobResults) -> None:
    res = runs["autocast"]
    for name, _ in CASES:
        (l32, l16), dtypes = res[0][name]
        assert l16 != l32, "bf16 autocast had no effect"
        assert abs(l16 - l32) / abs(l32) < 2e-2
        assert dtypes == {"torch.float32"}
        assert res[1][name][0] == res[0][name][0]  # every rank reports the same loss


def _fsdp_holdings(rank: int) -> dict:
    """What FSDP2 under the plan's policy keeps between forward and backward, per ZeRO level (2 gloo ranks)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.codegen.runtime import data_parallel as dpm
    from autopar.planner.inter_op.memory import model_state_bytes

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for zero in (1, 3):
        torch.manual_seed(0)
        blocks = [nn.Linear(16, 16), nn.Linear(16, 16)]
        stage = nn.Sequential(*blocks)
        dpm.apply_fsdp([stage], [blocks], mesh, zero, policy=dpm.mp_policy("bfloat16", "float32"))
        stage(torch.randn(4, 16)).sum()  # forward only: what is live until the backward
        live = [p for b in blocks for p in b._parameters.values()]
        n = sum(p.numel() for b in blocks for p in b.parameters())
        out[zero] = {
            "live_dtypes": sorted({str(p.dtype) for p in live}),
            "live_unsharded_bytes": sum(p.numel() * p.element_size() for p in live if not hasattr(p, "to_local")),
            "model_params_bytes": model_state_bytes(n, zero=zero, dp=2, mixed_precision=True)[0],
            "elems": n,
        }
    return out


def test_fsdp2_holds_what_the_memory_model_charges(runs: JobResults) -> None:
    """ZeRO 1/2 (no resharding after forward): the gathered bf16 copy (2 B/param) stays live until the backward, as
    the memory model charges on top of the fp32 shard; ZeRO 3 frees it after each unit's forward."""
    res = runs["fsdp_holdings"][0]
    z1, z3 = res[1], res[3]
    assert z1["live_dtypes"] == ["torch.bfloat16"] and z1["live_unsharded_bytes"] == 2 * z1["elems"]
    assert z1["model_params_bytes"] == pytest.approx(4 * z1["elems"] / 2 + 2 * z1["elems"])
    assert z3["live_unsharded_bytes"] == 0 and z3["model_params_bytes"] == pytest.approx(4 * z3["elems"] / 2)
