"""autopar: automatic parallelization planner and compiler for PyTorch training.

    from autopar import auto_parallel, plan

The repository's top-level folders are its subpackages: :mod:`autopar.ir` (what the model computes),
:mod:`autopar.profiles` (what the hardware costs), :mod:`autopar.planner` (what to do), :mod:`autopar.codegen` (doing
it) and :mod:`autopar.zoo` (the built-in models). Importing ``autopar`` is cheap: the entry points below load their
modules (and torch) on first use, so ``autopar --help`` answers fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "auto_parallel": "autopar.planner.api",
    "plan": "autopar.planner.api",
    "AutoParallel": "autopar.planner.api",
    "PlanOptions": "autopar.planner.options",
    "search": "autopar.planner.search",
    "PlanInfeasibleError": "autopar.planner.search",
    "trace": "autopar.ir.trace",
    "TensorSpec": "autopar.ir.trace",
    "Plan": "autopar.ir.plan",
    "load_plan": "autopar.ir.plan",
    "load_builtin": "autopar.profiles.builtin",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only (names resolved lazily below)
    from autopar.ir.plan import Plan, load_plan  # noqa: F401
    from autopar.ir.trace import TensorSpec, trace  # noqa: F401
    from autopar.planner.api import AutoParallel, auto_parallel, plan  # noqa: F401
    from autopar.planner.options import PlanOptions  # noqa: F401
    from autopar.planner.search import PlanInfeasibleError, search  # noqa: F401
    from autopar.profiles.builtin import load_builtin  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in ("ir", "profiles", "planner", "codegen", "zoo"):
        return importlib.import_module(f"autopar.{name}")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
