"""The package's import graph: no cycles, and every import goes down the layer order.

Layers, bottom to top (DESIGN.md): ``ir`` <- ``profiles`` <- ``planner``; ``planner`` -> ``codegen`` -> ``ir``;
``zoo`` is plain PyTorch. Every import counts, at module level or inside a function (a lazy import is still a
dependency), except those under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("ir", "profiles", "planner", "codegen", "zoo")
# What each subpackage may import from autopar (itself always).
ALLOWED = {
    "ir": set(),
    "profiles": {"ir"},
    "zoo": set(),
    "codegen": {"ir"},
    "planner": {"ir", "profiles", "codegen", "zoo"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["autopar", *parts])


def _modules() -> dict[str, Path]:
    mods = {"autopar": ROOT / "__init__.py", "autopar.__main__": ROOT / "__main__.py"}
    for sub in SUBPACKAGES:
        for p in sorted((ROOT / sub).rglob("*.py")):
            mods[_module_name(p)] = p
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The autopar modules ``name`` imports (``from autopar.x import y`` counts ``autopar.x.y`` when that is a
    module, else ``autopar.x``)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out.update(t for t in targets if t == "autopar" or t.startswith("autopar."))
    return {t for t in out if t != name}


def _graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for target in _imports(name, path, modules):
            g.add_edge(name, target)
    return g


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else None


def test_no_import_cycles() -> None:
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles[:20])


def test_no_cycles_between_folders() -> None:
    """Collapsed to folders and top modules inside a layer (``codegen.runtime``, ``codegen.checkpoint``,
    ``planner.intra_op`` ...), the graph has no cycle either: a package never imports a module that imports it back
    through its ``__init__``."""
    g = nx.DiGraph()
    for src, dst in _graph().edges:
        a, b = ".".join(src.split(".")[:3]), ".".join(dst.split(".")[:3])
        if a != b:
            g.add_edge(a, b)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "folder-level cycles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles[:20])


def test_imports_follow_the_layer_order() -> None:
    bad = []
    for src, dst in _graph().edges:
        a, b = _layer(src), _layer(dst)
        if a is None or a == b:
            continue  # the top-level package re-exports from every layer
        if b is None or b not in ALLOWED[a]:
            bad.append(f"{src} imports {dst}")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_outside_the_package() -> None:
    """Product code imports ``autopar.*``, never the bare folder names (which only work from a checkout)."""
    bad = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{name}: import {m}" for m in mods if m.split(".")[0] in (*SUBPACKAGES, "examples", "tests")]
    assert not bad, "\n".join(bad)


def test_graph_sees_the_imports() -> None:
    """The checker itself: it finds a known edge (so the tests above cannot pass by finding nothing)."""
    g = _graph()
    assert g.has_edge("autopar.planner.search", "autopar.profiles.cost")
    assert g.number_of_edges() > 100
