"""Predicted vs measured step time of several plans of a small model on 2 CPU ranks (gloo), side by side.

    python benchmarks/runtime_cpu.py [--model gpt-tiny] [--steps 8] [--batch 8] [--seq 32]

Runs pure DP, pure TP and pure PP plans (made by hand, Megatron shardings for TP) and, when a ``pick`` function is
given (``planner`` fills it: ``pick(graph, world, global_batch) -> ir.Plan``), the planner's pick; each plan goes
through ``codegen.runtime.launch.run_plan`` (torchrun + worker), and the median step time after warm-up is compared
with the plan's predicted ``time.total``.  Reports the ratio of the pick's measured time to the best measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ir  # noqa: E402
from codegen.runtime.launch import run_plan  # noqa: E402
from codegen.runtime.testing import make_plan  # noqa: E402
from examples.zoo import build  # noqa: E402

Pick = Callable[[ir.Graph, int, int], ir.Plan]


def baseline_plans(graph: ir.Graph, world: int, batch: int) -> dict[str, ir.Plan]:
    """Pure DP, pure TP and pure PP plans for ``world`` ranks and a global batch."""
    return {
        "dp": make_plan(graph, dp=world, micro_batch=batch // world),
        "tp": make_plan(graph, tp=world, micro_batch=batch),
        "pp": make_plan(graph, pp=world, micro_batch=batch // (2 * world), num_microbatches=2 * world),
    }


def measure(plans: dict[str, ir.Plan], model: str, steps: int, seq: int | None) -> dict[str, dict]:
    """Run every plan with torchrun; returns each worker's JSON report."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        for name, plan in plans.items():
            path, rep = Path(d) / f"{name}.yaml", Path(d) / f"{name}.json"
            ir.dump_plan(plan, path)
            args = ["--report", str(rep), "--warmup", "2"] + (["--seq", str(seq)] if seq else [])
            rc = run_plan(path, model, steps, worker_args=args, timeout_s=600)
            if rc != 0:
                raise RuntimeError(f"plan {name} failed with exit code {rc}")
            out[name] = json.loads(rep.read_text())
    return out


def table(reports: dict[str, dict], pick_name: str | None) -> str:
    best = min(r["measured_step_s"] for r in reports.values())
    rows = [f"{'plan':10}{'mesh pp/dp/tp':>15}{'predicted s':>13}{'measured s':>12}{'meas/pred':>11}"
            f"{'vs best':>9}"]
    for name, r in reports.items():
        pred, meas = r["predicted_step_s"], r["measured_step_s"]
        mesh = "/".join(str(x) for x in r["mesh"])
        rows.append(f"{name:10}{mesh:>15}{pred:13.5f}{meas:12.5f}"
                    f"{(meas / pred if pred > 0 else float('nan')):11.2f}{meas / best:9.2f}")
    if pick_name is not None:
        rows.append(f"planner pick '{pick_name}': {reports[pick_name]['measured_step_s'] / best:.3f} x the best "
                    "measured (target <= 1.10)")
    else:
        rows.append("planner pick: none given (pass pick=... once the planner exists)")
    return "\n".join(rows)


def run(model: str = "gpt-tiny", steps: int = 8, batch: int = 8, seq: int | None = 32, world: int = 2,
        pick: Pick | None = None) -> dict[str, dict]:
    meta = build(model, batch=batch, device="meta", seq=seq)
    graph = ir.trace(meta.model, meta.example_inputs, frontend="fx", model_name=model)
    plans = baseline_plans(graph, world, batch)
    if pick is not None:
        plans = {"pick": pick(graph, world, batch), **plans}
    reports = measure(plans, model, steps, seq)
    sys.stdout.write(table(reports, "pick" if pick is not None else None) + "\n")
    return reports


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    a = ap.parse_args()
    run(a.model, a.steps, a.batch, a.seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
