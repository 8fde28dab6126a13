"""The ``autopar`` command-line tool."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]


def _load_model(name: str, batch: int, seq: int | None):  # noqa: ANN202 - returns examples.zoo.ModelSpec
    from examples.zoo import build

    return build(name, batch=batch, device="meta", seq=seq)


def _cmd_trace(args: argparse.Namespace) -> int:
    import ir
    from rich.console import Console
    from rich.table import Table

    spec = _load_model(args.model, args.batch, args.seq)
    graph = ir.verify(ir.trace(spec.model, spec.example_inputs, frontend=args.frontend, model_name=args.model))
    s = graph.summary()
    con = Console()
    t = Table(title=f"{args.model}: traced with {s['frontend']} (batch {args.batch})", show_header=False)
    t.add_row("nodes", str(s["nodes"]))
    t.add_row("parameters", f"{s['params']:,} ({s['param_bytes'] / 2**30:.2f} GiB)")
    t.add_row("training FLOPs / step", f"{s['train_flops']:.4g} (matmul {s['matmul_train_flops']:.4g})")
    t.add_row("layer groups", f"{s['layer_groups']} ({s['repeated_blocks']} blocks, {s['distinct_blocks']} distinct)")
    t.add_row("op kinds", ", ".join(f"{k}={v}" for k, v in s["op_kinds"].items()))
    t.add_row("unknown ops", ", ".join(s["unknown_ops"]) or "none")
    t.add_row("fingerprint", s["fingerprint"])
    con.print(t)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization planner for PyTorch training")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress and details")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="trace a model into the graph IR and summarize it")
    t.add_argument("model", help="built-in model name (see `autopar models`) or 'package.module:factory'")
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--seq", type=int, default=None)
    t.add_argument("--frontend", choices=["auto", "fx", "export"], default="auto")
    t.set_defaults(func=_cmd_trace)
    m = sub.add_parser("models", help="list the built-in models")
    m.set_defaults(func=lambda a: (print("\n".join(__import__("examples.zoo").zoo.list_models())), 0)[1])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from ir.errors import AutoparError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except (AutoparError, ValueError) as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
