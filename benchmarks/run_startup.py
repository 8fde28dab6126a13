"""What ``autopar run`` costs before and around a few training steps: workers forked from the agent's preloaded
server against fresh interpreters per rank (``AUTOPAR_FRESH_WORKERS=1``), measured side by side.

For 2 ranks (``dp=2``) and 4 ranks (``pp=2 x dp=2``) of ``--model``, each launch runs ``--steps`` steps in a fresh
``python -m autopar run`` process; the two ways alternate, ``--repeat`` times each.  Printed: the median wall seconds
and the median CPU seconds of the whole machine while the launch ran (from /proc/stat, so the agent's fork server
and its workers, which the launcher never reaps, count too; run it on an otherwise idle machine), and the ratios.

    python benchmarks/run_startup.py [--model gpt-tiny] [--steps 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MESHES = {2: {"pp": 1, "dp": 2, "tp": 1}, 4: {"pp": 2, "dp": 2, "tp": 1}}


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far (user + nice + system + irq + softirq + steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + (fields[7] if len(fields) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def make_plan(model: str, ranks: int, out: Path) -> Path:
    from autopar import ir
    from autopar.planner.graphs import traced_graph
    from autopar.planner.options import PlanOptions
    from autopar.planner.search import search
    from autopar.profiles.builtin import load_builtin

    prof = dataclasses.replace(load_builtin("dgx-a100-80gb"), nodes=1, devices_per_node=ranks)
    graph = traced_graph(model, frontend="fx")
    plan = search(graph, prof, PlanOptions(global_batch=8, dtype="float32", top_k=0, pins=MESHES[ranks],
                                           workers=1)).best
    path = out / f"{model}-{ranks}.yaml"
    ir.dump_plan(dataclasses.replace(plan, fused_kernels=False), path)
    return path


def launch(plan: Path, model: str, steps: int, fresh: bool) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("AUTOPAR_FRESH_WORKERS", None)
    if fresh:
        env["AUTOPAR_FRESH_WORKERS"] = "1"
    cpu0, t0 = machine_cpu_s(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autopar", "run", str(plan), "--model", model, "--steps",
                           str(steps)], env=env, capture_output=True, text=True, check=False)
    wall, cpu = time.perf_counter() - t0, machine_cpu_s() - cpu0
    if done.returncode:
        raise SystemExit(f"autopar run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="autopar-run-startup-"))
    plans = {n: make_plan(args.model, n, out) for n in MESHES}
    for plan in plans.values():  # one untimed launch each: the traced-graph cache and the OS file cache warm up
        launch(plan, args.model, args.steps, fresh=False)
    load = os.getloadavg()[0]
    print(f"autopar run {args.model}, {args.steps} steps, median of {args.repeat}; load average before: {load:.2f}")
    print(f"{'ranks':>5}  {'fresh wall s':>12} {'CPU s':>7}  {'forked wall s':>13} {'CPU s':>7}  "
          f"{'wall ratio':>10} {'CPU ratio':>9}")
    for n, plan in plans.items():
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.repeat):
            for fresh in (True, False):
                runs[fresh].append(launch(plan, args.model, args.steps, fresh))
        (fw, fc), (kw, kc) = ((statistics.median(w for w, _ in runs[f]), statistics.median(c for _, c in runs[f]))
                              for f in (True, False))
        print(f"{n:>5}  {fw:12.2f} {fc:7.2f}  {kw:13.2f} {kc:7.2f}  {fw / kw:9.2f}x {fc / kc:8.2f}x")


if __name__ == "__main__":
    main()
