"""Train a tiny GPT with a hybrid-parallel plan on 4 processes.

    torchrun --nproc-per-node 4 examples/auto_parallel_torchrun.py [--steps 5] [--model gpt-tiny]

The plan here is made by hand (pp=1, dp=2, tp=2, ZeRO-3 with Megatron shardings) through
``codegen.runtime.testing.make_plan``; once ``planner.auto_parallel`` exists this becomes its one-liner.  Run without
torchrun, the script prints the plan it would execute.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ir  # noqa: E402
from codegen.runtime.program import build_program  # noqa: E402
from codegen.runtime.testing import make_plan  # noqa: E402
from examples.zoo import build  # noqa: E402

log = logging.getLogger("auto_parallel_torchrun")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    meta = build(args.model, batch=args.batch // 2, device="meta")
    graph = ir.trace(meta.model, meta.example_inputs, frontend="fx", model_name=args.model)
    plan = make_plan(graph, dp=2, tp=2, zero=3, micro_batch=args.batch // 2, model=args.model)
    if "RANK" not in os.environ:
        sys.stdout.write(ir.plan_to_yaml(plan))
        return 0
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        spec = build(args.model, batch=args.batch, device="cpu", seed=0)
        program = build_program(plan, spec, graph=graph, init="copy")
        opt = torch.optim.AdamW(program.parameters(), lr=1e-3)
        target = spec.make_target(args.batch, "cpu")
        for step in range(args.steps):
            loss = program.step(spec.example_inputs, target)
            opt.step()
            opt.zero_grad()
            if dist.get_rank() == 0:
                log.info("step %d loss %.4f", step, loss)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
