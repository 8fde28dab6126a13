"""Plan -> per-rank program: :func:`build_program` and :class:`ParallelProgram`.

Build order (every rank, inside an initialized process group):

1. the mesh ``(pp, dp, tp)`` (:mod:`autopar.codegen.runtime.mesh`);
2. a meta clone of the model (the caller's model is never mutated), cut into layer-group fx modules and chained into
   this rank's pipeline stages (:mod:`autopar.codegen.runtime.split`, :mod:`autopar.codegen.runtime.pipeline`);
3. tensor parallelism: plan placements on parameters and activations (:mod:`autopar.codegen.runtime.tensor_parallel`);
   expert parallelism: routed-expert regions into ep submodules with ep-sharded weights
   (:mod:`autopar.codegen.runtime.expert_parallel`);
4. the dp axis: FSDP2 for ZeRO >= 1, or gradient all-reduce for ZeRO 0 (:mod:`autopar.codegen.runtime.data_parallel`);
5. ``to_empty`` and per-shard loading (:mod:`autopar.codegen.runtime.init`).

Inputs follow the model's own calling convention (:mod:`autopar.ir.inputs`): a tensor, positional tensors or
keyword tensors (``input_ids=..., labels=...``).  Without a ``loss_fn`` the model's (first) output is the loss, as
for Hugging Face models given ``labels``.

Batch semantics: :meth:`ParallelProgram.step` takes the *global* batch (the same tensors on every rank);
dp replica i uses rows ``[i*B/dp, (i+1)*B/dp)``, split into ``plan.num_microbatches`` micro-batches.  The loss is the
mean of the per-micro-batch losses, averaged over dp, which for a mean-reduced loss equals the single-process loss
over the global batch; gradients are scaled to match.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar import ir
from autopar.codegen.kernels.fx_rewrite import fuse_graph_module
from autopar.codegen.runtime import context_parallel as cpm
from autopar.codegen.runtime import data_parallel as dpm
from autopar.codegen.runtime import expert_parallel as epm
from autopar.codegen.runtime.batchnorm import sync_batch_norms
from autopar.codegen.runtime.init import Initializer, alias_names, meta_clone
from autopar.codegen.runtime.mesh import build_mesh, default_device
from autopar.codegen.runtime.pipeline import build_schedule, local_stage_indices
from autopar.codegen.runtime.split import SplitModel, StageModule, split_model
from autopar.codegen.runtime.tensor_parallel import (
    dtensor_placement,
    expand_op_shardings,
    implicit_replication,
    plan_param_placement,
    rewrite_group,
    to_dtensor,
    to_local_replicated,
    unpermute_chunks,
)
from autopar.codegen.runtime.weights import load_weights, strip_group
from autopar.ir.inputs import normalize, tensor_leaves, with_batch

__all__ = ["ParallelProgram", "build_program"]

log = logging.getLogger(__name__)

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _model_loss(out: torch.Tensor, target: object = None) -> torch.Tensor:
    """The loss when the model computes its own (no ``loss_fn``): its output, which must be a scalar."""
    if out.numel() != 1:
        raise ValueError(f"no loss_fn was given, so the model's first output is taken as the loss, but it has shape "
                         f"{tuple(out.shape)}; pass loss_fn=... or inputs that make the model return its loss "
                         "(e.g. labels=... for a Hugging Face model)")
    return out.reshape(())


_strip = strip_group


class ParallelProgram:
    """This rank's share of a plan: stage modules, schedule and gradient synchronization."""

    def __init__(self, *, plan: ir.Plan, mesh: DeviceMesh, stages: list[StageModule], stage_indices: list[int],
                 loss_fn: Loss, device: torch.device, chunks: dict[str, int], aliases: dict[str, list[str]],
                 tie_groups: dict[str, dist.ProcessGroup], non_persistent: frozenset[str] = frozenset(),
                 keywords: tuple[str, ...] = (), n_inputs: int | None = None,
                 examples: list[tuple[Any, Any]] | None = None, cp: cpm.CpRuntime | None = None,
                 ep: epm.ExpertParallel | None = None) -> None:
        self.plan = plan
        self._keywords = keywords  # keyword inputs, in the order the model was captured with
        self._n_inputs = n_inputs
        self.mesh = mesh
        self.stages = stages
        self.stage_indices = stage_indices
        self.loss_fn = loss_fn
        self.device = device
        self.coords = plan.mesh.coords(dist.get_rank())
        self._param_dtype = next((p.dtype for s in stages for p in s.parameters()), torch.float32)
        self._chunks = chunks  # read by codegen.checkpoint (older versions); same dict as .chunks
        self._aliases = aliases
        self._canon = {a: c for c, names in aliases.items() for a in names}
        self._tie_groups = tie_groups
        self._non_persistent = non_persistent
        self._cp: cpm.CpRuntime | None = cp
        self._ep: epm.ExpertParallel | None = ep
        self._fsdp = plan.zero >= 1 and plan.mesh.dp * plan.mesh.cp > 1
        self._grad_pg: dist.ProcessGroup | None = None
        self._gsync: dpm.GradSync | None = None  # ZeRO 0 with replicas: made at the first step (_grad_sync)
        self.schedule = None
        if plan.mesh.pp > 1:
            self.schedule = build_schedule(plan, list(stages), stage_indices, mesh["pp"].get_group(), device,
                                           loss_fn, examples)

    # ---- public API ----------------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The local module: the single stage module, or a ModuleList of this rank's (virtual) stages."""
        return self.stages[0] if len(self.stages) == 1 else nn.ModuleList(self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (local shards as DTensors where sharded), for a ``torch.optim`` optimizer."""
        seen: set[int] = set()
        for s in self.stages:
            for p in s.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(original FQN, parameter) for this rank's parameters."""
        seen: set[int] = set()
        for s in self.stages:
            for n, p in s.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self._canon.get(_strip(n), _strip(n)), p

    def named_buffers(self, *, persistent_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(original FQN, buffer) for this rank's buffers, each tensor once (``persistent_only``: only those the
        model's ``state_dict`` holds, e.g. for checkpoints; RoPE tables are usually non-persistent).  Persistence is
        the original model's: fx group modules register every buffer they copy as persistent."""
        seen: set[int] = set()
        for s in self.stages:
            for mname, mod in s.named_modules():
                for k, b in mod._buffers.items():
                    if b is None or id(b) in seen:
                        continue
                    seen.add(id(b))
                    fqn = _strip(f"{mname}.{k}" if mname else k)
                    fqn = self._canon.get(fqn, fqn)
                    if not (persistent_only and fqn in self._non_persistent):
                        yield fqn, b

    @property
    def chunks(self) -> dict[str, int]:
        """Parameter FQN -> number of chunks it is stored interleaved in (fused projections under tensor
        parallelism, e.g. 3 for GPT's qkv: :func:`autopar.codegen.runtime.tensor_parallel.permute_chunks`); parameters
        stored in the model's layout are absent (1).  A copy: the layout is fixed when the program is built."""
        return dict(self._chunks)

    @property
    def is_last_stage(self) -> bool:
        return len(self.plan.stages) - 1 in self.stage_indices

    @property
    def is_first_stage(self) -> bool:
        return 0 in self.stage_indices

    def step(self, inputs: torch.Tensor | Sequence[torch.Tensor] | dict[str, Any],
             targets: torch.Tensor | None = None) -> float:
        """Forward and backward of one global batch; returns the loss (the same float on every rank).

        ``inputs`` as the model takes them (a tensor, a tuple, or a dict of keyword tensors); ``targets`` for the
        program's ``loss_fn`` (none when the model computes its own loss).  Gradients are left in ``.grad``
        (synchronized over dp and tied stages) for the caller's optimizer."""
        ins = tuple(tensor_leaves(normalize(inputs), self._keywords))
        if self._n_inputs is not None and len(ins) != self._n_inputs:
            raise ValueError(f"the model was captured with {self._n_inputs} tensor input(s), got {len(ins)}")
        ins = tuple(self._dp_slice(x) for x in ins)
        if self._cp is not None:  # this rank's two sequence chunks (context parallelism)
            ins = tuple(self._cp.slice(x) for x in ins)
        if targets is None:
            if self.loss_fn is not _model_loss:
                raise ValueError("step() needs targets for the program's loss_fn")
            targets = torch.zeros(ins[0].shape[0] * self.plan.mesh.dp, dtype=torch.long)  # only sliced, never read
        tgt = self._dp_slice(targets)
        if self._cp is not None and self.loss_fn is not _model_loss:
            tgt = self._cp.slice(tgt)
        # Plain tensors created inside the model (torch.arange positions...) meet DTensors in forward *and* backward.
        ctx = implicit_replication() if self.plan.mesh.tp > 1 else contextlib.nullcontext()
        armed = g.armed() if (g := self._grad_sync()) is not None else contextlib.nullcontext()
        with ctx, self._autocast(), armed:  # armed: ZeRO 0's buckets go out during the backward
            loss = self._run_pipeline(ins, tgt) if self.schedule is not None else self._run_local(ins, tgt)
        self._sync_grads()
        return self._reduce_loss(loss)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision for ``plan.dtype == "bfloat16"``: compute in bf16 under autocast while parameters,
        gradients and optimizer state stay in the model's fp32 (the plan's 16 bytes/param memory model).  float16
        would need loss scaling, which the program does not do: such plans compute in the model's dtype."""
        if self.plan.dtype != "bfloat16" or self._param_dtype != torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    @torch.no_grad()
    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded, model-layout) CPU tensors of every parameter under all its names, on every rank.

        Collective over the whole world; meant for tests and checkpoints of models that fit in one process."""
        local: dict[str, torch.Tensor] = {}
        for fqn, p in self.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            c = self._chunks.get(fqn, 1)
            if c > 1:
                full = unpermute_chunks(full, c, self.plan.mesh.tp)
            for alias in self._aliases.get(fqn, [fqn]):
                local[alias] = full.detach().cpu().clone()
        if self.plan.mesh.pp == 1:
            return local
        parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local if self.coords[1:] == (0, 0, 0) else {})
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in (part or {}).items():
                out.setdefault(k, v)
        return out

    # ---- internals -----------------------------------------------------------------------------------------------
    def _dp_slice(self, x: torch.Tensor) -> torch.Tensor:
        dp, r = self.plan.mesh.dp, self.coords[1]
        b = x.shape[0]
        per = b // dp
        if b % (dp * self.plan.num_microbatches):
            raise ValueError(f"batch {b} is not divisible by dp*num_microbatches = "
                             f"{dp}*{self.plan.num_microbatches}; pass the plan's global batch "
                             f"({self.plan.global_batch})")
        return x[r * per:(r + 1) * per].to(self.device)

    def _run_local(self, ins: tuple[torch.Tensor, ...], tgt: torch.Tensor) -> torch.Tensor:
        n = self.plan.num_microbatches
        parts = [torch.chunk(x, n) for x in ins]
        total = torch.zeros((), device=self.device)
        for k, t in enumerate(torch.chunk(tgt, n)):
            out = self.stages[0](*(p[k] for p in parts))
            loss = self.loss_fn(out, t)
            (loss / n).backward()
            total += loss.detach().float()
        return total / n

    def _run_pipeline(self, ins: tuple[torch.Tensor, ...], tgt: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = ins if self.is_first_stage else ()
        target = tgt if self.is_last_stage else None
        self.schedule.step(*args, target=target, losses=losses)  # type: ignore[union-attr]
        if self.is_last_stage and losses:
            return torch.stack([x.detach().float() for x in losses]).mean()
        return torch.zeros((), device=self.device)

    def _sync_grads(self) -> None:
        experts = {id(p) for p in self._ep.parameters()} if self._ep is not None else set()
        params = [p for p in self.parameters() if id(p) not in experts]  # experts sync over their shard group
        if self._ep is not None and not self._fsdp:  # (under FSDP2 their reduce-scatter divides them)
            epm.sync_expert_grads(self._ep)
        if self._gsync is not None:  # cp ranks hold the same parameters, too
            self._gsync.finish()
        elif not self._fsdp:
            dpm.fix_grad_placements(params)
            if self.plan.mesh.replicas > 1:  # the plan's sync after the backward: one all-reduce
                dpm.allreduce_grads(params, self._grad_group(), average=True)
        if not self._tie_groups:
            return
        named = dict(self.named_parameters())
        for fqn, group in self._tie_groups.items():
            if fqn in named:
                dpm.allreduce_grads([named[fqn]], group, average=False)

    def _grad_sync(self) -> dpm.GradSync | None:
        """ZeRO 0's gradient all-reduce overlapped with the backward, a bucket per layer group, if the plan says so."""
        if self._gsync is None and self.plan.overlap_grad_sync and not self._fsdp and self.plan.mesh.replicas > 1:
            experts = {id(p) for p in self._ep.parameters()} if self._ep is not None else set()
            units = [list(g.parameters()) for st in self.stages for g in st.groups] + [list(self.parameters())]
            self._gsync = dpm.GradSync([[p for p in u if id(p) not in experts] for u in units], self._grad_group(),
                                       self.plan.num_microbatches, self.plan.num_microbatches if self.schedule else 1)
        return self._gsync

    def _grad_group(self) -> dist.ProcessGroup:
        """The group replicas average gradients over (dp, or dp x cp), looked up once: slicing the DeviceMesh every
        step cost 0.25-0.3 ms on CPU ranks, a few percent of a tiny model's step (Python work no cost model
        charges)."""
        if self._grad_pg is None:
            mesh = self.mesh["dp"] if self._cp is None else self._cp.grad_mesh
            self._grad_pg = mesh.get_group()
        return self._grad_pg

    def _reduce_loss(self, loss: torch.Tensor) -> float:
        mine = loss if (self.is_last_stage and self.coords.tp == 0) else torch.zeros_like(loss)
        buf = mine.reshape(1).clone()
        dist.all_reduce(buf)
        return float(buf.item()) / (self.plan.mesh.dp * self.plan.mesh.cp)


def build_program(plan: ir.Plan, model: Any, *, loss_fn: Loss | None = None,
                  example_inputs: Any = None, graph: ir.Graph | None = None,
                  device: torch.device | str | None = None,
                  init: Literal["copy", "model"] | Initializer | Mapping[str, torch.Tensor] | str | os.PathLike[str]
                  = "copy", seed: int = 0, sync_batchnorm: bool = False) -> ParallelProgram:
    """Build this rank's program for ``plan`` (call on every rank, inside an initialized process group).

    ``model`` is an ``nn.Module`` or an
    ``autopar.zoo.ModelSpec`` (whose ``loss_fn`` and ``example_inputs`` are the defaults).  ``example_inputs`` as the
    model takes them (a tensor, a tuple, or a dict of keyword inputs; any batch size: only shapes and dtypes are
    read).  Without ``loss_fn`` the model's first output is the loss (a Hugging Face model given ``labels``).
    ``graph`` is the traced ``autopar.ir.Graph`` the plan was made for (traced here when omitted); the model is
    captured again with the same front end (:func:`autopar.codegen.runtime.split.capture`).

    ``init`` is where the weights come from (:mod:`autopar.codegen.runtime.weights`): ``"copy"`` copies each rank's
    shards from the model's real weights; a state dict or a checkpoint path (safetensors, a Hugging Face directory,
    a ``torch.save`` file) reads them from there; ``"model"`` runs the model's own initialization shard-locally; an
    :data:`Initializer` (such as ``autopar.zoo.init_weights``) generates them from ``seed``.  All but ``"copy"``
    take a model on the meta device.  ``sync_batchnorm``: BatchNorm statistics over the dp group instead of per
    rank (:mod:`autopar.codegen.runtime.batchnorm`)."""
    if hasattr(model, "model") and hasattr(model, "example_inputs"):
        loss_fn = loss_fn or model.loss_fn
        example_inputs = example_inputs if example_inputs is not None else model.example_inputs
        model = model.model
    if example_inputs is None:
        raise ValueError("build_program needs example_inputs (or a ModelSpec that carries them)")
    inputs = normalize(example_inputs)
    if isinstance(init, str) and init not in ("copy", "model") and not os.path.exists(init):
        raise ValueError(f"init must be 'copy', 'model', a state dict, a checkpoint path or an initializer function "
                         f"(e.g. autopar.zoo.init_weights); got {init!r}, which is none of these (no such file)")
    dev = torch.device(device) if device is not None else default_device()
    mesh = build_mesh(plan, dev)
    meta = meta_clone(model)
    # Capture what the planner traced: a real model is captured as itself (torch.export reads shapes only, and the
    # program never writes to its tensors), a meta model as its clone; both give the plan's node names.
    real = not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    micro = with_batch(inputs, plan.micro_batch, _device_of(model) if real else "meta")
    if graph is None:
        graph = ir.trace(model if real else meta, micro)
    if graph.fingerprint != plan.graph_fingerprint:
        log.warning("plan fingerprint %s differs from the traced graph's %s (another batch size or model?)",
                    plan.graph_fingerprint, graph.fingerprint)
    if plan.stages[-1].layer_end != len(graph.layers):
        raise ValueError(f"the plan's stages cover {plan.stages[-1].layer_end} layer groups but the model has "
                         f"{len(graph.layers)}; re-plan for this model")
    aliases = alias_names(meta)
    split = split_model(model if real and graph.frontend == "export" else meta, graph, micro, dev)
    tie_groups = _tie_groups(plan, split, aliases)
    pp_rank, dp_rank, _, tp_rank = plan.mesh.coords(dist.get_rank())
    indices = local_stage_indices(plan, pp_rank)
    tp_mesh = mesh["tp"] if plan.mesh.tp > 1 else None
    canon = {a: c for c, names in aliases.items() for a in names}
    cpm.check_supported(plan, graph)
    epm.check_supported(plan)
    cpr = cpm.CpRuntime(plan, mesh) if plan.mesh.cp > 1 else None
    stages, group_lists, chunks = _make_stages(plan, graph, split, indices, tp_mesh, aliases, cpr)
    chunks = {canon.get(k, k): v for k, v in chunks.items()}
    epx = epm.ExpertParallel(plan, dev) if plan.mesh.ep > 1 else None
    if epx is not None:  # expert regions into ep submodules with ep-sharded weights (before FSDP and loading)
        epx.apply(stages)
    if sync_batchnorm and plan.mesh.dp > 1:
        for gl in group_lists:
            for g in gl:
                sync_batch_norms(g, mesh["dp"].get_group())
    if tp_mesh is not None:
        _distribute_params(stages, tp_mesh, plan, canon)
    fsdp = plan.zero >= 1 and plan.mesh.dp * plan.mesh.cp > 1
    if fsdp:  # with cp, parameters are sharded over dp x cp (all hold the same parameters)
        if epx is not None:  # expert weights over the ranks holding the same experts, first (inner units)
            epx.fully_shard(plan.zero, dpm.mp_policy(plan.dtype, plan.reduce_dtype))
        dpm.apply_fsdp(list(stages), group_lists, mesh["dp"] if cpr is None else cpr.grad_mesh, plan.zero,
                       policy=dpm.mp_policy(plan.dtype, plan.reduce_dtype))
    for s in stages:
        _to_empty_keep_ties(s, dev)
    load_weights(stages, model, init, seed, canon, chunks, plan, fsdp, dp_rank if cpr is None else cpr.grad_rank,
                 tp_rank, split.constants, experts=epx.layout if epx is not None else None)
    log.info("rank %d: stages %s, %d local parameter tensors", dist.get_rank(), indices,
             sum(1 for s in stages for _ in s.parameters()))
    return ParallelProgram(plan=plan, mesh=mesh, stages=stages, stage_indices=indices, loss_fn=loss_fn or _model_loss,
                           device=dev, chunks=chunks, aliases=aliases, tie_groups=tie_groups,
                           non_persistent=frozenset(canon.get(f, f) for f in _non_persistent(meta)),
                           keywords=tuple(inputs[1]), n_inputs=len(split.model_inputs), cp=cpr, ep=epx,
                           examples=[(split.boundary_examples(plan.stages[i].layer_start, dev),
                                      split.boundary_examples(plan.stages[i].layer_end, dev)) for i in indices])


def _device_of(model: nn.Module) -> torch.device:
    return next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device


def _non_persistent(model: nn.Module) -> Iterator[str]:
    for mname, mod in model.named_modules():
        for k in mod._non_persistent_buffers_set:
            yield f"{mname}.{k}" if mname else k


def _make_stages(plan: ir.Plan, graph: ir.Graph, split: SplitModel, indices: list[int], tp_mesh: DeviceMesh | None,
                 aliases: dict[str, list[str]], cpr: cpm.CpRuntime | None = None
                 ) -> tuple[list[StageModule], list[list[nn.Module]], dict[str, int]]:
    ops = expand_op_shardings(plan, graph) if tp_mesh is not None else {}
    canon = {a: c for c, names in aliases.items() for a in names}

    def placement_of(fqn: str) -> str:
        c = canon.get(fqn, fqn)
        return plan_param_placement(plan, aliases.get(c, [c]))

    stages, group_lists, chunks = [], [], {}
    for i in indices:
        st = plan.stages[i]
        ids = list(range(st.layer_start, st.layer_end))
        groups = [split.groups[g] for g in ids]
        if graph.frontend == "fx":  # the kernel patterns match torch-level ops, not an exported ATen graph
            groups = _fuse(groups, plan, tp_mesh)
        for g in groups:
            chunks.update(rewrite_group(g, graph, plan, tp_mesh, ops, selective_recompute=st.recompute == "selective",
                                        placement_of=placement_of))
            if cpr is not None:
                cpm.rewrite_group_cp(g, cpr.ctx, cpr.positions)
        wrap_in = (lambda x, m=tp_mesh: to_dtensor(x, m)) if tp_mesh is not None else None
        wrap_out = to_local_replicated if tp_mesh is not None else None
        stages.append(StageModule(groups, [split.specs[g] for g in ids], split.live_at(st.layer_start),
                                  split.live_at(st.layer_end), recompute=[st.recompute == "full"] * len(ids),
                                  wrap_in=wrap_in, wrap_out=wrap_out,
                                  context=implicit_replication if tp_mesh is not None else None))
        group_lists.append(groups)
    return stages, group_lists, chunks


def _fuse(groups: list[fx.GraphModule], plan: ir.Plan, tp_mesh: DeviceMesh | None) -> list[fx.GraphModule]:
    """The groups rewritten to call the generated fused kernels
    (:func:`autopar.codegen.kernels.fx_rewrite.fuse_graph_module`) when ``plan.fused_kernels`` is set: on when CUDA
    is available or ``TRITON_INTERPRET=1`` is forced, else eager.

    Stages under tensor parallelism (tp > 1) are *not* fused: their activations are DTensors, which the kernels do
    not take, and converting to local tensors is only correct for some placements (a norm over a sharded dim is not
    local), so those stages run eagerly (the planner costs them unfused, too)."""
    if not plan.fused_kernels or tp_mesh is not None:
        return groups
    return [fuse_graph_module(g, enabled=None) for g in groups]


def _distribute_params(stages: list[StageModule], mesh: DeviceMesh, plan: ir.Plan, canon: dict[str, str]) -> None:
    """Replace every (meta) parameter by a meta DTensor with the plan's tp placement; tied parameters stay tied."""
    new: dict[int, nn.Parameter] = {}
    for s in stages:
        for mname, mod in s.named_modules():
            for k, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in new:
                    fqn = canon.get(_strip(f"{mname}.{k}"), _strip(f"{mname}.{k}"))
                    names = {a for a, c in canon.items() if c == fqn} | {fqn}
                    pl = dtensor_placement(plan_param_placement(plan, names))
                    shape, _ = compute_local_shape_and_global_offset(p.shape, mesh, [pl])
                    local = torch.empty(shape, dtype=p.dtype, device="meta")
                    dt = DTensor.from_local(local, mesh, [pl], run_check=False, shape=p.shape, stride=p.stride())
                    new[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
                mod._parameters[k] = new[id(p)]


def _to_empty_keep_ties(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device)``, then restore parameters shared by several modules (``to_empty`` off the meta
    device creates one new Parameter per owning module, which would untie tied embeddings)."""
    owners = [(m, k, id(p)) for m in module.modules() for k, p in m._parameters.items() if p is not None]
    module.to_empty(device=device)
    first: dict[int, nn.Parameter] = {}
    for m, k, old in owners:
        p = m._parameters[k]
        assert p is not None
        m._parameters[k] = first.setdefault(old, p)


def _tie_groups(plan: ir.Plan, split: SplitModel, aliases: dict[str, list[str]]) -> dict[str, dist.ProcessGroup]:
    """Process groups that sum the gradients of a tied parameter held by stages on different pipeline ranks."""
    if plan.mesh.pp == 1:
        return {}
    canon = {a: c for c, names in aliases.items() for a in names}
    users: dict[str, set[int]] = {}
    for si, st in enumerate(plan.stages):
        for g in split.groups[st.layer_start:st.layer_end]:
            for n, _ in g.named_parameters(remove_duplicate=False):
                users.setdefault(canon.get(n, n), set()).add(si % plan.mesh.pp)
    out: dict[str, dist.ProcessGroup] = {}
    me = dist.get_rank()
    for fqn in sorted(users):
        pps = sorted(users[fqn])
        if len(pps) < 2:
            continue
        for d in range(plan.mesh.dp):
            for c in range(plan.mesh.cp):
                for t in range(plan.mesh.tp):
                    ranks = [plan.mesh.rank(pp=p, dp=d, cp=c, tp=t) for p in pps]
                    grp = dist.new_group(ranks)
                    if me in ranks:
                        out[fqn] = grp
    return out
