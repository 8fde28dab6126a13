"""Screening's stage split (:func:`autopar.planner.inter_op.partition.minmax_partition`) is exact: against every
split of small inputs, including runs of identical layers (ties at the optimum) and single heavy layers."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.planner.inter_op.partition import minmax_partition


def _brute(times: list[float], k: int) -> float:
    n = len(times)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(times[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_minmax_partition_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    kind = seed % 3
    if kind == 0:  # identical blocks between an embedding and a head, as a transformer
        times = [0.3] + [1.7] * (n - 2) + [0.9] if n > 2 else [1.7] * n
    elif kind == 1:
        times = [rng.choice((0.5, 1.0, 2.0)) for _ in range(n)]
    else:
        times = [rng.uniform(1e-4, 3.0) * (50 if rng.random() < 0.15 else 1) for _ in range(n)]
    for k in range(1, n + 2):
        got = minmax_partition(times, k)
        if k > n:
            assert got is None
            continue
        assert got is not None and len(got) == k
        assert got[0][0] == 0 and got[-1][1] == n and all(a < b for a, b in got)
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(got))
        assert max(sum(times[a:b]) for a, b in got) == pytest.approx(_brute(times, k), rel=1e-9)
