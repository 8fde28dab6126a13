"""Start-up time of the ``autopar`` commands a newcomer types first (issue 18).

Each command runs ``--repeat`` times in a fresh process (``python -m autopar ...``); the script prints the median
wall time beside the median CPU time (user + system of the child), since wall time on a loaded shared machine says
little. Targets on an idle 2-core machine: ``models``, ``show`` and ``diff`` under 1.5 s wall; an ``explain`` with a
wrong node name fails in under 3 s.

    python benchmarks/cli_time.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PLANS = Path(__file__).resolve().parents[1] / "tests" / "golden" / "plans"
A = str(PLANS / "gpt2-small_dgx-a100-80gb_1n_gb64.yaml")
B = str(PLANS / "gpt2-small_dgx-h100_4n_gb64.yaml")
COMMANDS: list[tuple[str, list[str], float]] = [
    ("--help", ["--help"], 1.5),
    ("models", ["models"], 1.5),
    ("show", ["show", A], 1.5),
    ("diff", ["diff", A, B], 1.5),
    ("explain (wrong node)", ["explain", B, "no_such_node"], 3.0),
]


def measure(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one ``python -m autopar argv`` run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "autopar", *argv], capture_output=True, check=False,
                   env=dict(os.environ, COLUMNS="120"))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{'command':<22} {'wall s':>8} {'CPU s':>8} {'target wall s':>14}")
    for name, argv, target in COMMANDS:
        runs = [measure(argv) for _ in range(args.repeat)]
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"{name:<22} {wall:8.2f} {cpu:8.2f} {target:14.1f}")


if __name__ == "__main__":
    main()
