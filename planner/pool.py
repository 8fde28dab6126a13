"""A process pool for the search's independent pieces of work (intra-op solves, screening), results in a fixed order.

Workers are forked, so they inherit the parent's imports (torch, OR-Tools) and the search state (graph, cost model,
solved tables) without pickling it; only the small task arguments and the results cross processes. Where ``fork``
is unavailable (Windows; macOS defaults to spawn, which would re-import torch in every worker at about 2 CPU-s each)
the work runs in-process, as it does for ``workers=1``. Results come back in the order of the arguments whatever
the worker count or finishing order, so the plan is the same bytes for any ``workers``.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence, TypeVar

__all__ = ["available_cores", "fork_available", "map_ordered"]

log = logging.getLogger(__name__)
A = TypeVar("A")
R = TypeVar("R")
_WORKER: tuple[Callable[[Any, Any], Any], Any] | None = None
"""Set in a forked worker only: the task function and the state it was forked with."""


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _init(fn: Callable[[Any, Any], Any], state: Any) -> None:
    global _WORKER
    _WORKER = (fn, state)


def _call(arg: Any) -> Any:
    assert _WORKER is not None, "pool task outside a forked worker"
    fn, state = _WORKER
    return fn(state, arg)


def map_ordered(fn: Callable[[Any, A], R], state: Any, args: Sequence[A], workers: int) -> list[R]:
    """``[fn(state, a) for a in args]``, on up to ``workers`` forked processes when that is possible and there is
    more than one task. ``fn`` must be a module-level function; ``state`` is inherited, not pickled. Put the
    costliest tasks first: workers take them in order."""
    if workers <= 1 or len(args) < 2 or not fork_available():
        return [fn(state, a) for a in args]
    ctx = multiprocessing.get_context("fork")
    gc.freeze()  # the inherited heap stays out of the workers' collections: no copy-on-write of every page they scan
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(args)), mp_context=ctx, initializer=_init,
                                 initargs=(fn, state)) as ex:
            return list(ex.map(_call, args))
    except BrokenProcessPool as e:  # a worker died (killed, out of memory): do the work here instead
        log.warning("search worker process failed (%s); continuing in-process", e)
        return [fn(state, a) for a in args]
    finally:
        gc.unfreeze()
