"""autopar's planner: the search over hybrid parallel plans, and the public entry points.

    from autopar.planner import auto_parallel, plan

The names load their modules (and torch, OR-Tools) on first use, so the ``autopar`` command line
(:mod:`autopar.planner.cli`) starts without them for commands that do not need them (``models``, ``show``, ``diff``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only (resolved lazily below)
    from autopar.planner.api import AutoParallel, auto_parallel, plan
    from autopar.planner.options import PlanOptions, parse_pins
    from autopar.planner.search import PlanInfeasibleError, SearchResult, search

__all__ = ["AutoParallel", "PlanInfeasibleError", "PlanOptions", "SearchResult", "auto_parallel", "parse_pins", "plan",
           "search"]

_LAZY = {"AutoParallel": "api", "auto_parallel": "api", "plan": "api", "PlanOptions": "options",
         "parse_pins": "options", "PlanInfeasibleError": "search", "SearchResult": "search", "search": "search"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"autopar.planner.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar.planner' has no attribute {name!r}")


class _PlannerModule(types.ModuleType):
    """``autopar.planner.search`` names both a submodule and the function it defines; importing the submodule binds
    the module to the package's ``search`` attribute, so the function is bound instead (as when this package
    imported it eagerly)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "search" and isinstance(value, types.ModuleType):
            value = value.search
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _PlannerModule
