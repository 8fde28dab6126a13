"""Intra-op (tensor-parallel) sharding: the CP-SAT search over each op's sharding on the tp axis, per layer group.

    rules.py          strategies_for: each op's strategies, by op family (rules_matmul, rules_elementwise,
                      rules_shape), from the Strategy type and rule context of strategy.py
    coster.py         seconds of compute and resharding collectives on the tp group
    model.py          the CP-SAT model of one layer group: choices, edges, shared collectives, memory rows
    cpsat.py          the solver core (its docstring states the formulation): plain costs in, choices out
    solve.py          solve_group / solve_graph / strategy_costs and the GroupSolution they report
"""

from autopar.planner.intra_op.cpsat import (
                                            CoreSolution,
                                            IntraOpOptions,
                                            add_edge_constraint,
                                            add_equal_constraint,
                                            add_forbidden_choice_constraint,
                                            add_memory_constraint,
                                            add_one_choice_constraint,
                                            add_shared_cost_constraint,
                                            evaluate_costs,
                                            solve_costs,
)
from autopar.planner.intra_op.rules import strategies_for
from autopar.planner.intra_op.rules_shape import reshape_pairs
from autopar.planner.intra_op.solve import GroupSolution, solve_graph, solve_group, strategy_costs
from autopar.planner.intra_op.strategy import Strategy

__all__ = ["IntraOpOptions", "GroupSolution", "CoreSolution", "Strategy", "solve_group", "solve_graph",
           "strategy_costs", "strategies_for", "reshape_pairs", "solve_costs", "evaluate_costs",
           "add_one_choice_constraint", "add_forbidden_choice_constraint", "add_edge_constraint",
           "add_equal_constraint", "add_memory_constraint", "add_shared_cost_constraint"]
