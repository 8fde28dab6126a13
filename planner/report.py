"""Human-readable views of plans: ``autopar show``, ``explain``, ``diff``, the alternatives ``autopar plan`` lists, and
the schedule trace (:mod:`autopar.planner.timeline`). Tables go through :mod:`autopar.planner.tables` (terminal
width, wrapped not truncated, empty columns dropped)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from autopar.ir.graph import Graph
from autopar.ir.plan import MeshPlan, Plan
from autopar.ir.serialize import to_data
from autopar.planner.tables import fmt_bytes, fmt_sig, fmt_time, module_ranges, render, table

__all__ = ["alternatives_table", "decisions", "diff_plans", "distinct_alternatives", "explain_node", "fmt_bytes",
           "fmt_time", "models_differ", "module_ranges", "render_plan", "render_tables", "schedule_trace"]


def render_tables(*tables: Any, width: int | None = None) -> str:
    """Plain text of ``tables`` at ``width`` columns (default: the terminal's)."""
    return render(*tables, width=width)


def render_plan(plan: Plan, *, graph: Graph | None = None, width: int | None = None) -> str:
    """Tables: summary, time breakdown, stages with memory, tensor-parallel shardings (``width``: the terminal's)."""
    del graph  # accepted for callers that have it; everything shown comes from the plan
    m = plan.mesh
    head = [("mesh", f"{mesh_text(m)}  ({plan.world_size} devices)"),
            ("batch", (f"global {plan.global_batch} = micro-batch {plan.micro_batch} x {plan.num_microbatches} "
                      f"micro-batches x dp {m.dp}")),
            ("schedule", plan.schedule + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")),
            ("ZeRO / recompute", f"ZeRO-{plan.zero} / " + ", ".join(sorted({s.recompute for s in plan.stages}))),
            ("dtype", plan.dtype),
            ("throughput", (f"{fmt_sig(plan.samples_per_s, 4)} samples/s, {fmt_sig(plan.tflops_per_device)} TFLOP/s "
                           f"per device, MFU {fmt_sig(plan.mfu * 100)}%"))]
    s = plan.solver
    head.append(("search", f"{s.candidates} candidates in {s.wall_s:.2f} s; intra-op {s.status}, gap {s.gap:.2%}"))
    if plan.cluster_source is not None:
        head.append(("profile file", f"{plan.cluster_source.path} (sha256 {plan.cluster_source.sha256[:12]})"))
    if plan.pins:
        head.append(("pins", ", ".join(plan.pins)))
    if plan.device_groups:  # a heterogeneous cluster: which nodes run which stages
        head.append(("device groups", "; ".join(
            f"{g.name}: {g.nodes} x {g.device}, stages "
            f"{','.join(str(s.index) for s in plan.stages if s.device_group == g.name) or 'none'}"
            for g in plan.device_groups)))
    if plan.zero == 0 and m.replicas > 1:
        head.append(("gradient sync", "a bucket per layer group, overlapping the backward" if plan.overlap_grad_sync
                     else "one all-reduce after the backward"))
    if m.cp > 1:
        head.append(("context parallel", cp_text(plan)))
    head.extend(("note", n) for n in plan.notes)
    tables: list[Any] = [table(f"autopar plan: {plan.model} on {plan.nodes} x {plan.devices_per_node} "
                               f"({plan.cluster})", ["", ""], head, header=False)]
    t = plan.time
    tot = t.total or 1.0
    parts = (("compute", t.compute), ("  of which matmul-like ops", t.matmul), ("overlap contention", t.contention),
             ("exposed communication", t.exposed_comm),
             ("  of which gradient sync", t.dp_exposed), ("pipeline bubble", t.bubble), ("optimizer step", t.optimizer))
    tables.append(table(f"iteration time {fmt_time(t.total)}", ["", ("time", "right"), ("share", "right")],
                        [[name, fmt_time(v), f"{v / tot:.0%}"] for name, v in parts if v > 0], header=False))
    many = len(plan.stages) > 1
    rows = []
    for sp in plan.stages:
        mem = sp.memory
        share = f" ({mem.total / mem.capacity:.0%})" if mem.capacity else ""
        rows.append([str(sp.index) if many else "", str(sp.index % m.pp) if plan.virtual_stages > 1 else "",
                     *([sp.device_group] if plan.device_groups else []), module_ranges(sp.modules), sp.recompute,
                     fmt_time(sp.fwd_s), fmt_time(sp.bwd_s),
                     fmt_bytes(mem.params + mem.grads + mem.optimizer), fmt_bytes(mem.activations),
                     fmt_bytes(mem.other) if mem.other else "", fmt_bytes(mem.total) + share])
    cols = ["stage", ("pp rank", "right"), *(["device"] if plan.device_groups else []), "layers", "recompute",
            ("fwd/mb", "right"), ("bwd/mb", "right"),
            ("model state", "right"), ("activations", "right"), ("other", "right"), ("total", "right")]
    tables.append(table("stages (memory per device of the stage's pipeline rank)" if many else
                        "the model on each device (one pipeline stage)", cols, rows))
    if plan.param_shardings:
        tables.append(table(f"tensor-parallel parameter shardings (tp={m.tp}; others replicated)",
                            ["parameter", "placement"], [[p.pattern, p.placement] for p in plan.param_shardings]))
    comm_ops = [o for o in plan.op_shardings if o.comm]
    if comm_ops:
        tables.append(table("resharding collectives (one of each distinct layer)",
                            ["node", "op", "strategy", "inputs", "output", "collective", ("time/mb", "right")],
                            [[o.node, o.op, o.strategy, " ".join(o.inputs), o.output, _comm(o.comm), fmt_time(o.comm_s)]
                             for o in comm_ops]))
    return render(*tables, width=width)


def _comm(comm: str) -> str:
    """'bwd:all_reduce,fwd:all_gather' -> 'bwd: all_reduce, fwd: all_gather' (breakable between words)."""
    return ", ".join(c.replace(":", ": ") for c in comm.split(","))


def mesh_text(m: MeshPlan) -> str:
    """``pp=1 dp=8 tp=1``, with ``ep``/``cp`` when they are above 1 (plans without them read as before)."""
    extra = "".join(f" {k}={v}" for k, v in (("ep", m.ep), ("cp", m.cp)) if v > 1)
    return f"pp={m.pp} dp={m.dp}{extra} tp={m.tp}"


def cp_text(plan: Plan) -> str:
    """How a cp plan splits attention and which ranks form a cp group (ranks tp apart: the axis between dp and tp)."""
    m = plan.mesh
    methods = {c for o in plan.op_shardings for c in o.comm.split("+") if c.startswith("cp_")}
    how = ("K/V by all-gather (backward: reduce-scatter)" if methods == {"cp_all_gather"} else
           f"K/V by a ring of {m.cp - 1} p2p steps (backward: {m.cp - 1} for dK/dV)")
    first = [m.rank(cp=c) for c in range(m.cp)]
    return (f"cp={m.cp}: the sequence in {2 * m.cp} chunks, cp rank i holding chunks i and {2 * m.cp - 1}-i; {how}; "
            f"{m.world_size // m.cp} cp groups of ranks {m.tp} apart, e.g. {first}; gradients and ZeRO over dp x cp "
            f"= {m.dp * m.cp}")


def explain_node(plan: Plan, node: str, *, graph: Graph | None = None) -> str:
    """Why a node got its sharding: the chosen strategy, its cost, and (with the graph) the alternatives."""
    found = [o for o in plan.op_shardings if o.node == node]
    if not found:
        names = sorted({o.node for o in plan.op_shardings})
        close = difflib.get_close_matches(node, names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"node {node!r} is not in the plan's op shardings of model {plan.model} ({hint}ops of "
                         f"repeated blocks are listed once, under the first block's names); known nodes include: "
                         f"{', '.join(names[:30])}")
    o = found[0]
    lines = [f"{o.node} ({o.op}): {o.strategy}",
             f"  consumes inputs as {', '.join(o.inputs) or '-'}, produces {o.output}",
             (f"  compute {fmt_time(o.compute_s)} per micro-batch (fwd+bwd, one device), "
             f"resharding {fmt_time(o.comm_s)}{' via ' + o.comm if o.comm else ''}")]
    if o.op == "sdpa" and plan.mesh.cp > 1:  # context parallelism: how this attention sees the whole sequence
        lines.append("  context parallel: " + cp_text(plan))
    if o.op == "grouped_mm":  # routed experts: where they live and what moving tokens to them costs
        lines.extend("  " + n for n in plan.notes if n.startswith("expert parallel:"))
        if plan.mesh.ep == 1:
            lines.append("  expert parallel: ep=1, every rank holds every expert (no all_to_all)")
    if graph is not None and plan.mesh.tp > 1:
        lines.append("  alternatives (same costs, same tp group):")
        lines.extend("    " + alt for alt in _alternatives(plan, graph, node))
    return "\n".join(lines)


def _alternatives(plan: Plan, graph: Graph, node: str) -> list[str]:
    """Each strategy the solver could have given ``node``, costed on the plan's cluster, tp group and micro-batch."""
    from autopar.planner.intra_op import strategy_costs
    from autopar.planner.profile_ref import plan_profile
    from autopar.profiles.cost import CostModel

    if not graph.has_node(node):
        return [f"(node {node!r} is not in this model's graph)"]
    try:
        prof = plan_profile(plan, nodes=plan.nodes)
    except (ValueError, OSError) as e:
        return [f"(cannot load cluster profile {plan.cluster!r} to cost alternatives: {e})"]
    # a heterogeneous cluster: costed on each device group the plan's stages run on
    groups = [(f"on {g.name} ({g.profile.device.name}):", g.profile) for g in getattr(prof, "groups", ())
              if any(s.device_group == g.name for s in plan.stages)] or [("", prof)]
    tp = plan.mesh.tp
    chosen = next((o.strategy for o in plan.op_shardings if o.node == node), "")
    out = []
    for head, group_profile in groups:
        cost = CostModel(group_profile)
        rows = strategy_costs(graph, graph.node(node), tp=tp, cost=cost, tp_span=cost.span(tp, 1), dtype=plan.dtype,
                              micro_batch_scale=plan.micro_batch / graph.batch)
        rows.sort(key=lambda r: r[1] + r[2] + r[3])
        out += [head] if head else []
        for st, f, b, ar in rows:
            mark = "*" if st.name == chosen else " "
            ins = " ".join(p or "-" for p in st.inputs)
            extra = f" + grad all-reduce {fmt_time(ar)}" if ar else ""
            out.append(f"{mark} {st.name:<12} inputs {ins:<16} -> {st.output:<6} compute {fmt_time(f + b)}{extra}")
    out.append("(* = chosen; resharding of inputs and outputs depends on the neighbours' choices and is what the "
               "solver traded against compute)")
    return out


def models_differ(a: Plan, b: Plan) -> str:
    """Why ``a`` and ``b`` are plans of different models ('' when they are of the same traced graph)."""
    if a.model != b.model:
        return f"A is a plan of {a.model}, B of {b.model}"
    if a.graph_fingerprint != b.graph_fingerprint:
        return (f"both plan {a.model} but of different graphs (fingerprints {a.graph_fingerprint[:12]} vs "
                f"{b.graph_fingerprint[:12]}: another sequence length or model version)")
    return ""


def diff_plans(a: Plan, b: Plan, *, width: int | None = None) -> str:
    """Field-by-field differences between two plans (stage lists and shardings summarized); plans of different
    models get a warning first and no speed ratio, which would compare different work."""
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
    if not rows:
        return "the plans are identical\n"
    other = models_differ(a, b)
    warning = f"warning: {other}; times and speeds are not comparable\n" if other else ""
    t = table("plan differences", ["field", "A", "B"], rows)
    if other:
        summary = (f"A: {fmt_time(a.time.total)}/iteration of {a.model}, "
                   f"B: {fmt_time(b.time.total)}/iteration of {b.model}")
    else:
        ratio = (f" (B is {a.time.total / b.time.total:.3g}x the speed of A)" if a.time.total > 0 and b.time.total > 0
                 else " (no speed ratio: a plan without predicted times)")
        summary = f"A: {fmt_time(a.time.total)}/iteration, B: {fmt_time(b.time.total)}/iteration{ratio}"
    return warning + render(t, width=width) + summary + "\n"


def _short(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return json.dumps(x) if not isinstance(x, str) else x


def schedule_trace(plan: Plan, path: str | Path) -> int:
    """Write the simulated iteration of ``plan`` as Chrome-trace JSON (:mod:`autopar.planner.timeline`); returns
    the number of events."""
    from autopar.planner.timeline import schedule_trace as write

    return write(plan, path)


def decisions(p: Plan) -> dict[str, str]:
    """The choices a plan makes, one short string each: what an alternative is told apart from the best by."""
    recompute = [s.recompute for s in p.stages]
    ps = p.stages
    state = max(s.memory.params + s.memory.grads + s.memory.optimizer for s in ps)
    return {
        "mesh": mesh_text(p.mesh),
        "micro-batches": f"{p.micro_batch}x{p.num_microbatches}",
        "schedule": p.schedule + (f"/v{p.virtual_stages}" if p.virtual_stages > 1 else ""),
        "ZeRO": str(p.zero),
        "recompute": recompute[0] if len(set(recompute)) == 1 else ",".join(recompute),
        "stage cuts": ",".join(str(s.layer_start) for s in ps[1:]) or "-",
        "tp sharding": _sharded(p),
        "model state": fmt_bytes(state),
        "dtype": p.dtype if p.reduce_dtype == p.dtype else f"{p.dtype} (reduce {p.reduce_dtype})",
    }


def _sharded(p: Plan) -> str:
    """'5 of 8 weights sharded' over the plan's parameter patterns (the plain and the memory-lean intra-op solve
    differ here); '-' without tensor parallelism."""
    if p.mesh.tp == 1 or not p.param_shardings:
        return "-"
    n = sum(1 for s in p.param_shardings if s.placement != "R")
    return f"{n} of {len(p.param_shardings)} weights sharded"


def _same(a: Plan, b: Plan) -> bool:
    """The same plan, whatever the search reports about itself or where its profile file is."""
    da, db = to_data(a), to_data(b)
    for d in (da, db):
        d.pop("solver", None)
        d.pop("cluster_source", None)
    return da == db


def distinct_alternatives(best: Plan, alternatives: tuple[Plan, ...] | list[Plan]) -> list[tuple[str, Plan]]:
    """The alternatives that are plans other than ``best`` and each other, each with what differs from the best
    ("mesh pp=1 dp=8 tp=1 -> pp=1 dp=4 tp=2; ZeRO 1 -> 0"). Identical plans (the same choices reached twice, e.g.
    by the plain and the memory-lean intra-op solve) are listed once."""
    shown: list[Plan] = [best]
    out: list[tuple[str, Plan]] = []
    base = decisions(best)
    for p in alternatives:
        if any(_same(p, q) for q in shown):
            continue
        mine = decisions(p)
        implied = {"tp sharding"} if p.mesh.tp != best.mesh.tp else set()  # a new tp implies new shardings
        label = _label(base, mine, skip=implied)
        if any(label == lbl for lbl, _ in out):  # another distinct plan reads the same: say what tells them apart
            label = _label(base, mine, skip=set())
            if any(label == lbl for lbl, _ in out):
                label += " (other per-op shardings)"
        shown.append(p)
        out.append((label, p))
    return out


def _label(base: dict[str, str], mine: dict[str, str], *, skip: set[str]) -> str:
    diff = [f"{k} {base[k]} -> {mine[k]}" for k in base if mine[k] != base[k] and k not in skip | {"model state"}]
    if mine["model state"] != base["model state"]:
        diff.append(f"model state {base['model state']} -> {mine['model state']} per device")
    return "; ".join(diff) or "the same choices with other per-op shardings"


def alternatives_table(best: Plan, alternatives: tuple[Plan, ...] | list[Plan], *, width: int | None = None) -> str:
    """The distinct alternatives as a table: what differs from the best, time per iteration, speed vs the best."""
    rows = [[str(i), label, fmt_time(p.time.total), f"{best.time.total / p.time.total:.3g}x"]
            for i, (label, p) in enumerate(distinct_alternatives(best, alternatives), 1)]
    if not rows:
        return ""
    t = table(f"alternatives (best: {fmt_time(best.time.total)}/iteration)",
              [("#", "right"), "differs from the best in", ("time/iter", "right"), ("speed vs best", "right")], rows)
    return render(t, width=width)
