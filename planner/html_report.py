"""A plan as one self-contained HTML page: ``autopar show plan.yaml --html report.html`` (and ``plan --html``,
``diff --html``).

The page has no scripts and fetches nothing: styles are inline and the figures are SVG drawn here.

* ``summary``: mesh, batch, schedule, memory savers, predicted throughput;
* ``timeline``: the simulated iteration per pipeline rank (:mod:`autopar.planner.timeline`): forward, backward,
  idle time inside the pipeline (bubble), exposed communication, the optimizer step;
* ``memory``: per device (one bar per pipeline stage), model state / activations / other stacked against capacity;
* ``sharding``: tensor-parallel parameter placements and the resharding collectives;
* ``alternatives``: the other plans the search kept, what differs from the best and their speed ratio.

``diff`` puts two plans side by side under the table of their differences.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from pathlib import Path

from autopar.ir.plan import Plan
from autopar.planner.report import distinct_alternatives, models_differ
from autopar.planner.tables import fmt_bytes, fmt_sig, fmt_time, module_ranges
from autopar.planner.timeline import Timeline, plan_timeline

__all__ = ["diff_html", "plan_html", "write_html"]

COLORS = {"forward": "#4C78A8", "backward": "#54A24B", "bubble": "#F2CF5B", "dp sync": "#E45756",
          "contention": "#B279A2", "comm": "#F58518", "optimizer": "#9D755D"}
MEM_COLORS = {"parameters": "#4C78A8", "gradients": "#72B7B2", "optimizer state": "#54A24B",
              "activations": "#F58518", "other": "#BAB0AC"}
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 12px}h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:4px 0}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top}th{background:#f5f5f5}td.n{text-align:right;font-variant-numeric:tabular-nums}
.legend span{display:inline-block;margin-right:14px;font-size:12px}.legend i{display:inline-block;width:11px;
height:11px;margin-right:4px;vertical-align:-1px}.note{color:#666;font-size:12px}.warn{color:#b00;font-weight:600}
.side{display:flex;gap:28px;align-items:flex-start}.side>div{flex:1;min-width:0}svg{max-width:100%;height:auto}
"""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td class='n'>{escape(c)}</td>" if i in numeric else f"<td>{escape(c)}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _legend(colors: dict[str, str]) -> str:
    return "<div class='legend'>" + "".join(f"<span><i style='background:{c}'></i>{escape(k)}</span>"
                                            for k, c in colors.items()) + "</div>"


def _summary(plan: Plan, pre: str) -> str:
    m, t = plan.mesh, plan.time
    rows = [("model", f"{plan.model} ({plan.num_params:,} parameters)"),
            ("cluster", f"{plan.cluster}: {plan.nodes} x {plan.devices_per_node} devices"),
            ("mesh", f"pp={m.pp} dp={m.dp} tp={m.tp}"),
            ("batch", (f"global {plan.global_batch} = micro-batch {plan.micro_batch} x {plan.num_microbatches} x dp "
                      f"{m.dp}")),
            ("schedule", str(plan.schedule) + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")),
            ("ZeRO / recompute", f"ZeRO-{plan.zero} / " + ", ".join(sorted({s.recompute for s in plan.stages}))),
            ("iteration time", (f"{fmt_time(t.total)}: compute {fmt_time(t.compute)}, exposed communication "
                               f"{fmt_time(t.exposed_comm)}, bubble {fmt_time(t.bubble)}, optimizer "
                               f"{fmt_time(t.optimizer)}")),
            ("throughput", (f"{fmt_sig(plan.samples_per_s, 4)} samples/s, {fmt_sig(plan.tflops_per_device)} TFLOP/s "
                           f"per device, MFU {fmt_sig(plan.mfu * 100)}%"))]
    if plan.cluster_source is not None:
        rows.append(("profile file", f"{plan.cluster_source.path} (sha256 {plan.cluster_source.sha256[:12]})"))
    rows += [("note", n) for n in plan.notes]
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return f"<section id='{pre}summary'><h2>Summary</h2><table>{body}</table></section>"


def _timeline_svg(tl: Timeline, width: int = 900) -> str:
    left, row, gap, top = 70, 26, 8, 8
    span = tl.iteration_s or 1.0
    x = lambda s: left + (width - left - 40) * s / span
    height = top + tl.pp * (row + gap) + 26
    parts = [(f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"viewBox='0 0 {width} {height}' role='img' aria-label='simulated pipeline timeline'>")]
    for r in range(tl.pp):
        y = top + r * (row + gap)
        parts.append(f"<text x='4' y='{y + row * 0.68:.1f}' font-size='12'>rank {r}</text>")
        mine = sorted((s for s in tl.spans if s.rank == r and s.kind in ("forward", "backward")),
                      key=lambda s: s.start)
        t0 = 0.0
        for s in mine:  # idle time inside the pipeline: the bubble
            if s.start > t0 + 1e-15:
                parts.append(_rect(x(t0), y, x(s.start) - x(t0), row, COLORS["bubble"],
                                   f"bubble: {fmt_time(s.start - t0)}"))
            t0 = max(t0, s.end)
        if tl.pipeline_s > t0 + 1e-15:
            parts.append(_rect(x(t0), y, x(tl.pipeline_s) - x(t0), row, COLORS["bubble"],
                               f"bubble: {fmt_time(tl.pipeline_s - t0)}"))
        for s in tl.spans:
            if s.rank == r:
                parts.append(_rect(x(s.start), y, x(s.end) - x(s.start), row, COLORS[s.kind],
                                   f"{s.label}: {fmt_time(s.end - s.start)}"))
    y = top + tl.pp * (row + gap) + 4
    for k in range(5):
        t = span * k / 4
        anchor = "start" if k == 0 else "end" if k == 4 else "middle"
        parts.append(f"<line x1='{x(t):.1f}' y1='{y}' x2='{x(t):.1f}' y2='{y + 5}' stroke='#888'/>"
                     f"<text x='{x(t):.1f}' y='{y + 17}' font-size='11' text-anchor='{anchor}'>{fmt_time(t)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _rect(x: float, y: float, w: float, h: float, color: str, tip: str) -> str:
    edge = " stroke='#fff' stroke-width='0.5'" if w > 4 else ""  # thin bars: no outline to wash them out
    return (f"<rect x='{x:.2f}' y='{y}' width='{max(w, 0.5):.2f}' height='{h}' fill='{color}'{edge}>"
            f"<title>{escape(tip)}</title></rect>")


def _timeline(plan: Plan, pre: str) -> str:
    tl = plan_timeline(plan)
    bubble = ", ".join(f"rank {r}: {fmt_time(b)}" for r, b in enumerate(tl.bubble_s))
    return (f"<section id='{pre}timeline'><h2>Simulated pipeline timeline (one iteration)</h2>{_legend(COLORS)}"
            f"{_timeline_svg(tl)}<p class='note'>{plan.num_microbatches} micro-batches, schedule "
            f"{escape(str(plan.schedule))}; idle time in the pipeline per rank: {escape(bubble)}. The plan counts "
            f"{fmt_time(plan.time.total)} per iteration.</p></section>")


def _memory(plan: Plan, pre: str, width: int = 900) -> str:
    left, row, gap = 240, 20, 6
    cap = max((s.memory.capacity for s in plan.stages), default=0.0)
    top_val = max([cap, *(s.memory.total for s in plan.stages)]) or 1.0
    x = lambda b: left + (width - left - 120) * b / top_val
    height = len(plan.stages) * (row + gap) + 10
    parts = [(f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"viewBox='0 0 {width} {height}' role='img' aria-label='memory per device'>")]
    for i, s in enumerate(plan.stages):
        y = 4 + i * (row + gap)
        m = s.memory
        label = f"stage {s.index} (rank {s.index % plan.mesh.pp}): {module_ranges(s.modules)}"
        label = label if len(label) <= 40 else label[:39] + "\u2026"  # the whole list is in the tooltip
        parts.append(f"<text x='4' y='{y + row * 0.72:.1f}' font-size='11'><title>{escape(module_ranges(s.modules))}"
                     f"</title>{escape(label)}</text>")
        at = 0.0
        for kind, b in (("parameters", m.params), ("gradients", m.grads), ("optimizer state", m.optimizer),
                        ("activations", m.activations), ("other", m.other)):
            if b > 0:
                parts.append(_rect(x(at), y, x(at + b) - x(at), row, MEM_COLORS[kind], f"{kind}: {fmt_bytes(b)}"))
                at += b
        share = f" ({m.total / m.capacity:.0%})" if m.capacity else ""
        parts.append(f"<text x='{x(at) + 4:.1f}' y='{y + row * 0.72:.1f}' font-size='11'>"
                     f"{escape(fmt_bytes(m.total) + share)}</text>")
    if cap:
        parts.append(f"<line x1='{x(cap):.1f}' y1='0' x2='{x(cap):.1f}' y2='{height}' stroke='#b00' "
                     f"stroke-dasharray='4 3'><title>capacity {fmt_bytes(cap)}</title></line>")
    parts.append("</svg>")
    note = f"Dashed line: device capacity {fmt_bytes(cap)}." if cap else ""
    return (f"<section id='{pre}memory'><h2>Memory per device</h2>{_legend(MEM_COLORS)}{''.join(parts)}"
            f"<p class='note'>{note} One bar per pipeline stage (the device of its rank).</p></section>")


def _sharding(plan: Plan, pre: str) -> str:
    if plan.param_shardings:
        params = _table(["parameter", "placement on the tp axis"], [(p.pattern, p.placement)
                                                                     for p in plan.param_shardings])
    else:
        params = f"<p>No tensor parallelism (tp={plan.mesh.tp}): every parameter is whole on its device.</p>"
    comm = [o for o in plan.op_shardings if o.comm]
    ops = _table(["node", "op", "strategy", "inputs", "output", "collective", "time/mb"],
                 [(o.node, o.op, o.strategy, " ".join(o.inputs), o.output, o.comm, fmt_time(o.comm_s))
                  for o in comm], numeric=(6,)) if comm else ""
    return (f"<section id='{pre}sharding'><h2>Sharding (tp={plan.mesh.tp}, ZeRO-{plan.zero} over "
            f"dp={plan.mesh.dp})</h2>"
            f"{params}{'<h3>Resharding collectives</h3>' + ops if ops else ''}</section>")


def _alternatives(plan: Plan, alternatives: Sequence[Plan] | None, pre: str) -> str:
    if alternatives is None:
        body = ("<p class='note'>A plan file holds the chosen plan only; <code>autopar plan ... --html</code> lists "
                "the alternatives the search kept.</p>")
    else:
        rows = [(str(i), label, fmt_time(p.time.total), f"{plan.time.total / p.time.total:.3g}x")
                for i, (label, p) in enumerate(distinct_alternatives(plan, list(alternatives)), 1)]
        body = (_table(["#", "differs from the best in", "time/iteration", "speed vs best"], rows, numeric=(2, 3))
                if rows else "<p>The search kept no other distinct plan.</p>")
    return f"<section id='{pre}alternatives'><h2>Alternatives</h2>{body}</section>"


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{escape(title)}</h1>{body}</body></html>\n")


def _sections(plan: Plan, alternatives: Sequence[Plan] | None, pre: str = "") -> str:
    """The five sections; ``pre`` prefixes their ids (``a-``, ``b-`` on a diff page)."""
    return (_summary(plan, pre) + _timeline(plan, pre) + _memory(plan, pre) + _sharding(plan, pre)
            + _alternatives(plan, alternatives, pre))


def plan_html(plan: Plan, alternatives: Sequence[Plan] | None = None) -> str:
    """The page of one plan (``alternatives``: the search's other plans, when known)."""
    title = f"autopar plan: {plan.model} on {plan.nodes} x {plan.devices_per_node} ({plan.cluster})"
    return _page(title, _sections(plan, alternatives))


def diff_html(a: Plan, b: Plan, diff_text: str) -> str:
    """Two plans side by side under the text of their differences (:func:`autopar.planner.report.diff_plans`)."""
    other = models_differ(a, b)
    warn = f"<p class='warn'>{escape(other)}: times and speeds are not comparable.</p>" if other else ""
    ratio = "" if other else (f"<p>B is {a.time.total / b.time.total:.3g}x the speed of A.</p>"
                              if b.time.total else "")
    cols = "".join(f"<div><h2>{k}: {escape(p.model)}, pp={p.mesh.pp} dp={p.mesh.dp} tp={p.mesh.tp}</h2>"
                   f"{_sections(p, None, k.lower() + '-')}</div>" for k, p in (("A", a), ("B", b)))
    body = (f"<section id='differences'><h2>Differences</h2>{warn}{ratio}<pre>{escape(diff_text)}</pre></section>"
            f"<div class='side'>{cols}</div>")
    return _page(f"autopar diff: {a.model} vs {b.model}", body)


def write_html(path: str | Path, html: str) -> Path:
    p = Path(path)
    p.write_text(html, encoding="utf-8")
    return p
