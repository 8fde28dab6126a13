"""Planning time on this machine: GPT-3 175B on 1024 A100s, Llama-3 70B on 512 H100s, and how it grows with the
cluster (8 .. 4096 devices).  Target: under 60 s each for the two headline cases.

    python benchmarks/search_time.py [--quick]
"""

from __future__ import annotations

import argparse
import time

from autopar import ir
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin
from autopar.zoo import build


def plan_once(model: str, cluster: str, nodes: int, global_batch: int) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    spec = build(model, batch=1, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, model_name=model)
    t1 = time.perf_counter()
    res = search(graph, load_builtin(cluster, nodes=nodes), PlanOptions(global_batch=global_batch))
    t2 = time.perf_counter()
    p = res.best
    desc = (f"tp{p.mesh.tp} pp{p.mesh.pp} dp{p.mesh.dp} mb{p.micro_batch}x{p.num_microbatches} {p.schedule}"
            f"{'/v' + str(p.virtual_stages) if p.virtual_stages > 1 else ''} z{p.zero}, {res.screened} candidates, "
            f"MFU {p.mfu:.0%}")
    return t1 - t0, t2 - t1, desc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the scaling sweep")
    args = ap.parse_args()
    print(f"{'case':<34} {'trace s':>8} {'search s':>9}  plan")
    for model, cluster, nodes, gb in (("gpt3-175b", "dgx-a100-80gb", 128, 1536), ("llama3-70b", "dgx-h100", 64, 1024)):
        tt, ts, desc = plan_once(model, cluster, nodes, gb)
        ok = "ok" if tt + ts < 60 else "MISSED 60 s"
        print(f"{model + ' on ' + str(nodes * 8) + ' GPUs':<34} {tt:>8.2f} {ts:>9.2f}  {desc}  [{ok}]")
    if args.quick:
        return
    print("\nscaling (gpt3-175b, dgx-a100-80gb, global batch = 2 x devices, at least 512):")
    for nodes in (1, 4, 16, 64, 256, 512):
        try:
            tt, ts, desc = plan_once("gpt3-175b", "dgx-a100-80gb", nodes, max(512, 2 * nodes * 8))
            print(f"{str(nodes * 8) + ' devices':<34} {tt:>8.2f} {ts:>9.2f}  {desc}")
        except Exception as e:  # noqa: BLE001 - an infeasible size is a result worth printing
            print(f"{str(nodes * 8) + ' devices':<34} {'':>8} {'':>9}  {str(e).splitlines()[0][:110]}")


if __name__ == "__main__":
    main()
