"""The simulated timeline of one training iteration of a plan, per pipeline rank: what ``autopar show --trace``
writes as a Perfetto / Chrome trace and what the HTML report draws.

The forward and backward ops come from the schedule simulator (:func:`autopar.planner.inter_op.schedule.simulate`) on
the plan's per-stage times; after each rank's last backward come the parts of the plan's iteration time that the
stage times do not hold, as the planner counts them (:mod:`autopar.planner.inter_op.evaluate`): the exposed
data-parallel synchronization, the compute lost to overlap contention, the rest of the exposed communication (tensor
parallel and pipeline transfers not inside the stage times), then the optimizer step, which every rank runs after the
slowest one. So the ``comm/optimizer`` track holds the plan's ``dp_exposed``, ``contention`` and ``optimizer``
figures and the timeline ends at the plan's iteration time (or later, by the difference, where the simulated pipeline
without per-boundary transfer times is longer than the plan's compute and bubble).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from autopar.ir.plan import Plan
from autopar.planner.tables import module_ranges

__all__ = ["Span", "Timeline", "chrome_trace", "plan_timeline", "schedule_trace", "stage_label"]

Kind = Literal["forward", "backward", "dp sync", "contention", "comm", "optimizer"]


@dataclass(frozen=True, slots=True)
class Span:
    """One bar of the timeline: ``kind`` on pipeline rank ``rank`` from ``start`` to ``end`` seconds."""

    rank: int
    kind: Kind
    start: float
    end: float
    label: str
    stage: int = -1
    """Virtual stage of a forward/backward op; -1 for the others."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """Spans of one iteration; ``iteration_s`` is when the last rank finishes its optimizer step."""

    pp: int
    spans: tuple[Span, ...]
    pipeline_s: float
    iteration_s: float
    bubble_s: tuple[float, ...]
    """Per rank: idle time between its first op and the end of the pipeline."""


def stage_label(plan: Plan, k: int) -> str:
    return f"stage {k}: {module_ranges(plan.stages[k].modules)}"


def plan_timeline(plan: Plan) -> Timeline:
    """Simulate ``plan``'s schedule and lay out the iteration per pipeline rank (see the module docstring)."""
    from autopar.planner.inter_op.schedule import simulate

    t = plan.time
    res = simulate([s.fwd_s for s in plan.stages], [s.bwd_s for s in plan.stages], pp=plan.mesh.pp,
                   num_microbatches=plan.num_microbatches, schedule=plan.schedule,
                   virtual_stages=plan.virtual_stages)
    spans: list[Span] = []
    for e in res.events:
        kind: Kind = "forward" if e.kind == "F" else "backward"
        name = f"{e.kind}{e.microbatch}" + (f".c{e.chunk}" if plan.virtual_stages > 1 else "")
        spans.append(Span(e.rank, kind, e.start, e.end, name, e.stage))
    # what the plan counts beyond the simulated pipeline, the exposed dp sync, contention and optimizer: the other
    # exposed communication (tp collectives, pipeline transfers) that the stage times do not already hold
    other_comm = max(t.total - (res.pipeline_s + t.dp_exposed + t.contention + t.optimizer), 0.0)
    ends = []
    for r in range(plan.mesh.pp):
        at = res.rank_end_s[r]
        for kind, dur, label in (("dp sync", t.dp_exposed, "data-parallel sync (exposed)"),
                                 ("contention", t.contention, "overlap contention"),
                                 ("comm", other_comm, "other exposed communication (tp, pipeline)")):
            if dur > 0:
                spans.append(Span(r, kind, at, at + dur, label))  # type: ignore[arg-type]
                at += dur
        ends.append(at)
    opt_start = max(ends) if ends else 0.0
    if t.optimizer > 0:
        spans.extend(Span(r, "optimizer", opt_start, opt_start + t.optimizer, "optimizer step")
                     for r in range(plan.mesh.pp))
    busy = [sum(s.end - s.start for s in spans if s.rank == r and s.kind in ("forward", "backward"))
            for r in range(plan.mesh.pp)]
    bubble = tuple(max(res.pipeline_s - b, 0.0) for b in busy)
    return Timeline(pp=plan.mesh.pp, spans=tuple(spans), pipeline_s=res.pipeline_s,
                    iteration_s=opt_start + t.optimizer, bubble_s=bubble)


def chrome_trace(plan: Plan, tl: Timeline | None = None) -> dict[str, Any]:
    """Chrome Trace Event JSON (Perfetto, chrome://tracing): one process per pipeline rank, thread 0 ``compute``
    (forward/backward ops), thread 1 ``comm/optimizer``; times in microseconds."""
    tl = tl or plan_timeline(plan)
    us = 1e6
    ev: list[dict[str, Any]] = []
    for r in range(tl.pp):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"pp rank {r}"}})
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "comm/optimizer"}})
    for s in tl.spans:
        compute = s.kind in ("forward", "backward")
        args: dict[str, Any] = {"stage": s.stage, "stage_name": stage_label(plan, s.stage)} if compute else {}
        ev.append({"ph": "X", "name": s.label, "cat": s.kind, "pid": s.rank, "tid": 0 if compute else 1,
                   "ts": s.start * us, "dur": (s.end - s.start) * us, "args": args})
    t = plan.time
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"model": plan.model, "schedule": str(plan.schedule), "pp": plan.mesh.pp,
                          "virtual_stages": plan.virtual_stages, "num_microbatches": plan.num_microbatches,
                          "iteration_s": tl.iteration_s, "pipeline_s": tl.pipeline_s,
                          "plan_iteration_s": t.total, "plan_exposed_comm_s": t.exposed_comm,
                          "plan_contention_s": t.contention, "plan_optimizer_s": t.optimizer,
                          "bubble_s": list(tl.bubble_s)}}


def schedule_trace(plan: Plan, path: str | Path) -> int:
    """Write :func:`chrome_trace` of ``plan`` to ``path``; returns the number of events."""
    trace = chrome_trace(plan)
    Path(path).write_text(json.dumps(trace))
    return len(trace["traceEvents"])
