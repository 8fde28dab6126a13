"""The shared vocabulary of plans: tensor placements on the tp axis, schedules, recompute modes.

A placement says how one tensor lives on the tensor-parallel ranks:

* ``R`` -- replicated: every rank holds all of it;
* ``P`` -- partial: every rank holds a full-shaped addend, the tensor is their sum;
* ``S(d)`` -- sharded contiguously on dim ``d``;
* ``S(d)[k]`` -- a fused tensor of ``k`` equal chunks along ``d`` (e.g. q, k, v), each chunk sharded on ``d``, so a
  rank holds its slice of every chunk.

:class:`Placement` is the typed form and :meth:`Placement.parse` the one parser; the text form (``str(p)``) is what
plans store in YAML and what the solver uses as a key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

__all__ = ["Placement", "parse_placement", "is_shard", "shard", "public_placement", "Schedule", "Recompute"]

_SHARD = re.compile(r"^S\((\d+)\)(?:\[(\d+)\])?$")


@dataclass(frozen=True, slots=True)
class Placement:
    """One tensor's layout on the tp axis (see the module docstring)."""

    kind: Literal["R", "P", "S"]
    dim: int = -1
    """The sharded dim (``S`` only; -1 otherwise)."""
    chunks: int = 1
    """Chunks of a fused tensor, each sharded on ``dim`` (``S(d)[k]``); 1 for a contiguous shard."""

    def __post_init__(self) -> None:
        if self.kind not in ("R", "P", "S"):
            raise ValueError(f"placement kind must be R, P or S, got {self.kind!r}")
        if self.kind == "S" and (self.dim < 0 or self.chunks < 1):
            raise ValueError(f"a shard needs dim >= 0 and chunks >= 1, got dim={self.dim} chunks={self.chunks}")
        if self.kind != "S" and (self.dim != -1 or self.chunks != 1):
            raise ValueError(f"{self.kind} takes no dim or chunks")

    @classmethod
    def parse(cls, text: str) -> Placement:
        """``"R"``, ``"P"``, ``"S(d)"`` or ``"S(d)[k]"`` -> a Placement; anything else is a ``ValueError``."""
        if text in ("R", "P"):
            return cls(text)  # type: ignore[arg-type]
        m = _SHARD.match(text) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"placement must be R, P, S(<dim>) or S(<dim>)[<parts>], got {text!r}")
        return cls("S", int(m.group(1)), int(m.group(2) or 1))

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def public(self) -> Placement:
        """The plan's coarse form: ``S(d)[k]`` -> ``S(d)``."""
        return Placement("S", self.dim) if self.kind == "S" else self

    def __str__(self) -> str:
        if self.kind != "S":
            return self.kind
        return f"S({self.dim})" if self.chunks == 1 else f"S({self.dim})[{self.chunks}]"


def parse_placement(text: str) -> Placement:
    """:meth:`Placement.parse`."""
    return Placement.parse(text)


def shard(dim: int, chunks: int = 1) -> str:
    """The text form of ``S(dim)``, or of the chunked ``S(dim)[chunks]`` when ``chunks > 1``."""
    return str(Placement("S", dim, chunks))


def is_shard(text: str | None) -> bool:
    """Whether a placement's text form is a shard (``S(...)``); None (no placement) is not."""
    return text is not None and text.startswith("S(")


def public_placement(text: str) -> str:
    """The plan's form of a placement's text (``S(d)[k]`` -> ``S(d)``)."""
    return str(Placement.parse(text).public)


class Schedule(StrEnum):
    """Pipeline schedules (torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class Recompute(StrEnum):
    """Activation recomputation per stage: none, selective (cheap ops re-run) or full (whole layers re-run)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
