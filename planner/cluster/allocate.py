"""The allocation model: which pool, and how many of its nodes, each job gets.

Formulation (CP-SAT; plain numbers in, no I/O, so tests compare it with brute force):

- ``x[j, c]`` in {0, 1}: job ``j`` runs choice ``c`` = (pool ``p(c)``, ``n(c)`` nodes, throughput ``T[j, c]``).
- ``add_one_choice_constraint``: ``sum_c x[j, c] == 1`` -- every job runs, in one pool.
- ``add_capacity_constraint``: ``sum_{j, c: p(c) = p} n(c) x[j, c] <= N_p`` for every pool ``p``.
- ``add_fairness_constraint``: ``sum_c T[j, c] x[j, c] >= f * E_j``, ``E_j`` being the job's throughput under an
  equal share of the cluster and ``f`` the fairness fraction.
- moved ``m_j = 1 - x[j, current_j]`` for a job running now (``current_j`` its present choice), 0 for a new job.
- Objective, goodput: ``max sum_j w_j sum_c (T[j, c] / E_j) x[j, c] - mu * sum_j m_j - eps * nodes used``
  (weighted throughput normalised per job, a migration cost ``mu`` per moved job, and ``eps`` per node so that of
  two equally good allocations the one leaving nodes free wins).
- max-min: first ``max t`` subject to ``t <= sum_c (T[j, c] / (w_j E_j)) x[j, c]`` for every job; then the goodput
  objective with ``t`` held at its optimum (lexicographic, in two solves).
- equal: every job limited to its equal-share node count (the largest choice within it), goodput objective (so only the
  pool placement is chosen).

Values are scaled by ``SCALE`` and rounded to integers for CP-SAT.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "NODE_EPS",
    "POLICIES",
    "SCALE",
    "Choice",
    "InfeasibleAllocation",
    "Policy",
    "Problem",
    "allocate",
    "objective",
]

Policy = Literal["goodput", "max-min", "equal"]
POLICIES: tuple[str, ...] = ("goodput", "max-min", "equal")
SCALE = 10_000
NODE_EPS = 1.0 / SCALE
"""Objective cost of one node in use (a tie-break: an idle node is worth keeping free)."""


class InfeasibleAllocation(ValueError):
    """No allocation meets every job's minimum and the fairness fraction on this cluster."""


@dataclass(frozen=True, slots=True)
class Choice:
    pool: str
    nodes: int
    samples_per_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """The allocation problem as plain numbers (see the module docstring)."""

    choices: Mapping[str, tuple[Choice, ...]]
    """Per job, the (pool, nodes, throughput) it may run; a curve's points."""
    capacity: Mapping[str, int]
    """Nodes per pool."""
    equal: Mapping[str, float]
    """Per job, its throughput under an equal share (``E_j``; > 0)."""
    weight: Mapping[str, float] = field(default_factory=dict)
    """Per job, its weight (default 1)."""
    equal_nodes: Mapping[str, int] = field(default_factory=dict)
    """Per job, its equal-share node count (the ``equal`` policy's limit)."""
    current: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    """Jobs running now: their (pool, nodes)."""

    def __post_init__(self) -> None:
        for j, cs in self.choices.items():
            if not cs:
                raise InfeasibleAllocation(f"job {j} has no plan on any node count it may get")
            if not self.equal.get(j, 0) > 0:
                raise ValueError(f"job {j}: its equal-share throughput must be positive")
            for c in cs:
                if c.pool not in self.capacity or c.nodes < 1 or c.samples_per_s < 0:
                    raise ValueError(f"job {j}: bad choice {c}")


def _w(p: Problem, j: str) -> float:
    return float(p.weight.get(j, 1.0))


def _value(p: Problem, j: str, c: Choice) -> float:
    """A choice's share of the goodput objective: weighted, normalised throughput less the node tie-break."""
    return _w(p, j) * c.samples_per_s / p.equal[j] - NODE_EPS * c.nodes


def objective(p: Problem, alloc: Mapping[str, Choice], migration_cost: float = 0.0) -> float:
    """The goodput objective of ``alloc`` in floating point (the CP-SAT model's, unscaled)."""
    moved = sum(1 for j, c in alloc.items() if j in p.current and p.current[j] != (c.pool, c.nodes))
    return sum(_value(p, j, c) for j, c in alloc.items()) - migration_cost * moved


def _allowed(p: Problem, j: str, policy: str, fairness: float) -> list[Choice]:
    cs = list(p.choices[j])
    if policy == "equal":
        share = p.equal_nodes.get(j)
        if share is None:
            raise ValueError(f"the equal policy needs job {j}'s equal-share node count")
        best: dict[str, Choice] = {}
        for c in cs:
            if c.nodes <= share and (c.pool not in best or c.nodes > best[c.pool].nodes):
                best[c.pool] = c
        cs = list(best.values()) or [min(cs, key=lambda c: c.nodes)]  # a job whose minimum is above its share
    return [c for c in cs if c.samples_per_s >= fairness * p.equal[j] - 1e-12] if policy != "equal" else cs


def allocate(p: Problem, policy: str = "goodput", *, fairness: float = 0.5, migration_cost: float = 0.1,
             time_limit_s: float = 30.0) -> dict[str, Choice]:
    """The best allocation under ``policy`` (see the module docstring); raises InfeasibleAllocation if none."""
    from ortools.sat.python import cp_model

    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not 0.0 <= fairness <= 1.0:
        raise ValueError(f"fairness must be in [0, 1], got {fairness}")
    if migration_cost < 0:
        raise ValueError(f"migration cost must be >= 0, got {migration_cost}")
    m = cp_model.CpModel()
    allowed = {j: _allowed(p, j, policy, fairness) for j in p.choices}
    x = {(j, i): m.NewBoolVar(f"x_{j}_{i}") for j, cs in allowed.items() for i in range(len(cs))}
    add_one_choice_constraint(m, x, allowed)
    add_capacity_constraint(m, x, allowed, p.capacity)
    if policy != "equal":
        add_fairness_constraint(m, x, allowed, p, fairness)
    goodput = sum(round(SCALE * _value(p, j, c)) * x[j, i] for j, cs in allowed.items() for i, c in enumerate(cs))
    stay = [x[j, i] for j, cs in allowed.items() for i, c in enumerate(cs)
            if p.current.get(j) == (c.pool, c.nodes)]
    moved = sum(1 for j in allowed if j in p.current) - sum(stay)
    score = goodput - round(SCALE * migration_cost) * moved
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1  # deterministic; the model is small (jobs x curve points)
    if policy == "max-min":
        t = m.NewIntVar(0, 1 << 40, "t")
        for j, cs in allowed.items():
            m.Add(t <= sum(round(SCALE * c.samples_per_s / (_w(p, j) * p.equal[j])) * x[j, i]
                           for i, c in enumerate(cs)))
        m.Maximize(t)
        _solve(solver, m)
        m.Add(t >= solver.Value(t))
        m.ClearObjective()
    m.Maximize(score)
    _solve(solver, m)
    return {j: cs[i] for j, cs in allowed.items() for i in range(len(cs)) if solver.Value(x[j, i])}


def _solve(solver: object, m: object) -> None:
    from ortools.sat.python import cp_model

    status = solver.Solve(m)  # type: ignore[attr-defined]
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleAllocation("no allocation gives every job its minimum nodes and the fairness fraction of its "
                                   "equal-share throughput on this cluster; lower --fairness, raise a job's "
                                   "max_devices/lower its min_devices, or add nodes")


def add_one_choice_constraint(m: object, x: dict, allowed: dict[str, list[Choice]]) -> None:
    """sum_c x[j, c] == 1 for every job j."""
    for j, cs in allowed.items():
        m.AddExactlyOne([x[j, i] for i in range(len(cs))])  # type: ignore[attr-defined]


def add_capacity_constraint(m: object, x: dict, allowed: dict[str, list[Choice]], capacity: Mapping[str, int]) -> None:
    """sum_{j, c in pool p} n(c) x[j, c] <= N_p for every pool p."""
    for pool, cap in capacity.items():
        m.Add(sum(c.nodes * x[j, i] for j, cs in allowed.items()  # type: ignore[attr-defined]
                  for i, c in enumerate(cs) if c.pool == pool) <= cap)


def add_fairness_constraint(m: object, x: dict, allowed: dict[str, list[Choice]], p: Problem, f: float) -> None:
    """sum_c T[j, c] x[j, c] >= f * E_j for every job j (choices below it were already left out, so this holds by
    construction; it stays as the model's statement of the rule, and an empty choice list makes the model
    infeasible through the one-choice constraint)."""
    for j, cs in allowed.items():
        m.Add(sum(round(SCALE * c.samples_per_s / p.equal[j]) * x[j, i]  # type: ignore[attr-defined]
                  for i, c in enumerate(cs)) >= int(SCALE * f) - 1)
