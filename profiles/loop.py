"""The training loop's fixed eager work per step (``runtime_overhead["step"]``), measured on the host.

Besides its ops, an eager training step pays work that does not grow with the model: the loss and its backward
(``cross_entropy`` over the output), starting autograd's engine, the optimizer's per-step path (its hooks, the loop
over parameter groups) and ``zero_grad``.  No op of the traced graph carries it (a zoo model's loss is outside the
graph), so a model of per-op costs alone puts a small model's whole step at the per-op rate: on this project's
2-core VM the fixed part is ~170 us against ~6 us for a tiny op per pass.

Measured as the intercept of a straight line through the step times of two models of ``k`` tiny linears (its slope
from adjacent pairs of timings, :func:`autopar.profiles.eager._paired_extra`), each step the loop the worker runs:
forward, ``cross_entropy``, backward, AdamW, ``zero_grad``, the loss read back; in a process of its own, in units
of the same process's per-pass op cost.  Costed once per step on every rank
(:func:`autopar.planner.inter_op.evaluate.evaluate_stages`), scaled by a fit's ``overhead`` factor.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.profiles.eager import _paired_extra, _time_calls, _training_op_overhead, in_own_process

__all__ = ["measure_step_overhead"]

SIZES = (1, 9)
"""Linears in the two models whose step times give the intercept."""


def _stepper(layers: int) -> Any:
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
    x, target = torch.ones(2, 8), torch.zeros(2, dtype=torch.long)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(net(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def _loop_worker(queue: Any, threads: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    cpu, sync = torch.device("cpu"), (lambda: None)
    per_pass = _training_op_overhead(cpu, sync, repeats)
    (k1, k2), (small, large) = SIZES, [_stepper(k) for k in SIZES]
    per_layer = _paired_extra(large, small, sync, repeats) / (k2 - k1)  # adjacent pairs: the slope
    queue.put(max(_time_calls(small, sync, repeats, 5, warmup=10) - k1 * per_layer, 0.0) / per_pass)


def measure_step_overhead(*, threads: int = 1, repeats: int = 5) -> float:
    """The training loop's fixed work per step in units of the per-pass op cost (see the module docstring)."""
    return float(in_own_process(_loop_worker, threads, repeats, timeout=300.0))
