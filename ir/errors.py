"""Errors a user can cause while lifting a model, each with an actionable one-paragraph message."""

from __future__ import annotations

__all__ = ["AutoparError", "TraceError", "ExampleInputError", "IRVerificationError", "SchemaError"]


class AutoparError(Exception):
    """Base class of every error autopar raises for something the user can fix."""


class TraceError(AutoparError):
    """No front end could capture the model.  Names the module/op that stopped each front end and its reason."""

    def __init__(self, frontend: str, reason: str, where: str = "", *, parts: tuple["TraceError", ...] = ()) -> None:
        self.frontend = frontend
        self.reason = reason
        self.where = where
        self.parts = parts or (self,)
        super().__init__(self._message())

    def _message(self) -> str:
        parts = "; ".join(f"{p.frontend}{' in ' + p.where if p.where else ''}: {p.reason}" for p in self.parts)
        return (f"could not capture the model ({parts}); hint: data-dependent Python control flow (e.g. "
                "`if x.sum() > 0`) cannot be traced: rewrite it with torch.where/torch.cond, or move it into a "
                "submodule, which autopar then runs as an opaque region (replicated, cost estimated)")

    @classmethod
    def combine(cls, *errors: "TraceError") -> "TraceError":
        parts = tuple(p for e in errors for p in e.parts)
        return cls("+".join(e.frontend for e in errors), errors[-1].reason, errors[-1].where, parts=parts)


class ExampleInputError(TraceError):
    """The example inputs do not fit the model (wrong shape or dtype)."""

    def __init__(self, frontend: str, reason: str, where: str = "", given: str = "") -> None:
        self.given = given
        super().__init__(frontend, reason, where)

    def _message(self) -> str:
        loc = f" at {self.where}" if self.where else ""
        return (f"the example inputs do not fit the model{loc}: {self.reason} (inputs given: {self.given or '?'}); "
                "hint: check the batch/sequence/feature sizes and dtypes (token ids must be int64)")


class IRVerificationError(AutoparError, AssertionError):
    """``autopar.ir.verify`` found a broken invariant (an autopar bug or a hand-built graph)."""


class SchemaError(AutoparError, ValueError):
    """A YAML document (plan or profile) does not match its schema; ``field`` names the offending field path."""

    def __init__(self, field: str, problem: str, *, doc: str = "document") -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"invalid {doc}: {field}: {problem}" if field else f"invalid {doc}: {problem}")
