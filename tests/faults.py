"""Fault injection for the resume tests, run inside the workers as ``autopar run --step-hook faults:kill_rank``.

With ``FAULT_KILL_AT_STEP=S`` (and ``FAULT_KILL_RANK=R``, default 1) rank R exits hard (``os._exit(1)``, no
cleanup) right after step S, before that step's checkpoint, but only on torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) so the restarted group can finish. The tests put this folder on PYTHONPATH.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

log = logging.getLogger("autopar.planner.run.worker")


def kill_rank(step: int) -> None:
    at = os.environ.get("FAULT_KILL_AT_STEP")
    if (at and int(at) == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and dist.get_rank() == int(os.environ.get("FAULT_KILL_RANK", "1"))):
        log.warning("fault injection: rank %d exits after %d steps", dist.get_rank(), step)
        os._exit(1)
