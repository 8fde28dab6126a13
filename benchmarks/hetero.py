"""Heterogeneous pipelines (issue 15): GPT-3 175B on 16 DGX A100 + 16 DGX H100 nodes (built-in profile a100-h100),
global batch 1536, sequence 2048. Prints the predicted throughput of the best plan on the A100 group alone, on the
H100 group alone, and of the best pipeline split across both (its stages per device type), with the planning CPU
seconds (this process and its workers) beside the wall seconds.

Acceptance: the split is predicted faster than either group alone.

    python benchmarks/hetero.py [--model gpt3-175b] [--global-batch 1536] [--workers N]
"""

from __future__ import annotations

import argparse
import resource
import time

from autopar import ir
from autopar.planner.hetero import best_by_kind
from autopar.planner.options import PlanOptions
from autopar.profiles.hetero import load_cluster
from autopar.zoo import build


def cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--cluster", default="a100-h100")
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    spec = build(args.model, batch=1, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, model_name=args.model)
    prof = load_cluster(args.cluster)
    c0, w0 = cpu_s(), time.perf_counter()
    kinds, screened = best_by_kind(graph, prof, PlanOptions(global_batch=args.global_batch, workers=args.workers))
    cpu, wall = cpu_s() - c0, time.perf_counter() - w0
    print(f"{args.model} on {prof.name} ({' + '.join(f'{g.nodes} x {g.profile.name}' for g in prof.groups)}), "
          f"global batch {args.global_batch}: {screened} candidates, {cpu:.1f} CPU-s in {wall:.1f} s")
    best_alone = 0.0
    for name in [g.name for g in prof.groups] + ["split"]:
        if name not in kinds:
            print(f"  {name:>6}: no plan fits")
            continue
        p = kinds[name][0]
        m = p.mesh
        desc = (f"pp={m.pp} dp={m.dp} tp={m.tp} mb={p.micro_batch}x{p.num_microbatches} {p.schedule}"
                f"{'/v' + str(p.virtual_stages) if p.virtual_stages > 1 else ''} zero={p.zero}")
        print(f"  {name:>6}: {p.samples_per_s:8.2f} samples/s  ({p.nodes} nodes, {desc}, MFU {p.mfu:.0%})")
        if name == "split":
            for g in p.device_groups:
                sizes = [s.layer_end - s.layer_start for s in p.stages if s.device_group == g.name]
                print(f"          {g.name}: {len(sizes)} stages of {min(sizes)}-{max(sizes)} layer groups "
                      f"({sum(sizes)} in all) on {g.nodes} x {g.device}")
            ratio = p.samples_per_s / best_alone if best_alone else float("inf")
            print(f"  split / best single group: {ratio:.2f}x -> {'PASS' if ratio > 1 else 'FAIL'}")
        else:
            best_alone = max(best_alone, p.samples_per_s)


if __name__ == "__main__":
    main()
