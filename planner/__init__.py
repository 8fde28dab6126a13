"""autopar's planner: the search over hybrid parallel plans, and the public entry points.

    from planner import auto_parallel, plan
"""

from planner.api import AutoParallel, auto_parallel, plan
from planner.options import PlanOptions, parse_pins
from planner.search import PlanInfeasibleError, SearchResult, search

__all__ = ["AutoParallel", "auto_parallel", "plan", "PlanOptions", "parse_pins", "PlanInfeasibleError",
           "SearchResult", "search"]
