"""Where a measured training step's time goes, per rank: the ``autopar calibrate`` step hook and its attribution.

The worker (:mod:`autopar.planner.run.worker`) calls :func:`profile_step` after every step when launched with
``--step-hook autopar.planner.run.attribution:profile_step``.  It profiles steps ``START+1 .. STOP`` with
``torch.profiler`` (CPU activity; CUDA too where available) and writes ``rank<R>.json`` under ``DIR``, from the
environment variables ``AUTOPAR_CALIBRATE_DIR``, ``AUTOPAR_CALIBRATE_START`` and ``AUTOPAR_CALIBRATE_STOP``.

:func:`attribute` splits the profiled window of the rank's host threads (the training loop, and autograd's device
thread on CUDA) into

- ``comm``: collectives (``c10d::*`` and functional collectives, DTensor's included), outermost calls, and the wait
  of an asynchronous one (the host's gap until its next op);
- ``p2p``: pipeline sends and receives (``c10d::send``/``recv`` and their waits), which hold the transfer *and* the
  pipeline bubble (a stage waiting for its neighbour);
- ``idle``: barriers and the program's per-step loss all-reduce
  (``autopar::loss_sync``, a one-element collective whose time is waiting for the slowest rank): waiting for the
  slowest rank, which no cost-model term describes (on a machine shared with other work it is the ranks' uneven
  share of the cores);
- ``optimizer``: ``Optimizer.step`` and ``zero_grad``;
- ``compute``: the rest of the window (ops and the eager framework time between them), of which ``matmul`` is the part
  inside matmul-like ops (mm, addmm, bmm, linear, attention, convolution).

While profiling, :func:`profile_step` names the waits the profiler would otherwise count as compute
(:func:`instrument`): the loss all-reduce above; ``torch.distributed.pipelining``'s waits for its sends and
receives (``autopar::p2p_wait``, inside the schedule's forward/backward actions: the pipeline's bubble); and every
blocking ``Work.wait()`` (``c10d::wait``: FSDP2's all-gather wait inside its copy-out, a synchronous collective's
wait after its call), in the category of what encloses it or, at top level, of the thread's last collective, p2p
or barrier call.

Times are per step (the window divided by the number of profiled steps).  On CUDA the host timeline still attributes
waits (collectives and synchronizations block the host), so the same split applies.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["CATEGORIES", "ENV_DIR", "ENV_START", "ENV_STOP", "LOSS_SYNC", "P2P_WAIT", "WAIT", "attribute",
           "category", "instrument", "profile_step"]

ENV_DIR, ENV_START, ENV_STOP = "AUTOPAR_CALIBRATE_DIR", "AUTOPAR_CALIBRATE_START", "AUTOPAR_CALIBRATE_STOP"
CATEGORIES = ("compute", "comm", "p2p", "idle", "optimizer")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
           "aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "aten::conv", "aten::_conv",
           "aten::convolution", "aten::cudnn_convolution", "aten::mkldnn_convolution")
_P2P = ("c10d::send", "c10d::recv", "c10d::isend", "c10d::irecv", "c10d::batch_isend_irecv")
LOSS_SYNC, P2P_WAIT, WAIT = "autopar::loss_sync", "autopar::p2p_wait", "c10d::wait"


def category(name: str) -> str | None:
    """The attribution category of a profiler event name (None: part of whatever encloses it, or compute)."""
    if name.startswith("Optimizer."):
        return "optimizer"
    if "barrier" in name or name == LOSS_SYNC:
        return "idle"
    if name.startswith(_P2P) or name == P2P_WAIT:
        return "p2p"
    if name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::")) or name in (
            "aten::wait", "wait_tensor", "record_param_comms"):
        return "comm"
    if name.startswith(_MATMUL):
        return "matmul"
    return None


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def attribute(events: Iterable[tuple[Any, ...]], window_s: float, steps: int) -> dict[str, float]:
    """Seconds per step in each of :data:`CATEGORIES` (plus ``matmul`` within ``compute`` and ``step``).

    ``events``: ``(name, start_s, end_s, parent_index[, thread])``, ``parent_index`` indexing the same list (None for
    a top-level event); several threads may be concatenated (on CUDA autograd runs the backward on a thread of its
    own).  Each event counts in the category of its outermost categorised ancestor-or-self, so a collective inside
    DTensor's redistribution counts as communication and a matmul inside it does not count twice; the time a
    category covers is the union of its events' intervals, so concurrent threads do not count it twice either.
    Asynchronous collectives and receives return before they complete and their wait is no profiler event: the gap
    on the same thread from a top-level collective (p2p) call to the thread's next top-level event counts as that
    collective's (p2p's) time.
    """
    if steps < 1 or window_s <= 0:
        raise ValueError(f"need steps >= 1 and a positive window, got steps={steps}, window_s={window_s}")
    cats: list[str | None] = []
    spans: dict[str, list[tuple[float, float]]] = {c: [] for c in ("comm", "p2p", "idle", "optimizer", "matmul")}
    tops: dict[Any, list[tuple[float, float, str | None]]] = {}
    waited: dict[Any, str] = {}  # per thread: the category of its last top-level collective, p2p or barrier call
    for ev in events:
        name, start, end, parent = ev[:4]
        if parent is not None and not 0 <= parent < len(cats):
            raise ValueError(f"event {name!r}: parent {parent} must come earlier in the list")
        inherited = cats[parent] if parent is not None else None
        own = category(name)
        thread = ev[4] if len(ev) > 4 else 0
        if parent is None and name == WAIT:  # a blocking wait on the work of the call it follows
            own = waited.get(thread, "comm")
        elif parent is None and own in ("comm", "p2p", "idle"):
            waited[thread] = own
        cats.append(inherited or own)
        if own is not None and inherited is None and end > start:
            spans[own].append((start, end))
        if parent is None:
            tops.setdefault(thread, []).append((start, end, own))
    for top in tops.values():
        top.sort()
        for (_, end, own), (nxt, _, _) in itertools.pairwise(top):
            if own in ("comm", "p2p") and nxt > end:
                spans[own].append((end, nxt))
    out = {c: _union(v) / steps for c, v in spans.items()}
    out["step"] = window_s / steps
    out["compute"] = max(0.0, out["step"] - out["comm"] - out["p2p"] - out["idle"] - out["optimizer"])
    return out


def _cpu_thread_events(prof: Any) -> list[tuple[str, float, float, int | None, int]]:
    """``(name, start_s, end_s, parent_index, thread)`` of every host thread's events, thread by thread in start order,
    parents first (background communication threads name their events ``gloo:``/``nccl:``, which are not
    categorised, so they add nothing)."""
    evs = [e for e in prof.events() if getattr(e, "device_type", None) is None or str(e.device_type).endswith("CPU")]
    out: list[tuple[str, float, float, int | None, int]] = []
    for thread in sorted({e.thread for e in evs}):
        mine = sorted((e for e in evs if e.thread == thread), key=lambda e: (e.time_range.start, -e.time_range.end))
        base = len(out)
        index = {id(e): base + i for i, e in enumerate(mine)}
        for e in mine:
            par = e.cpu_parent
            while par is not None and id(par) not in index:
                par = par.cpu_parent
            p = index.get(id(par)) if par is not None else None
            out.append((e.name, e.time_range.start * 1e-6, e.time_range.end * 1e-6, p, thread))
    return out


class _State:
    prof: Any = None
    t0: float = 0.0
    undo: Any = None


def instrument() -> Callable[[], None]:
    """Name the waits for the profiler (see the module docstring): wrap the program's loss all-reduce in
    :data:`LOSS_SYNC`, the pipeline schedule's p2p waits in :data:`P2P_WAIT` and ``Work.wait`` in :data:`WAIT`.
    Returns the function that undoes it."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules
    from torch.profiler import record_function

    from autopar.codegen.runtime.program import ParallelProgram

    wait, reduce = schedules._wait_batch_p2p, ParallelProgram._reduce_loss
    work = dist.distributed_c10d.Work
    work_wait = work.wait

    def named_work_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        with record_function(WAIT):
            return work_wait(self, *args, **kwargs)

    def named_wait(work: Any) -> Any:
        with record_function(P2P_WAIT):
            return wait(work)

    def named_reduce(self: Any, loss: Any) -> float:
        with record_function(LOSS_SYNC):
            return reduce(self, loss)

    schedules._wait_batch_p2p = named_wait
    ParallelProgram._reduce_loss = named_reduce  # type: ignore[method-assign]
    work.wait = named_work_wait  # type: ignore[method-assign]

    def undo() -> None:
        schedules._wait_batch_p2p = wait
        ParallelProgram._reduce_loss = reduce  # type: ignore[method-assign]
        work.wait = work_wait  # type: ignore[method-assign]
    return undo


def profile_step(step: int) -> None:
    """Worker step hook (``--step-hook autopar.planner.run.attribution:profile_step``); see the module docstring."""
    import time

    import torch

    out_dir = os.environ.get(ENV_DIR)
    if not out_dir:
        return
    start, stop = int(os.environ[ENV_START]), int(os.environ[ENV_STOP])
    if step == start:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        _State.undo = instrument()
        _State.prof = torch.profiler.profile(activities=acts)
        _State.prof.__enter__()
        _State.t0 = time.perf_counter()
    elif step == stop and _State.prof is not None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        window = time.perf_counter() - _State.t0
        _State.prof.__exit__(None, None, None)
        _State.undo()
        rank = int(os.environ.get("RANK", "0"))
        res = attribute(_cpu_thread_events(_State.prof), window, stop - start)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": stop - start, **res}))
        _State.prof = None
