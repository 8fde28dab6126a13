"""Shared clusters: allocate whole nodes of one or more pools to many training jobs from their real plans.

``jobs`` (the jobs file and the pools), ``curves`` (each job's throughput at each node count, planned and cached),
``allocate`` (the CP-SAT allocation), ``problem`` (curves -> allocation problem, and the baselines), ``changes``
(arrivals and departures), ``cli`` (``autopar schedule``).  Not to be confused with
:mod:`autopar.planner.inter_op.schedule`, the pipeline schedule of one job.
"""
