"""Cut a model into per-layer-group fx modules and chain them into pipeline stages.

The model is captured with the front end that made the plan's graph (``ir.Graph.frontend``), so fx node names equal
``autopar.ir.Node.name``: ``torch.fx.symbolic_trace`` for graphs traced with ``frontend="fx"`` (the zoo), and
``torch.export`` for the rest (Hugging Face, timm, torchtitan models: ``ir.trace``'s ``auto`` falls back to it).  An
exported program is re-captured on the meta clone at the run's micro-batch shapes, with the same positional and
keyword inputs, and run as its ATen training graph (``ExportedProgram.module()``): every op keeps autograd, so the
group modules train like the model itself.  Its outputs are the model's flattened outputs (``ModelOutput`` fields,
dict values, tuple items); the program's result is the first tensor among them (the loss when the model computes its
own from ``labels``, else the logits).  Every fx node is assigned to the layer group
(``autopar.ir.Graph.layers``) that
holds the ir node of the same name; nodes the IR skips (``x.size()``, ``getattr``, ``get_attr``) go to the group of
their first user.  Each group becomes one :class:`torch.fx.GraphModule` whose placeholders are the values it reads
from earlier groups (or the model inputs) and whose output tuple holds the values later groups (or the model output)
read.  Submodules and parameters keep their original fully qualified names inside a group module, so parameter
shardings written against the model's FQNs apply unchanged.

A :class:`StageModule` runs a contiguous range of groups.  Its inputs are all values live at its start boundary and
its outputs all values live at its end boundary (pass-through values included, e.g. Llama's RoPE tables), so stage k
feeds stage k+1 only, as ``torch.distributed.pipelining`` requires.  The last stage returns the model output.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from autopar import ir
from autopar.codegen.runtime.init import meta_clone
from autopar.ir.opaque import symbolic_trace_with

__all__ = ["Example", "GroupSpec", "SplitModel", "capture", "split_model", "StageModule"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Wiring of one layer group: the value names it reads and the value names it produces for later groups."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(slots=True)
class SplitModel:
    """The model cut into layer-group modules (on whatever device the traced root lives)."""

    groups: list[fx.GraphModule]
    specs: list[GroupSpec]
    model_inputs: tuple[str, ...]
    """Placeholder names of the model's forward, in order."""
    output: str
    """Value name of the model output (a single tensor)."""
    values: dict[str, tuple[tuple[int, ...], torch.dtype, bool]] = field(default_factory=dict)
    """Exported captures: value name -> (shape, dtype, requires grad) at the captured micro-batch, for pipeline
    stages whose boundary tensors are declared up front (see :meth:`boundary_examples`)."""

    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors the capture holds that the model does not (``torch.tensor(...)`` built in forward, lifted by
    torch.export), with their values: loaded like the model's buffers."""

    def boundary_examples(self, boundary: int, device: torch.device) -> tuple[torch.Tensor, ...] | None:
        """Empty tensors shaped like the values crossing ``boundary`` (None without exported metadata).

        ``torch.distributed.pipelining`` otherwise infers a stage's outputs by running it on uninitialized inputs,
        which breaks on integer inputs carried through the pipeline (``labels`` for a model computing its own loss:
        garbage class indices)."""
        names = self.live_at(boundary)
        if not self.values or any(n not in self.values for n in names):
            return None
        out = []
        for n in names:
            shape, dtype, grad = self.values[n]
            out.append(torch.empty(shape or (1,), dtype=dtype, device=device).requires_grad_(grad))
        return tuple(out)

    def live_at(self, boundary: int) -> tuple[str, ...]:
        """Values crossing the boundary before group ``boundary`` (``len(groups)``: the model output)."""
        if boundary == 0:
            return self.model_inputs
        if boundary >= len(self.groups):
            return (self.output,)
        produced = list(self.model_inputs)
        for s in self.specs[:boundary]:
            produced.extend(s.outputs)
        needed: set[str] = {self.output}
        for s in self.specs[boundary:]:
            needed.update(s.inputs)
        return tuple(dict.fromkeys(v for v in produced if v in needed))


def _assign_groups(gm: fx.GraphModule, graph: ir.Graph) -> dict[fx.Node, int]:
    """Layer-group index of every fx node (-1 for placeholders); raises if the trace does not match the IR."""
    group_of_ir: dict[str, int] = {}
    for g in graph.layers:
        for n in graph.nodes[g.start:g.end]:
            group_of_ir[n.name] = g.index
    nodes = list(gm.graph.nodes)
    missing = [n for n in group_of_ir if n not in {x.name for x in nodes}]
    if missing and graph.frontend != "export":
        raise ValueError(f"the model's capture does not match the given ir.Graph (nodes {missing[:3]} missing); "
                         "pass the graph traced from this model (ir.trace(model, inputs, frontend='fx'))")
    if missing:
        # torch.export specializes size-1 dimensions, so a capture at micro-batch 1 can drop or rename a few nodes
        # of a graph traced at a larger batch (broadcasts, copies): the rest still place the stage cuts, and the
        # plan's pins on the missing nodes are only skipped (DTensor keeps the values exact)
        log.info("the capture at the run's micro-batch lacks %d node(s) of the plan's graph, e.g. %s", len(missing),
                 missing[:3])
    out: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        if n.op == "output":
            continue
        if n.op == "placeholder":
            out[n] = -1
        elif n.name in group_of_ir:
            out[n] = group_of_ir[n.name]
        else:
            users = [out[u] for u in n.users if u in out]
            if users:
                out[n] = min(users)
            elif n.users:
                out[n] = len(graph.layers) - 1
    for n in nodes:  # never before an input (a node matched by name in a capture at another batch)
        if n in out and n.op != "placeholder":
            out[n] = max([out[n], *(out[a] for a in n.all_input_nodes if a in out and a.op != "get_attr")])
    return out


Example = tuple[tuple[Any, ...], dict[str, Any]]
"""Positional and keyword example inputs (at the run's micro-batch shapes, usually on the meta device)."""


def capture(root: nn.Module, graph: ir.Graph, example: Example | None = None,
            device: torch.device | None = None) -> fx.GraphModule:
    """``root`` as an fx GraphModule from the front end that captured ``graph`` (see the module docstring).

    An exported capture of a meta model creates its tensors (``arange`` positions, masks) on the meta device: those
    device arguments are moved to ``device``, where the program runs."""
    if graph.frontend != "export":  # with the plan's opaque regions as leaves (autopar.ir.opaque)
        leaves = [path for path, _ in graph.opaque]
        return _bind_omitted(symbolic_trace_with(root, leaves) if leaves else fx.symbolic_trace(root), graph)
    if example is None:
        raise ValueError("a model captured with torch.export needs example inputs to be captured again")
    key = _capture_key(root, example, device)
    done = _CAPTURED.get(root, {}).get(key)
    if done is not None:
        return copy.deepcopy(done)
    gm = _export(root, example, device)
    _CAPTURED.setdefault(root, {})[key] = gm
    return copy.deepcopy(gm)


_CAPTURED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, fx.GraphModule]] = weakref.WeakKeyDictionary()
"""Exported captures per caller's model (held weakly) and :func:`_capture_key`: a second program of the same model at
the same shapes (another plan, a re-plan, ``autopar calibrate``'s re-runs, a test's meshes) skips the export, about a
second a small Hugging Face model and more for a large one.  Each use gets its own copy (meta parameters: cheap)."""


def _capture_key(root: nn.Module, example: Example, device: torch.device | None) -> tuple:
    """What an export of ``root`` depends on besides its code: the module tree (names, types, training mode), every
    parameter's and buffer's name, shape and dtype, and the example inputs' structure, shapes and dtypes (other
    values by repr).  A model changed in place between two programs (a submodule replaced, a layer resized, eval
    mode) is exported again; a forward rebound on an instance is not detected."""
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(tuple(example))
    inputs = tuple((tuple(v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor) else repr(v)
                   for v in leaves)
    modules = tuple((name, type(m).__qualname__, m.training) for name, m in root.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in itertools.chain(
        root.named_parameters(remove_duplicate=False), root.named_buffers(remove_duplicate=False)))
    return str(spec), inputs, modules, tensors, str(device)


def _export(root: nn.Module, example: Example, device: torch.device | None) -> fx.GraphModule:
    args, kwargs = example
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(root, tuple(args), dict(kwargs), strict=False)
    # The program must never write to the caller's tensors (to_empty would re-point a real parameter's data): the
    # captured module's parameters and buffers become meta tensors, ties kept; constants keep their values.
    gm = meta_clone(ep.module())
    for n in list(gm.graph.nodes):  # the input guard module torch.export inserts checks shapes only
        if n.op == "call_module" and not n.users and str(n.target).startswith("_guards"):
            gm.graph.erase_node(n)
        elif device is not None and any(_is_meta(v) for v in (*n.args, *n.kwargs.values())):
            n.args = tuple(device if _is_meta(v) else v for v in n.args)
            n.kwargs = {k: device if _is_meta(v) else v for k, v in n.kwargs.items()}
    gm.recompile()
    return gm


def _bind_omitted(gm: fx.GraphModule, graph: ir.Graph) -> fx.GraphModule:
    """symbolic_trace makes a placeholder of every forward argument, optional ones included (timm's ViT:
    ``attn_mask=None, is_causal=False``); the planner's trace ran with the caller's inputs only and the others at
    their defaults.  Those placeholders are replaced by their default values, so the program takes what the model
    was traced with."""
    given = set(graph.inputs)
    for n in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in given]:
        if not n.args:
            raise ValueError(f"forward argument {n.target!r} has no default and was not in the traced inputs "
                             f"{sorted(given)}")
        default = n.args[0]
        for user in list(n.users):
            user.args = fx.node.map_aggregate(user.args, lambda a, n=n, d=default: d if a is n else a)
            user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a, n=n, d=default: d if a is n else a)
        if not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


def _is_meta(v: object) -> bool:
    return isinstance(v, torch.device) and v.type == "meta"


def _result(out_node: fx.Node) -> fx.Node:
    """The program's result: the model's (first) output tensor."""
    flat: list[fx.Node] = []
    fx.node.map_arg(out_node.args[0], flat.append)  # type: ignore[arg-type,func-returns-value]
    if not flat:
        raise ValueError("the model returns no tensor")
    return flat[0]


def split_model(root: nn.Module, graph: ir.Graph, example: Example | None = None,
                device: torch.device | None = None) -> SplitModel:
    """Capture ``root`` (see :func:`capture`) and cut it into one GraphModule per layer group of ``graph``."""
    if not graph.layers:
        raise ValueError("the ir.Graph has no layer groups; trace it with ir.trace")
    gm = capture(root, graph, example, device)
    group = _assign_groups(gm, graph)
    nodes = list(gm.graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    result = out_node.args[0]
    if not isinstance(result, fx.Node):
        if graph.frontend != "export":
            raise ValueError("the model must return a single tensor to be split into pipeline stages")
        result = _result(out_node)
    n_groups = len(graph.layers)
    members: list[list[fx.Node]] = [[] for _ in range(n_groups)]
    for n in nodes:
        if n in group and group[n] >= 0 and not (graph.frontend == "export" and n.op == "get_attr"):
            members[group[n]].append(n)
    # An exported graph reads every parameter through a get_attr node: each group reads its own, so a parameter
    # used by several stages (tied embeddings) is held by each of them, never sent between stages as a value.
    local_attr = graph.frontend == "export"
    specs, modules = [], []
    for gi in range(n_groups):
        mine = set(members[gi])
        needed = dict.fromkeys(a for n in members[gi] for a in n.all_input_nodes if a not in mine)
        attrs = [a for a in needed if local_attr and a.op == "get_attr"]
        reads = [a for a in needed if a not in attrs]
        writes = [n for n in members[gi] if n is result or any(group.get(u, n_groups) > gi for u in n.users)]
        spec = GroupSpec(gi, tuple(a.name for a in reads), tuple(n.name for n in writes))
        specs.append(spec)
        modules.append(_group_module(gm, members[gi], reads, writes, f"Group{gi}", attrs))
    placeholders = tuple(n.name for n in nodes if n.op == "placeholder")
    values = _value_metadata(gm) if graph.frontend == "export" else {}
    own = {n for n, _ in itertools.chain(root.named_parameters(remove_duplicate=False),
                                         root.named_buffers(remove_duplicate=False))}
    constants = {}
    for n in nodes:
        t = _attr(gm, str(n.target)) if n.op == "get_attr" and str(n.target) not in own else None
        if isinstance(t, torch.Tensor) and not t.is_meta:
            constants[str(n.target)] = t.detach().clone()
    return SplitModel(modules, specs, placeholders, result.name, values, constants)


def _value_metadata(gm: fx.GraphModule) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]]:
    """Shape, dtype and whether autograd tracks it, per tensor value of an exported graph: a floating value computed
    from a trainable parameter requires grad; inputs, integer values and values built from inputs only do not."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype, bool]] = {}
    grad: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = gm.get_parameter(str(n.target)) if _is_param(gm, str(n.target)) else None
            grad[n] = bool(t is not None and t.requires_grad)
            continue
        grad[n] = n.op != "placeholder" and any(grad.get(a, False) for a in n.all_input_nodes)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            req = grad[n] and (val.dtype.is_floating_point or val.dtype.is_complex)
            out[n.name] = (tuple(int(d) for d in val.shape), val.dtype, req)
    return out


def _attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def _group_module(gm: fx.GraphModule, members: list[fx.Node], reads: list[fx.Node], writes: list[fx.Node],
                  name: str, attrs: list[fx.Node] = ()) -> fx.GraphModule:  # type: ignore[assignment]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for r in reads:
        env[r] = g.placeholder(r.name)
    for a in attrs:
        env[a] = g.node_copy(a)
    for n in members:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[w] for w in writes))
    return fx.GraphModule(gm, g, name)


class StageModule(nn.Module):
    """Runs layer groups ``groups`` in order: ``forward(*live_in) -> live_out`` (a tuple, or the model output).

    ``wrap_in`` / ``wrap_out`` convert values at the stage boundary (plain tensors <-> DTensors under tensor
    parallelism); ``context`` is entered around every group call (DTensor's implicit replication of plain
    tensors under tensor parallelism); ``recompute[i]`` checkpoints group i (``torch.utils.checkpoint``, non-reentrant).
    """

    def __init__(self, groups: list[fx.GraphModule], specs: list[GroupSpec], inputs: tuple[str, ...],
                 outputs: tuple[str, ...], *, recompute: list[bool] | None = None,
                 wrap_in: Callable[[object], object] | None = None,
                 wrap_out: Callable[[object], object] | None = None,
                 context: Callable[[], contextlib.AbstractContextManager[object]] | None = None) -> None:
        super().__init__()
        self.groups = nn.ModuleList(groups)
        self.specs = specs
        self.in_names = inputs
        self.out_names = outputs
        self.recompute = recompute or [False] * len(groups)
        self._wrap_in = wrap_in
        self._wrap_out = wrap_out
        self._context = context or contextlib.nullcontext

    def _run(self, mod: nn.Module, *ins: object) -> object:
        with self._context():  # entered again when a checkpointed group is recomputed in backward
            return mod(*ins)

    def forward(self, *args: object) -> object:
        if len(args) != len(self.in_names):
            raise ValueError(f"stage expects {len(self.in_names)} inputs ({', '.join(self.in_names)}), "
                             f"got {len(args)}")
        env = dict(zip(self.in_names, (self._wrap_in(a) if self._wrap_in else a for a in args)))
        for mod, spec, rc in zip(self.groups, self.specs, self.recompute):
            ins = [env[n] for n in spec.inputs]
            if rc and torch.is_grad_enabled():
                outs = checkpoint(self._run, mod, *ins, use_reentrant=False)
            else:
                outs = self._run(mod, *ins)
            env.update(zip(spec.outputs, outs))
        res = [_at_least_1d(self._wrap_out(env[n]) if self._wrap_out else env[n]) for n in self.out_names]
        return res[0] if len(res) == 1 else tuple(res)


def _at_least_1d(x: object) -> object:
    """A stage output as pipeline schedules send it: contiguous (an ``expand``-ed mask or a transposed value is not,
    and the p2p send needs it), and a scalar (the loss of a model computing its own) as shape (1,), because the
    schedule concatenates the last stage's outputs over micro-batches."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.reshape(1) if x.dim() == 0 else x.contiguous()
