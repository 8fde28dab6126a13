"""Plan -> torch.distributed program: mesh, layer-group split, DTensor TP, FSDP2/replicate, pipelining, sharded init.

Entry points: :func:`codegen.runtime.program.build_program` (inside a process group), the torchrun worker
``python -m codegen.runtime.worker plan.yaml --model M`` and :func:`codegen.runtime.launch.run_plan`.
"""

from codegen.runtime.launch import run_plan, torchrun_command
from codegen.runtime.program import ParallelProgram, build_program

__all__ = ["ParallelProgram", "build_program", "run_plan", "torchrun_command"]
