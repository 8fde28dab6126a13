"""Alpha-beta least-squares fit: ``t(S) = alpha + beta * S`` with ``alpha, beta >= 0``.

The fit minimises *relative* residuals ``sum(((alpha + beta*S_i) - t_i) / t_i)^2`` by default: measured sizes span
five orders of magnitude, and an ordinary linear fit would let the largest messages decide everything and turn
small-message predictions into noise (alpha dominating at small sizes is exactly what we want to capture).
Non-negativity is enforced by solving the two one-parameter sub-problems when the joint solution leaves the
feasible quadrant (the exact NNLS solution for two variables).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["fit_alpha_beta", "busbw_from_beta"]


def _solve(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    a_mat = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    sol, *_ = np.linalg.lstsq(a_mat, t * w, rcond=None)
    alpha, beta = float(sol[0]), float(sol[1])
    if alpha >= 0 and beta >= 0:
        return alpha, beta
    cands: list[tuple[float, float, float]] = []
    # beta only (alpha = 0)
    xb = x * w
    b = max(float(xb @ (t * w) / (xb @ xb)), 0.0) if xb @ xb > 0 else 0.0
    cands.append((float(np.sum((b * x - t) ** 2 * w**2)), 0.0, b))
    # alpha only (beta = 0)
    a = max(float(np.sum(t * w**2) / np.sum(w**2)), 0.0)
    cands.append((float(np.sum((a - t) ** 2 * w**2)), a, 0.0))
    _, alpha, beta = min(cands)
    return alpha, beta


def fit_alpha_beta(
    sizes: Sequence[float], times: Sequence[float], *, relative: bool = True
) -> tuple[float, float]:
    """Fit ``times ~ alpha + beta * sizes``; returns ``(alpha_s, beta_s_per_byte)``, both >= 0.

    If the data show no size dependence at all (beta would be 0), beta is set from the largest point so that the
    bandwidth stays finite: ``beta = max(t_max - alpha, 1e-3 * t_max) / S_max``.
    """
    x = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if x.shape != t.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"need two equal-length sequences of >= 2 points, got {len(x)} sizes and {len(t)} times")
    if np.any(t <= 0) or np.any(x < 0):
        raise ValueError("times must be positive and sizes non-negative")
    w = 1.0 / t if relative else np.ones_like(t)
    alpha, beta = _solve(x, t, w)
    if beta <= 0:
        i = int(np.argmax(x))
        beta = max(float(t[i]) - alpha, 1e-3 * float(t[i])) / max(float(x[i]), 1.0)
    return alpha, beta


def busbw_from_beta(beta: float, factor: float) -> float:
    """Bus bandwidth (bytes/s) from a fitted ``beta`` (s/byte of message) and the collective's factor f(g)."""
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    return factor / beta
