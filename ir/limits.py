"""Upper bounds on the sizes autopar accepts, so that absurd inputs fail at once with a clear message instead of
hanging the search or exhausting memory (``--nodes 1e30``, ``--global-batch 1e18``, ``devices_per_node: 1e6``).

The bounds sit far above any cluster or batch trained to date (the largest published runs use ~2e4-1e5 devices,
8-16 per node, global batches of a few thousand sequences and contexts of ~1e6 tokens)."""

from __future__ import annotations

__all__ = ["MAX_BATCH", "MAX_DEVICES_PER_NODE", "MAX_NODES", "MAX_SEQ", "MAX_TEXT", "check_bound", "clip"]

MAX_NODES = 100_000
MAX_DEVICES_PER_NODE = 1_024
MAX_BATCH = 1 << 24
MAX_SEQ = 1 << 22
MAX_TEXT = 200
"""Characters of a user's value quoted in an error message."""


def clip(value: object, n: int = MAX_TEXT) -> str:
    """``str(value)`` cut to ``n`` characters, noting the full length."""
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= n else f"{s[:n]}... ({len(s)} characters)"


def check_bound(what: str, value: int, limit: int, *, lo: int = 1) -> None:
    """Raise ValueError unless ``lo <= value <= limit`` (an int); the message names ``what`` and the bounds."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {clip(repr(value))}")  # noqa: TRY004 (a user error)
    if value < lo:
        raise ValueError(f"{what} must be >= {lo}, got {clip(value)}")
    if value > limit:
        raise ValueError(f"{what} {clip(value)} is beyond autopar's limit of {limit:,}; check the value")
