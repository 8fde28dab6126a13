"""Pipeline stages and schedules with ``torch.distributed.pipelining``.

Stage i of the plan (``Plan.stages[i]``, ``pp * virtual_stages`` of them) runs on pipeline rank ``i % pp``: with one
virtual stage per rank that is the usual contiguous split; with v > 1 it is the looped placement of interleaved 1F1B
(Narayanan et al. SC'21, Sec. 2.2.1).  Schedules: GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan et al.
2021) and interleaved 1F1B.  Gradients are scaled by 1/num_microbatches (the loss is a mean over micro-batches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from autopar import ir

__all__ = ["local_stage_indices", "build_schedule"]

log = logging.getLogger(__name__)


def local_stage_indices(plan: ir.Plan, pp_rank: int) -> list[int]:
    """Indices of the plan's stages that run on pipeline rank ``pp_rank``."""
    return [i for i in range(len(plan.stages)) if i % plan.mesh.pp == pp_rank]


Examples = tuple[torch.Tensor, ...] | None


def build_schedule(plan: ir.Plan, modules: list[nn.Module], indices: list[int], group: dist.ProcessGroup,
                   device: torch.device, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   examples: list[tuple[Examples, Examples]] | None = None) -> object:
    """The plan's schedule over this rank's stage modules.  ``examples[k]``: (inputs, outputs) of local stage k as
    empty tensors, when known: the stages are then declared statically instead of inferred by a trial run."""
    n = len(plan.stages)
    examples = examples or [(None, None)] * len(modules)
    stages = [PipelineStage(m, i, n, device, group=group, input_args=ins, output_args=outs)
              if ins is not None and outs is not None else PipelineStage(m, i, n, device, group=group)
              for m, i, (ins, outs) in zip(modules, indices, examples)]
    mb = plan.num_microbatches
    if plan.schedule == "interleaved_1f1b" or len(stages) > 1:
        if mb % plan.mesh.pp:
            raise ValueError(f"interleaved 1F1B needs num_microbatches ({mb}) divisible by pp ({plan.mesh.pp})")
        return ScheduleInterleaved1F1B(stages, n_microbatches=mb, loss_fn=loss_fn)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[plan.schedule]
    return cls(stages[0], n_microbatches=mb, loss_fn=loss_fn)
