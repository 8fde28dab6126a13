"""A model's traced graph, a built-in model's from the traced-graph cache: ``traced_graph("gpt-tiny", batch=8)``.

Importing this module, and a cache hit, import no torch: the command line (``autopar run``'s checks of a plan against
its model, ``explain``, ``replan``) answers from the cache in a fraction of a second, and builds and traces only on a
miss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autopar import zoo

__all__ = ["traced_graph"]


def traced_graph(name: str, *, batch: int = 1, seq: int | None = None, frontend: str = "auto",
                 cache: bool = True) -> Any:
    """``name`` built on the meta device at ``batch`` and traced (:func:`autopar.ir.trace`, then verified).

    A built-in model's graph comes from the traced-graph cache (:mod:`autopar.ir.trace_cache`, keyed by the name,
    batch, sequence length, front end and the zoo's source) unless ``cache`` is False; a ``package.module:factory``
    model's source is not known, so it is always traced."""
    from autopar.ir.trace_cache import cached_graph, source_digest

    def make() -> Any:
        from autopar import ir
        from autopar.zoo.registry import build

        spec = build(name, batch=batch, device="meta", seq=seq)
        return ir.verify(ir.trace(spec.model, spec.example_inputs, frontend=frontend, model_name=name))

    if not cache or name not in zoo.list_models():
        return make()
    key = {"zoo": name, "seq": seq, "batch": batch, "frontend": frontend,
           "zoo_source": source_digest(Path(zoo.__file__).resolve().parent)}
    return cached_graph(key, make)
