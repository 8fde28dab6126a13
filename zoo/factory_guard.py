"""Running a user's ``package.module:factory`` under a time limit, with its failures turned into one-line errors.

A factory is user code: it may hang (``autopar trace pkg:make`` would hang with it), raise, or call ``sys.exit``
(which used to end the CLI with status 0 and no output).  :func:`guarded` runs the import and the call with an
interval timer (``$AUTOPAR_FACTORY_TIMEOUT_S``, default 600 s; main thread on POSIX only) and raises ``ValueError``
naming the factory for a timeout, a ``SystemExit`` or an exception (its type and first line).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["FACTORY_TIMEOUT_ENV", "guarded"]

FACTORY_TIMEOUT_ENV = "AUTOPAR_FACTORY_TIMEOUT_S"
T = TypeVar("T")


class _Expired(BaseException):
    """Raised by the timer inside the factory (a BaseException: a factory's ``except Exception`` cannot eat it)."""


def _limit() -> float:
    try:
        return float(os.environ.get(FACTORY_TIMEOUT_ENV, "600"))
    except ValueError:
        return 600.0


@contextmanager
def _timer(seconds: float) -> Iterator[None]:
    if seconds <= 0 or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _Expired

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def guarded(ref: str, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` (importing or calling the factory ``ref``; ``what`` says which) under the time limit."""
    limit = _limit()
    try:
        with _timer(limit):
            return fn()
    except _Expired:
        raise ValueError(f"{what} {ref!r} did not finish within {limit:g} s: does it hang (a download, a prompt, a "
                         f"deadlock)? set {FACTORY_TIMEOUT_ENV} to allow longer") from None
    except SystemExit as e:
        raise ValueError(f"{what} {ref!r} called sys.exit({e.code!r}) instead of returning a model: a factory must "
                         "return an nn.Module, a (module, example_inputs) pair or a ModelSpec") from None
    except (ValueError, ImportError):  # already worded for the user (the caller words ImportError)
        raise
    except Exception as e:  # the user's code failed: say where and why, in one line
        raise ValueError(f"{what} {ref!r} failed: {_first(e)}") from e
