"""Test helpers: hand-made Megatron-style plans and a multi-process CPU harness (gloo ranks, parity with one process).

:func:`make_plan` writes the same fields the planner emits (mesh, stages, tp param/op shardings with their ``comm``
fields), so the runtime can be exercised without the planner.  :func:`spawn` runs a function on N gloo ranks.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor.debug import CommDebugMode

from autopar import ir
from autopar.profiles.profiler import exit_without_finalization, free_port

__all__ = ["COLWISE", "ROWWISE", "JobFailed", "collective_counts", "comm_mode", "free_port", "make_plan",
           "megatron_shardings", "parity_worker", "reference_step", "spawn", "spawn_jobs"]

COLWISE = ("qkv", "fc1", "w_gate", "w_up", "wq", "wk", "wv")
"""Linear modules that Megatron-LM shards by output features (S(0) on the weight)."""
ROWWISE = ("proj", "fc2", "wo", "w_down")
"""Linear modules sharded by input features (S(1) on the weight; their output is a partial sum)."""


def _pattern(fqn: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", fqn, count=1)


def megatron_shardings(graph: ir.Graph) -> tuple[tuple[ir.ParamSharding, ...], tuple[ir.OpSharding, ...]]:
    """Column/row-parallel Megatron shardings (Shoeybi et al. 2019) for the blocks of ``graph``: two all-reduces per
    block forward (after attention and after the MLP), none elsewhere (embeddings and head replicated)."""
    params: dict[str, str] = {}
    ops: list[ir.OpSharding] = []
    blocks = graph.blocks()
    if not blocks:
        return (), ()
    first = blocks[0]
    rowwise_nodes: set[str] = set()
    for n in graph.group_nodes(first):
        if n.op != "linear":
            continue
        leaf = n.module_path.rsplit(".", 1)[-1]
        last = len(n.out.shape) - 1
        if leaf in COLWISE:
            for p in n.params:
                params[_pattern(p)] = "S(0)"
            ops.append(ir.OpSharding(node=n.name, op="linear", strategy="column", inputs=("R",),
                                     output=f"S({last})"))
        elif leaf in ROWWISE:
            for p in n.params:
                params[_pattern(p)] = "S(1)" if p.endswith("weight") else "R"
            ops.append(ir.OpSharding(node=n.name, op="linear", strategy="row", inputs=(f"S({last})",), output="P"))
            rowwise_nodes.add(n.name)
    for n in graph.group_nodes(first):
        reads = [i for i in n.activation_inputs if i in rowwise_nodes]
        if reads and n.op == "add":
            ops.append(ir.OpSharding(node=n.name, op="add", strategy="replicate",
                                     inputs=tuple("R" for _ in n.activation_inputs), output="R",
                                     comm="all_reduce"))
    return tuple(ir.ParamSharding(pattern=k, placement=v) for k, v in params.items()), tuple(ops)


def make_plan(graph: ir.Graph, *, pp: int = 1, dp: int = 1, tp: int = 1, zero: int = 0, schedule: str = "1f1b",
              micro_batch: int = 1, num_microbatches: int = 1, virtual_stages: int = 1, recompute: str = "none",
              model: str = "", cuts: tuple[int, ...] | None = None, overlap_grad_sync: bool = True) -> ir.Plan:
    """A plan with the given mesh and memory savers; stages split the layer groups evenly (or at ``cuts``);
    ``overlap_grad_sync``: ZeRO 0's gradient all-reduce in buckets during the backward, or one after it."""
    n_stages = pp * virtual_stages
    n = len(graph.layers)
    if cuts is None:
        cuts = tuple(round(n * k / n_stages) for k in range(1, n_stages))
    bounds = (0, *cuts, n)
    stages = tuple(ir.StagePlan(index=i, layer_start=bounds[i], layer_end=bounds[i + 1],
                                modules=tuple(g.module_path or f"<{g.role}>"
                                              for g in graph.layers[bounds[i]:bounds[i + 1]]),
                                recompute=recompute)  # type: ignore[arg-type]
                   for i in range(n_stages))
    pshard, oshard = megatron_shardings(graph) if tp > 1 else ((), ())
    world = pp * dp * tp
    return ir.Plan(model=model or graph.model_name, graph_fingerprint=graph.fingerprint, num_params=graph.num_params,
                   cluster="local-cpu", nodes=1, devices_per_node=world,
                   global_batch=micro_batch * num_microbatches * dp, micro_batch=micro_batch,
                   num_microbatches=num_microbatches, mesh=ir.MeshPlan(pp=pp, dp=dp, tp=tp),
                   schedule=schedule, virtual_stages=virtual_stages, zero=zero,  # type: ignore[arg-type]
                   stages=stages, param_shardings=pshard, op_shardings=oshard, overlap_grad_sync=overlap_grad_sync)


def planned(graph: ir.Graph, mesh: dict[str, int], global_batch: int) -> ir.Plan:
    """The planner's float32 plan for ``graph`` under ``mesh`` (pins dp/tp/pp, optionally cp, micro_batch) on as many
    A100-profile devices as the mesh has ranks."""
    import dataclasses

    from autopar.planner.options import PlanOptions
    from autopar.planner.search import search
    from autopar.profiles.builtin import load_builtin

    world = mesh["dp"] * mesh["tp"] * mesh["pp"] * mesh.get("cp", 1)
    prof = dataclasses.replace(load_builtin("dgx-a100-80gb", nodes=1), devices_per_node=world)
    opts = PlanOptions(global_batch=global_batch, pins=dict(mesh), dtype="float32", workers=1, top_k=0)
    return search(graph, prof, opts).best


def sgd_losses(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module, int], torch.Tensor], steps: int,
               lr: float) -> list[float]:
    """Single-process reference: ``steps`` SGD steps of ``loss_of(model, step)``; the loss of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def program_losses(program: Any, batch: Callable[[int], Any], steps: int, lr: float) -> list[float]:
    """``steps`` SGD steps of a parallel program on ``batch(step)`` (a keyword dict, or a tuple of step arguments);
    the loss of each step (the same float on every rank)."""
    opt = torch.optim.SGD(program.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        b = batch(step)
        losses.append(program.step(*b) if isinstance(b, tuple) else program.step(b))
        opt.step()
        opt.zero_grad()
    return losses


def _start_method() -> str:
    """Ranks start from a fork server that has imported torch, torch.distributed and autopar once (each rank
    importing them afresh costs ~5 CPU-s on these machines, and the suite starts well over a hundred ranks); where
    there is no fork server, a fresh interpreter per rank."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(list(_PRELOAD))
    # Triton fixes a function's mode (compiled or interpreted) when it decorates it, its own `tl.*` functions at
    # import, and the fork server imports triton (through autopar's kernels) for every later rank.  So it starts in
    # the interpreter mode that the kernel tests' ranks need, whatever the environment of the test that happens to
    # start it (tests/conftest.py removes TRITON_INTERPRET around the other multi-process modules).  Their ranks
    # still run eagerly: the runtime fuses only when the rank's own environment asks for the interpreter.
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return "forkserver"


_PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining",
            "torch.distributed.checkpoint", "autopar.codegen.runtime.program", "autopar.planner.search", "harness",
            "outside_models", *(f"transformers.models.{m}.modeling_{m}" for m in
                                ("gpt2", "llama", "t5", "qwen2", "bert", "vit", "resnet", "mixtral")))
"""What the fork server imports (a module that does not import is skipped): what the ranks of the multi-process
tests import; the Hugging Face model classes of tests/outside_models.py."""


def _fresh(rank: int, world: int, port: int, env: dict[str, str]) -> None:
    """A rank's process as a freshly spawned one would be: the parent's environment now (the fork server's is the
    one it started with), the rendezvous variables, one thread and torch's initial random state."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(torch.initial_seed())


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out_dir: str,
           env: dict[str, str]) -> None:
    _fresh(rank, world, port, env)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears its process group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # gloo's threads can abort an interpreter's teardown after the work is saved


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world`` gloo processes (1 thread each); returns every rank's return value."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, d, dict(os.environ)), nprocs=world,
                           join=True, start_method=_start_method())
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]


class JobFailed(AssertionError):
    """A job of :func:`spawn_jobs` that raised, or that did not run because an earlier job of its group raised."""


class JobResults(dict):
    """``{job name: [result of rank 0, rank 1, ...]}``; looking up a job that failed or did not run raises
    :class:`JobFailed` with the rank's traceback, so only the tests that read that job fail, each saying why."""

    def __init__(self, results: dict[str, list[Any]], failed: dict[str, JobFailed]) -> None:
        super().__init__(results)
        self.failed = failed

    def __missing__(self, name: str) -> list[Any]:
        if name in self.failed:
            raise self.failed[name]
        raise KeyError(name)


def _jobs_entry(rank: int, world: int, port: int, jobs: list[tuple[str, Callable[..., Any], tuple[Any, ...]]],
                out_dir: str, env: dict[str, str]) -> None:
    _fresh(rank, world, port, env)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seed = torch.initial_seed()
    try:
        for i, (_, fn, args) in enumerate(jobs):
            torch.manual_seed(seed)  # each job starts from the random state of a fresh process
            result = fn(rank, *args)
            dist.barrier()  # every rank finished the job before any result counts
            torch.save(result, os.path.join(out_dir, f"job{i}-rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # as in _entry


def spawn_jobs(world: int, jobs: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]) -> JobResults:
    """Run several jobs one after another in ONE group of ``world`` gloo processes (spawning and importing torch
    costs seconds per rank; a module's multi-process tests share one group this way). Job ``name: (fn, args)`` runs
    ``fn(rank, *args)`` on every rank, from the same random state as in a fresh process.

    Returns ``{name: [result of each rank]}``. A job that raises ends the group: reading its result, or that of a
    job after it, raises :class:`JobFailed` naming the job and carrying the rank's traceback; the jobs before it
    keep their results."""
    order = list(jobs)
    if not order:
        return JobResults({}, {})
    with tempfile.TemporaryDirectory() as d:
        error: BaseException | None = None
        try:
            mp.start_processes(_jobs_entry, args=(world, free_port(), [(n, *jobs[n]) for n in order], d,
                                                  dict(os.environ)), nprocs=world, join=True,
                               start_method=_start_method())
        except Exception as e:  # noqa: BLE001 - any rank failure, reported per job below
            error = e
        results: dict[str, list[Any]] = {}
        failed: dict[str, JobFailed] = {}
        for i, name in enumerate(order):
            paths = [os.path.join(d, f"job{i}-rank{r}.pt") for r in range(world)]
            if not failed and all(os.path.exists(p) for p in paths):
                results[name] = [torch.load(p, weights_only=False) for p in paths]
            elif not failed:
                failed[name] = JobFailed(f"job {name!r} on {world} ranks failed: {error}")
            else:
                first = next(iter(failed))
                failed[name] = JobFailed(f"job {name!r} on {world} ranks did not run: job {first!r} failed before "
                                         f"it: {error}")
        return JobResults(results, failed)


def comm_mode() -> CommDebugMode:
    """A ``CommDebugMode`` that can watch several forward passes of the same modules (a step of several
    micro-batches).  torch 2.13's module tracker registers one more forward hook on a module each time it runs and
    every one of them pops the tracker's parent list, so a module's second forward in one context raised
    ``IndexError: list index out of range``; here a module's earlier hook is removed before the next is added."""
    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker

    class _Tracker(_CommModeModuleTracker):
        def _fw_pre_hook(self, mod: torch.nn.Module, input: Any) -> None:
            if not self.is_bw:
                old = self.register_forward_hook_handles.pop(self._get_mod_name(mod), None)
                if old is not None:
                    old.remove()
            super()._fw_pre_hook(mod, input)

    cm = CommDebugMode()
    cm.advanced_module_tracker = _Tracker()
    return cm


def collective_counts(cm: CommDebugMode) -> dict[str, int]:
    """``{"all_reduce": n, "reduce_scatter": m, ...}``: the DTensor/functional collectives CommDebugMode saw
    (forward and backward; pipeline p2p and FSDP2's own collectives are not DTensor ops and are not counted)."""
    out: dict[str, int] = {}
    for op, n in cm.get_comm_counts().items():
        name = str(op).split(".")[-1].rstrip("_").replace("allreduce", "all_reduce")
        name = {"reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather"}.get(name, name)
        out[name] = out.get(name, 0) + n
    return out


def reference_step(model_name: str, batch: int, seq: int, seed: int, lr: float) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and SGD-updated parameters (all names) for the parity tests."""
    from autopar.zoo import build

    spec = build(model_name, batch=batch, device="cpu", seq=seq, seed=seed)
    model, x, y = spec.model, spec.example_inputs, spec.make_target(batch, "cpu")  # type: ignore[misc]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = spec.loss_fn(model(*x), y)
    loss.backward()
    opt.step()
    return float(loss.detach()), {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


def parity_worker(rank: int, configs: list[dict[str, Any]], model_name: str | list[str], batch: int, seq: int,
                  lr: float = 1.0) -> dict[str, dict[str, float]]:
    """For each config, one SGD step (lr 1: the update is the gradient itself) under a plan vs the single-process
    step.  A config holds ``name``, optional ``init`` and ``count_comms``, and either :func:`make_plan` kwargs or
    ``plan``: an ``autopar.ir.Plan`` or ``{model name: Plan}`` (e.g. plans the planner emitted; a model without one is
    skipped).

    Returns ``{config name: {"loss": |dloss|/loss, "param": .., "update": .., "loss_value": loss}}`` (and ``"comms"``:
    :func:`collective_counts` of the step, for ``count_comms`` configs without a pipeline): "param" is the
    largest norm-wise relative error (max|got-ref| / max|ref|) of an updated parameter, "update" that of the update
    (= the gradient, at lr 1), which is far more sensitive."""
    from autopar.codegen.runtime.program import build_program
    from autopar.zoo import build, init_weights

    if isinstance(model_name, list):
        res: dict[str, dict[str, float]] = {}
        for m in model_name:
            res.update({f"{m}/{k}": v for k, v in parity_worker(rank, configs, m, batch, seq, lr).items()})
        return res
    ref_loss, ref_params = reference_step(model_name, batch, seq, 0, lr)
    spec = build(model_name, batch=batch, device="cpu", seq=seq, seed=0)
    init_params = {k: v.detach().clone() for k, v in spec.model.named_parameters(remove_duplicate=False)}
    target = spec.make_target(batch, "cpu")  # type: ignore[misc]
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name=model_name)
    out: dict[str, dict[str, float]] = {}
    for cfg in configs:
        cfg = dict(cfg)
        name = cfg.pop("name")
        count_comms = bool(cfg.pop("count_comms", False))
        init = cfg.pop("init", "copy")
        plan = cfg.pop("plan", None)
        if isinstance(plan, dict):  # planner-emitted plans, one per model (a model without one is skipped)
            if model_name not in plan:
                continue
            plan = plan[model_name]
        if plan is None:
            dp, nmb = cfg.get("dp", 1), cfg.get("num_microbatches", 1)
            plan = make_plan(graph, micro_batch=batch // (dp * nmb), model=model_name, **cfg)
        elif plan.global_batch != batch:
            raise ValueError(f"config {name}: the plan is for global batch {plan.global_batch}, not {batch}")
        src = spec if init == "copy" else build(model_name, batch=batch, device="meta", seq=seq)
        prog = build_program(plan, src, loss_fn=spec.loss_fn, example_inputs=spec.example_inputs, graph=graph,
                             init="copy" if init == "copy" else init_weights, seed=0)
        opt = torch.optim.SGD(prog.parameters(), lr=lr)
        # CommDebugMode's module tracker breaks torch.distributed.pipelining's autograd.grad: no counts under pp
        count_comms = count_comms and plan.mesh.pp == 1
        cm = CommDebugMode() if count_comms else contextlib.nullcontext()
        with cm:
            loss = prog.step(spec.example_inputs, target)
        opt.step()
        got = prog.gathered_state_dict()
        err, upd, worst = 0.0, 0.0, ""
        for k, ref in ref_params.items():
            # norm-wise relative errors (max |diff| / max |ref|) of the updated parameter and of the update itself
            e = float((got[k] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            d_ref = ref - init_params[k]
            u = float((got[k] - init_params[k] - d_ref).abs().max() / d_ref.abs().max().clamp_min(1e-30))
            if max(e, u) > max(err, upd):
                worst = k
            err, upd = max(err, e), max(upd, u)
        out[name] = {"loss": abs(loss - ref_loss) / abs(ref_loss), "param": err, "update": upd,
                     "worst": worst, "loss_value": loss}  # type: ignore[dict-item]
        if count_comms:
            out[name]["comms"] = collective_counts(cm)  # type: ignore[arg-type,assignment]
        dist.barrier()
    return out
