"""Predicted vs published throughput for Megatron-LM SC'21 Table 1 (GPT on up to 3072 A100s).

For each row: the published plan costed with the built-in DGX A100 profile (all choices pinned), its predicted
TFLOP/s per GPU under the paper's own FLOP formula (96*B*s*l*h^2*(1+s/6h+V/16lh), recompute counted), the ratio to the
published number, and what the planner's own (unpinned) plan predicts.

    python benchmarks/calibration.py [--no-search]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.calibration import calibrate_case, load_cases  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-search", action="store_true", help="only cost the published plans")
    args = ap.parse_args()
    print(f"{'case':<24} {'GPUs':>5} {'published':>9} {'predicted':>9} {'ratio':>6} {'planner':>8} "
          f"{'planner plan':<44} {'s':>5}")
    ratios, wins = [], []
    for case in load_cases():
        t0 = time.perf_counter()
        r = calibrate_case(case, search_free=not args.no_search)
        ratios.append(r.ratio)
        desc = ""
        if r.planner_plan is not None:
            p = r.planner_plan
            desc = (f"tp{p.mesh.tp} pp{p.mesh.pp} dp{p.mesh.dp} mb{p.micro_batch} {p.schedule}"
                    f"{'/v' + str(p.virtual_stages) if p.virtual_stages > 1 else ''} z{p.zero} "
                    f"{'/'.join(sorted({s.recompute for s in p.stages}))}")
            wins.append(r.planner_tflops >= r.predicted_tflops * (1 - 1e-9))
        print(f"{r.case.removeprefix('megatron_sc21_t1_'):<24} {r.gpus:>5} {r.published_tflops:>9.1f} "
              f"{r.predicted_tflops:>9.1f} {r.ratio:>6.2f} {r.planner_tflops:>8.1f} {desc:<44} "
              f"{time.perf_counter() - t0:>5.1f}")
    print(f"median predicted/published: {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max "
          f"{max(ratios):.2f}); target: every row within 0.80-1.20")
    if wins:
        print(f"planner's plan predicts >= the published plan's throughput on {sum(wins)}/{len(wins)} rows")


if __name__ == "__main__":
    main()
