"""Tensor parallelism on the ``tp`` mesh axis with DTensor, driven by the plan's shardings.

What is done to the layer-group fx modules of a stage (see :mod:`autopar.codegen.runtime.split`):

* Parameters become DTensors with the plan's placement (:meth:`autopar.ir.Plan.placement_of`): ``S(0)`` on a Linear
weight is
  column parallel, ``S(1)`` row parallel, ``S(0)`` on an Embedding weight vocabulary parallel, ``R`` replicated.
  Activations stay DTensors inside a stage, so DTensor's sharding propagation inserts the collectives the placements
  imply (the all-reduce of a row-parallel output, the masked-partial reduction of a vocabulary-parallel lookup), and
  views written with global sizes (``.view(b, s, n_head, head_dim)``) keep working on sharded tensors.
* The plan's op shardings (``Plan.op_shardings``; a repeated block's entries are applied to every block with the same
  structural hash) pin activations: each activation input of the op is redistributed to the placement the plan says it
  is consumed in, and the output to the placement it is produced in (``P`` is left to DTensor).  E.g. ``S(1)`` on a
  LayerNorm input is sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models").
* Fused projections: a column-parallel Linear whose output is split by a view into ``(c, heads, head_dim)`` (GPT's
  fused qkv, c = 3) cannot be sharded contiguously, because rank 0 would hold all of q and half of k.  As in
  Megatron-LM, the weight rows are stored chunk-interleaved (each rank's shard is ``[q_r; k_r; v_r]``) and the view
  is computed on the local shard.  :func:`permute_chunks` / :func:`unpermute_chunks` convert between the model's
  layout and the stored one when parameters are loaded or gathered.
* ``scaled_dot_product_attention`` has no DTensor rule on CPU; it runs locally on head- or batch-sharded q/k/v
  (attention is independent per head and per sample) and replicates otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.utils.checkpoint import checkpoint

from autopar import ir
from autopar.codegen.runtime.tp_ops import (
    CONV_OPS,
    ChannelConv,
    InplaceOnPlain,
    ModuleConv,
    WholeOp,
    custom_op,
    inplace_op,
    to_dtensor,
)

__all__ = ["implicit_replication", "dtensor_placement", "param_layout", "plan_param_placement", "Place", "LocalView",
           "HeadSDPA", "expand_op_shardings", "rewrite_group",
           "permute_chunks", "unpermute_chunks", "to_dtensor", "to_local_replicated"]

log = logging.getLogger(__name__)


def dtensor_placement(s: str) -> Placement:
    """A plan placement (``R`` / ``P`` / ``S(d)`` / ``S(d)[k]``) -> its DTensor placement (an interleaved
    ``S(d)[k]`` is ``Shard(d)`` of the chunk-interleaved layout, see :func:`param_layout`)."""
    return param_layout(s)[0]


def param_layout(s: str) -> tuple[Placement, int]:
    """(DTensor placement, chunks) of a parameter placement: ``S(0)[3]`` is a fused projection of 3 chunks
    (q, k, v) each sharded on dim 0 — stored chunk-interleaved so ``Shard(0)`` gives every rank its slice of each
    chunk (:func:`permute_chunks`); ``R`` / ``S(d)`` have one chunk."""
    p = ir.Placement.parse(s)
    if p.kind == "R":
        return Replicate(), 1
    if p.kind == "P":
        return Partial(), 1
    return Shard(p.dim), p.chunks


def plan_param_placement(plan: ir.Plan, names: Iterable[str]) -> str:
    """The plan's placement of a parameter known under ``names`` (tied weights: the planner names the traced
    graph's FQN only, e.g. ``wte.weight`` and not ``lm_head.weight``).  Names no pattern matches are replicated by
    default and do not count; explicit placements that disagree are an error."""
    explicit: dict[str, list[str]] = {}
    for n in sorted(set(names)):
        for ps in plan.param_shardings:
            if ps.matches(n):
                explicit.setdefault(ps.placement, []).append(n)
                break
    if len(explicit) > 1:
        raise ValueError(f"tied parameters {sorted(set(names))} have different placements in the plan "
                         f"({explicit}); give them one placement")
    return next(iter(explicit), "R")


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Treat plain tensors met by DTensor ops as replicated (positions from ``torch.arange``, RoPE tables).

    Unlike ``torch.distributed.tensor.experimental.implicit_replication`` this restores the previous setting on
    exit, so it nests (stage forward inside a training step, recomputation inside backward)."""
    disp = DTensor._op_dispatcher
    prev = disp._allow_implicit_replication
    disp._allow_implicit_replication = True
    try:
        yield
    finally:
        disp._allow_implicit_replication = prev


def to_local_replicated(x: object) -> object:
    """A DTensor leaving a stage is replicated (all-gather/all-reduce if needed) and returned as a plain tensor."""
    if isinstance(x, DTensor):
        if any(not isinstance(p, Replicate) for p in x.placements):
            x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        return x.to_local()
    return x


class Place(nn.Module):
    """Redistribute an activation to one placement on the tp mesh (inserted where the plan pins a placement)."""

    def __init__(self, mesh: DeviceMesh, placement: str) -> None:
        super().__init__()
        self.mesh = mesh
        self.placement = dtensor_placement(placement)

    def forward(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = to_dtensor(x, self.mesh)
        if tuple(x.placements) != (self.placement,):
            x = x.redistribute(self.mesh, [self.placement])
        return x


class LocalView(nn.Module):
    """``x.view(*shape)`` of a last-dim-sharded DTensor holding c interleaved chunks: the local shard is viewed with
    ``shape[shard_dim] / tp`` and the result is sharded on ``shard_dim`` (the head dimension)."""

    def __init__(self, mesh: DeviceMesh, shard_dim: int) -> None:
        super().__init__()
        self.mesh = mesh
        self.shard_dim = shard_dim

    def forward(self, x: Any, *shape: Any) -> Any:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        x = to_dtensor(x, self.mesh)
        last = Shard(x.ndim - 1)
        if tuple(x.placements) != (last,):
            x = x.redistribute(self.mesh, [last])
        local_shape = list(int(s) for s in shape)
        local_shape[self.shard_dim] //= self.mesh.size()
        y = x.to_local().view(local_shape)
        return DTensor.from_local(y, self.mesh, [Shard(self.shard_dim)], run_check=False,
                                  shape=torch.Size(int(s) for s in shape),
                                  stride=_contiguous_stride([int(s) for s in shape]))


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


class HeadSDPA(nn.Module):
    """``scaled_dot_product_attention`` on DTensors (local per head/sample shard) with optional recomputation.

    ``recompute=True`` is the plan's *selective* recomputation: only the attention core is checkpointed, the
    activation-heavy, FLOP-light part (Korthikanti et al. 2022, Sec. 5)."""

    def __init__(self, mesh: DeviceMesh | None, recompute: bool = False) -> None:
        super().__init__()
        self.mesh = mesh
        self.recompute = recompute

    def _local(self, q: Any, k: Any, v: Any, kwargs: dict[str, Any]) -> Any:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs), q, k, v,
                              use_reentrant=False)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward(self, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            names = ("attn_mask", "dropout_p", "is_causal", "scale")
            kwargs.update(zip(names, args))
        if not any(isinstance(t, DTensor) for t in (q, k, v)):
            return self._local(q, k, v, kwargs)
        mesh = next(t.device_mesh for t in (q, k, v) if isinstance(t, DTensor))
        q, k, v = (to_dtensor(t, mesh) for t in (q, k, v))
        pl = tuple(q.placements)
        mask = kwargs.get("attn_mask")
        if isinstance(mask, DTensor):  # a mask built in forward from replicated values: the same on every rank
            mask = kwargs["attn_mask"] = mask.full_tensor()
        # a mask with a batch (dim 0) or head (dim 1) extent > 1 must be cut like q; broadcast dims need nothing
        mask_ok = mask is None or pl not in ((Shard(0),), (Shard(1),)) or mask.dim() < 4 or \
            mask.shape[pl[0].dim] == 1  # type: ignore[union-attr]
        ok = (pl in ((Shard(0),), (Shard(1),)) and tuple(k.placements) == pl and tuple(v.placements) == pl
              and mask_ok)
        if not ok:
            rep = [Replicate()]
            q, k, v = (t.redistribute(mesh, rep) for t in (q, k, v))
            pl = (Replicate(),)
        out = self._local(q.to_local(), k.to_local(), v.to_local(), kwargs)
        shape = torch.Size([*q.shape[:-1], v.shape[-1]])
        return DTensor.from_local(out, mesh, list(pl), run_check=False, shape=shape,
                                  stride=_contiguous_stride(list(shape)))


def expand_op_shardings(plan: ir.Plan, graph: ir.Graph) -> dict[str, ir.OpSharding]:
    """Node name -> OpSharding for every node, repeating a block's entries on all blocks with its structural hash."""
    group_of = {}
    for g in graph.layers:
        for i in range(g.start, g.end):
            group_of[graph.nodes[i].name] = g
    out: dict[str, ir.OpSharding] = {}
    for op in plan.op_shardings:
        if not graph.has_node(op.node):
            raise ValueError(f"plan op_shardings names node {op.node!r}, which is not in the traced graph")
        g = group_of.get(op.node)
        if g is None:
            out[op.node] = op
            continue
        offset = graph.index(op.node) - g.start
        for other in graph.layers:
            if other.structural_hash == g.structural_hash:
                out[graph.nodes[other.start + offset].name] = op
    return out


def _pinned_inputs(node: ir.Node, op: ir.OpSharding) -> list[tuple[str, str]]:
    """(activation input name, placement) pairs; ``op.inputs`` lists either all inputs or only activations."""
    if len(op.inputs) == len(node.inputs):
        pairs = list(zip(node.inputs, op.inputs))
    elif len(op.inputs) == len(node.activation_inputs):
        pairs = list(zip(node.activation_inputs, op.inputs))
    elif not op.inputs:
        return []
    else:
        raise ValueError(f"op sharding of {node.name}: {len(op.inputs)} input placements for {len(node.inputs)} "
                         f"inputs ({len(node.activation_inputs)} activations)")
    return [(n, p) for n, p in pairs if n not in node.params and p != "P"]


def _view_chunks(graph: ir.Graph, linear: str, view: str, tp: int, planned: int = 1,
                 gathered: bool = False) -> tuple[int, int]:
    """(chunks, shard_dim of the view output) for a view splitting the last dim of a column-parallel output.

    The view output is sharded on its first head count that tp divides (GPT's fused qkv: 3 chunks of heads).  When
    tp divides no head count (Llama's 2 kv heads on tp=4) it is sharded on head_dim within each head if the plan asks
    for that layout, ``S(0)[k]`` with k = the number of heads (every head is then one chunk).  A plan that keeps the
    weight contiguous (``S(0)``) and pins the view's input replicated (``gathered``: the planner's all-gather before
    the view) gets no local view: the output stays a global-semantics DTensor and the pin gathers it."""
    src, dst = graph.node(linear).out.shape, graph.node(view).out.shape
    lead = len(src) - 1
    if len(dst) <= len(src) or tuple(dst[:lead]) != tuple(src[:lead]):
        return 1, -1
    factors = dst[lead:]
    for j, f in enumerate(factors[:-1]):
        if f % tp == 0:
            return math.prod(factors[:j]), lead + j
    if planned > 1 and planned == math.prod(factors[:-1]) and factors[-1] % tp == 0:
        return planned, len(dst) - 1
    if planned == 1 and gathered:
        return 1, -1
    raise ValueError(f"tp={tp} divides none of the head counts in {view} {tuple(dst)} (output of {linear}); "
                     "choose a tp that divides the number of (key/value) heads, or a plan that shards head_dim "
                     f"(S(0)[{math.prod(factors[:-1])}] on the weight, as the planner emits)")


_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
"""Attention as fx (torch function) and torch.export (ATen op) capture it."""


def rewrite_group(gm: fx.GraphModule, graph: ir.Graph, plan: ir.Plan, mesh: DeviceMesh | None,
                  ops: dict[str, ir.OpSharding], *, selective_recompute: bool,
                  placement_of: Callable[[str], str] | None = None) -> dict[str, int]:
    """Insert placements, local fused views and DTensor attention into one group module, in place.

    ``placement_of(fqn)`` is the plan's placement of a parameter (default :meth:`autopar.ir.Plan.placement_of`; the
    program
    passes one that resolves tied names).  Returns ``{param fqn: chunks}`` for parameters stored chunk-interleaved
    (fused projections)."""
    placement_of = placement_of or plan.placement_of
    chunks: dict[str, int] = {}
    current = {n.name: n for n in gm.graph.nodes}
    erased: set[str] = set()
    for n in list(gm.graph.nodes):
        if n.name in erased:
            continue
        if n.op == "call_function" and n.target in _SDPA and (mesh or selective_recompute):
            _swap_node(gm, n, HeadSDPA(mesh, selective_recompute), f"_sdpa_{n.name}")
            continue
        if mesh is None:
            continue
        name = n.name  # the IR's name for this value, also after a swap
        if n.op == "call_function" and n.target in CONV_OPS:
            n = current[name] = _swap_node(gm, n, ChannelConv(n.target), f"_conv_{name}")
        elif n.op == "call_module" and type(gm.get_submodule(str(n.target))) in ModuleConv.TYPES:
            # fx keeps nn.ConvNd calls as modules: computed from the module's (sharded) parameters, which stay
            # where they are (the wrapper does not own the module, so parameter names do not change)
            n = current[name] = _swap_node(gm, n, ModuleConv(gm.get_submodule(str(n.target))), f"_conv_{name}")
        elif custom_op(n):
            n = current[name] = _swap_node(gm, n, WholeOp(n.target), f"_whole_{name}")
        elif inplace_op(n):
            n = current[name] = _swap_node(gm, n, InplaceOnPlain(n.target), f"_inplace_{name}")
        if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.Linear):
            chunks.update(_fused_projection(gm, graph, n, placement_of, mesh, erased, current, ops))
        op = ops.get(name)
        if op is not None and graph.has_node(name):
            _pin(gm, n, graph.node(name), op, mesh, current, name)
    gm.graph.lint()
    gm.recompile()
    return chunks


def _fused_projection(gm: fx.GraphModule, graph: ir.Graph, n: fx.Node, placement_of: Callable[[str], str],
                      mesh: DeviceMesh, erased: set[str], current: dict[str, fx.Node],
                      ops: dict[str, ir.OpSharding]) -> dict[str, int]:
    """A column-parallel Linear whose output a view splits into (chunks, heads, head_dim): store the weight (and
    bias) chunk-interleaved and view the local shard (:class:`LocalView`).  ``{param: chunks}`` when it applies."""
    tp = mesh.size()
    placement, k = param_layout(placement_of(f"{n.target}.weight"))
    if placement != Shard(0):
        return {}
    user = next(iter(n.users)) if len(n.users) == 1 else None
    c, dim = 1, -1
    if user is not None and _is_view(user) and graph.has_node(user.name):
        view_op = ops.get(user.name)
        c, dim = _view_chunks(graph, n.name, user.name, tp, k,
                              gathered=view_op is not None and view_op.inputs[:1] == ("R",))
    if k != c:
        # The storage layout is the runtime's business: DTensor keeps global semantics, so a contiguous shard is
        # exact too (only the collectives differ from the ones the planner costed).
        log.debug("%s.weight: plan layout S(0)[%d], runtime stores %d chunk(s)", n.target, k, c)
    if c == 1:
        return {}
    assert user is not None
    erased.add(user.name)
    current[user.name] = _swap_node(gm, user, LocalView(mesh, dim), f"_view_{user.name}")
    mod = gm.get_submodule(str(n.target))
    return {f"{n.target}.{p}": c for p in ("weight", "bias") if getattr(mod, p, None) is not None}


def _is_view(n: fx.Node) -> bool:
    return n.op == "call_method" and n.target in ("view", "reshape")


def _swap_node(gm: fx.GraphModule, n: fx.Node, mod: nn.Module, name: str) -> fx.Node:
    gm.add_submodule(name, mod)
    with gm.graph.inserting_before(n):
        new = gm.graph.call_module(name, n.args, dict(n.kwargs))
    n.replace_all_uses_with(new)
    gm.graph.erase_node(n)
    return new


def _is_index(dtype: str | None) -> bool:
    """Integer and boolean values (ids, masks, position buckets) are never pinned: they stay plain tensors, computed
    whole on every rank (exact, and next to free), which DTensor's implicit replication treats as replicated.  The
    in-place integer ops models run on them (a shifted ``labels`` copy filled in place, T5's bucket sums) have no
    DTensor rule, and an in-place op cannot turn a plain tensor into a DTensor."""
    return dtype is not None and not dtype.startswith(("float", "bfloat", "complex"))


def graph_meta(n: fx.Node) -> str | None:
    """The dtype name of an fx value from its captured metadata (None when unknown)."""
    val = n.meta.get("val")
    return str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else None


def _pin(gm: fx.GraphModule, n: fx.Node, node: ir.Node, op: ir.OpSharding, mesh: DeviceMesh,
         current: dict[str, fx.Node], name: str | None = None) -> None:
    """Pin ``n``'s activation inputs and output to the plan's placements.  ``current`` maps a value's name to the
    fx node that now carries it (the producer's output pin, a swapped-in module), so a consumer's pin applies on top
    of its producer's: a sequence-parallel norm's ``S(1)`` output is all-gathered for a column-parallel Linear that
    consumes ``R`` (Korthikanti et al. 2022, the ``g`` operator).  ``name``: the IR's name of ``n``'s value (when
    ``n`` is a swapped-in module)."""
    key = name or n.name
    for k, (inp, placement) in enumerate(_pinned_inputs(node, op)):
        src = current.get(inp)
        if src is None or src not in n.all_input_nodes or _is_index(graph_meta(src)):
            continue
        attr = f"_place_{n.name}_in{k}"
        gm.add_submodule(attr, Place(mesh, placement))
        with gm.graph.inserting_before(n):
            p = gm.graph.call_module(attr, (src,))
        n.replace_input_with(src, p)
    if op.output != "P" and not (node.outputs and _is_index(node.outputs[0].dtype)):
        attr = f"_place_{n.name}_out"
        gm.add_submodule(attr, Place(mesh, op.output))
        with gm.graph.inserting_after(n):
            p = gm.graph.call_module(attr, (n,))
        n.replace_all_uses_with(p, delete_user_cb=lambda u: u is not p)
        current[key] = p


def permute_chunks(t: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    """Model layout -> stored layout: rows [c0 | c1 | ...] of dim 0 reordered so a contiguous 1/tp shard holds the
    rank's slice of every chunk (Megatron-LM's per-partition qkv layout)."""
    n = t.shape[0]
    return t.reshape(chunks, tp, n // (chunks * tp), *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def unpermute_chunks(t: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    """Inverse of :func:`permute_chunks`."""
    n = t.shape[0]
    return t.reshape(tp, chunks, n // (chunks * tp), *t.shape[1:]).transpose(0, 1).reshape(t.shape)
