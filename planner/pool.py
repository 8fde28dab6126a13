"""A process pool for the search's independent pieces of work (intra-op solves, screening, exact evaluation), results
in a fixed order.

Workers are forked, so they inherit the parent's imports (OR-Tools) and the search state (graph, cost model) without
pickling it; only the small task arguments and the results cross processes. One :class:`Pool` serves every phase of
a search: its workers are forked once, at the first parallel :meth:`Pool.map`, and keep what they touched (pages
copied on write, warm caches) for the later phases. Where ``fork`` is unavailable (Windows; macOS defaults to
spawn, which would re-import torch in every worker at about 2 CPU-s each) the work runs in-process, as it does for
``workers=1``. Results come back in the order of the arguments whatever the worker count or finishing order, so the
plan is the same bytes for any ``workers``.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Generic, TypeVar

__all__ = ["Pool", "available_cores", "fork_available", "map_ordered"]

log = logging.getLogger(__name__)
A = TypeVar("A")
R = TypeVar("R")
S = TypeVar("S")
_STATE: Any = None
"""Set in a forked worker only: the state it was forked with."""


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _init(state: Any) -> None:
    global _STATE
    _STATE = state


def _call(task: tuple[Callable[[Any, Any], Any], Any]) -> Any:
    fn, arg = task
    return fn(_STATE, arg)


class Pool(Generic[S]):
    """``workers`` forked processes that run ``fn(state, arg)`` for module-level functions ``fn``.

    ``state`` is inherited as it is when the workers start (the first :meth:`map` with two or more tasks), never
    pickled; later changes to it in this process are not seen by the workers. Use as a context manager: leaving it
    stops the workers."""

    def __init__(self, state: S, workers: int) -> None:
        self.state = state
        self.parallel = workers > 1 and fork_available()
        self._workers = workers
        self._ex: ProcessPoolExecutor | None = None

    @property
    def started(self) -> bool:
        """Whether the workers are running (a parallel map has run)."""
        return self._ex is not None

    def map(self, fn: Callable[[S, A], R], args: Sequence[A]) -> list[R]:
        """``[fn(state, a) for a in args]``, on the workers when there are two or more tasks. Put the costliest
        tasks first: workers take them in order."""
        if not self.parallel or len(args) < 2:
            return [fn(self.state, a) for a in args]
        if self._ex is None:
            # the inherited heap stays out of the workers' collections: no copy-on-write of every page they scan
            gc.freeze()
            self._ex = ProcessPoolExecutor(max_workers=self._workers, mp_context=multiprocessing.get_context("fork"),
                                           initializer=_init, initargs=(self.state,))
        try:
            return list(self._ex.map(_call, [(fn, a) for a in args]))
        except BrokenProcessPool as e:  # a worker died (killed, out of memory): do the work here instead
            log.warning("search worker process failed (%s); continuing in-process", e)
            self.close()
            self.parallel = False
            return [fn(self.state, a) for a in args]

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None
            gc.unfreeze()

    def __enter__(self) -> Pool[S]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_ordered(fn: Callable[[Any, A], R], state: Any, args: Sequence[A], workers: int) -> list[R]:
    """``[fn(state, a) for a in args]`` on a :class:`Pool` of up to ``workers`` processes used for this one map."""
    with Pool(state, min(workers, len(args))) as pool:
        return pool.map(fn, args)
