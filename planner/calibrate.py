"""``autopar calibrate``: run plans, attribute the measured time, fit the profile, and say how far off it was.

For each plan: ``autopar run`` under the attribution hook (:mod:`autopar.planner.run.attribution`) for ``steps`` steps,
the last ``profiled`` of them under ``torch.profiler``.  The measured step time is the median of the steps after
warm-up that ran *without* the profiler; the profiled window gives each rank's split into compute, collectives,
p2p (transfer + bubble), idle and optimizer, rescaled to that step time.

The fit compares, per plan, the prediction's critical-rank breakdown with the measured one (the busiest rank; its
collectives without the wait for the slowest rank, see :func:`measured_observation`):

    [compute, its matmul-like part, exposed communication, optimizer, step total]  (each relative to the measured
    step time)

The matmul-like part (GEMMs, attention, convolutions: ``TimeBreakdown.matmul`` against the attribution's
``matmul``) tells the fit how much of the compute the arithmetic rate explains and how much the per-op eager cost:
without it, on this 2-core VM, the fit raised the matmul rate's factor to x2.0-2.3 for compute that the profiler
finds outside the GEMMs (0.76 of 3.1 ms in matmuls at batch 2 per rank).  Left out of the fit one run at a time, the
five fit runs of ``benchmarks/calibrate_cpu.py`` (six saved runs) were predicted within 20% 16 times of 30 with it,
10 without it.

The prediction of a plan under a candidate profile is the planner's own: the search re-run with the plan's mesh,
ZeRO level, micro-batch, schedule and recompute pinned (:func:`predict`), so calibration checks the same code path
``autopar plan`` uses.  The factors are fitted by :func:`autopar.profiles.refit.fit_factors` (those the runs
determine, :data:`DETERMINED`); when the fitted profile makes the planner shard a measured plan differently
(:func:`calibrate_loop`), that plan is re-planned, run and fitted again (``--iterations``).  The result is written as
a profile (``-o fitted.yaml``) with its provenance, plus a JSON sidecar (``fitted.yaml.calibration.json``) holding the
factors, the measurements and the predictions before and after.  ``--apply SIDECAR`` carries fitted factors over to
another base profile of the same machine (e.g. measured with 4 ranks after fitting on 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from autopar import ir
from autopar.ir.graph import Graph
from autopar.ir.plan import Plan
from autopar.planner.options import PlanOptions
from autopar.planner.run import attribution
from autopar.profiles.cost import CostModel
from autopar.profiles.refit import OVERLAP_FIELD, FitResult, apply_factors, factor_names, fit_factors, provenance
from autopar.profiles.schema import ClusterProfile, save_profile

__all__ = [
    "FIT_FACTORS",
    "RunMeasurement",
    "add_parser",
    "calibrate",
    "calibrate_loop",
    "cmd_calibrate",
    "compose",
    "determined",
    "load_factors",
    "measure_plan",
    "model_step",
    "observation",
    "plan_pins",
    "predict",
    "shardings",
    "stage_table",
]

log = logging.getLogger(__name__)

FIT_FACTORS = ("matmul", "vector", "memory", "overhead", "dtensor", "fsdp", "overlap")
"""Device factors fitted by default (``overlap`` where the schema has it, ``dtensor`` when a plan runs tensor
parallelism, ``fsdp`` when one runs FSDP2, ZeRO >= 1 with dp > 1); ``link.alpha``/``link.beta`` are added when the
plans communicate (see :func:`calibrate`)."""
_OBS = ("compute", "matmul", "comm", "optimizer", "total")
DETERMINED = 0.05
"""A default factor is fitted only if scaling it by 10 or by 1/10 moves some observation of the runs by this share of
that run's measured step time: below it, the runs do not determine the factor (their step times vary more than that
between runs, see ``benchmarks/calibrate_cpu.py``), and the fit would move it to explain noise; it stays 1.  The move
of a part of the step (compute, collectives, optimizer) counts as predicted or in proportion to that part's measured
value, whichever is larger; the whole step's, as predicted: a base profile far from the machine (an A100's for a CPU
rank) predicts the compute a hundred times below what is measured, and the factor that closes that gap moves the
prediction by little at x10, yet it is what the runs determine."""


@dataclass(kw_only=True, slots=True)
class RunMeasurement:
    """One plan run: the measured step time and each rank's attribution (seconds per step)."""

    plan_path: str
    model: str
    mesh: tuple[int, int, int]
    step_s: float
    """Median step time of the unprofiled steps after warm-up."""
    ranks: list[dict[str, float]] = field(default_factory=list)
    """Per rank (index = global rank): compute, comm, p2p, idle, optimizer, matmul, step; scaled to ``step_s``."""
    seq: int | None = None

    def critical(self) -> dict[str, float]:
        """The busiest rank's attribution (largest compute + comm + optimizer)."""
        return max(self.ranks, key=lambda r: r["compute"] + r["comm"] + r["optimizer"])

    def stage(self, plan: Plan, index: int) -> dict[str, float]:
        """Mean attribution over the ranks that run pipeline stage ``index``."""
        pp_rank = index % plan.mesh.pp
        rows = [r for g, r in enumerate(self.ranks) if plan.mesh.coords(g)[0] == pp_rank]
        return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]} if rows else {}


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_plan(plan_path: str | Path, model: str, *, steps: int = 16, warmup: int = 4, profiled: int = 4,
                 seq: int | None = None, timeout_s: float = 600.0) -> RunMeasurement:
    """Run the plan with torchrun on this machine and attribute its time (see the module docstring)."""
    from autopar.planner.run.torchrun import run_plan

    if warmup < 1 or profiled < 1 or steps < warmup + profiled + 2:
        raise ValueError(f"need warmup >= 1, profiled >= 1 and steps >= warmup + profiled + 2, got steps={steps}, "
                         f"warmup={warmup}, profiled={profiled}")
    plan = ir.load_plan(plan_path)
    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as d:
        rep = Path(d) / "report.json"
        args = ["--report", str(rep), "--warmup", str(warmup),
                "--step-hook", "autopar.planner.run.attribution:profile_step"]
        env = {attribution.ENV_DIR: d, attribution.ENV_START: str(steps - profiled),
               attribution.ENV_STOP: str(steps)}
        with _env(env):
            rc = run_plan(plan_path, model, steps, worker_args=args, timeout_s=timeout_s, seq=seq)
        files = [rep] + [Path(d) / f"rank{r}.json" for r in range(plan.world_size)]
        if rc != 0 and not all(f.is_file() for f in files):
            raise RuntimeError(f"running {plan_path} failed (torchrun exit code {rc})")
        if rc != 0:  # e.g. a gloo abort while tearing down, after every rank wrote its numbers
            log.warning("%s: torchrun exited with %d after the run completed; using its measurements", plan_path, rc)
        report = json.loads(rep.read_text())
        ranks = [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(plan.world_size)]
    times = report["step_times"][warmup:steps - profiled]
    step_s = statistics.median(times)
    scaled = []
    for r in ranks:
        k = step_s / r["step"]
        scaled.append({c: r[c] * k for c in (*attribution.CATEGORIES, "matmul", "step")})
    return RunMeasurement(plan_path=str(plan_path), model=model, mesh=(plan.mesh.pp, plan.mesh.dp, plan.mesh.tp),
                          step_s=step_s, ranks=scaled, seq=seq)


def model_step(model: str, seq: int | None = None) -> Callable[[], None]:
    """A training step of zoo ``model`` at batch 2 on CPU (forward, the zoo's loss for it, backward, and the worker's
    AdamW step): with ``functools.partial``, the workload of :func:`autopar.profiles.eager.time_concurrent` for the
    time-slicing factor of that model's ranks on oversubscribed cores.  The optimizer belongs in it: it sweeps every
    parameter's four copies, which a core shared with another process has evicted (paired on this VM, 4 against 2
    processes on 2 cores: x2.35 and x2.07 without it, x2.50 and x2.25 with it; runs spend 20-40% of a step there)."""
    import torch

    from autopar.zoo import build

    spec = build(model, batch=2, device="cpu", seq=seq)
    target = spec.make_target(2, "cpu")
    opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-6)

    def step() -> None:
        spec.loss_fn(spec.model(*spec.example_inputs), target).backward()
        opt.step()
        opt.zero_grad()

    return step


def plan_pins(plan: Plan) -> dict[str, int | str]:
    """Pins that make the search reproduce ``plan``'s choices (mesh, ZeRO, micro-batch, schedule, recompute)."""
    order = ("none", "selective", "full")
    rc = max((str(s.recompute) for s in plan.stages), key=order.index, default="none")
    return {"pp": plan.mesh.pp, "dp": plan.mesh.dp, "tp": plan.mesh.tp, "zero": plan.zero,
            "micro_batch": plan.micro_batch, "schedule": str(plan.schedule), "virtual_stages": plan.virtual_stages,
            "recompute": rc}


def link_groups(plans: Sequence[Plan], profile: ClusterProfile) -> set[tuple[str, int]]:
    """The ``(level, group size)`` link-table points the plans' collectives read: each plan's tensor-parallel group,
    its data-parallel (dp x cp) group, the pair of stages holding tied parameters and the whole world (the step's
    loss all-reduce).  A fit's link factors rescale only these (:func:`~autopar.profiles.refit.apply_factors`)."""
    cost, out = CostModel(profile), set()
    for p in plans:
        m = p.mesh
        tie = [(2, (m.pp - 1) * m.dp * m.cp * m.tp)] if m.pp > 1 else []
        for size, stride in [(m.tp, 1), (m.dp * m.cp, m.tp), (p.world_size, 1), *tie]:
            if size > 1:
                span = cost.span(size, stride)
                out.add(("intra_node", span.devices_per_node))
                if span.nodes > 1:
                    out.add(("inter_node", span.nodes))
    return out


def predict(graph: Graph, profile: ClusterProfile, plan: Plan) -> Plan:
    """The planner's prediction for ``plan``'s choices under ``profile`` (the search with the choices pinned)."""
    from autopar.planner.search import search

    opts = PlanOptions(global_batch=plan.global_batch, dtype=plan.dtype, pins=plan_pins(plan), top_k=0,  # type: ignore
                       workers=1, fused_kernels=plan.fused_kernels, overlap_grad_sync=plan.overlap_grad_sync)
    return search(graph, profile, opts).best


def observation(plan: Plan) -> list[float]:
    """The predicted ``[compute, matmul, comm, optimizer, total]`` of a plan (critical pipeline rank; ``matmul``:
    the part of compute in matmul-like ops)."""
    t = plan.time
    return [t.compute + getattr(t, "contention", 0.0), t.matmul, t.exposed_comm, t.optimizer, t.total]


def measured_observation(m: RunMeasurement) -> list[float]:
    """The measured counterpart of :func:`observation`: the busiest rank's compute and optimizer, and its
    collectives' time without the wait for the slowest rank.  Every rank of a plan without pipeline stages runs the
    same collectives, and the one that arrives last at each waits least: the smallest per-rank collective time is
    what the links cost, the rest is the other ranks waiting for the straggler (on a machine shared with other work,
    its uneven share of the cores), which no link coefficient describes.  With pipeline stages, the busiest rank's."""
    c = m.critical()
    comm = min(r["comm"] for r in m.ranks) if m.mesh[0] == 1 else c["comm"]
    return [c["compute"], c["matmul"], comm, c["optimizer"], m.step_s]


def plan_graph(plan: Plan, model: str, seq: int | None) -> Graph:
    """The model traced as the plan was made (fingerprint-matched, see the worker)."""
    from autopar.planner.run.worker import _plan_graph

    return _plan_graph(plan, model, seq)


def calibrate(base: ClusterProfile, runs: Sequence[tuple[Plan, Graph, RunMeasurement]], *,
              names: Sequence[str] | None = None, prior: float = 2e-2) -> FitResult:
    """Fit ``base``'s factors to the runs (see the module docstring); ``names`` defaults to :data:`FIT_FACTORS`
    (``overlap`` where the schema has it) plus ``link.alpha``/``link.beta`` when the plans communicate: one latency
    and one bandwidth correction for every collective, so that collectives the fitted plans do not run (a ZeRO
    plan's gathers) inherit what the measured ones show about this machine's links.  A pipeline's p2p keeps the
    profile's own measurement: a collective's fitted latency also holds the wait for the slowest rank, which a
    pipeline's schedule costs as its bubble.  Of the default names, only those the runs determine are fitted
    (:data:`DETERMINED`); the others stay 1.

    ``prior`` weighs ``sum (log k)^2`` against the squared relative residuals: ``(s_r / s_k)^2`` with ``s_r`` ~ 0.1,
    the run-to-run spread of a measured step on a shared machine, and ``s_k`` ~ ln 2, a factor of two as how far a
    measured coefficient may be from its in-situ value.  Factors the runs cannot tell apart (a step's compute matched
    by slower matmuls or by slower memory) then share the correction instead of one going to x0.3 and another to
    x10 (on this 2-core VM, 1e-3 fitted matmul x0.29-0.44 and link beta x11-13 in some runs)."""
    if not runs:
        raise ValueError("calibrate needs at least one measured run")
    screen = names is None
    if names is None:
        links = ["link.alpha", "link.beta"] if any(p.world_size > 1 for p, _, _ in runs) else []
        tp = any(p.mesh.tp > 1 for p, _, _ in runs)
        fsdp = any(p.zero >= 1 and p.mesh.dp * p.mesh.cp > 1 for p, _, _ in runs)
        names = [n for n in factor_names((), base) if n in FIT_FACTORS and (tp or n != "dtensor")
                 and (fsdp or n != "fsdp")] + links
    measured, scale = [], []
    for _, _, m in runs:
        measured += measured_observation(m)
        scale += [m.step_s] * len(_OBS)
    plans = [p for p, _, _ in runs]

    at_base = [predict(g, base, p) for p, g, _ in runs]
    groups = link_groups(plans, base)
    if any(q.mesh != p.mesh for q, (p, _, _) in zip(at_base, runs)):
        raise ValueError("a plan's choices are not reproducible under the base profile (different mesh)")
    # each set of factors is predicted once (the base is read by the mesh check, the screen and the fit's start;
    # a factor of 1 changes nothing, so it is left out of the key)
    memo: dict[tuple, list[float]] = {(): [x for q in at_base for x in observation(q)]}

    def observe(factors: dict[str, float]) -> list[float]:
        key = tuple(sorted((k, v) for k, v in factors.items() if v != 1.0))
        if key not in memo:
            prof = apply_factors(base, factors, link_groups=groups)
            memo[key] = [x for p, g, _ in runs for x in observation(predict(g, prof, p))]
        return list(memo[key])

    # a factor moves one part of a step (compute, collectives, optimizer); the step's gap is the sum of the parts'
    # gaps, so the whole step counts as predicted
    parts = [None if _OBS[i % len(_OBS)] == "total" else y for i, y in enumerate(measured)]
    kept = determined(names, observe, scale, parts) if screen else list(names)
    if not kept:  # nothing to fit: the base profile as it is
        before = tuple(memo[()])
        cost = sum(((a - b) / s) ** 2 for a, b, s in zip(before, measured, scale))
        return FitResult(factors={n: 1.0 for n in names}, before=before, after=before, measured=tuple(measured),
                         cost_before=cost, cost_after=cost, iterations=0, evaluations=1,
                         determined={n: False for n in names})
    log.info("fitting %s to %d plan(s)", ", ".join(kept), len(plans))
    fit = fit_factors(kept, observe, measured, scale, prior=prior)
    left = [n for n in names if n not in kept]
    return replace(fit, factors={**fit.factors, **{n: 1.0 for n in left}},
                   determined={**fit.determined, **{n: False for n in left}})


def determined(names: Sequence[str], observe: Callable[[dict[str, float]], list[float]],
               scale: Sequence[float], measured: Sequence[float | None] | None = None) -> list[str]:
    """The ``names`` whose factor, at 10 or 1/10, moves some observation by :data:`DETERMINED` of its scale, as
    predicted or, where ``measured`` gives the observation's measured value (not None), in proportion to it."""
    at_base = observe({})
    seen = measured if measured is not None else [None] * len(at_base)
    out = []
    for name in names:
        moved = max(abs(a - b) / s * (max(1.0, y / b) if y is not None and b > 0 else 1.0)
                    for f in (10.0, 0.1) for a, b, s, y in zip(observe({name: f}), at_base, scale, seen))
        if moved >= DETERMINED:
            out.append(name)
        else:
            log.info("calibrate: %s left at 1: at x10 and x0.1 it moves no observation by %.0f%% of its step "
                     "(at most %.1f%%)", name, 100 * DETERMINED, 100 * moved)
    return out


def shardings(plan: Plan) -> tuple:
    """What the intra-op solver decided for a plan (op strategies and parameter placements)."""
    return (tuple((o.node, o.strategy) for o in plan.op_shardings),
            tuple((p.pattern, p.placement) for p in plan.param_shardings))


def compose(first: dict[str, float], then: dict[str, float], base_overlap: float = 0.0) -> dict[str, float]:
    """The factors of applying ``first`` and then ``then``: products, except ``overlap``, a clamped shift of the
    base profile's overlap value ``base_overlap`` (see :mod:`autopar.profiles.refit`)."""
    out = dict(first)
    for k, v in then.items():
        if k == "overlap":
            mid = min(1.0, max(0.0, base_overlap + out.get(k, 1.0) - 1.0))
            end = min(1.0, max(0.0, mid + v - 1.0))
            out[k] = max(end - base_overlap + 1.0, 1e-9)
        else:
            out[k] = out.get(k, 1.0) * v
    return out


def calibrate_loop(base: ClusterProfile, runs: list[tuple[Plan, Graph, RunMeasurement]], *, iterations: int = 2,
                   remeasure: Callable[[Plan, int], RunMeasurement] | None = None
                   ) -> tuple[FitResult, dict[str, float], list[tuple[Plan, Graph, RunMeasurement]]]:
    """Fit, re-plan, re-measure: closes the loop when a fit changes what the planner does with a measured mesh.

    After each fit, every run's plan is re-planned (all choices pinned) on the fitted profile; a plan whose
    shardings changed (e.g. tensor-parallel ops sharded once compute looks slower) was not what ran, so it is run
    (``remeasure(plan, iteration)``) and the next fit starts from the fitted profile.  Returns the last fit, the
    factors over ``base`` in total, and the runs the last fit used."""
    total: dict[str, float] = {}
    current, fit = base, None
    for it in range(max(1, iterations)):
        fit = calibrate(current, runs)
        total = compose(total, fit.factors, getattr(base.device, OVERLAP_FIELD, 0.0))
        current = apply_factors(base, total, link_groups=link_groups([p for p, _, _ in runs], base))
        if it + 1 >= iterations or remeasure is None:
            break
        replanned = [(predict(g, current, p), g, m) for p, g, m in runs]
        if all(shardings(q) == shardings(p) for (q, _, _), (p, _, _) in zip(replanned, runs)):
            break
        runs = [(q, g, m if shardings(q) == shardings(p) else remeasure(q, it + 1))
                for (q, g, m), (p, _, _) in zip(replanned, runs)]
        log.info("calibrate: the fit changed shardings; re-measured and fitting again (iteration %d)", it + 2)
    assert fit is not None
    return fit, total, runs


def stage_table(plan: Plan, m: RunMeasurement, before: Plan, after: Plan | None = None) -> str:
    """Predicted (before/after the fit) vs measured, per stage and for the step, as text."""
    hdr = f"{'':10}{'pred before':>12}" + (f"{'pred after':>12}" if after else "") + f"{'measured':>11}"
    hdr += f"{'meas/before':>12}" + (f"{'meas/after':>11}" if after else "")
    title = (f"{Path(m.plan_path).name}: pp={plan.mesh.pp} dp={plan.mesh.dp} tp={plan.mesh.tp} zero={plan.zero} "
             f"mb={plan.micro_batch}x{plan.num_microbatches} {plan.schedule}")
    rows = [title, hdr]

    def row(label: str, pb: float, pa: float | None, meas: float) -> str:
        s = f"{label:10}{pb * 1e3:10.3f}ms" + (f"{pa * 1e3:10.3f}ms" if pa is not None else "")
        s += f"{meas * 1e3:9.3f}ms{meas / pb if pb > 0 else float('nan'):12.2f}"
        return s + (f"{meas / pa if pa else float('nan'):11.2f}" if pa is not None else "")

    for k, st in enumerate(plan.stages):
        meas = m.stage(plan, k)
        busy = meas.get("compute", 0.0) + meas.get("comm", 0.0)
        sb = before.stages[k] if k < len(before.stages) else st
        sa = after.stages[k] if after is not None and k < len(after.stages) else None
        rows.append(row(f"stage {k}", (sb.fwd_s + sb.bwd_s) * before.num_microbatches,
                        (sa.fwd_s + sa.bwd_s) * after.num_microbatches if sa is not None and after else None, busy))
    c = m.critical()
    parts = (("compute", "compute", "compute"), ("comm", "exposed_comm", "comm"),
             ("p2p+bubble", "bubble", "p2p"), ("optimizer", "optimizer", "optimizer"))
    for label, attr, key in parts:
        rows.append(row(label, getattr(before.time, attr), getattr(after.time, attr) if after else None, c[key]))
    rows.append(f"{'idle':10}{'':>12}" + (f"{'':>12}" if after else "") + f"{c['idle'] * 1e3:9.3f}ms")
    rows.append(row("step", before.time.total, after.time.total if after else None, m.step_s))
    return "\n".join(rows)


def load_factors(path: str | Path) -> dict[str, float]:
    """The fitted factors from a calibration sidecar JSON."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("factors"), dict):
        raise ValueError(f"{path}: not an autopar calibration sidecar (no 'factors' mapping)")  # noqa: TRY004
    return {str(k): float(v) for k, v in data["factors"].items()}


def add_parser(sub: Any) -> None:
    """The ``calibrate`` subcommand's arguments (on the CLI's subparsers)."""
    c = sub.add_parser("calibrate", help="run plans, attribute the measured time, fit the cluster profile to it")
    c.add_argument("plans", nargs="*", help="plan YAMLs to run and fit on (the same model; e.g. dp=2 and tp=2)")
    c.add_argument("--model", help="zoo model name or package.module:factory")
    c.add_argument("--cluster", required=True, help="base profile (YAML or built-in) whose coefficients are fitted")
    c.add_argument("-o", "--output", required=True, help="write the fitted profile YAML here (+ .calibration.json)")
    c.add_argument("--steps", type=int, default=40, help="steps per run (all but --warmup and --profiled are timed)")
    c.add_argument("--warmup", type=int, default=4, help="steps excluded from the timing")
    c.add_argument("--profiled", type=int, default=4, help="last steps run under torch.profiler (attribution only)")
    c.add_argument("--seq", type=int, default=None, help="sequence length override (as given to autopar run)")
    c.add_argument("--iterations", type=int, default=2,
                   help="fit, re-plan, and re-measure plans whose shardings the fit changed, up to this many fits")
    c.add_argument("--apply", default=None,
                   help="instead of running: apply the factors of this calibration JSON to --cluster")
    c.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.planner.api import resolve_cluster

    base = resolve_cluster(args.cluster)
    out = Path(args.output)
    if args.apply:
        factors = load_factors(args.apply)
        groups = json.loads(Path(args.apply).read_text()).get("link_groups")  # None: written before they were kept
        prof = apply_factors(base, factors, note=f"factors of {args.apply}",
                             link_groups=None if groups is None else {(str(a), int(b)) for a, b in groups})
        save_profile(_renamed(prof, base, f"factors of {args.apply}"), out)
        print(f"wrote {out}: {base.name} with " + ", ".join(f"{k} x{v:.3g}" for k, v in sorted(factors.items())))
        return 0
    if not args.plans or not args.model:
        raise ValueError("calibrate needs plan YAMLs and --model (or --apply CALIBRATION.json)")
    runs = []
    for path in args.plans:
        plan = ir.load_plan(path)
        if plan.world_size != base.world_size:
            raise ValueError(f"{path} needs {plan.world_size} ranks but --cluster {base.name} has {base.world_size}")
        m = measure_plan(path, args.model, steps=args.steps, warmup=args.warmup, profiled=args.profiled,
                         seq=args.seq)
        runs.append((plan, plan_graph(plan, args.model, args.seq), m))

    def remeasure(plan: Plan, it: int) -> RunMeasurement:
        path = out.with_name(f"{out.stem}.iter{it}.pp{plan.mesh.pp}dp{plan.mesh.dp}tp{plan.mesh.tp}.yaml")
        ir.dump_plan(plan, path)
        return measure_plan(path, args.model, steps=args.steps, warmup=args.warmup, profiled=args.profiled,
                            seq=args.seq)

    fit, total, runs = calibrate_loop(base, runs, iterations=args.iterations, remeasure=remeasure)
    what = ", ".join(f"{Path(m.plan_path).name} ({args.model})" for _, _, m in runs)
    groups = link_groups([p for p, _, _ in runs], base)
    fitted = provenance(base, replace(fit, factors=total), what, groups)
    save_profile(fitted, out)
    sidecar = out.with_name(out.name + ".calibration.json")
    befores = [predict(g, base, p) for p, g, _ in runs]
    afters = [predict(g, fitted, p) for p, g, _ in runs]
    sidecar.write_text(json.dumps({
        "base": base.name, "base_source": base.source, "model": args.model,
        "plans": [m.plan_path for _, _, m in runs], "factors": total, "link_groups": sorted(groups),
        "last_fit_factors": fit.factors,
        "determined": fit.determined, "cost_before": fit.cost_before, "cost_after": fit.cost_after,
        "observations": list(_OBS), "measured": fit.measured, "before": fit.before, "after": fit.after,
        "runs": [asdict(m) for _, _, m in runs]}, indent=1))
    for (p, _, m), b, a in zip(runs, befores, afters):
        print(stage_table(p, m, b, a) + "\n")
    print("fitted factors: " + ", ".join(f"{k} x{v:.3g}" + ("" if fit.determined.get(k) else " (undetermined)")
                                         for k, v in total.items()))
    print(f"wrote {out} and {sidecar}; re-plan with: autopar plan MODEL --cluster {out} ...")
    return 0


def _renamed(prof: ClusterProfile, base: ClusterProfile, what: str) -> ClusterProfile:
    return replace(prof, name=f"{base.name}-calibrated", source=f"{base.source}; calibrated ({what})")

