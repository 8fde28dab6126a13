"""autopar.planner.run.torchrun.stop_process_tree: a launcher whose child runs in a session of its own (as torchrun
starts its workers) is stopped together with that child, and the launcher's output pipe closes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from autopar.planner.run.torchrun import stop_process_tree

# The launcher starts a worker in a new session (torchrun's workers: start_new_session=True), prints its pid, and both
# sleep; the worker inherits the launcher's stdout, as torchrun's workers do.
LAUNCHER = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(w.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the process tree is read from /proc")
@pytest.mark.parametrize("grace_s", [0.0, 1.0])
def test_stops_workers_in_their_own_sessions(grace_s: float) -> None:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    worker = int(proc.stdout.readline())
    assert os.getsid(worker) == worker != os.getsid(proc.pid)
    start = time.monotonic()
    stop_process_tree(proc, grace_s=grace_s)
    assert proc.returncode is not None
    assert proc.stdout.read() == ""  # EOF: nothing holds the pipe open any more
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)   # the orphaned worker is reaped by init
    assert not _alive(worker), "the worker outlived the launcher"
    assert time.monotonic() - start < grace_s + 5
