"""Opaque regions: submodules no front end captures, planned around instead of failing the whole model.

When neither ``fx.symbolic_trace`` nor ``torch.export`` captures a model, the usual cause is one submodule with
data-dependent Python control flow (``if h.mean() > 0:``), a NumPy call or a ``.item()``-sized tensor.  The ``fx``
front end then retries with that submodule as a leaf (an fx ``call_module`` the tracer does not enter), found from
the traceback of the failure, until the rest traces or the failure is in the root's own ``forward`` (nothing to
isolate).  Each leaf becomes one IR node, op ``opaque``:

* its output shapes come from running a real copy of the submodule (random weights on the CPU, one submodule at a
  time) on inputs of the traced shapes: its control flow needs values, which FakeTensors do not have;
* its cost is an estimate: 2 FLOPs per parameter per output row forward (a dense layer's count; the module is not
  inspected), twice that backward, plus its inputs/outputs/parameters read and written;
* it only runs replicated: no sharding rule exists for it, so under tensor parallelism its parameters are replicated
  and its inputs gathered; data and pipeline parallelism are unaffected.

``autopar trace`` names each opaque region and why it is opaque.  The runtime captures the model with the same
leaves (:func:`symbolic_trace_with`), so plan and program agree node for node.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

__all__ = ["MAX_REGIONS", "OpaquePropagation", "failing_submodule", "opaque_flops", "symbolic_trace_with",
           "trace_isolating"]

log = logging.getLogger(__name__)

MAX_REGIONS = 16
"""At most this many submodule classes are made opaque before the capture is given up."""


class _LeafTracer(fx.Tracer):
    def __init__(self, leaves: Iterable[str]) -> None:
        super().__init__()
        self.leaves = frozenset(leaves)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


def symbolic_trace_with(root: torch.nn.Module, leaves: Iterable[str]) -> fx.GraphModule:
    """``fx.symbolic_trace(root)`` with the submodules ``leaves`` (FQNs) kept as single ``call_module`` nodes."""
    tracer = _LeafTracer(leaves)
    graph = tracer.trace(root)
    return fx.GraphModule(tracer.root, graph, root.__class__.__name__)


def failing_submodule(model: torch.nn.Module, exc: BaseException) -> str | None:
    """The FQN of the innermost submodule (not the root) being called on ``exc``'s traceback (the module's
    ``__call__`` frames, whatever its ``forward`` names its first argument)."""
    paths = {id(m): p for p, m in model.named_modules() if p}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name in ("forward", "_call_impl", "_wrapped_call_impl") and id(me) in paths:
            found = paths[id(me)]
        tb = tb.tb_next
    return found


def trace_isolating(model: torch.nn.Module) -> tuple[fx.GraphModule, dict[str, str]]:
    """symbolic_trace ``model``, making each submodule that stops it opaque (see the module docstring).

    Returns the GraphModule and ``{submodule FQN: why}``; re-raises the failure when it is not inside a submodule."""
    leaves: dict[str, str] = {}
    while True:
        try:
            return symbolic_trace_with(model, leaves), leaves
        except Exception as e:  # noqa: BLE001 - whatever stops the tracer is the reason the region is opaque
            where = failing_submodule(model, e)
            if where is None or where in leaves or len({type(model.get_submodule(p)) for p in leaves}) >= MAX_REGIONS:
                raise
            lines = str(e).strip().splitlines()
            why = f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]
            # every instance of that class runs the same forward: all become opaque at once (one retrace, not one
            # per repeated layer)
            cls = type(model.get_submodule(where))
            for path, m in model.named_modules():
                if path and type(m) is cls and not any(path.startswith(p + ".") for p in leaves):
                    leaves[path] = why
            log.info("opaque region(s) of class %s: %s", cls.__name__, why)


class OpaquePropagation(FakeTensorProp):
    """FakeTensorProp that runs the opaque ``leaves`` for real (see the module docstring)."""

    def __init__(self, module: fx.GraphModule, mode: Any, leaves: Iterable[str]) -> None:
        super().__init__(module, mode)
        self.leaves = frozenset(leaves)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target not in self.leaves:
            return super().call_module(target, args, kwargs)
        sub = self.module.get_submodule(target)
        flat: list[Any] = []
        fx.node.map_aggregate((args, kwargs), lambda a: flat.append(a) if isinstance(a, torch.Tensor) else None)
        device = flat[0].device if flat else torch.device("cpu")
        with unset_fake_temporarily():
            real = _real_copy(sub)
            gen = torch.Generator().manual_seed(0)
            r_args = fx.node.map_aggregate(args, lambda a: _real_like(a, gen))
            r_kwargs = fx.node.map_aggregate(kwargs, lambda a: _real_like(a, gen))
            with torch.no_grad():
                out = real(*r_args, **r_kwargs)
        with self._mode:  # fake outputs on the traced inputs' device (meta for a meta model)
            return fx.node.map_aggregate(out, lambda t: torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t)


def _real_copy(sub: torch.nn.Module) -> torch.nn.Module:
    if not any(t.is_meta for t in [*sub.parameters(), *sub.buffers()]):
        return copy.deepcopy(sub).cpu()
    real = copy.deepcopy(sub).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*real.parameters(), *real.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.02)
            else:
                t.zero_()
    return real


def _real_like(a: Any, gen: torch.Generator) -> Any:
    if not isinstance(a, torch.Tensor):
        return a
    if a.is_floating_point():
        return torch.randn(a.shape, generator=gen, dtype=a.dtype)
    return torch.zeros(a.shape, dtype=a.dtype)


def opaque_flops(n_params: int, outputs: Iterable[Any]) -> tuple[float, float]:
    """(forward, backward) FLOPs of an opaque region: 2 per parameter per output row, backward twice forward."""
    rows = max((math.prod(o.shape[:-1]) for o in outputs if getattr(o, "shape", None)), default=1)
    fwd = 2.0 * n_params * rows
    return fwd, 2.0 * fwd
