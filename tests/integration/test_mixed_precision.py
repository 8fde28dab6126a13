"""bfloat16 plans compute under autocast with fp32 parameters, gradients and optimizer state (2 gloo ranks); with
FSDP2 (ZeRO 3) the gathers run in bf16 (MixedPrecisionPolicy from the plan) and the sharded state stays fp32."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import ir
from autopar.codegen.runtime.program import build_program
from autopar.zoo import build

from harness import make_plan, spawn

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks

CASES = [("gpt-tiny", {"dp": 2, "micro_batch": 2}), ("llama-tiny", {"pp": 2, "micro_batch": 2, "num_microbatches": 2}),
         ("gpt-tiny-z3", {"dp": 2, "micro_batch": 2, "zero": 3})]


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


def test_bfloat16_plans_use_autocast_with_fp32_master_state() -> None:
    res = spawn(_worker, 2, CASES)
    for name, _ in CASES:
        (l32, l16), dtypes = res[0][name]
        assert l16 != l32, "bf16 autocast had no effect"
        assert abs(l16 - l32) / abs(l32) < 2e-2
        assert dtypes == {"torch.float32"}
        assert res[1][name][0] == res[0][name][0]  # every rank reports the same loss
