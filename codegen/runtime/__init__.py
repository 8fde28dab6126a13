"""Plan -> torch.distributed program: mesh, layer-group split, DTensor TP, FSDP2/replicate, pipelining, sharded init.

Entry point: :func:`autopar.codegen.runtime.program.build_program` (inside a process group). The torchrun launcher
and worker that run a plan by model name live in :mod:`autopar.planner.run`.
"""

from autopar.codegen.runtime.program import ParallelProgram, build_program

__all__ = ["ParallelProgram", "build_program"]
