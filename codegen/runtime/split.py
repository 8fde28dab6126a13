"""Cut a model into per-layer-group fx modules and chain them into pipeline stages.

The model is traced with ``torch.fx.symbolic_trace`` (the same front end as :func:`autopar.ir.trace` with
``frontend="fx"``,
so fx node names equal ``autopar.ir.Node.name``).  Every fx node is assigned to the layer group
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
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from autopar import ir

__all__ = ["GroupSpec", "SplitModel", "split_model", "StageModule"]

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
    if missing:
        raise ValueError(f"the model's fx trace does not match the given ir.Graph (nodes {missing[:3]} missing); "
                         "pass the graph traced from this model (ir.trace(model, inputs, frontend='fx'))")
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
    return out


def split_model(root: nn.Module, graph: ir.Graph) -> SplitModel:
    """Trace ``root`` with fx and cut it into one GraphModule per layer group of ``graph``."""
    if not graph.layers:
        raise ValueError("the ir.Graph has no layer groups; trace it with ir.trace")
    gm = fx.symbolic_trace(root)
    group = _assign_groups(gm, graph)
    nodes = list(gm.graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    result = out_node.args[0]
    if not isinstance(result, fx.Node):
        raise ValueError("the model must return a single tensor to be split into pipeline stages")
    n_groups = len(graph.layers)
    members: list[list[fx.Node]] = [[] for _ in range(n_groups)]
    for n in nodes:
        if n in group and group[n] >= 0:
            members[group[n]].append(n)
    specs, modules = [], []
    for gi in range(n_groups):
        mine = set(members[gi])
        reads = dict.fromkeys(a for n in members[gi] for a in n.all_input_nodes if a not in mine)
        writes = [n for n in members[gi] if n is result or any(group.get(u, n_groups) > gi for u in n.users)]
        spec = GroupSpec(gi, tuple(a.name for a in reads), tuple(n.name for n in writes))
        specs.append(spec)
        modules.append(_group_module(gm, members[gi], list(reads), writes, f"Group{gi}"))
    placeholders = tuple(n.name for n in nodes if n.op == "placeholder")
    return SplitModel(modules, specs, placeholders, result.name)


def _group_module(gm: fx.GraphModule, members: list[fx.Node], reads: list[fx.Node], writes: list[fx.Node],
                  name: str) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for r in reads:
        env[r] = g.placeholder(r.name)
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
        res = [self._wrap_out(env[n]) if self._wrap_out else env[n] for n in self.out_names]
        return res[0] if len(res) == 1 else tuple(res)
