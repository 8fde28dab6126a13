"""Running a plan on this machine: the torchrun launcher (:mod:`autopar.planner.run.torchrun`) and the per-rank
training program it starts (``python -m autopar.planner.run.worker plan.yaml --model M``).

They sit above codegen because they resolve models by name (the zoo or ``package.module:factory``) and feed data;
codegen itself only turns a Plan and a model into a program. The names below load the launcher (and torch) on first
use, so :mod:`autopar.planner.run.attribution` and the command line's parser stay free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only (resolved lazily below)
    from autopar.planner.run.torchrun import check_checkpoint_dir, run_plan, torchrun_command

__all__ = ["FAILURE_DIR_ENV", "check_checkpoint_dir", "run_plan", "torchrun_command"]

FAILURE_DIR_ENV = "AUTOPAR_FAILURE_DIR"
"""Set by the launcher: each failing rank writes ``rank<N>.attempt<A>.txt`` there (``A``: torchrun's restart count),
one line, for its one-line summary."""


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("autopar.planner.run.torchrun"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar.planner.run' has no attribute {name!r}")
