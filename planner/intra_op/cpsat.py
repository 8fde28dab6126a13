"""The CP-SAT core of the intra-op (tensor-parallel) sharding solver: plain costs in, choices out, no I/O.

Formulation (Alpa, Zheng et al. OSDI'22 Sec. 4.2; tight edge variables as in meta-pytorch/autoparallel
``optimize_sharding.py``). The choosers V are the nodes of one layer group, each with its strategies S_v
(:mod:`autopar.planner.intra_op.rules`), plus pseudo-nodes whose "strategies" are placements: the residual input of
the group, and every parameter read by several nodes. E are the data edges ``e = (u -> v)``, v reading u's output.

Variables

* ``x[v,s] in {0,1}``: node v runs strategy s.
* ``y[e,s,s'] in {0,1}``: edge e joins choice s of u with choice s' of v; created only for allowed pairs (the value
  ``out(u,s)`` can be resharded to ``in(v,s')``: ``R -> P`` and ``S -> P`` cannot), and only for edges that cost
  something or share a collective (an edge whose every pair is allowed and free constrains nothing).
* ``z[g,k] in {0,1}``: conversion k (a collective, keyed by direction and (source, target) placement) of the value
  of shared group g is paid (created for conversions that cost something). A shared group is the two or more edges
  that read the same value: one collective serves every consumer that needs the same conversion (and their gradients
  are summed before one reshard).

Objective (seconds, scaled to integer nanoseconds)

    min  sum_{v,s} c(v,s) x[v,s]  +  sum_{e,s,s'} r(e,s,s') y[e,s,s']  +  sum_{g,k} C(g,k) z[g,k]

* ``c(v,s)``: forward + backward compute on one device, the conversions of side inputs and outputs that cross the
  group boundary, the tp all-reduce of partial weight gradients; and, in the memory-lean variant, the Lagrangian
  price on parameter memory ``lambda * B * local_elems(v,s)`` (``lambda = param_byte_price_s``, ``B =
  param_state_bytes``, local elements of the parameters the strategy reads: ``numel / t`` sharded, ``numel``
  replicated; a tied parameter is priced once, on its pseudo-node). ``c = INF`` forbids the choice.
* ``r(e,s,s')``: forward reshard of the value + backward reshard of its gradient, for an edge alone in its group;
  0 for edges of a shared group, whose costs are the ``C(g,k)`` instead.

Constraints (one ``add_<name>_constraint`` each)

* one choice     ``sum_s x[v,s] = 1``                                           (add_one_choice_constraint)
* forbidden      ``x[v,s] = 0`` where ``c(v,s) = INF``                          (add_forbidden_choice_constraint)
* edge (tight)   ``sum_s' y[e,s,s'] = x[u,s]`` for all s and ``sum_s y[e,s,s'] = x[v,s']`` for all s', the sums
                 over allowed pairs only, so a forbidden pair cannot be chosen    (add_edge_constraint)
* shared cost    ``z[g,k] >= y[e,s,s']`` for every edge e of g and pair (s,s') needing conversion k
                                                                                (add_shared_cost_constraint)
* equality       ``sum_{s: key_a(s)=k} x[a,s] = sum_{s': key_b(s')=k} x[b,s']`` for every key k
                 (add_equal_constraint). Used for (1) a parameter read by several nodes (tied weights): its
                 pseudo-node's placement equals each reader's placement of it; (2) a repeated block's residual input
                 (a pseudo-node) equals its output placement, so identical blocks chain without resharding.
* memory         ``sum_{v,s} saved(v,s) x[v,s] <= budget``: activation bytes saved for backward
                                                                                (add_memory_constraint)

:func:`solve_costs` takes plain costs and does no I/O, so tests compare it with brute-force enumeration
(:func:`evaluate_costs` is the objective of one assignment); :mod:`autopar.planner.intra_op.model` builds those costs
from a layer group of the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, NamedTuple, Sequence

from ortools.sat.python import cp_model

__all__ = ["IntraOpOptions", "CPSAT_WORKERS", "CoreSolution", "Edge", "EqualPair", "Shared", "INF", "solve_costs", "evaluate_costs",
           "add_one_choice_constraint", "add_forbidden_choice_constraint", "add_edge_constraint",
           "add_equal_constraint", "add_memory_constraint", "add_shared_cost_constraint"]

INF = math.inf
CPSAT_WORKERS = 1
"""CP-SAT search threads per solve in the planner: one keeps every solve deterministic; the planner's parallelism
comes from solving independent groups in separate processes (``PlanOptions.workers``)."""
_NS = 1e9


@dataclass(kw_only=True, slots=True, frozen=True)
class IntraOpOptions:
    """How to run the CP-SAT solve."""

    time_limit_s: float = 10.0
    """Wall-clock limit of one group's solve (CP-SAT ``max_time_in_seconds``)."""
    workers: int = 1
    """CP-SAT search workers; 1 keeps results deterministic."""
    seed: int = 0
    """CP-SAT ``random_seed``."""
    activation_budget_bytes: float | None = None
    """Cap on the activation bytes one group saves for backward (per device, per micro-batch); None = no cap."""
    param_byte_price_s: float = 0.0
    """Seconds charged per byte of parameter state a device holds (a Lagrangian price on memory): 0 optimizes time
    alone; the outer search raises it to find memory-lean shardings (replicated weights cost tp times the memory)."""
    param_state_bytes: float = 16.0
    """Bytes of model state per parameter element priced by ``param_byte_price_s`` (mixed-precision Adam: 16)."""

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.activation_budget_bytes is not None and self.activation_budget_bytes < 0:
            raise ValueError(f"activation_budget_bytes must be >= 0, got {self.activation_budget_bytes}")
        if self.param_byte_price_s < 0 or self.param_state_bytes < 0:
            raise ValueError("param_byte_price_s and param_state_bytes must be >= 0")


class CoreSolution(NamedTuple):
    choices: list[int]
    objective: float
    bound: float
    status: str
    gap: float


# ---- the CP-SAT core ----------------------------------------------------------------------------------------------
def add_one_choice_constraint(model: cp_model.CpModel, x: list[list[cp_model.IntVar]]) -> None:
    """sum_s x[v,s] = 1 for every node v."""
    for xs in x:
        model.add_exactly_one(xs)


def add_forbidden_choice_constraint(model: cp_model.CpModel, x: list[list[cp_model.IntVar]],
                                    node_cost: Sequence[Sequence[float]]) -> None:
    """x[v,s] = 0 for every choice whose cost c(v,s) is INF."""
    for v, cs in enumerate(node_cost):
        for s, c in enumerate(cs):
            if c == INF:
                model.add(x[v][s] == 0)


def add_edge_constraint(model: cp_model.CpModel, x: list[list[cp_model.IntVar]], u: int, v: int,
                        y: dict[tuple[int, int], cp_model.IntVar]) -> None:
    """sum_s' y[e,s,s'] = x[u,s] for all s;  sum_s y[e,s,s'] = x[v,s'] for all s'.

    ``y`` holds the allowed pairs of edge e = (u -> v) only; a missing pair is a forbidden reshard, fixed to 0."""
    for s in range(len(x[u])):
        model.add(sum(y[s, s2] for s2 in range(len(x[v])) if (s, s2) in y) == x[u][s])
    for s2 in range(len(x[v])):
        model.add(sum(y[s, s2] for s in range(len(x[u])) if (s, s2) in y) == x[v][s2])


def add_equal_constraint(model: cp_model.CpModel, x: list[list[cp_model.IntVar]], a: int, b: int,
                         key_a: Sequence[Hashable], key_b: Sequence[Hashable]) -> None:
    """sum_{s: key_a(s)=k} x[a,s] = sum_{s': key_b(s')=k} x[b,s'] for every key k."""
    for k in dict.fromkeys([*key_a, *key_b]):
        model.add(sum(x[a][s] for s, ka in enumerate(key_a) if ka == k)
                  == sum(x[b][s] for s, kb in enumerate(key_b) if kb == k))


def add_shared_cost_constraint(model: cp_model.CpModel, z: cp_model.IntVar, ys: Sequence[cp_model.IntVar]) -> None:
    """z[u,k] >= y[e,s,s'] for every edge e out of u whose pair (s,s') needs conversion k: one collective serves
    every consumer of a value that needs the same conversion (and their gradients are summed before one reshard)."""
    for y in ys:
        model.add(z >= y)


def add_memory_constraint(model: cp_model.CpModel, x: list[list[cp_model.IntVar]], mem: Sequence[Sequence[float]],
                          budget: float) -> None:
    """sum_{v,s} saved(v,s) x[v,s] <= budget (bytes, rounded up per term)."""
    model.add(sum(int(math.ceil(m)) * x[v][s] for v, ms in enumerate(mem) for s, m in enumerate(ms) if m)
              <= int(math.floor(budget)))


class _Model(cp_model.CpModel):
    """A CpModel without OR-Tools' per-instance camelCase aliases: its constructor binds a deprecated wrapper for
    each of ~60 methods (about 1.7 ms a model, a tenth of a large search's CPU); this module uses snake_case only."""

    def _add_pre_pep8_methods(self) -> None:
        pass


Edge = tuple[int, int, Sequence[Sequence[float]]]
EqualPair = tuple[int, int, Sequence[Hashable], Sequence[Hashable]]
Shared = tuple[Sequence[tuple[int, Sequence[Sequence[Hashable]]]], dict[Hashable, float]]
"""(edges as (edge index, key per (s, s') pair), cost per key): each key's cost is paid once if any edge uses it."""


def evaluate_costs(node_cost: Sequence[Sequence[float]], edges: Sequence[Edge], choices: Sequence[int],
                   shared: Sequence[Shared] = ()) -> float:
    """Objective of an assignment (INF if it uses an invalid choice or reshard)."""
    tot = sum(node_cost[v][c] for v, c in enumerate(choices))
    tot += sum(m[choices[u]][choices[v]] for u, v, m in edges)
    for es, costs in shared:
        used = {km[choices[edges[e][0]]][choices[edges[e][1]]] for e, km in es}
        tot += sum(costs.get(k, 0.0) for k in used)
    return tot


def solve_costs(num_choices: Sequence[int], node_cost: Sequence[Sequence[float]], edges: Sequence[Edge], *,
                mem: Sequence[Sequence[float]] | None = None, budget: float | None = None,
                equal_pairs: Sequence[EqualPair] = (), shared: Sequence[Shared] = (),
                hint: Sequence[int] | None = None,
                options: IntraOpOptions = IntraOpOptions(), cost_scale: float = _NS) -> CoreSolution:
    """Minimise node + edge + shared costs (floats, INF = forbidden) subject to the constraints in the module docstring.

    Costs are multiplied by ``cost_scale`` and rounded to integers for CP-SAT; ``objective`` and ``bound`` are
    returned in the original unit. Raises ValueError when the instance is infeasible (e.g. the memory budget)."""
    model = _Model()
    x = [[model.new_bool_var(f"x{v}_{s}") for s in range(k)] for v, k in enumerate(num_choices)]
    add_one_choice_constraint(model, x)
    add_forbidden_choice_constraint(model, x, node_cost)
    terms: list[tuple[int, cp_model.IntVar]] = [(round(c * cost_scale), x[v][s]) for v, cs in enumerate(node_cost)
                                                for s, c in enumerate(cs) if c != INF and round(c * cost_scale)]
    in_shared = {e for es, _ in shared for e, _ in es}
    ys: list[dict[tuple[int, int], cp_model.IntVar]] = []
    for ei, (u, v, mat) in enumerate(edges):
        ys.append({})
        if ei not in in_shared and all(c == 0 for row in mat for c in row):
            continue  # every pair allowed and free: the edge constrains nothing
        y = {(s, s2): model.new_bool_var(f"y{ei}_{s}_{s2}") for s in range(num_choices[u])
             for s2 in range(num_choices[v]) if mat[s][s2] != INF}
        ys[-1] = y
        add_edge_constraint(model, x, u, v, y)
        terms += [(round(mat[s][s2] * cost_scale), var) for (s, s2), var in y.items() if round(mat[s][s2] * cost_scale)]
    for gi, (es, costs) in enumerate(shared):
        for k, c in costs.items():
            if round(c * cost_scale) <= 0:
                continue
            z = model.new_bool_var(f"z{gi}_{k}")
            add_shared_cost_constraint(model, z, [var for e, km in es for (s, s2), var in ys[e].items()
                                                  if km[s][s2] == k])
            terms.append((round(c * cost_scale), z))
    for a, b, ka, kb in equal_pairs:
        add_equal_constraint(model, x, a, b, ka, kb)
    if budget is not None and mem is not None and budget != INF:
        add_memory_constraint(model, x, mem, budget)
    model.minimize(sum(c * var for c, var in terms))
    if hint is not None:
        for v, c in enumerate(hint):
            for s, var in enumerate(x[v]):
                model.add_hint(var, s == c)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = options.time_limit_s
    solver.parameters.num_workers = options.workers
    solver.parameters.random_seed = options.seed
    solver.parameters.linearization_level = 2  # full LP relaxation of the edge rows/columns: proves optimality fast
    # The instances are small (tens to a few hundred booleans) and that relaxation closes them near the root, so
    # probing, symmetry detection, repeated presolve and lazily added LP rows cost more than they find.  On 80 sampled
    # T5-base layer-group instances: 43 -> 21 ms a solve, on 36 of GPT-3 13B 8.4 -> 3.8 ms, the same optima.
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.symmetry_level = 0
    solver.parameters.max_presolve_iterations = 1
    solver.parameters.add_lp_constraints_lazily = False
    st = solver.solve(model)
    if st in (cp_model.INFEASIBLE, cp_model.MODEL_INVALID):
        if budget is not None and mem is not None and budget != INF:
            raise ValueError("the intra-op sharding problem is infeasible: no strategy assignment fits the "
                             "activation budget; raise activation_budget_bytes, use more tensor parallelism, or "
                             "recompute")
        raise ValueError("the intra-op sharding problem is infeasible: no valid strategy assignment at this tensor-"
                         "parallel degree (an op whose every sharding is forbidden, or no compatible neighbour "
                         "shardings, e.g. a dimension tp does not divide)")
    if st == cp_model.UNKNOWN:  # time limit hit before any solution: fall back to the hint
        choices = list(hint) if hint is not None else [0] * len(num_choices)
        obj = evaluate_costs(node_cost, edges, choices, shared)
        return CoreSolution(choices, obj, solver.best_objective_bound / cost_scale, "timeout", 1.0)
    choices = [next(s for s, var in enumerate(xs) if solver.boolean_value(var)) for xs in x]
    obj, bound = solver.objective_value, solver.best_objective_bound
    gap = 0.0 if st == cp_model.OPTIMAL else max(0.0, (obj - bound) / max(abs(obj), 1e-9))
    status = "optimal" if st == cp_model.OPTIMAL else "feasible"
    return CoreSolution(choices, obj / cost_scale, bound / cost_scale, status, gap)

