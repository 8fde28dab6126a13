"""Validation primitives of the profile loaders (``profiles.schema``): typed reads of YAML values that fail with the
offending field path, and the YAML loader they read."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import yaml

from autopar.ir.limits import clip


class ProfileError(ValueError):
    """A cluster profile is invalid; the message starts with the offending field path."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as ``2.3e11`` (PyYAML's 1.1 rules read them as strings)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))



_TINY, _HUGE = 1e-30, 1e30  # magnitudes a profile number may have (0 aside, where allowed)


def _fail(path: str, msg: str) -> ProfileError:
    return ProfileError(f"{clip(path)}: {clip(msg, 400)}")  # values quoted are cut: messages stay short


def _mapping(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise _fail(path, f"expected a mapping, got {type(v).__name__}")
    return v


def _keys(d: Mapping[str, Any], path: str, required: set[str], optional: set[str] = frozenset()) -> None:
    for k in d:
        if k not in required and k not in optional:
            allowed = ", ".join(sorted(required | set(optional)))
            raise _fail(_join(path, str(k) if isinstance(k, str) and k else repr(k)), f"unknown key (allowed: {allowed})")
    for k in sorted(required):
        if k not in d:
            raise _fail(_join(path, k), "missing required field")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _num(v: Any, path: str, *, positive: bool = True, allow_zero: bool = False) -> float:
    try:
        x = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:  # an int beyond float range
        x = math.nan
    if not math.isfinite(x):
        raise _fail(path, f"expected a {'positive ' if positive else ''}number, got {v!r}")
    if x != 0 and not _TINY <= abs(x) <= _HUGE:  # denormal rates or 1e308 FLOP/s overflow the cost model
        raise _fail(path, f"{v!r} is outside the magnitudes autopar accepts ({_TINY:g} to {_HUGE:g}): check units")
    if positive and (x < 0 or (x == 0 and not allow_zero)):
        kind = "non-negative" if allow_zero else "positive"
        raise _fail(path, f"expected a {kind} number, got {v!r}")
    return x


def _int(v: Any, path: str, *, minimum: int = 1, maximum: int = 1 << 62) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(path, f"expected an integer >= {minimum}, got {v!r}")
    if v < minimum:
        raise _fail(path, f"expected an integer >= {minimum}, got {v!r}")
    if v > maximum:
        raise _fail(path, f"{v} is beyond autopar's limit of {maximum:,}; check the value")
    return v


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise _fail(path, f"expected a string, got {v!r}")
    return v


def _str_map(v: Any, path: str) -> dict[str, str]:
    d = _mapping(v, path)
    return {str(k): _str(x, _join(path, str(k))) for k, x in d.items()}




def _op_overhead(v: Any, path: str, kinds: tuple[str, ...]) -> dict[str, float]:
    """A mapping of ``kinds`` (a subset) to non-negative numbers."""
    out = {}
    for k, x in _mapping(v, path).items():
        if k not in kinds:
            raise _fail(f"{path}.{k}", f"unknown kind (allowed: {', '.join(kinds)})")
        out[str(k)] = _num(x, f"{path}.{k}", allow_zero=True)
    return out
