"""Public entry points: :func:`plan`, :func:`auto_parallel` and the stepwise :class:`AutoParallel` behind them.

``AutoParallel`` runs trace -> plan -> apply one step at a time and never mutates the caller's model::

    ap = AutoParallel(model, example_inputs=(x,), cluster="dgx-a100-80gb", nodes=4, global_batch=512)
    graph = ap.trace()          # ir.Graph (meta-device shapes, no weights touched)
    result = ap.plan()          # SearchResult: best plan + alternatives
    program = ap.apply()        # under torchrun: the parallel model with a training step
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from autopar import ir
from autopar.ir.graph import Graph
from autopar.ir.plan import Plan, load_plan
from autopar.ir.trace_cache import cache_root
from autopar.planner.options import PlanOptions, parse_pins
from autopar.planner.search import SearchResult, search
from autopar.profiles.builtin import resolve_profile, with_nodes
from autopar.profiles.schema import ClusterProfile

if TYPE_CHECKING:  # torch loads on first use: `autopar plan` on a cached graph never needs it
    import torch

__all__ = ["AutoParallel", "plan", "auto_parallel", "resolve_cluster", "in_distributed_launch", "batch_one"]

log = logging.getLogger(__name__)


def in_distributed_launch() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE/RANK)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _measured_profile_path(ranks: int) -> Path:
    return cache_root() / f"profile-{socket.gethostname()}-{ranks}.yaml"


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_")


def _measure_here(path: Path, ranks: int, timeout_s: float) -> None:
    """Run ``python -m autopar.profiles.profiler --quick`` in a child process without the launcher's environment.

    Under torchrun ``TORCHELASTIC_USE_AGENT_STORE`` (and MASTER_*) would make the profiler's own process group join
    the agent's store instead of creating one, so its ranks would wait forever."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV)}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [sys.executable, "-m", "autopar.profiles.profiler", "-o", str(tmp), "--ranks", str(ranks), "--quick",
           "--no-progress"]
    try:
        res = subprocess.run(cmd, env=env, timeout=timeout_s, check=False, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"measuring this machine failed (exit {res.returncode}): {res.stderr[-2000:]}\n"
                               "pass cluster=... (a built-in name or a profile YAML from `autopar profile`)")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _wait_for(path: Path, failed: Path, timeout_s: float) -> None:
    deadline, started = time.monotonic() + timeout_s, time.time() - 5.0
    while not path.exists():
        if failed.exists() and failed.stat().st_mtime >= started:  # ignore a marker left by an earlier run
            raise RuntimeError(f"local rank 0 failed to measure this machine: {failed.read_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no measured profile at {path} after {timeout_s:.0f} s (local rank 0 measures it)")
        time.sleep(0.2)


def resolve_cluster(cluster: str | Path | ClusterProfile | None, nodes: int | None = None,
                    timeout_s: float = 1800.0) -> ClusterProfile:
    """A cluster profile from a built-in name, a YAML path, a profile object, or (None) this machine measured.

    A measured profile (``autopar profile --quick`` with one rank per local process, or per GPU, or 2) is cached per
    host and rank count (``$AUTOPAR_CACHE``, default ``~/.cache/autopar``); under torchrun local rank 0 measures it
    while the other local ranks wait for the file."""
    if isinstance(cluster, ClusterProfile):
        return with_nodes(cluster, nodes) if nodes else cluster
    if cluster is not None:
        return resolve_profile(cluster, nodes)
    import torch

    from autopar.profiles.schema import load_profile

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 2))
    path = _measured_profile_path(ranks)
    failed = path.with_suffix(".failed")
    if not path.exists():
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            log.info("no cluster given: measuring this machine (%d ranks) into %s", ranks, path)
            path.parent.mkdir(parents=True, exist_ok=True)
            failed.unlink(missing_ok=True)
            try:
                _measure_here(path, ranks, timeout_s)
            except Exception as e:
                failed.write_text(str(e)[:2000])
                raise
        else:
            _wait_for(path, failed, timeout_s)
    prof = load_profile(path)
    return with_nodes(prof, nodes) if nodes else prof


def batch_one(example_inputs: Any) -> Any:
    """The example inputs cut to batch 1 along their leading (batch) dimension, in the form they were given (a
    tensor or tuple -> a tuple, a dict of keyword inputs -> a dict).

    The planner traces every model at batch 1 and scales activations by the micro-batch size, so that a candidate
    micro-batch smaller than the example batch never sees a batch dimension it cannot split.  Inputs are cut only
    when every tensor input has the same leading size (batch-first); otherwise they are used as given."""
    import torch

    from autopar.ir.inputs import normalize

    args, kwargs = normalize(example_inputs)
    items = (*args, *kwargs.values())
    leads = {int(x.shape[0]) for x in items if isinstance(x, torch.Tensor) and x.dim() > 0}
    leads |= {int(x.shape[0]) for x in items if isinstance(x, ir.TensorSpec) and x.shape}

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x[:1]
        if isinstance(x, ir.TensorSpec) and x.shape:
            return ir.TensorSpec((1, *x.shape[1:]), x.dtype)
        return x

    if len(leads) == 1 and leads != {1}:
        args, kwargs = tuple(one(x) for x in args), {k: one(v) for k, v in kwargs.items()}
    return kwargs if kwargs and not args else ((args, kwargs) if kwargs else args)


@dataclass
class AutoParallel:
    """Stepwise trace -> plan -> apply (see the module docstring)."""

    model: torch.nn.Module
    example_inputs: Any
    """As the model takes them: a tensor, a tuple, or a dict of keyword inputs (see :mod:`autopar.ir.inputs`)."""
    global_batch: int
    cluster: str | Path | ClusterProfile | None = None
    nodes: int | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    model_name: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra :class:`PlanOptions` fields (``pins``, ``dtype``, ``top_k``...)."""
    frontend: str = "auto"
    _graph: Graph | None = None
    _result: SearchResult | None = None
    _profile: ClusterProfile | None = None

    def profile(self) -> ClusterProfile:
        if self._profile is None:
            self._profile = resolve_cluster(self.cluster, self.nodes)
        return self._profile

    def trace(self) -> Graph:
        """The model traced at batch 1 (see :func:`batch_one`), whatever batch the example inputs have."""
        if self._graph is None:
            from autopar.ir.inputs import batch_size, normalize

            name = self.model_name or type(self.model).__name__
            graph = ir.trace(self.model, batch_one(self.example_inputs), frontend=self.frontend,  # type: ignore
                             model_name=name)
            if graph.frontend == "export" and batch_size(normalize(self.example_inputs)) > 1:
                # torch.export specializes size-1 dimensions (a batch-1 graph drops broadcasts a larger batch
                # needs), and the runtime captures these models again at the micro-batch: plan on the example batch
                graph = ir.trace(self.model, self.example_inputs, frontend="export", model_name=name)
            self._graph = ir.verify(graph)
        return self._graph

    def plan_options(self) -> PlanOptions:
        opts = dict(self.options)
        pins = opts.pop("pins", {})
        if isinstance(pins, (list, tuple)):
            pins = parse_pins(list(pins))
        return PlanOptions(global_batch=self.global_batch, pins=pins, **opts)

    def plan(self, progress: Callable[[str, float], None] | None = None) -> SearchResult:
        if self._result is None:
            self._result = search(self.trace(), self.profile(), self.plan_options(), progress)
        return self._result

    def apply(self, plan: Plan | str | Path | None = None, *, init: Any = "copy", seed: int = 0,
              sync_batchnorm: bool = False) -> Any:
        """Build this rank's parallel program (needs an initialized process group, e.g. under torchrun).

        ``init="copy"`` shards the caller's weights; a state dict or a checkpoint path (safetensors file, Hugging Face
        model directory, ``torch.save`` file) reads them from there and ``init="model"`` runs the model's own
        initialization shard by shard, both for a model on the meta device; ``init="seed"`` generates a zoo model's
        weights shard by shard (``autopar.zoo.init_weights``), and any ``init(model, seed)`` function does the same
        with its own rules (:mod:`autopar.codegen.runtime.weights`)."""
        from autopar.codegen.runtime.program import build_program
        from autopar.zoo import init_weights

        init = init_weights if isinstance(init, str) and init == "seed" else init

        if plan is None:
            chosen = self.plan().best
        elif isinstance(plan, Plan):
            chosen = plan
        else:
            chosen = load_plan(plan)
        chosen.check_compatible(fingerprint=self.trace().fingerprint,
                                world_size=int(os.environ.get("WORLD_SIZE", chosen.world_size)))
        return build_program(chosen, self.model, loss_fn=self.loss_fn, example_inputs=self.example_inputs,
                             graph=self.trace(), init=init, seed=seed, sync_batchnorm=sync_batchnorm)

    def explain(self, node: str) -> str:
        from autopar.planner.report import explain_node

        return explain_node(self.plan().best, node, graph=self.trace())

    def diff(self, other: Plan) -> str:
        from autopar.planner.report import diff_plans

        return diff_plans(self.plan().best, other)


def _plan_once(ap: AutoParallel) -> Plan:
    """Rank 0 searches and broadcasts the plan, so every rank builds the same program (and the search runs once)."""
    import torch
    import torch.distributed as dist

    from autopar.ir.plan import plan_from_yaml, plan_to_yaml

    if not (dist.is_available() and dist.is_initialized()):
        return ap.plan().best
    box: list[str | None] = [plan_to_yaml(ap.plan().best) if dist.get_rank() == 0 else None]
    nccl = dist.get_backend() == "nccl"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if nccl else None
    dist.broadcast_object_list(box, src=0, device=dev)
    assert box[0] is not None
    return plan_from_yaml(box[0])


def plan(model: torch.nn.Module, example_inputs: Any, *, cluster: str | Path | ClusterProfile,
         global_batch: int, nodes: int | None = None, model_name: str = "", **options: Any) -> SearchResult:
    """Plan ``model`` for ``cluster``: the best :class:`autopar.ir.Plan` (``.best``) and the top-k ``.alternatives``."""
    return AutoParallel(model, example_inputs, global_batch, cluster=cluster, nodes=nodes, model_name=model_name,
                        options=options).plan()


def auto_parallel(model: torch.nn.Module, *, example_inputs: Any, global_batch: int,
                  loss_fn: Callable[..., torch.Tensor] | None = None, cluster: str | Path | ClusterProfile | None = None, nodes: int | None = None,
                  plan: Plan | str | Path | None = None, sync_batchnorm: bool = False, init: Any = "copy",
                  **options: Any) -> Any:
    """One line from a model to a parallel training program.

    Under torchrun: profiles this machine (``cluster=None``) or loads ``cluster``, plans (or loads ``plan``) and
    returns the rank's parallel program (``.step(inputs, targets)``, ``.parameters()`` for any torch optimizer).
    Without torchrun: returns the best :class:`autopar.ir.Plan` for ``cluster`` instead.  ``model`` is never mutated.

    ``example_inputs`` as the model takes them: a tensor, a tuple, or a dict of keyword inputs.  Without ``loss_fn``
    the model computes its own loss (a Hugging Face model given ``labels``): ``.step(batch)`` with the same keywords.
    The program's weights are the caller's (``init="copy"``), sharded per rank; for a model built on the meta
    device, ``init=`` a state dict or checkpoint path (e.g. a ``save_pretrained`` directory), or ``"model"`` for its
    own initialization run shard-locally.  ``sync_batchnorm=True``:
    BatchNorm statistics over the data-parallel group (default: per rank, as the plan's note says).
    """
    if in_distributed_launch():
        world = int(os.environ["WORLD_SIZE"])
        if plan is None:
            prof = resolve_cluster(cluster, nodes)
            if prof.nodes * prof.devices_per_node != world:
                per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
                prof = replace(prof, devices_per_node=per_node, nodes=max(1, world // per_node)) \
                    if prof.nodes == 1 else with_nodes(prof, max(1, world // prof.devices_per_node))
            cluster = prof
        ap = AutoParallel(model, example_inputs, global_batch, cluster=cluster, nodes=None, loss_fn=loss_fn,
                          options=options)
        return ap.apply(plan if plan is not None else _plan_once(ap), sync_batchnorm=sync_batchnorm, init=init)
    if cluster is None and plan is None:
        raise ValueError("outside torchrun, auto_parallel plans for a given cluster: pass cluster='dgx-a100-80gb' "
                         "(or a profile YAML), or launch with torchrun to run on this machine")
    if plan is not None:
        return plan if isinstance(plan, Plan) else load_plan(plan)
    ap = AutoParallel(model, example_inputs, global_batch, cluster=cluster, nodes=nodes, loss_fn=loss_fn,
                      options=options)
    return ap.plan().best
