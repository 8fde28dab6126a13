"""Trace time and peak memory of lifting big models into the IR on the meta device.

Each model is traced in a fresh subprocess so its peak RSS is its own. Targets (issue 2): GPT-3 175B in under 60 s and
under 2 GB on a 2-core machine.

    python benchmarks/trace_time.py [--models gpt3-175b llama3-70b] [--frontend auto|fx|export]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
from autopar import ir
from autopar.zoo import build
t0 = time.perf_counter()
spec = build({name!r}, batch=1, device="meta")
t1 = time.perf_counter()
g = ir.trace(spec.model, spec.example_inputs, frontend={frontend!r})
t2 = time.perf_counter()
ir.verify(g)
print(json.dumps(dict(build_s=t1 - t0, trace_s=t2 - t1, verify_s=time.perf_counter() - t2, nodes=len(g.nodes),
                      params=g.num_params, blocks=len(g.blocks()), frontend=g.frontend,
                      peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


def measure(name: str, frontend: str) -> dict:
    code = CHILD.format(name=name, frontend=frontend)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2-small", "gpt3-175b", "llama3-70b", "llama3-405b"])
    ap.add_argument("--frontend", default="auto", choices=["auto", "fx", "export"])
    args = ap.parse_args()
    print(f"{'model':<14} {'frontend':<8} {'params':>10} {'nodes':>6} {'blocks':>6} {'trace s':>8} "
          f"{'peak RSS MB':>11}  target: <60 s, <2048 MB")
    for name in args.models:
        r = measure(name, args.frontend)
        ok = "ok" if r["trace_s"] < 60 and r["peak_rss_mb"] < 2048 else "MISSED"
        print(f"{name:<14} {r['frontend']:<8} {r['params'] / 1e9:>9.1f}B {r['nodes']:>6} {r['blocks']:>6} "
              f"{r['trace_s']:>8.2f} {r['peak_rss_mb']:>11.0f}  {ok}")


if __name__ == "__main__":
    main()
