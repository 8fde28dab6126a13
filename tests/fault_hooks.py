"""Step hooks for the failure tests (``autopar run --step-hook fault_hooks:NAME``; the tests put this folder on
PYTHONPATH): ``disk_full`` makes rank ``$FAULT_RANK`` (default 1) fail after step 1 as a full disk would, and
``crash`` makes rank ``$FAULT_RANK`` raise a RuntimeError there (its peers then fail in a collective), and ``hang``
makes every rank sleep for five minutes after step 1."""

from __future__ import annotations

import errno
import os
import time

import torch.distributed as dist


def disk_full(step: int) -> None:
    if step == 1 and dist.get_rank() == int(os.environ.get("FAULT_RANK", "1")):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/checkpoints/.tmp-step_00000001/__1_0.distcp")


def crash(step: int) -> None:
    if step == 1 and dist.get_rank() == int(os.environ.get("FAULT_RANK", "1")):
        raise RuntimeError("injected fault after step 1")


def hang(step: int) -> None:
    if step == 1:
        time.sleep(300)
