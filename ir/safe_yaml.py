"""YAML in and out of autopar's files with bounded cost, and atomic writes.

:func:`load_yaml` composes the document first and measures it *with aliases expanded* before building any Python
object: a 1.2 KB "billion laughs" document (nine levels of nine aliases) expands to ~4e8 nodes, which is refused at
once instead of hanging whatever walks the result (validation, error messages quoting it).  Recursive aliases are
refused too.  :func:`write_atomic` writes a temporary file next to the target and renames it over the target, so a
concurrent reader sees the old file or the new one, never half of one, and a failed write leaves the old file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

__all__ = ["MAX_YAML_BYTES", "MAX_YAML_NODES", "YamlLimitError", "load_yaml", "write_atomic"]

MAX_YAML_BYTES = 64 << 20
"""Largest document read (a GPT-3 175B plan is ~30 KB)."""
MAX_YAML_NODES = 2_000_000
"""Most YAML nodes a document may expand to (aliases counted at every use)."""


class YamlLimitError(ValueError):
    """A document too large, too aliased or recursive."""


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes of ``root`` with every alias expanded (memoized on node identity); raises past ``limit`` or on a cycle."""
    size: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            kids = _children(node)
            total = 1 + sum(size[id(k)] for k in kids)
            if total > limit:
                raise YamlLimitError(f"expands to more than {limit:,} nodes (aliases repeated at every use): refused")
            size[key] = total
            continue
        if key in size:
            continue
        if key in active:
            raise YamlLimitError("has a recursive alias: refused")
        active.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node) if id(k) not in size)
    return size[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []


def load_yaml(text: str, *, loader: type[yaml.SafeLoader] = yaml.SafeLoader, max_bytes: int = MAX_YAML_BYTES,
              max_nodes: int = MAX_YAML_NODES) -> Any:
    """``yaml.load(text, loader)`` (a SafeLoader or subclass) with the document's size and alias expansion bounded.

    Raises :class:`YamlLimitError` (size, aliases, recursion) or ``yaml.YAMLError`` (syntax)."""
    if len(text) > max_bytes:
        raise YamlLimitError(f"is {len(text):,} characters, more than the {max_bytes:,} autopar reads")
    ld = loader(text)
    try:
        node = ld.get_single_node()
        if node is None:
            return None
        _expanded_size(node, max_nodes)
        return ld.construct_document(node)
    finally:
        ld.dispose()


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a unique temporary file in the same directory and ``os.replace``."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
