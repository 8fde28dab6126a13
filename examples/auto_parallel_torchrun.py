"""Train a tiny GPT with the plan autopar picks for this machine, on 4 processes.

    torchrun --nproc-per-node 4 examples/auto_parallel_torchrun.py [--steps 5] [--model gpt-tiny]

The one line that matters is ``auto_parallel(...)``: it profiles this machine (cached under ~/.cache/autopar), plans
for the 4 ranks, and returns this rank's parallel program.  Run without torchrun, the script prints the plan that
autopar would pick for a DGX A100 node instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from autopar import auto_parallel
from autopar.ir.plan import plan_to_yaml
from autopar.zoo import build

log = logging.getLogger("auto_parallel_torchrun")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    spec = build(args.model, batch=args.batch, device="cpu", seed=0)
    if "RANK" not in os.environ:
        plan = auto_parallel(spec.model, example_inputs=spec.example_inputs, loss_fn=spec.loss_fn,
                             global_batch=args.batch, cluster="dgx-a100-80gb", nodes=1)
        sys.stdout.write(plan_to_yaml(plan))
        return 0
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        program = auto_parallel(spec.model, example_inputs=spec.example_inputs, loss_fn=spec.loss_fn,
                                global_batch=args.batch, dtype="float32")
        opt = torch.optim.AdamW(program.parameters(), lr=1e-3)
        target = spec.make_target(args.batch, "cpu")
        for step in range(args.steps):
            loss = program.step(spec.example_inputs, target)
            opt.step()
            opt.zero_grad()
            if dist.get_rank() == 0:
                log.info("step %d loss %.4f (plan: pp=%d dp=%d tp=%d)", step, loss, program.plan.mesh.pp,
                         program.plan.mesh.dp, program.plan.mesh.tp)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
