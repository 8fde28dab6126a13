"""``python -m autopar``: the same command-line tool as the ``autopar`` console script."""

from autopar.planner.cli import main

raise SystemExit(main())
