"""The per-rank training program launched by torchrun: ``python -m codegen.runtime.worker plan.yaml --model M``.

Each step feeds the plan's global batch of a zoo model (or ``package.module:factory``) through the program built
from the plan, runs AdamW, and logs loss and step time.  At the end it measures every pipeline stage in isolation
(forward + backward of one micro-batch, replayed on inputs captured during training, all tp/dp peers of the stage
together) and logs measured vs predicted step time: the plan's ``time.total`` against the median step, and per
stage ``(fwd_s + bwd_s) x num_microbatches`` against the measurement.  ``--report`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["main", "run_worker", "measure_stages"]

log = logging.getLogger("codegen.runtime.worker")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m codegen.runtime.worker", description=__doc__.splitlines()[0])
    p.add_argument("plan", help="plan YAML (from `autopar plan`)")
    p.add_argument("--model", required=True, help="zoo model name or package.module:factory")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from the timing statistics")
    p.add_argument("--seq", type=int, default=None, help="sequence length override for language models")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init", choices=["seed", "copy"], default="seed",
                   help="seed: meta model initialized shard by shard; copy: build the full model, copy shards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write a JSON report here (rank 0)")
    return p


def _synced_time() -> float:
    dist.barrier()
    return time.perf_counter()


def measure_stages(program: Any, captured: dict[int, tuple[torch.Tensor, ...]], repeats: int = 3) -> dict[int, float]:
    """Median seconds of forward + backward of one micro-batch for each local stage (collective per stage group)."""
    from codegen.runtime.tensor_parallel import implicit_replication

    out: dict[int, float] = {}
    for idx, stage in zip(program.stage_indices, program.stages):
        args = captured.get(idx)
        if args is None:
            continue
        times = []
        for _ in range(repeats):
            ins = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
            t0 = time.perf_counter()
            with implicit_replication():  # plain tensors made inside the model meet DTensors under tp
                res = stage(*ins)
                res = res if isinstance(res, tuple) else (res,)
                tot = sum(r.float().sum() for r in res if isinstance(r, torch.Tensor) and r.requires_grad)
                if isinstance(tot, torch.Tensor):
                    tot.backward()
            times.append(time.perf_counter() - t0)
        out[idx] = statistics.median(times)
    program_zero_grad(program)
    return out


def program_zero_grad(program: Any) -> None:
    for p in program.parameters():
        p.grad = None


def _plan_graph(plan: Any, model: str, seq: int | None) -> Any:
    """The model traced at the batch the plan was made for: ``autopar plan`` traces batch 1, ``auto_parallel`` the
    caller's example batch, hand-made plans the micro or global batch.  Falls back to the micro-batch trace."""
    import ir
    from examples.zoo import build

    first = None
    for b in dict.fromkeys((plan.micro_batch, 1, plan.global_batch)):
        meta = build(model, batch=b, device="meta", seq=seq)
        graph = ir.trace(meta.model, meta.example_inputs, frontend="fx", model_name=model)
        if graph.fingerprint == plan.graph_fingerprint:
            return graph
        first = first or graph
    log.warning("no batch size (%s) reproduces the plan's graph fingerprint %s: was the plan made for model %s "
                "(with this --seq)?", sorted({plan.micro_batch, 1, plan.global_batch}), plan.graph_fingerprint, model)
    return first


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import ir
    from codegen.runtime.mesh import default_device
    from codegen.runtime.program import build_program
    from examples.zoo import build

    plan = ir.load_plan(args.plan)
    device = default_device()
    spec = build(args.model, batch=plan.global_batch, device="cpu", seq=args.seq, seed=args.seed)
    graph = _plan_graph(plan, args.model, args.seq)
    param_dtype = str(next(iter(spec.model.parameters())).dtype).removeprefix("torch.")
    if plan.dtype != param_dtype and dist.get_rank() == 0:  # the runtime has no mixed precision (yet)
        log.warning("the plan was made for %s but the program trains in the model's %s: predicted times assume "
                    "%s (plan with --dtype %s to compare like with like)", plan.dtype, param_dtype, plan.dtype,
                    param_dtype)
    src = spec if args.init == "copy" else build(args.model, batch=plan.global_batch, device="meta", seq=args.seq)
    program = build_program(plan, src, loss_fn=spec.loss_fn, example_inputs=spec.example_inputs, graph=graph,
                            device=device, init=args.init, seed=args.seed)
    captured: dict[int, tuple[torch.Tensor, ...]] = {}
    for idx, stage in zip(program.stage_indices, program.stages):
        stage.register_forward_pre_hook(
            lambda m, a, idx=idx: captured.setdefault(idx, tuple(t.detach().clone() for t in a)))
    opt = torch.optim.AdamW(program.parameters(), lr=args.lr)
    target = spec.make_target(plan.global_batch, "cpu") if spec.make_target else None
    if target is None:
        raise ValueError(f"model {args.model} has no target maker; the worker needs a zoo-style ModelSpec")
    losses, times = [], []
    for step in range(args.steps):
        t0 = _synced_time()
        loss = program.step(spec.example_inputs, target)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = _synced_time() - t0
        losses.append(loss)
        times.append(dt)
        if dist.get_rank() == 0:
            log.info("step %d  loss %.5f  time %.4f s", step, loss, dt)
    stage_s = measure_stages(program, captured)
    gathered: list[dict[int, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stage_s)
    per_stage: dict[int, float] = {}
    for g in gathered:
        for k, v in (g or {}).items():
            per_stage[k] = max(per_stage.get(k, 0.0), v)
    timed = times[args.warmup:] or times
    report = {
        "plan": args.plan, "model": args.model, "mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp],
        "zero": plan.zero, "schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
        "losses": losses, "step_times": times, "measured_step_s": statistics.median(timed),
        "predicted_step_s": plan.time.total,
        "stages": [{"index": i, "predicted_s": (s.fwd_s + s.bwd_s) * plan.num_microbatches,
                    "measured_s": per_stage.get(i, float("nan")) * plan.num_microbatches}
                   for i, s in enumerate(plan.stages)],
    }
    return report


def format_report(r: dict[str, Any]) -> str:
    """Measured vs predicted step time, overall and per stage, as a text table."""
    def ratio(m: float, p: float) -> str:
        return f"{m / p:8.2f}" if p > 0 else "       -"

    lines = [f"{'':14}{'predicted s':>14}{'measured s':>14}{'ratio':>8}",
             f"{'step':14}{r['predicted_step_s']:14.5f}{r['measured_step_s']:14.5f}"
             f"{ratio(r['measured_step_s'], r['predicted_step_s'])}"]
    for s in r["stages"]:
        lines.append(f"{'stage ' + str(s['index']):14}{s['predicted_s']:14.5f}{s['measured_s']:14.5f}"
                     f"{ratio(s['measured_s'], s['predicted_s'])}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        report = run_worker(args)
        if dist.get_rank() == 0:
            log.info("measured vs predicted (per stage: one step's micro-batches, stage in isolation)\n%s",
                     format_report(report))
            if args.report:
                with open(args.report, "w") as f:
                    json.dump(report, f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
