"""The launch agent ``autopar run`` starts: torchrun with its workers forked from a preloaded server.

    python -u -m autopar.planner.run [torchrun options] -m autopar.planner.run.worker PLAN --model M ...

It takes torchrun's command line as is (rendezvous, ``--nnodes``, ``--max-restarts``, ``--redirects``...) and runs
torchrun's elastic agent, with one difference: the workers of :mod:`autopar.planner.run.worker` are not fresh
interpreters.  Before anything else the agent starts a fork server that imports torch, torch.distributed and
autopar's runtime once, while the agent itself imports torchrun and meets its rendezvous; each worker (and each
restarted worker) is then forked from that server and starts with everything imported.  A fresh interpreter spends
~5 CPU-s on those imports, so every rank paid it again: on a 2-core machine a 4-rank run of a small model spent
most of its time importing.

What a worker sees is what torchrun gives it: the agent's environment plus torchrun's per-rank variables
(``RANK``, ``LOCAL_RANK``, ``TORCHELASTIC_RESTART_COUNT``...), the agent's working directory and ``sys.path``, and
the agent's stdout/stderr (unbuffered, as ``python -u``).  A worker that raises exits non-zero and torchrun
reports it (and restarts the group when asked) as it would a fresh interpreter's failure.

The agent itself (torchrun's elastic agent: rendezvous, monitoring, restarts) runs in a process forked from the same
server (:func:`_run_forked_agent`), so that the launch imports torch once, in the server, rather than once there and
once more in the agent (~2 CPU-s a launch); the process started as ``python -m autopar.planner.run`` imports no
torch, waits for it, passes SIGTERM and SIGINT on to it, and exits with its exit code.  Where that child cannot be
started, the agent runs in the launched process as before.

Anything else after ``-m``/the script (another module, a script path, ``--no-python``) runs exactly as
``torchrun`` runs it, and so does the worker where the platform has no fork server or where
``AUTOPAR_FRESH_WORKERS=1`` asks for fresh interpreters (e.g. a model factory whose module must not be imported
before the rank's environment is set).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["FRESH_WORKERS_ENV", "PRELOAD", "WORKER_MODULE", "main"]

WORKER_MODULE = "autopar.planner.run.worker"
FRESH_WORKERS_ENV = "AUTOPAR_FRESH_WORKERS"
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.distributed.launcher.api", WORKER_MODULE,
           "autopar.planner.run.preflight", "autopar.codegen.runtime.program", "autopar.codegen.checkpoint",
           "autopar.zoo")
"""What the fork server imports before it forks the agent and the workers: torchrun's agent, and what every worker
imports on its way to its first step."""
_SERVER_STATE = ("_forkserver_address", "_forkserver_authkey")
"""The fork server's client state the forked agent needs to ask the same server for its workers (the address, and on
Pythons that authenticate the connection, the key); the alive fd and the resource tracker's arrive with the fork."""


def forks_workers(argv: Sequence[str]) -> bool:
    """Whether the workers of this torchrun command line are forked from the preloaded server."""
    if os.environ.get(FRESH_WORKERS_ENV, "") not in ("", "0"):
        return False
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    args = list(argv)
    return any(a in ("-m", "--module") and args[i + 1:i + 2] == [WORKER_MODULE] for i, a in enumerate(args))


def _start_fork_server() -> None:
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()  # returns at once: the server imports while the agent goes on


def _local_rendezvous(args: object) -> None:
    """torchrun's single-machine defaults: ``--standalone`` (or a static one-node launch without an endpoint) is a
    c10d store on a free local port under a fresh run id."""
    from torch.distributed.run import parse_min_max_nnodes

    single = (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
              and parse_min_max_nnodes(args.nnodes)[1] == 1)
    if args.standalone or single:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _run_forked_agent(argv: list[str]) -> int | None:
    """Run :func:`_agent` in a child of the (preloaded) fork server and return its exit code; None where the child
    could not be started (then the caller runs the agent itself)."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    state = {k: getattr(server, k) for k in _SERVER_STATE if getattr(server, k, None) is not None}
    if "_forkserver_address" not in state:
        return None
    proc = multiprocessing.get_context("forkserver").Process(target=_forked_agent, args=(argv, state),
                                                              name="autopar-agent")
    try:
        proc.start()
    except (OSError, ValueError, RuntimeError):
        return None

    def forward(signum: int, _frame: Any) -> None:
        if proc.pid is not None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    proc.join()
    code = proc.exitcode if proc.exitcode is not None else 1
    return code if code >= 0 else 128 - code  # killed by signal N: the shell's 128 + N


def _forked_agent(argv: list[str], state: dict[str, Any]) -> None:
    """The agent in a child of the fork server: it reaches the server the launching process started (the address and
    key of ``state``, the alive fd inherited) instead of starting one of its own."""
    from multiprocessing import resource_tracker

    # a process group of its own: a signal to the launcher's group (Ctrl-C, `autopar run`'s timeout) reaches the
    # agent once, through the launcher, as it reached torchrun's own agent, not twice (a second one would cut its
    # shutdown of the workers short)
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    for k, v in state.items():
        setattr(server, k, v)
    # the server is the launching process's: running while that process lives, and not a child of this one (whose
    # liveness check, a waitpid, would fail here)
    server.ensure_running = resource_tracker.ensure_running
    _agent(argv, forked=True)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    forked = forks_workers(argv)
    if forked:
        _start_fork_server()
        code = _run_forked_agent(argv)
        if code is not None:
            sys.exit(code)
    _agent(argv, forked)


def _agent(argv: list[str], forked: bool) -> None:
    """torchrun's agent for ``argv``; with ``forked`` workers of the worker module come from the fork server."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import config_from_args, parse_args, run

    args = parse_args(argv)
    if not forked or args.no_python or args.run_path or not args.module or args.training_script != WORKER_MODULE:
        record(run)(args)  # torchrun itself
        return

    def launch() -> None:
        from torch.distributed.launcher.api import elastic_launch

        from autopar.planner.run.worker import entry

        _local_rendezvous(args)
        config, _, _ = config_from_args(args)
        config.start_method = "forkserver"
        elastic_launch(config=config, entrypoint=entry)(*args.training_script_args)

    record(launch)()  # a failed worker group ends in torchrun's error summary and exit status
