"""Running a plan on this machine: the torchrun launcher (:mod:`autopar.planner.run.torchrun`) and the per-rank
training program it starts (``python -m autopar.planner.run.worker plan.yaml --model M``).

They sit above codegen because they resolve models by name (the zoo or ``package.module:factory``) and feed data;
codegen itself only turns a Plan and a model into a program.
"""

from autopar.planner.run.torchrun import check_checkpoint_dir, run_plan, torchrun_command

__all__ = ["check_checkpoint_dir", "run_plan", "torchrun_command"]
