"""What a sharding rule produces and what it reads: :class:`Strategy` and the per-node context :class:`_Ctx`.

A placement is ``R`` (replicated), ``P`` (partial sums), ``S(d)`` (dim d split in ``t`` contiguous chunks) or, inside
the solver only, ``S(d)[k]``: dim d viewed as ``[k, n/k]`` with the inner factor split (an *interleaved* shard, what
DTensor calls ``_StridedShard``). The interleaved form is what lets a fused ``qkv`` projection whose output is laid out
``[3, heads, head_dim]`` be column-parallel with each rank owning whole heads (Megatron-LM's fused QKV); the public
placement of such a parameter is still ``S(0)`` and the split factor is reported next to it.

A :class:`Strategy` is one way to run a node on the tp axis of size ``t``: the placement required for each input
(parameters included, ``None`` = any placement, e.g. the shape-only input of ``zeros_like``), the output placement,
the fraction of the work each device does, the placement of the gradient it returns for each input, and which
parameters' gradients need a tp all-reduce (a replicated weight applied to a sharded input gets partial gradients).

Gradient placement of a consumed input (Megatron's f/g operators, Shoeybi et al. 2019, generalised; :meth:`_Ctx.mk`):
an input consumed ``S(d)`` gets an ``S(d)`` gradient; consumed ``P`` gets ``R``; consumed ``R`` by a strategy that
splits the work (column-parallel linear, broadcasting against a sharded tensor) gets a ``P`` gradient, otherwise ``R``.

The rules that enumerate strategies per op family live in ``rules_matmul``, ``rules_elementwise`` and ``rules_shape``;
:func:`autopar.planner.intra_op.rules.strategies_for` dispatches to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir.graph import FLOAT_DTYPES, Graph, Node

__all__ = ["Strategy"]


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node on the tp axis."""

    name: str
    inputs: tuple[str | None, ...]
    """Placement each input (by position in ``Node.inputs``, parameters included) is consumed in; None = any."""
    output: str
    frac: float = 1.0
    """Fraction of the op's work (FLOPs and bytes) each device does."""
    grads: tuple[str | None, ...] = ()
    """Placement of the gradient returned for each input (None: no gradient flows, e.g. integer or parameter)."""
    grad_allreduce: tuple[str, ...] = ()
    """Parameters whose gradients are partial sums over the tp group (need an all-reduce in backward)."""


def _dims(node: Node, rank: int) -> tuple[int, ...] | None:
    """Normalized ``dim`` attribute (or first positional arg) of a reduction/softmax/cat; None when absent."""
    d = node.attr("dim")
    if d is None:
        args = node.attr("args")
        if isinstance(args, (tuple, list)) and args:
            d = args[0]
    if d is None:
        return None
    ds = d if isinstance(d, (tuple, list)) else (d,)
    if not all(isinstance(x, int) for x in ds):
        return None
    return tuple(sorted({x % rank for x in ds})) if rank else ()


class _Ctx:
    """What the rules need about one node: its input metas, which inputs are parameters, its output, ``t``."""

    def __init__(self, graph: Graph, node: Node, t: int) -> None:
        self.graph, self.node, self.t = graph, node, t
        self.metas = [graph.input_meta(node, i) for i in range(len(node.inputs))]
        self.is_param = [x in node.params for x in node.inputs]
        self.out = node.outputs[0] if node.outputs else None

    def acts(self) -> list[int]:
        return [i for i, p in enumerate(self.is_param) if not p and self.metas[i] is not None]

    def params(self) -> list[int]:
        return [i for i, p in enumerate(self.is_param) if p]

    def ok(self, size: int) -> bool:
        return size > 0 and size % self.t == 0

    def is_float(self, i: int) -> bool:
        m = self.metas[i]
        return m is not None and m.dtype in FLOAT_DTYPES

    def mk(self, name: str, ins: dict[int, str | None], out: str, frac: float = 1.0, *, default: str | None = "R",
           grads: dict[int, str] | None = None, exempt: tuple[int, ...] = ()) -> Strategy:
        """A strategy consuming input ``i`` as ``ins[i]`` (``default`` for the rest); gradient placements follow the
        rule in the module docstring unless ``grads`` overrides them, and replicated float parameters of a work-
        splitting strategy (``frac < 1``, not in ``exempt``) get their gradients all-reduced."""
        n = len(self.node.inputs)
        full = tuple(ins.get(i, default) for i in range(n))
        gl: list[str | None] = []
        for i, p in enumerate(full):
            if self.is_param[i] or p is None or not self.is_float(i):
                gl.append(None)
            elif grads and i in grads:
                gl.append(grads[i])
            elif p == "P":
                gl.append("R")
            elif p == "R":
                gl.append("P" if frac < 1 else "R")
            else:
                gl.append(p)
        ar = tuple(self.node.inputs[i] for i in self.params()
                   if full[i] == "R" and frac < 1 and i not in exempt and self.is_float(i))
        return Strategy(name, full, out, frac, tuple(gl), tuple(dict.fromkeys(ar)))
