"""Launch a plan with torchrun on this machine: ``run_plan(plan.yaml, model, steps)`` (``autopar run`` calls it).

Multi-node runs pass torchrun's rendezvous options through ``extra_torchrun_args`` (``--nnodes 2 --node-rank 0
--rdzv-backend c10d --rdzv-endpoint host:29500``); ``nproc`` defaults to the plan's devices per node.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import ir

__all__ = ["torchrun_command", "run_plan"]

log = logging.getLogger(__name__)


def torchrun_command(plan_path: str | Path, model_name: str, steps: int, nproc: int | None = None,
                     extra_torchrun_args: Sequence[str] = (), worker_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line that runs ``codegen.runtime.worker`` for the plan."""
    plan = ir.load_plan(plan_path)
    n = nproc if nproc is not None else plan.devices_per_node
    if n < 1:
        raise ValueError(f"nproc must be >= 1, got {n}")
    extra = list(extra_torchrun_args)
    if not any(a.startswith("--nnodes") for a in extra) and n != plan.world_size:
        raise ValueError(f"the plan needs {plan.world_size} processes but one node would start {n}; pass "
                         "--nnodes/--rdzv options for a multi-node run or re-plan for this machine")
    if not any(a.startswith(("--rdzv", "--master-port", "--master_port")) for a in extra):
        extra = ["--standalone", *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), *extra,
            "-m", "codegen.runtime.worker", str(plan_path), "--model", model_name, "--steps", str(steps),
            *worker_args]


def run_plan(plan_path: str | Path, model_name: str, steps: int, nproc: int | None = None,
             extra_torchrun_args: Sequence[str] = (), worker_args: Sequence[str] = (),
             timeout_s: float | None = None) -> int:
    """Run the plan under torchrun (gloo on CPU, nccl on CUDA) and return torchrun's exit code.

    The workers log loss and step time per step and, at the end, measured vs predicted step time per stage."""
    cmd = torchrun_command(plan_path, model_name, steps, nproc, extra_torchrun_args, worker_args)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    log.info("launching: %s", " ".join(cmd))
    return subprocess.run(cmd, env=env, timeout=timeout_s, check=False).returncode
