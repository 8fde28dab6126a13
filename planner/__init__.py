"""autopar's planner: the search over hybrid parallel plans, and the public entry points."""

__all__: list[str] = []
