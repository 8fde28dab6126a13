"""Typed conversion between frozen dataclasses and plain YAML/JSON data.

``to_data`` turns a dataclass tree into dicts/lists/scalars; ``from_data`` rebuilds it, checking every field against
its annotation and raising :class:`autopar.ir.SchemaError` with the dotted path of the first bad field
(``stages.1.recompute:
expected one of 'none', 'selective', 'full', got 'some'``).  Unknown keys are rejected by name.  A dataclass's own
``__post_init__`` ``ValueError`` becomes a SchemaError at that object's path.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import reprlib
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from autopar.ir.errors import SchemaError
from autopar.ir.limits import MAX_TEXT, clip

__all__ = ["to_data", "from_data"]

T = TypeVar("T")
_HINTS: dict[type, dict[str, Any]] = {}


def to_data(obj: Any) -> Any:
    """Dataclass tree -> plain data (dict/list/str/int/float/bool/None)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_data(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(v) for k, v in obj.items()}
    return obj


_REPR = reprlib.Repr()  # (keyword arguments need Python 3.12)
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict, _REPR.maxlevel = MAX_TEXT, MAX_TEXT, 8, 8, 3


def _r(value: Any) -> str:
    """A user's value quoted in a message: ``repr`` bounded in size and depth (never ``repr`` of the whole)."""
    return clip(_REPR.repr(value))


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str, doc: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, path, doc)
            except SchemaError as e:
                errors.append(e)
        raise errors[0] if errors else SchemaError(path, f"unexpected {_r(value)}", doc=doc)
    if origin is Literal:
        if value not in get_args(tp) or isinstance(value, bool) != any(isinstance(a, bool) for a in get_args(tp)):
            raise SchemaError(path, f"expected {_describe(tp)}, got {_r(value)}", doc=doc)
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(path, f"expected a list, got {type(value).__name__}", doc=doc)
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise SchemaError(path, f"expected {len(args)} items, got {len(value)}", doc=doc)
            return tuple(_convert(a, v, f"{path}.{i}", doc) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [_convert(item, v, f"{path}.{i}", doc) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(path, f"expected a mapping, got {type(value).__name__}", doc=doc)
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(kt, k, f"{path}.{k}", doc): _convert(vt, v, f"{path}.{k}", doc) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_data(tp, value, path=path, doc=doc)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise SchemaError(path, f"expected {_describe(tp)}, got {_r(value)}", doc=doc) from None
    if tp is bool:
        if not isinstance(value, bool):
            raise SchemaError(path, f"expected true/false, got {_r(value)}", doc=doc)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(path, f"expected an integer, got {_r(value)}", doc=doc)
        return value
    if tp is float:
        try:
            f = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        except OverflowError:  # an int beyond float range
            f = math.nan
        if not math.isfinite(f):
            raise SchemaError(path, f"expected a finite number, got {_r(value)}", doc=doc)
        return f
    if tp is str:
        if not isinstance(value, str):
            raise SchemaError(path, f"expected a string, got {_r(value)}", doc=doc)
        return value
    raise TypeError(f"from_data: unsupported annotation {tp!r} at {path}")


def from_data(cls: type[T], data: Any, *, path: str = "", doc: str = "document") -> T:
    """Rebuild dataclass ``cls`` from plain ``data``, validating every field (see module docstring)."""
    where = path or "<root>"
    if not isinstance(data, dict):
        raise SchemaError(where, f"expected a mapping for {cls.__name__}, got {type(data).__name__}", doc=doc)
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = clip(str(unknown[0])) or "''"
        raise SchemaError(f"{path}.{key}" if path else key, "unknown field", doc=doc)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(sub, "missing required field", doc=doc)
            continue
        kwargs[name] = _convert(hints[name], data[name], sub, doc)
    try:
        return cls(**kwargs)
    except SchemaError:
        raise
    except (ValueError, TypeError) as e:
        raise SchemaError(where, clip(str(e), 4 * MAX_TEXT), doc=doc) from None

