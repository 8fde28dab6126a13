"""The ``autopar`` command-line tool: trace, profile, plan, show, explain, diff, run, calibrate, replan, schedule."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]

log = logging.getLogger(__name__)


def _spec(name: str, batch: int = 1, seq: int | None = None) -> Any:
    from autopar.ir.limits import MAX_SEQ, check_bound
    from autopar.zoo import build

    if seq is not None:
        check_bound("--seq", seq, MAX_SEQ)
    return build(name, batch=batch, device="meta", seq=seq)


def _trace(name: str, seq: int | None = None, frontend: str = "auto", cache: bool = True) -> Any:
    """Build ``name`` on the meta device and trace it; a built-in model's graph comes from the graph cache
    (:mod:`autopar.ir.trace_cache`, keyed by the zoo's source) unless ``cache`` is False."""
    from autopar.ir.limits import MAX_SEQ, check_bound
    from autopar.planner.graphs import traced_graph

    if seq is not None:
        check_bound("--seq", seq, MAX_SEQ)
    return traced_graph(name, seq=seq, frontend=frontend, cache=cache)


def _plan_graph(plan: Any, args: argparse.Namespace) -> Any:
    """The graph of the model a plan command works on, with the plan's fingerprint checked against it.

    Plans are data: the model comes from ``--model``; the plan's own ``model:`` is used only when it names a built-in
    model, or with ``--trust-plan-model`` (a ``package.module:factory`` would be imported and called)."""
    from autopar.ir.errors import SchemaError
    from autopar.zoo import list_models

    name = getattr(args, "model", None)
    if not name:
        if plan.model not in list_models() and not getattr(args, "trust_plan_model", False):
            raise SchemaError("model", f"the plan names model {_clip(plan.model)!r}, which is not a built-in model; "
                              "a plan is data and autopar does not import code it names: pass --model "
                              "package.module:factory (or --trust-plan-model to import the plan's)", doc="plan")
        name = plan.model
    graph = _trace(name)
    plan.check_compatible(fingerprint=graph.fingerprint)
    return graph


def _clip(value: Any, n: int = 200) -> str:
    """``str(value)`` cut to ``n`` characters (error messages never embed an unbounded value)."""
    s = str(value)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} characters)"


def _cmd_trace(args: argparse.Namespace) -> int:
    from autopar.planner.tables import render, table

    graph = _trace(args.model, args.seq, args.frontend, cache=not args.no_cache)
    s = graph.summary()
    rows = [("nodes", str(s["nodes"])),
            ("parameters", f"{s['params']:,} ({s['param_bytes'] / 2**30:.2f} GiB fp32)"),
            ("training FLOPs / sample", f"{s['train_flops']:.4g} (matmul {s['matmul_train_flops']:.4g})"),
            ("layer groups", f"{s['layer_groups']} ({s['repeated_blocks']} blocks, {s['distinct_blocks']} distinct)"),
            ("op kinds", ", ".join(f"{k}={v}" for k, v in s["op_kinds"].items())),
            ("unknown ops", ", ".join(s["unknown_ops"]) or "none"),
            ("opaque regions", "; ".join(s["opaque_regions"]) + " (not captured: run replicated, cost estimated)"
             if s["opaque_regions"] else "none"),
            ("fingerprint", s["fingerprint"])]
    print(render(table(f"{args.model}: traced with {s['frontend']} (batch 1)", ["", ""], rows, header=False)), end="")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from autopar.zoo import list_models

    print("\n".join(list_models()))
    return 0


def _progress_printer() -> Any:
    from rich.console import Console
    from rich.progress import Progress

    prog = Progress(transient=True, console=Console(stderr=True))
    task = prog.add_task("planning", total=1.0)
    prog.start()

    def update(msg: str, frac: float) -> None:
        prog.update(task, completed=frac, description=msg)
        if frac >= 1.0:
            prog.stop()

    return update


def _cmd_plan(args: argparse.Namespace) -> int:
    from autopar.ir.plan import dump_plan
    from autopar.planner.api import resolve_cluster
    from autopar.planner.hetero import search_hetero
    from autopar.planner.options import PlanOptions, parse_pins
    from autopar.planner.profile_ref import with_source
    from autopar.planner.report import alternatives_table, render_plan
    from autopar.planner.search import search
    from autopar.profiles.hetero import HeteroProfile, load_cluster

    # a heterogeneous profile (node groups of several device types) plans pipelines across them, or one group alone
    profile = load_cluster(args.cluster, args.nodes) if args.cluster else resolve_cluster(args.cluster, args.nodes)
    workers = {} if args.workers is None else {"workers": args.workers}
    load = tuple(map(float, filter(None, args.expert_load.split(","))))  # MoE routing histogram
    opts = PlanOptions(global_batch=args.global_batch, pins=parse_pins(args.pin), dtype=args.dtype,
                       top_k=args.top_k, intra_op_time_limit_s=args.time_limit, seed=args.seed,
                       fused_kernels=not args.no_fused_kernels, expert_load=load, **workers)
    graph = _trace(args.model, args.seq, cache=not args.no_cache)  # after every argument is checked
    run = search_hetero if isinstance(profile, HeteroProfile) else search
    result = run(graph, profile, opts, progress=None if args.quiet else _progress_printer())
    best = with_source(result.best, args.cluster)
    print(render_plan(best, graph=graph), end="")
    alternatives = alternatives_table(best, result.alternatives)
    print("\n" + alternatives if alternatives else "", end="")
    if args.output:
        dump_plan(best, args.output)
        _search_report(args.output, result)
        print(f"wrote {args.output}")
    if args.html:
        from autopar.planner.html_report import plan_html, write_html

        print(f"wrote {write_html(args.html, plan_html(best, result.alternatives))}")
    return 0


def _search_report(plan_path: str, result: Any) -> Path:
    """``PLAN.search.json`` beside the plan: how the search went, with its wall time (which the plan's YAML leaves
    out, so that planning the same model twice writes the same bytes)."""
    import json

    from autopar.ir.safe_yaml import write_atomic

    s = result.best.solver
    side = Path(plan_path).with_suffix(".search.json")
    write_atomic(side, json.dumps({"plan": str(plan_path), "wall_s": result.wall_s, "candidates": s.candidates,
                                   "screened": result.screened, "status": s.status, "gap": s.gap, "seed": s.seed,
                                   "workers": s.workers, "alternatives": len(result.alternatives)}, indent=1))
    return side


def _cmd_show(args: argparse.Namespace) -> int:
    from autopar.ir.plan import load_plan
    from autopar.planner.report import render_plan, schedule_trace

    plan = load_plan(args.plan)
    print(render_plan(plan), end="")
    if args.trace:
        n = schedule_trace(plan, args.trace)
        print(f"wrote {n} trace events to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.html:
        from autopar.planner.html_report import plan_html, write_html

        print(f"wrote {write_html(args.html, plan_html(plan))} (one self-contained page: open it in a browser)")
    if args.kernels:
        from autopar.codegen.triton_gen import render_kernels

        print(render_kernels(_plan_graph(plan, args)))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from autopar.ir.plan import load_plan
    from autopar.planner.report import explain_node

    plan = load_plan(args.plan)
    text = explain_node(plan, args.node)  # an unknown node fails here, before the model is traced
    if not args.no_alternatives and plan.mesh.tp > 1:
        text = explain_node(plan, args.node, graph=_plan_graph(plan, args))
    print(text)
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from autopar.ir.plan import load_plan
    from autopar.planner.report import diff_plans

    a, b = load_plan(args.a), load_plan(args.b)
    text = diff_plans(a, b)
    print(text, end="")
    if args.html:
        from autopar.planner.html_report import diff_html, write_html

        print(f"wrote {write_html(args.html, diff_html(a, b, text))} (both plans side by side)")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from autopar.profiles.profiler import run_profile_command

    prof = run_profile_command(args.output, args.ranks, args.quick, backend=args.backend, name=args.name,
                               progress=not args.no_progress)
    print(f"wrote {args.output}: {prof.name}, {prof.nodes} x {prof.devices_per_node} {prof.device.name}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from autopar.ir.limits import MAX_SEQ, check_bound
    from autopar.planner.run.torchrun import check_checkpoint_dir, checkpoint_lock, run_plan

    if args.seq is not None:
        check_bound("--seq", args.seq, MAX_SEQ)
    worker: list[str] = ["--data", args.data]
    if args.init:
        if args.init not in ("seed", "copy", "model") and not Path(args.init).exists():
            raise ValueError(f"--init {args.init!r} is not seed, copy, model or an existing checkpoint path")
        worker += ["--init", str(Path(args.init).resolve()) if Path(args.init).exists() else args.init]
    if args.step_hook:
        worker += ["--step-hook", args.step_hook]
    if args.report:
        worker += ["--report", str(Path(args.report).resolve())]
    if args.checkpoint_dir:
        from autopar.codegen.checkpoint_dir import CheckpointOptions

        ckpt = str(Path(args.checkpoint_dir).resolve())
        CheckpointOptions(root=ckpt, every=args.save_every, keep=args.keep)  # validates before launching
        worker += ["--checkpoint-dir", ckpt, "--save-every", str(args.save_every), "--keep", str(args.keep)]
        worker += ["--resume"] if args.resume else []
    elif args.resume or args.save_every:
        raise ValueError("--resume and --save-every need --checkpoint-dir")
    elif args.max_restarts:
        log.warning("--max-restarts without --checkpoint-dir: a restarted group trains again from step 0")
    with checkpoint_lock(ckpt if args.checkpoint_dir else None, args.torchrun_args or ()):  # a second run on the directory fails here, at once
        if args.checkpoint_dir:
            start = check_checkpoint_dir(ckpt, args.resume)
            if start is not None and start > args.steps:
                raise ValueError(f"the checkpoint in {ckpt} is at step {start}, beyond --steps {args.steps}")
        # `kill` (SIGTERM) stops the run as Ctrl-C does: run_plan then stops torchrun and every worker with it
        signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            return int(run_plan(args.plan, args.model, steps=args.steps, nproc=args.nproc,
                                extra_torchrun_args=args.torchrun_args or [], worker_args=worker,
                                max_restarts=args.max_restarts, timeout_s=args.timeout, summarize=True,
                                seq=args.seq))
        except TimeoutError as e:
            print(f"autopar: error: {e}", file=sys.stderr)
            return 124


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _cmd_replan(args: argparse.Namespace) -> int:
    from autopar.ir.plan import dump_plan, load_plan
    from autopar.planner.hetero import search_hetero
    from autopar.planner.options import PlanOptions, parse_pins
    from autopar.planner.profile_ref import plan_profile, with_source
    from autopar.planner.report import diff_plans
    from autopar.planner.search import search
    from autopar.profiles.hetero import HeteroProfile

    old = load_plan(args.plan)
    # every argument is checked before the model is traced (seconds to minutes for a large model); a plan on a
    # heterogeneous cluster re-plans on the whole cluster (its groups fix their nodes)
    profile = plan_profile(old, plan_path=args.plan, override=args.cluster,
                           nodes=args.nodes or (None if old.device_groups else old.nodes))
    pins = parse_pins(args.pin) if args.pin else {}
    opts = PlanOptions(global_batch=args.global_batch or old.global_batch, pins=pins, dtype=old.dtype,  # type: ignore
                       fused_kernels=old.fused_kernels)
    graph = _plan_graph(old, args)
    new = (search_hetero if isinstance(profile, HeteroProfile) else search)(graph, profile, opts).best
    source = args.cluster if args.cluster else old.cluster_source.path if old.cluster_source else None
    new = with_source(new, source)
    print(diff_plans(old, new), end="")
    out = args.output or str(Path(args.plan).with_suffix("")) + (f".{args.nodes}n.yaml" if args.nodes else
                                                                  ".replanned.yaml")
    dump_plan(new, out)
    print(f"wrote {out}; checkpoints saved under the old plan load into it, resharded "
          f"(autopar run {out} --model {new.model} --resume --checkpoint-dir DIR --steps N)")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model the plan is for (default: the plan's model: field when "
                   "it names a built-in model); the plan's fingerprint is checked against it")
    p.add_argument("--trust-plan-model", action="store_true",
                   help="import the package.module:factory the plan's model: field names (plans are data otherwise)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autopar", description="Automatic parallelization planner for PyTorch training")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress and details")
    p.add_argument("--debug", action="store_true", help="show the traceback of any error")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("trace", help="trace a model into the graph IR and summarize it")
    t.add_argument("model", help="built-in model name (see `autopar models`) or 'package.module:factory'")
    t.add_argument("--seq", type=int, default=None)
    t.add_argument("--frontend", choices=["auto", "fx", "export"], default="auto")
    t.add_argument("--no-cache", action="store_true", help="trace afresh instead of reading the graph cache")
    t.set_defaults(func=_cmd_trace)

    m = sub.add_parser("models", help="list the built-in models")
    m.set_defaults(func=_cmd_models)

    pl = sub.add_parser("plan", help="search the best hybrid-parallel plan")
    pl.add_argument("model", help="built-in model name or 'package.module:factory'")
    pl.add_argument("--cluster", required=True,
                    help="built-in profile (dgx-a100-80gb, dgx-h100, h200; heterogeneous: a100-h100) or a YAML")
    pl.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the profile's)")
    pl.add_argument("--global-batch", type=int, required=True)
    pl.add_argument("--seq", type=int, default=None, help="sequence length (language models)")
    pl.add_argument("--pin", action="append", default=[], help="fix a choice, e.g. --pin tp=8 --pin schedule=1f1b")
    pl.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    pl.add_argument("--expert-load", default="", help="MoE: routed-token share per expert, e.g. 0.2,0.1,... (uniform)")
    pl.add_argument("--top-k", type=int, default=3)
    pl.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds per distinct layer solve")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pl.add_argument("--workers", type=int, default=None,
                    help="processes for the search (default: the available cores; 1: in-process); same plan for any")
    pl.add_argument("--no-cache", action="store_true",
                    help="trace afresh instead of reading the traced-graph cache ($AUTOPAR_CACHE, ~/.cache/autopar)")
    pl.add_argument("--no-fused-kernels", action="store_true",
                    help="run eagerly: no generated Triton kernels, fused groups costed unfused")
    pl.add_argument("-o", "--output", help="write the plan YAML here")
    pl.add_argument("--html", help="also write the plan and its alternatives as one self-contained HTML page")
    pl.set_defaults(func=_cmd_plan)

    sh = sub.add_parser("show", help="print a plan as tables")
    sh.add_argument("plan")
    sh.add_argument("--trace", help="also write the simulated schedule as Chrome-trace/Perfetto JSON")
    sh.add_argument("--kernels", action="store_true", help="also print the generated Triton kernels")
    sh.add_argument("--html", help="also write the plan as one self-contained HTML page (timeline, memory, sharding)")
    _model_args(sh)
    sh.set_defaults(func=_cmd_show)

    ex = sub.add_parser("explain", help="why a node got its sharding, and what the alternatives cost")
    ex.add_argument("plan")
    ex.add_argument("node")
    ex.add_argument("--no-alternatives", action="store_true", help="skip re-tracing the model")
    _model_args(ex)
    ex.set_defaults(func=_cmd_explain)

    df = sub.add_parser("diff", help="compare two plans")
    df.add_argument("a")
    df.add_argument("b")
    df.add_argument("--html", help="also write both plans side by side as one self-contained HTML page")
    df.set_defaults(func=_cmd_diff)

    pr = sub.add_parser("profile", help="measure this machine into a cluster profile")
    from autopar.profiles.profiler_args import build_parser as profile_args

    profile_args(pr)
    pr.set_defaults(func=_cmd_profile)

    rn = sub.add_parser("run", help="run a plan with torchrun on this machine")
    rn.add_argument("plan")
    rn.add_argument("--model", required=True)
    rn.add_argument("--steps", type=int, default=10)
    rn.add_argument("--seq", type=int, default=None, help="sequence length the plan was made for (autopar plan --seq)")
    rn.add_argument("--nproc", type=int, default=None, help="processes (default: the plan's world size)")
    rn.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from them after a restart")
    rn.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (0: after the last step only)")
    rn.add_argument("--keep", type=int, default=2, help="checkpoints to keep (0: all)")
    rn.add_argument("--resume", action="store_true",
                    help="continue from the latest checkpoint in --checkpoint-dir (e.g. under a re-planned mesh)")
    rn.add_argument("--max-restarts", type=int, default=0,
                    help="torchrun restarts of the group after a rank fails (each resumes from the last checkpoint)")
    rn.add_argument("--data", choices=["example", "step"], default="example",
                    help="example: the model's example batch every step; step: a fresh batch seeded by the step")
    rn.add_argument("--report", default=None, help="write a JSON report (losses, times, parameter SHA-256) here")
    rn.add_argument("--init", default=None, metavar="SOURCE",
                    help="where the weights come from: seed (zoo models' default: the zoo's initializer), copy (the "
                         "factory's own weights; default for package.module:factory models), model (the model's own "
                         "initialization, run shard by shard on a meta model), or a checkpoint path (.safetensors, a "
                         "Hugging Face model directory, a torch.save file)")
    rn.add_argument("--timeout", type=float, default=None, help="stop torchrun and its workers after this many s")
    rn.add_argument("--step-hook", default=None,
                    help="package.module:function the workers call as function(step) after every step")
    rn.add_argument("--torchrun-args", nargs=argparse.REMAINDER, help="passed to torchrun (e.g. --nnodes 2 ...)")
    rn.set_defaults(func=_cmd_run)

    from autopar.planner.calibrate import add_parser as calibrate_args

    calibrate_args(sub)

    from autopar.planner.cluster.cli import add_parser as schedule_args

    schedule_args(sub)

    rp = sub.add_parser("replan", help="re-plan for another cluster size or other pins (same model)")
    rp.add_argument("plan")
    rp.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the plan's)")
    rp.add_argument("--cluster", default=None,
                    help="profile to re-plan on (default: the plan's own, found by its recorded path and hash)")
    _model_args(rp)
    rp.add_argument("--global-batch", type=int, default=None)
    rp.add_argument("--pin", action="append", default=[])
    rp.add_argument("-o", "--output")
    rp.set_defaults(func=_cmd_replan)
    return p


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``autopar: error: ...``, exit 2), like every other expected failure."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"autopar: error: {_one_line(message)} (see `{self.prog} --help`)\n")


def _one_line(text: object, limit: int = 2000) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit] + "..."


def _os_error(e: OSError) -> str:
    """An OSError as what failed on which file, and what to do."""
    import errno

    where = f" {e.filename!s}" if e.filename is not None else ""
    fix = {errno.ENOSPC: "free space or choose another directory",
           errno.EACCES: "check the permissions or choose another path",
           errno.EPERM: "check the permissions or choose another path",
           errno.EROFS: "the file system is read-only: choose another path",
           errno.EISDIR: "that is a directory: give a file path",
           errno.ENOENT: "check the path (does its directory exist?)",
           errno.ENOTDIR: "a part of the path is not a directory"}.get(e.errno or 0, "check the path")
    return f"{e.strerror or type(e).__name__}:{where}; {fix}"


def _check_output(path: str, flag: str, *, makes_dirs: bool = False) -> None:
    """Refuse an output path that cannot be written, before the work that would fill it (a run's report is
    written after the last training step).  ``makes_dirs``: the command creates missing directories itself."""
    import os

    p = Path(path)
    parent = p.resolve().parent
    if p.is_dir():
        raise ValueError(f"{flag} {_clip(path)} is a directory; give a file path (e.g. {_clip(path)}/out)")
    while makes_dirs and not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the nearest existing folder is where the directories get created
    if not parent.is_dir():
        raise ValueError(f"{flag} {_clip(path)}: directory {_clip(parent)} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {_clip(path)} is not writable (permissions or a read-only file system); choose "
                         "another path")


def main(argv: Sequence[str] | None = None) -> int:
    """The error boundary: expected failures (bad input, an OSError on a named file, a worker's failure) print one
    line and exit 2; anything else is an internal error (exit 1) whose traceback ``--debug`` shows."""
    from autopar.ir.errors import AutoparError

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv[:argv.index("--torchrun-args")] if "--torchrun-args" in argv else "--debug" in argv
    if debug:  # accepted anywhere on the line (before a run's --torchrun-args)
        argv.remove("--debug")
    args = build_parser().parse_args(argv)
    args.debug = debug
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        for flag in ("output", "report", "trace", "html"):  # before the work whose result they would hold
            if isinstance(getattr(args, flag, None), str):
                _check_output(getattr(args, flag), f"--{flag}", makes_dirs=args.command in ("profile", "calibrate"))
        return int(args.func(args))
    except (AutoparError, ValueError, FileNotFoundError) as e:
        if args.debug:
            raise
        print(f"autopar: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        if args.debug:
            raise
        print(f"autopar: error: {_one_line(_os_error(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"autopar: internal error: {_one_line(f'{type(e).__name__}: {e}', 300)} (an autopar bug: run again "
              "with --debug for the traceback and report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
