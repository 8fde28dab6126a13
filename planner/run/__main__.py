"""``python -m autopar.planner.run [torchrun options] -m autopar.planner.run.worker PLAN ...``: the launch agent
``autopar run`` starts (:mod:`autopar.planner.run.agent`).  It runs as the package's ``__main__`` so that the workers
it forks do not import their parent's main module again (multiprocessing skips a ``__main__`` module)."""

from autopar.planner.run.agent import main

main()
