"""The per-rank training program launched by torchrun: ``python -m autopar.planner.run.worker plan.yaml --model M``.

Each step feeds the plan's global batch of a zoo model (or ``package.module:factory``) through the program built
from the plan, runs AdamW, and logs loss and step time.  At the end it measures every pipeline stage in isolation
(forward + backward of one micro-batch, replayed on inputs captured during training, all tp/dp peers of the stage
together) and logs measured vs predicted step time: the plan's ``time.total`` against the median step, and per
stage ``(fwd_s + bwd_s) x num_microbatches`` against the measurement.  ``--report`` writes the numbers as JSON.

Checkpoints (``--checkpoint-dir D``): the program and optimizer are saved every ``--save-every`` steps and after
the last step (:class:`autopar.codegen.checkpoint.Checkpointer`, resharding on load, so a checkpoint loads under another
plan).  When torchrun restarts the group after a rank died (``TORCHELASTIC_RESTART_COUNT > 0``) the workers resume
from the latest checkpoint, losing only the steps since it; ``--resume`` resumes at the first start too (e.g. under
a re-planned mesh).  ``--data step`` draws every step's batch from a generator seeded by the step number, so a
resumed run sees the same batches as an uninterrupted one; ``--data example`` (default) trains on the model's
example batch every step.

``--step-hook package.module:function`` calls ``function(step)`` on every rank after each optimizer step (``step``
counts the steps done), before that step's checkpoint: for monitoring, early stopping or fault injection (the
tests kill a rank from one).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopar.planner.run import FAILURE_DIR_ENV

__all__ = ["entry", "main", "run_worker", "measure_stages", "step_batch", "state_digest"]

log = logging.getLogger("autopar.planner.run.worker")  # run as __main__ under torchrun


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autopar.planner.run.worker", description=__doc__.splitlines()[0])
    p.add_argument("plan", help="plan YAML (from `autopar plan`)")
    p.add_argument("--model", required=True, help="zoo model name or package.module:factory")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from the timing statistics")
    p.add_argument("--seq", type=int, default=None, help="sequence length override for language models")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init", default=None,
                   help="seed (zoo models only; their default): meta model initialized shard by shard with the zoo's "
                        "rules; copy (the default for package.module:factory models): the factory's own weights, "
                        "copied shard by shard; model: the model's own initialization, shard by shard; or a "
                        "checkpoint path (read shard by shard)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None,
                   help="write a JSON report here (rank 0), with a SHA-256 of every final parameter (model layout)")
    p.add_argument("--data", choices=["example", "step"], default="example",
                   help="example: the model's example batch every step; step: a batch seeded by the step number")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (shared by all ranks)")
    p.add_argument("--save-every", type=int, default=0, help="save every K steps (0: only after the last step)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep (0: all)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the latest checkpoint in --checkpoint-dir (automatic after a torchrun restart)")
    p.add_argument("--step-hook", default=None,
                   help="package.module:function called as function(step) on every rank after each step")
    return p


def _synced_time() -> float:
    dist.barrier()
    return time.perf_counter()


def measure_stages(program: Any, captured: dict[int, tuple[torch.Tensor, ...]], repeats: int = 3) -> dict[int, float]:
    """Median seconds of forward + backward of one micro-batch for each local stage (collective per stage group)."""
    from autopar.codegen.runtime.tensor_parallel import implicit_replication

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
    """The model's graph at the batch the plan was made for, checked against the plan (as the launcher does)."""
    from autopar.planner.run.preflight import plan_graph

    return plan_graph(plan, model, seq)


def step_batch(spec: Any, step: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The synthetic batch of ``step``: tensors shaped like the spec's example inputs and target, drawn from a
    generator seeded by ``(seed, step)``.  Floating tensors are standard normal; integer tensors (token ids, class
    labels) uniform over the range the example tensor spans, so ids stay valid for the model."""
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)

    def like(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen).to(t.dtype)
        if t.dtype == torch.bool:
            return torch.randint(0, 2, t.shape, generator=gen).bool()
        lo, hi = (int(t.min()), int(t.max()) + 1) if t.numel() else (0, 1)
        return torch.randint(lo, hi, t.shape, generator=gen, dtype=t.dtype)

    target = spec.make_target(spec.batch, "cpu")
    return tuple(like(x.cpu()) for x in spec.example_inputs), like(target)


def state_digest(program: Any) -> dict[str, str]:
    """SHA-256 of every parameter's full tensor in model layout, by model FQN (collective over the world)."""
    out = {}
    for fqn, t in sorted(program.gathered_state_dict().items()):
        out[fqn] = hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(plan, spec, program) for this rank."""
    from autopar import ir
    from autopar.codegen.runtime.mesh import default_device
    from autopar.codegen.runtime.program import build_program
    from autopar.zoo import build, init_weights

    plan = ir.load_plan(args.plan)
    custom = ":" in args.model
    if args.init is None:
        args.init = "copy" if custom else "seed"
    if args.init == "seed" and custom:
        raise ValueError(f"--init seed applies the zoo's initializer, which would overwrite {args.model}'s own "
                         "weights (and leave derived buffers unset); use --init copy")
    spec = build(args.model, batch=plan.global_batch, device="cpu", seq=args.seq, seed=args.seed)
    if spec.make_target is None:
        raise ValueError(f"model {args.model} has no target maker; the worker needs a zoo-style ModelSpec")
    graph = _plan_graph(plan, args.model, args.seq)
    param_dtype = str(next(iter(spec.model.parameters())).dtype).removeprefix("torch.")
    mixed = plan.dtype == "bfloat16" and param_dtype == "float32"  # autocast, fp32 master state (ParallelProgram)
    if plan.dtype != param_dtype and not mixed and dist.get_rank() == 0:
        log.warning("the plan was made for %s but the program trains in the model's %s: predicted times assume "
                    "%s (plan with --dtype %s to compare like with like)", plan.dtype, param_dtype, plan.dtype,
                    param_dtype)
    src = spec if args.init == "copy" else build(args.model, batch=plan.global_batch, device="meta", seq=args.seq)
    init = init_weights if args.init == "seed" else args.init  # "copy", "model" or a checkpoint path
    program = build_program(plan, src, loss_fn=spec.loss_fn, example_inputs=spec.example_inputs, graph=graph,
                            device=default_device(), init=init, seed=args.seed)
    return plan, spec, program


def _resume(args: argparse.Namespace, plan: Any, program: Any, opt: torch.optim.Optimizer) -> tuple[Any, int]:
    """(Checkpointer or None, the step to start from)."""
    from autopar.codegen.checkpoint import Checkpointer, CheckpointOptions, latest_checkpoint

    if not args.checkpoint_dir:
        if args.resume or args.save_every:
            raise ValueError("--resume and --save-every need --checkpoint-dir")
        return None, 0
    ck = Checkpointer(CheckpointOptions(root=args.checkpoint_dir, every=args.save_every, keep=args.keep))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    found = latest_checkpoint(args.checkpoint_dir)
    if not (args.resume or restart):
        if found is not None:
            raise ValueError(f"{args.checkpoint_dir} already holds a checkpoint (step {found[1]}); pass --resume "
                             "to continue from it, or choose an empty --checkpoint-dir")
        return ck, 0
    if found is None:
        if args.resume and not restart:
            raise FileNotFoundError(f"--resume: no checkpoint in {args.checkpoint_dir}")
        log.info("restart %d: no checkpoint saved yet, starting from step 0", restart)
        return ck, 0
    start = ck.resume(program, opt)
    if start > args.steps:
        raise ValueError(f"the checkpoint is at step {start}, beyond --steps {args.steps}; ask for more steps")
    if dist.get_rank() == 0:
        meta_file = found[0] / "autopar.json"
        saved = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        log.info("resumed from step %d (%s; saved under mesh pp,dp,tp=%s, now %s)%s", start, found[0],
                 saved.get("mesh", "?"), [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp],
                 f" after torchrun restart {restart}" if restart else "")
    return ck, start


def load_step_hook(ref: str | None) -> Callable[[int], None] | None:
    """``package.module:function`` -> the function (``--step-hook``); None for None."""
    if not ref:
        return None
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--step-hook must look like package.module:function, got {ref!r}")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"--step-hook {ref}: {module} has no function {attr!r}")
    return fn


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    plan, spec, program = _build(args)
    captured: dict[int, tuple[torch.Tensor, ...]] = {}

    def capture(idx: int, inputs: tuple[Any, ...]) -> None:  # returns None: a pre-hook's result replaces the inputs
        if idx not in captured:
            captured[idx] = tuple(t.detach().clone() for t in inputs)

    for idx, stage in zip(program.stage_indices, program.stages):
        stage.register_forward_pre_hook(lambda m, a, idx=idx: capture(idx, a))
    opt = torch.optim.AdamW(program.parameters(), lr=args.lr)
    on_step = load_step_hook(args.step_hook)
    ck, start = _resume(args, plan, program, opt)
    extra = {"plan": str(args.plan), "model": args.model, "mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp]}
    target = spec.make_target(plan.global_batch, "cpu")
    losses, times = [], []
    # A step's time is the interval between the ends of consecutive steps, as a training loop logs it: the ranks
    # meet once here and then at every step's loss all-reduce, with no barrier of the measurement's own in between
    # (on 4 CPU ranks sharing 2 cores a barrier costs 1-2 ms, a tenth of a tiny model's step).  What runs between
    # steps (the step hook, a checkpoint) counts in the next step's time.
    t0 = _synced_time()
    for step in range(start, args.steps):
        inputs, tgt = step_batch(spec, step, args.seed) if args.data == "step" else (spec.example_inputs, target)
        loss = program.step(inputs, tgt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        dt, t0 = t1 - t0, t1
        losses.append(loss)
        times.append(dt)
        if dist.get_rank() == 0:
            log.info("step %d  loss %.5f  time %.4f s", step, loss, dt)
        if on_step is not None:
            on_step(step + 1)
        if ck is not None:
            ck.maybe_save(program, opt, step + 1, force=step + 1 == args.steps, extra=extra)
    digest = state_digest(program) if args.report else {}
    report = _report(args, plan, program, captured, losses, times)
    report.update(start_step=start, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                  param_sha256=digest)
    return report


def _report(args: argparse.Namespace, plan: Any, program: Any, captured: dict[int, tuple[torch.Tensor, ...]],
            losses: list[float], times: list[float]) -> dict[str, Any]:
    stage_s = measure_stages(program, captured)
    gathered: list[dict[int, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stage_s)
    per_stage: dict[int, float] = {}
    for g in gathered:
        for k, v in (g or {}).items():
            per_stage[k] = max(per_stage.get(k, 0.0), v)
    timed = times[args.warmup:] or times
    return {
        "plan": args.plan, "model": args.model, "mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp],
        "zero": plan.zero, "schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
        "losses": losses, "step_times": times, "measured_step_s": statistics.median(timed) if timed else math.nan,
        "predicted_step_s": plan.time.total,
        "stages": [{"index": i, "predicted_s": (s.fwd_s + s.bwd_s) * plan.num_microbatches,
                    "measured_s": per_stage.get(i, float("nan")) * plan.num_microbatches}
                   for i, s in enumerate(plan.stages)],
    }


def format_report(r: dict[str, Any]) -> str:
    """Measured vs predicted step time, overall and per stage, as a text table."""
    def ratio(m: float, p: float) -> str:
        return f"{m / p:8.2f}" if p > 0 else "       -"

    lines = [f"{'':14}{'predicted s':>14}{'measured s':>14}{'ratio':>8}",
             f"{'step':14}{r['predicted_step_s']:14.6g}{r['measured_step_s']:14.6g}"
             f"{ratio(r['measured_step_s'], r['predicted_step_s'])}"]
    for s in r["stages"]:
        lines.append(f"{'stage ' + str(s['index']):14}{s['predicted_s']:14.6g}{s['measured_s']:14.6g}"
                     f"{ratio(s['measured_s'], s['predicted_s'])}")
    return "\n".join(lines)


def _record_failure(e: BaseException) -> None:
    where = os.environ.get(FAILURE_DIR_ENV)
    if not where:
        return
    text = str(e).strip().splitlines()[0][:500] if str(e).strip() else ""
    line = f"{type(e).__name__}: {text}" if text else type(e).__name__
    rank = os.environ.get("RANK", "?")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:  # one file per rank and torchrun attempt: a restarted group's causes do not overwrite the first's
        with open(os.path.join(where, f"rank{rank}.attempt{attempt}.txt"), "w") as f:
            f.write(json.dumps({"rank": rank, "cause": line, "errno": getattr(e, "errno", None),
                                "attempt": int(attempt) if attempt.isdigit() else 0, "time": time.time()}))
    except OSError:  # the summary is best effort (a full disk may refuse it too)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":  # connect process pairs on first use (what a collective needs, not the full mesh at init)
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    try:
        dist.init_process_group(backend)
    except BaseException as e:  # a rendezvous that fails is a rank's cause too
        _record_failure(e)
        raise
    if dist.get_rank() != 0:  # informational messages (checkpoint saved, resumed...) once, from rank 0
        logging.getLogger().setLevel(logging.WARNING)
    done = False
    try:
        report = run_worker(args)
        if dist.get_rank() == 0:
            log.info("measured vs predicted (per stage: one step's micro-batches, stage in isolation)\n%s",
                     format_report(report))
            if args.report:
                from autopar.ir.safe_yaml import write_atomic

                write_atomic(args.report, json.dumps(report, indent=1))
        done = True
    except BaseException as e:
        _record_failure(e)
        raise
    finally:
        try:  # every rank finishes before any tears down (gloo aborts a peer whose connections close early); a
            # failed rank does not wait: its peers may be in a step's collective, which a barrier would never match
            if done:
                dist.barrier()
        finally:
            dist.destroy_process_group()
    return 0


def entry(*argv: str) -> int:
    """:func:`main` as the function torchrun's agent forks (:mod:`autopar.planner.run.agent`): the process ends
    in multiprocessing's ``os._exit`` after it returns, never in the interpreter's teardown (see below).  An error
    is printed here, as a fresh interpreter's rank prints it (``[rankN]:`` before each line), and ends the process
    with exit status 1, which torchrun reports (and restarts the group on) as it does a fresh worker's."""
    try:
        return main(argv)
    except Exception:  # noqa: BLE001 - every error is the rank's failure, reported by its exit status
        import traceback

        rank = os.environ.get("RANK", "?")
        sys.stderr.write("".join(f"[rank{rank}]: {line}\n" for line in traceback.format_exc().splitlines()))
        sys.stderr.flush()
        raise SystemExit(1) from None


if __name__ == "__main__":
    from autopar.profiles.profiler import exit_without_finalization

    exit_without_finalization(main())  # an error raised by main() still exits through Python, with its traceback
