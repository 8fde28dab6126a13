"""The pass pipeline: the one place that says which IR passes run, and in which order.

::

    capture -> group -> decompose -> fuse

``capture``    the front end (``torch.fx``/``torch.export`` + FakeTensor shapes, :func:`autopar.ir.trace`): a module
               becomes a flat :class:`~autopar.ir.Graph`.  It is the only step that is not ``Graph -> Graph``.
``group``      :func:`~autopar.ir.passes.group.group_layers`: the ordered layer groups, identical blocks hashed equal.
``decompose``  :func:`~autopar.ir.passes.decompose.decompose_attention` (off by default): fused attention written out
               as score matmul, softmax, dropout and value matmul, as pre-FlashAttention frameworks ran it.
``fuse``       :func:`~autopar.ir.passes.fuse.apply_fused_bytes` (off by default): each fused group's bytes counted
               once.

Each pass is a pure function ``Graph -> Graph`` and :func:`run_passes` checks :func:`autopar.ir.verify` after each,
so a pass that breaks an invariant fails where it ran.  Where each step runs:

* :func:`autopar.ir.trace`: capture, then ``default_pipeline(options)`` (group, plus decompose/fuse if selected);
  calibration against Megatron-LM traces with ``PassOptions(decompose_attention=True, ...)``;
* ``autopar.planner.search``: ``default_pipeline(PassOptions(fused_kernels=...), start="fuse")`` on its copy for
  tensor-parallel degree 1 (the runtime fuses only stages without tensor parallelism), so the traced graph it is
  given must not have been fused already.

Which optional passes run is chosen by :class:`PassOptions`, passed explicitly (no global state).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Mapping

from autopar.ir.errors import IRVerificationError
from autopar.ir.graph import Graph
from autopar.ir.passes.decompose import decompose_attention
from autopar.ir.passes.fuse import apply_fused_bytes
from autopar.ir.passes.group import group_layers
from autopar.ir.verify import verify as verify_graph

__all__ = ["PIPELINE", "Pass", "PassOptions", "default_pipeline", "run_passes", "verify_after"]

PIPELINE: tuple[str, ...] = ("capture", "group", "decompose", "fuse")
"""The default pipeline's steps, in the order they run."""


@dataclass(frozen=True, slots=True)
class Pass:
    """One named pass: a pure function ``Graph -> Graph``."""

    name: str
    fn: Callable[[Graph], Graph]

    def __call__(self, graph: Graph) -> Graph:
        return self.fn(graph)


@dataclass(kw_only=True, slots=True, frozen=True)
class PassOptions:
    """Which optional passes of the pipeline run."""

    decompose_attention: bool = False
    """Run ``decompose``: replace fused attention (``sdpa``) by its unfused ops, e.g. to cost frameworks without
    flash attention (Megatron-LM 2021-22)."""
    attention_dropout_p: float = 0.0
    """Dropout probability on the attention probabilities written out by ``decompose`` (0: no dropout node)."""
    fused_kernels: bool = False
    """Run ``fuse``: discount the bytes each fused group saves (the planner's search turns it on for its tp = 1
    tables when ``PlanOptions.fused_kernels`` is set)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.attention_dropout_p < 1.0:
            raise ValueError(f"attention_dropout_p must be in [0, 1), got {self.attention_dropout_p}")
        if self.attention_dropout_p > 0.0 and not self.decompose_attention:
            raise ValueError("attention_dropout_p needs decompose_attention=True (fused attention has no dropout "
                             "node to cost)")


def default_pipeline(options: PassOptions | None = None, *, module_types: Mapping[str, str] | None = None,
                     start: str = "group", stop: str = "fuse") -> tuple[Pass, ...]:
    """The passes of the default pipeline from ``start`` to ``stop`` (inclusive, names from :data:`PIPELINE`),
    in order, leaving out the optional ones ``options`` does not select.

    ``module_types`` (module path -> class name) names the layer groups' module types for ``group``; the front end
    knows them (``capture`` itself is run by :func:`autopar.ir.trace`, not returned here)."""
    names = PIPELINE[1:]
    for what, name in (("start", start), ("stop", stop)):
        if name not in names:
            raise ValueError(f"{what}={name!r} is not a pass of the pipeline; choose from {', '.join(names)}")
    if names.index(start) > names.index(stop):
        raise ValueError(f"start={start!r} comes after stop={stop!r} in the pipeline {' -> '.join(PIPELINE)}")
    opts = options if options is not None else PassOptions()
    passes = [Pass("group", partial(group_layers, module_types=dict(module_types or {})))]
    if opts.decompose_attention:
        passes.append(Pass("decompose", partial(decompose_attention, dropout_p=opts.attention_dropout_p)))
    if opts.fused_kernels:
        passes.append(Pass("fuse", apply_fused_bytes))
    selected = names[names.index(start): names.index(stop) + 1]
    return tuple(p for p in passes if p.name in selected)


def verify_after(name: str, graph: Graph) -> Graph:
    """``autopar.ir.verify(graph)``, naming the pass that produced ``graph`` when an invariant is broken."""
    try:
        return verify_graph(graph)
    except IRVerificationError as e:
        raise IRVerificationError(f"after pass {name!r}: {e}") from e


def run_passes(graph: Graph, passes: Iterable[Pass], *, verify: bool = True) -> Graph:
    """Run ``passes`` in order on ``graph``; with ``verify``, check the IR's invariants after each one."""
    for p in passes:
        graph = p.fn(graph)
        if verify:
            verify_after(p.name, graph)
    return graph
