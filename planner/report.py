"""Human-readable views of plans: ``autopar show``, ``explain``, ``diff`` and the schedule trace."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.ir.graph import Graph
from autopar.ir.plan import Plan
from autopar.ir.serialize import to_data

__all__ = ["render_tables", "render_plan", "explain_node", "diff_plans", "schedule_trace", "fmt_bytes", "fmt_time"]


def fmt_bytes(b: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def render_tables(*tables: Any, width: int = 120) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    for t in tables:
        con.print(t)
    return buf.getvalue()


def _ranges(modules: tuple[str, ...]) -> str:
    """'<prefix>, blocks.0-11' style summary of a stage's modules."""
    out: list[str] = []
    run: list[str] = []
    for m in modules:
        head, _, idx = m.rpartition(".")
        if idx.isdigit() and run and run[-1].rpartition(".")[0] == head:
            run.append(m)
            continue
        if run:
            out.append(_fmt_run(run))
        run = [m] if idx.isdigit() else []
        if not idx.isdigit():
            out.append(m)
    if run:
        out.append(_fmt_run(run))
    return ", ".join(out)


def _fmt_run(run: list[str]) -> str:
    head = run[0].rpartition(".")[0]
    a, b = run[0].rpartition(".")[2], run[-1].rpartition(".")[2]
    return run[0] if a == b else f"{head}.{a}-{b}"


def render_plan(plan: Plan, *, graph: Graph | None = None, width: int = 120) -> str:
    """Tables: summary, time breakdown, stages with memory, tensor-parallel shardings."""
    m = plan.mesh
    head = Table(title=f"autopar plan: {plan.model} on {plan.nodes} x {plan.devices_per_node} ({plan.cluster})",
                 show_header=False)
    head.add_row("mesh", f"pp={m.pp} dp={m.dp} tp={m.tp}  ({plan.world_size} devices)")
    head.add_row("batch", f"global {plan.global_batch} = micro-batch {plan.micro_batch} x {plan.num_microbatches} "
                          f"micro-batches x dp {m.dp}")
    sched = plan.schedule + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")
    head.add_row("schedule", sched)
    head.add_row("ZeRO / recompute", f"ZeRO-{plan.zero} / " + ", ".join(sorted({s.recompute for s in plan.stages})))
    head.add_row("dtype", plan.dtype)
    head.add_row("throughput", f"{plan.samples_per_s:.2f} samples/s, {plan.tflops_per_device:.1f} TFLOP/s per "
                               f"device, MFU {plan.mfu:.1%}")
    s = plan.solver
    head.add_row("search", f"{s.candidates} candidates in {s.wall_s:.2f} s; intra-op {s.status}, gap {s.gap:.2%}")
    if plan.pins:
        head.add_row("pins", ", ".join(plan.pins))
    for n in plan.notes:
        head.add_row("note", n)
    t = plan.time
    tt = Table(title=f"iteration time {fmt_time(t.total)}")
    for c in ("compute", "contention", "exposed comm", "of which dp", "bubble", "optimizer"):
        tt.add_column(c, justify="right")
    tot = t.total or 1.0
    tt.add_row(*(f"{fmt_time(v)} ({v / tot:.0%})" for v in (t.compute, t.contention, t.exposed_comm, t.dp_exposed,
                                                             t.bubble, t.optimizer)))
    st = Table(title="stages (memory per device of the stage's pipeline rank)")
    for c in ("stage", "rank", "layers", "recompute", "fwd/mb", "bwd/mb", "model state", "activations", "other",
              "total"):
        st.add_column(c, justify="left" if c in ("layers", "recompute") else "right",
                      no_wrap=c in ("layers", "recompute", "fwd/mb", "bwd/mb", "model state", "activations", "other", "total"))
    for sp in plan.stages:
        mem = sp.memory
        share = f" ({mem.total / mem.capacity:.0%})" if mem.capacity else ""
        st.add_row(str(sp.index), str(sp.index % m.pp), _ranges(sp.modules), sp.recompute, fmt_time(sp.fwd_s),
                   fmt_time(sp.bwd_s), fmt_bytes(mem.params + mem.grads + mem.optimizer),
                   fmt_bytes(mem.activations), fmt_bytes(mem.other), fmt_bytes(mem.total) + share)
    tables: list[Any] = [head, tt, st]
    if plan.param_shardings:
        ps = Table(title=f"tensor-parallel parameter shardings (tp={m.tp}; others replicated)")
        ps.add_column("parameter")
        ps.add_column("placement")
        for p in plan.param_shardings:
            ps.add_row(p.pattern, p.placement)
        tables.append(ps)
    comm_ops = [o for o in plan.op_shardings if o.comm]
    if comm_ops:
        ct = Table(title="resharding collectives (one of each distinct layer)")
        for c in ("node", "op", "strategy", "inputs", "output", "collective", "time/mb"):
            ct.add_column(c)
        for o in comm_ops:
            ct.add_row(o.node, o.op, o.strategy, " ".join(o.inputs), o.output, o.comm, fmt_time(o.comm_s))
        tables.append(ct)
    return render_tables(*tables, width=width)


def explain_node(plan: Plan, node: str, *, graph: Graph | None = None) -> str:
    """Why a node got its sharding: the chosen strategy, its cost, and (with the graph) the alternatives."""
    found = [o for o in plan.op_shardings if o.node == node]
    if not found:
        known = ", ".join(sorted({o.node for o in plan.op_shardings})[:30])
        raise ValueError(f"node {node!r} is not in the plan's op shardings (ops of repeated blocks are listed once, "
                         f"under the first block's names); known nodes include: {known}")
    o = found[0]
    lines = [f"{o.node} ({o.op}): {o.strategy}",
             f"  consumes inputs as {', '.join(o.inputs) or '-'}, produces {o.output}",
             f"  compute {fmt_time(o.compute_s)} per micro-batch (fwd+bwd, one device), "
             f"resharding {fmt_time(o.comm_s)}{' via ' + o.comm if o.comm else ''}"]
    if graph is not None and plan.mesh.tp > 1:
        lines.append("  alternatives (same costs, same tp group):")
        lines.extend("    " + alt for alt in _alternatives(plan, graph, node))
    return "\n".join(lines)


def _alternatives(plan: Plan, graph: Graph, node: str) -> list[str]:
    """Each strategy the solver could have given ``node``, costed on the plan's cluster, tp group and micro-batch."""
    from autopar.planner.intra_op import strategy_costs
    from autopar.profiles.builtin import resolve_profile
    from autopar.profiles.cost import CostModel

    if not graph.has_node(node):
        return [f"(node {node!r} is not in this model's graph)"]
    try:
        cost = CostModel(resolve_profile(plan.cluster, plan.nodes))
    except (ValueError, OSError) as e:
        return [f"(cannot load cluster profile {plan.cluster!r} to cost alternatives: {e})"]
    tp = plan.mesh.tp
    chosen = next((o.strategy for o in plan.op_shardings if o.node == node), "")
    rows = strategy_costs(graph, graph.node(node), tp=tp, cost=cost, tp_span=cost.span(tp, 1), dtype=plan.dtype,
                          micro_batch_scale=plan.micro_batch / graph.batch)
    rows.sort(key=lambda r: r[1] + r[2] + r[3])
    out = []
    for st, f, b, ar in rows:
        mark = "*" if st.name == chosen else " "
        ins = " ".join(p or "-" for p in st.inputs)
        extra = f" + grad all-reduce {fmt_time(ar)}" if ar else ""
        out.append(f"{mark} {st.name:<12} inputs {ins:<16} -> {st.output:<6} compute {fmt_time(f + b)}{extra}")
    out.append("(* = chosen; resharding of inputs and outputs depends on the neighbours' choices and is what the "
               "solver traded against compute)")
    return out


def diff_plans(a: Plan, b: Plan) -> str:
    """Field-by-field differences between two plans (stage lists and shardings summarized)."""
    da, db = to_data(a), to_data(b)
    rows: list[tuple[str, str, str]] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in dict.fromkeys([*x, *y]):
                walk(x.get(k), y.get(k), f"{path}.{k}" if path else k)
        elif isinstance(x, list) and isinstance(y, list) and path in ("stages", "param_shardings", "op_shardings"):
            if x != y:
                rows.append((path, f"{len(x)} entries", f"{len(y)} entries" + (" (differ)" if len(x) == len(y)
                                                                                 else "")))
        elif x != y:
            rows.append((path, _short(x), _short(y)))

    walk(da, db, "")
    t = Table(title="plan differences")
    t.add_column("field")
    t.add_column("A")
    t.add_column("B")
    for r in rows:
        t.add_row(*r)
    speed = a.time.total / b.time.total if b.time.total else float("nan")
    summary = (f"A: {fmt_time(a.time.total)}/iteration, B: {fmt_time(b.time.total)}/iteration "
               f"(B is {speed:.2f}x the speed of A)")
    return render_tables(t) + summary + "\n" if rows else "the plans are identical\n"


def _short(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    s = json.dumps(x) if not isinstance(x, str) else x
    return s if len(s) <= 60 else s[:57] + "..."


def schedule_trace(plan: Plan, path: str | Path) -> int:
    """Write the simulated pipeline schedule of ``plan`` as Chrome-trace JSON; returns the number of events."""
    from autopar.planner.inter_op.schedule import chrome_trace, simulate

    fwd = [s.fwd_s for s in plan.stages]
    bwd = [s.bwd_s for s in plan.stages]
    res = simulate(fwd, bwd, pp=plan.mesh.pp, num_microbatches=plan.num_microbatches,
                   schedule=plan.schedule, virtual_stages=plan.virtual_stages)
    names = [f"stage {s.index}: {_ranges(s.modules)}" for s in plan.stages]
    trace = chrome_trace(res, stage_names=names)
    Path(path).write_text(json.dumps(trace))
    return len(trace.get("traceEvents", []))
