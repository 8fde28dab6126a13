"""Launch a plan with torchrun on this machine: ``run_plan(plan.yaml, model, steps)`` (``autopar run`` calls it).

Multi-node runs pass torchrun's rendezvous options through ``extra_torchrun_args`` (``--nnodes 2 --node-rank 0
--rdzv-backend c10d --rdzv-endpoint host:29500``); ``nproc`` defaults to the plan's devices per node.

Fault tolerance: with ``max_restarts > 0`` torchrun restarts the whole worker group when a rank dies, and the
workers (given a checkpoint directory) resume from the latest checkpoint; see :mod:`autopar.planner.run.worker`.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from autopar import ir
from autopar.ir.errors import AutoparError
from autopar.planner.run import FAILURE_DIR_ENV

__all__ = ["check_checkpoint_dir", "checkpoint_lock", "run_plan", "torchrun_command"]

log = logging.getLogger(__name__)


def torchrun_command(plan_path: str | Path, model_name: str, steps: int, nproc: int | None = None,
                     extra_torchrun_args: Sequence[str] = (), worker_args: Sequence[str] = (),
                     max_restarts: int = 0) -> list[str]:
    """The command line that runs ``autopar.planner.run.worker`` for the plan under torchrun's agent: torchrun's
    options as torchrun takes them, through :mod:`autopar.planner.run.agent` (workers forked from a preloaded server).

    ``max_restarts``: how often torchrun restarts the worker group after a rank fails (``--max-restarts``)."""
    plan = ir.load_plan(plan_path)
    n = nproc if nproc is not None else plan.devices_per_node
    if n < 1:
        raise ValueError(f"nproc must be >= 1, got {n}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    extra = list(extra_torchrun_args)
    if not any(a.startswith("--nnodes") for a in extra) and n != plan.world_size:
        raise ValueError(f"the plan needs {plan.world_size} processes but one node would start {n}; pass "
                         "--nnodes/--rdzv options for a multi-node run or re-plan for this machine")
    if not any(a.startswith(("--rdzv", "--master-port", "--master_port")) for a in extra):
        extra = ["--standalone", *extra]
    if max_restarts and not any(a.startswith(("--max-restarts", "--max_restarts")) for a in extra):
        extra = ["--max-restarts", str(max_restarts), *extra]
    return [sys.executable, "-u", "-m", "autopar.planner.run", "--nproc-per-node", str(n), *extra,
            "-m", "autopar.planner.run.worker", str(plan_path), "--model", model_name, "--steps", str(steps),
            *worker_args]


def check_checkpoint_dir(directory: str | Path, resume: bool) -> int | None:
    """Refuse a launch that would mix runs in one checkpoint directory; returns the step a ``resume`` starts from.

    Without ``resume`` the directory must hold no checkpoint (a fresh run would overwrite it); with ``resume`` it
    must hold one."""
    from autopar.codegen.checkpoint_dir import latest_checkpoint

    found = latest_checkpoint(directory)
    if resume and found is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {directory} (expected step_* directories and a 'latest' "
                                "marker written by `autopar run --checkpoint-dir`); drop --resume to start fresh")
    if not resume and found is not None:
        raise ValueError(f"{directory} already holds a checkpoint (step {found[1]}); pass --resume to continue "
                         "from it, or choose an empty --checkpoint-dir")
    return found[1] if found else None


@contextmanager
def checkpoint_lock(directory: str | Path | None, torchrun_args: Sequence[str] = ()) -> Iterator[None]:
    """Hold the exclusive lock of checkpoint ``directory`` (None: nothing) for a launch: a second run on it fails at
    once (CheckpointLockedError).  The workers see ``$AUTOPAR_CHECKPOINT_LOCK`` and rely on this process's lock.
    In a multi-node launch only node 0's launcher locks (the directory is shared by every node's)."""
    if directory is None or _node_rank(torchrun_args) != 0:
        yield
        return
    from autopar.codegen.checkpoint_dir import LOCK_ENV, CheckpointLock, check_private

    key = str(Path(directory).resolve())
    before = os.environ.get(LOCK_ENV)
    with CheckpointLock(key):
        check_private(Path(key))  # another user's or a shared directory fails here, not in the workers
        os.environ[LOCK_ENV] = key
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(LOCK_ENV, None)
            else:
                os.environ[LOCK_ENV] = before


def _node_rank(torchrun_args: Sequence[str]) -> int:
    """This launcher's node rank: torchrun's ``--node-rank``/``--node_rank`` (or ``$NODE_RANK``), default 0."""
    args = list(torchrun_args)
    for i, a in enumerate(args):
        for flag in ("--node-rank", "--node_rank"):
            if a == flag and i + 1 < len(args):
                return int(args[i + 1]) if args[i + 1].isdigit() else 0
            if a.startswith(flag + "="):
                v = a.split("=", 1)[1]
                return int(v) if v.isdigit() else 0
    v = os.environ.get("NODE_RANK", "0")
    return int(v) if v.isdigit() else 0


def run_plan(plan_path: str | Path, model_name: str, steps: int, nproc: int | None = None,
             extra_torchrun_args: Sequence[str] = (), worker_args: Sequence[str] = (),
             timeout_s: float | None = None, max_restarts: int = 0, summarize: bool = False,
             seq: int | None = None) -> int:
    """Run the plan under torchrun (gloo on CPU, nccl on CUDA) and return torchrun's exit code.

    ``seq``: the sequence length the plan was made for (``autopar plan --seq``); the launcher checks the plan against
    the model built with it and the workers build it so.

    ``summarize``: raise :class:`WorkerFailure` (one line: the failing rank and its cause, out-of-space first)
    instead of returning a non-zero exit code.  ``timeout_s`` counts from the call (the launcher's checks included).

    The workers log loss and step time per step and, at the end, measured vs predicted step time per stage.
    torchrun runs in its own process group; past ``timeout_s`` (raises ``TimeoutError``) or on Ctrl-C that whole
    group (torchrun and every worker, restarted ones included) is terminated."""
    from autopar.planner.run.preflight import plan_graph

    start = time.monotonic()  # --timeout counts from here: the checks below are part of the run
    worker_args = [*worker_args, *(["--seq", str(seq)] if seq is not None else [])]
    cmd = torchrun_command(plan_path, model_name, steps, nproc, extra_torchrun_args, worker_args, max_restarts)
    with _factory_limit(timeout_s):  # a hanging model factory is stopped within --timeout too
        plan_graph(ir.load_plan(plan_path), model_name, seq)  # another model's plan, or one that does not fit it, stops
    env = dict(os.environ)
    failures = tempfile.mkdtemp(prefix="autopar-failures-")
    env[FAILURE_DIR_ENV] = failures
    env.setdefault("OMP_NUM_THREADS", "1")
    # A fresh rendezvous store for every restart.  By default torchrun's c10d rendezvous keeps one shared TCPStore
    # for all rounds while the workers' env:// init assumes a new store per retry and adds no per-attempt prefix, so
    # a restarted group can read a dead attempt's peer addresses (gloo: "Connection refused" connecting to the old
    # port, or a hang) before the new peers overwrite them (pytorch/pytorch#135712, NCCL's unique id alike; in
    # torch 2.13 the shared server is still built only once per agent).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    log.info("launching: %s", " ".join(cmd))
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            raise TimeoutError(f"the run did not finish within {timeout_s:g} s (stopped after "
                               f"{time.monotonic() - start:.1f} s): torchrun and its workers are stopped") from None
        except BaseException:
            _stop_group(proc)
            raise
        if rc and summarize:
            raise WorkerFailure(_summary(Path(failures), rc))
        return rc
    finally:
        shutil.rmtree(failures, ignore_errors=True)


@contextmanager
def _factory_limit(timeout_s: float | None) -> Iterator[None]:
    from autopar.zoo.factory_guard import FACTORY_TIMEOUT_ENV

    before = os.environ.get(FACTORY_TIMEOUT_ENV)
    if timeout_s is not None:
        current = float(before) if before and before.replace(".", "", 1).isdigit() else 600.0
        os.environ[FACTORY_TIMEOUT_ENV] = str(min(current, max(timeout_s, 0.001)))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FACTORY_TIMEOUT_ENV, None)
        else:
            os.environ[FACTORY_TIMEOUT_ENV] = before


class WorkerFailure(AutoparError):
    """A worker rank failed; the message is one line naming the rank and the cause."""


def _summary(failures: Path, rc: int) -> str:
    """One line for a failed run: the rank and cause, from torchrun's last attempt that reported one (named when the
    group was restarted).  A full disk comes first (it explains the others' failures), then the rank that failed
    first: its peers fail after it, in the collective it left ("Connection closed by peer")."""
    found = []
    for f in failures.glob("rank*.txt"):
        try:
            found.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    if not found:
        return (f"the workers failed (torchrun exit {rc}) without reporting a cause: a rank was killed or ran out "
                "of memory? see the output above")
    last = max(int(r.get("attempt", 0)) for r in found)
    found = [r for r in found if int(r.get("attempt", 0)) == last]
    when = f" (torchrun restart {last}, the last to report a cause)" if last else ""

    def order(r: dict[str, Any]) -> tuple[int, float, int]:
        full = r.get("errno") == errno.ENOSPC or "No space left" in r["cause"]
        when = r.get("time")
        return (0 if full else 1, when if isinstance(when, (int, float)) else math.inf,
                int(r["rank"]) if str(r["rank"]).isdigit() else 1 << 30)

    first = min(found, key=order)
    others = f" ({len(found) - 1} other rank(s) failed too)" if len(found) > 1 else ""
    return f"rank {first['rank']} failed{when}: {first['cause']}{others}; the workers' output is above"


def _stop_group(proc: subprocess.Popen[Any]) -> None:
    stop_process_tree(proc)


def stop_process_tree(proc: subprocess.Popen[Any], grace_s: float = 3.0) -> None:
    """Stop torchrun (started with ``start_new_session=True``) and every process below it, then reap it.

    SIGTERM to torchrun's process group first (torchrun forwards it to its workers), then SIGKILL to that group and
    to every descendant.  The descendants need their own signal: torchrun starts each worker in a session of its
    own, so killing torchrun's group alone orphans the workers, and they keep running (and keep the launcher's
    output pipes open) after torchrun is gone.  They are listed before torchrun is signalled, while they are still
    its children, and again before the SIGKILL (a restarted group's workers)."""
    tree = set(_descendants(proc.pid))
    if grace_s > 0:
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            tree |= set(_descendants(proc.pid))
    _killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), read from /proc; empty where there is no /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for e in entries:
        try:
            with open(f"/proc/{e}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name, in parentheses, may hold spaces
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
