"""autopar's graph IR: what the model computes (trace -> Graph), op rules, the Plan type and its YAML form.

Importing it does not import torch: ``trace`` and ``TensorSpec`` load :mod:`autopar.ir.trace` (and torch) on first
use, so reading and printing plans stays fast.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from autopar.ir.errors import AutoparError, ExampleInputError, IRVerificationError, SchemaError, TraceError
from autopar.ir.graph import DTYPE_BYTES, Graph, LayerGroup, Node, ParamInfo, TensorMeta
from autopar.ir.ops import OpKind
from autopar.ir.passes import Pass, PassOptions, decompose_attention, default_pipeline, group_layers, run_passes
from autopar.ir.placement import Placement, Recompute, Schedule
from autopar.ir.plan import (
                     PLAN_SCHEMA_VERSION,
                     MemoryBreakdown,
                     MeshPlan,
                     OpSharding,
                     ParamSharding,
                     Plan,
                     SolverReport,
                     StagePlan,
                     TimeBreakdown,
                     dump_plan,
                     load_plan,
                     plan_from_yaml,
                     plan_to_yaml,
)
from autopar.ir.verify import verify

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only (resolved lazily below)
    from autopar.ir.trace import TensorSpec, trace

__all__ = [
    "DTYPE_BYTES", "PLAN_SCHEMA_VERSION", "AutoparError", "ExampleInputError", "Graph", "IRVerificationError",
    "LayerGroup", "MemoryBreakdown", "MeshPlan", "Node", "OpKind", "OpSharding", "ParamInfo", "ParamSharding", "Pass",
    "PassOptions", "Placement", "Plan", "Recompute", "Schedule", "SchemaError", "SolverReport", "StagePlan",
    "TensorMeta", "TensorSpec", "TimeBreakdown", "TraceError", "decompose_attention", "default_pipeline", "dump_plan",
    "group_layers", "load_plan", "plan_from_yaml", "plan_to_yaml", "run_passes", "trace", "verify",
]

_LAZY = ("trace", "TensorSpec")  # from autopar.ir.trace, which imports torch


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module("autopar.ir.trace"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar.ir' has no attribute {name!r}")


class _IRModule(types.ModuleType):
    """``autopar.ir.trace`` names both a submodule and the function it defines. Importing the submodule binds the
    module to the package's ``trace`` attribute; here the function is bound instead, so ``ir.trace(model, ...)``
    works whichever module imported :mod:`autopar.ir.trace` first (as when this package imported it eagerly)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "trace" and isinstance(value, types.ModuleType):
            value = value.trace
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _IRModule
