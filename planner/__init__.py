"""autopar's planner: the search over hybrid parallel plans, and the public entry points.

    from autopar.planner import auto_parallel, plan
"""

from autopar.planner.api import AutoParallel, auto_parallel, plan
from autopar.planner.options import PlanOptions, parse_pins
from autopar.planner.search import PlanInfeasibleError, SearchResult, search

__all__ = ["AutoParallel", "auto_parallel", "plan", "PlanOptions", "parse_pins", "PlanInfeasibleError",
           "SearchResult", "search"]
