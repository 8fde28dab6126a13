"""Text tables for the command line: as wide as the terminal, never truncated, without columns that say nothing.

Every table the CLI prints goes through :func:`table` and :func:`render`:

* the width is the terminal's (``COLUMNS`` first, then the terminal itself; 120 in a pipe or a file), or what the
  caller asks for;
* a table too wide for that is cut into tables of whole columns (each repeating the first, key column) when they
  fit; otherwise a cell that does not fit wraps onto more lines (at spaces, else anywhere): no value is ever cut to
  an ellipsis;
* a column whose every cell is empty is dropped (the caller leaves a cell empty where the value is nothing to report,
  e.g. a zero bubble).
"""

from __future__ import annotations

import io
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["PIPE_WIDTH", "TextTable", "fmt_bytes", "fmt_sig", "fmt_time", "module_ranges", "render", "table",
           "terminal_width"]

PIPE_WIDTH = 120
"""Width used when stdout is not a terminal and ``COLUMNS`` is unset."""

Justify = Literal["left", "right", "center"]


def terminal_width(default: int = PIPE_WIDTH) -> int:
    """Columns to render for: ``$COLUMNS``, else the terminal's width, else ``default`` (a pipe, a file)."""
    return max(shutil.get_terminal_size((default, 24)).columns, 40)


def fmt_bytes(b: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if s >= 1e-6 or s == 0:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e9:.1f} ns"


def fmt_sig(x: float, digits: int = 3) -> str:
    """``x`` with at least ``digits`` significant digits, no exponent down to 1e-4 (36110, 156, 15.6, 0.0523)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if abs(x) >= 10 ** (digits - 1):
        return f"{x:.0f}"
    if abs(x) < 1e-4:
        return f"{x:.{digits}g}"
    decimals = max(digits - 1 - math.floor(math.log10(abs(x))), 0)
    return f"{x:.{decimals}f}"


@dataclass(frozen=True, slots=True)
class TextTable:
    """A table before layout: its title, columns ``(name, justify)``, rows of strings, and whether it has a header."""

    title: str | None
    columns: tuple[tuple[str, Justify], ...]
    rows: tuple[tuple[str, ...], ...]
    header: bool = True


def module_ranges(modules: tuple[str, ...]) -> str:
    """'<prefix>, blocks.0-11' style summary of a stage's modules."""
    out: list[str] = []
    run: list[str] = []
    for m in modules:
        head, _, idx = m.rpartition(".")
        if idx.isdigit() and run and run[-1].rpartition(".")[0] == head:
            run.append(m)
            continue
        if run:
            out.append(_fmt_run(run))
        run = [m] if idx.isdigit() else []
        if not idx.isdigit():
            out.append(m)
    if run:
        out.append(_fmt_run(run))
    return ", ".join(out)


def _fmt_run(run: list[str]) -> str:
    head = run[0].rpartition(".")[0]
    a, b = run[0].rpartition(".")[2], run[-1].rpartition(".")[2]
    return run[0] if a == b else f"{head}.{a}-{b}"


def table(title: str | None, columns: Sequence[str | tuple[str, Justify]], rows: Sequence[Sequence[str]], *,
          header: bool = True, drop_empty: bool = True) -> TextTable:
    """A table to :func:`render`; columns whose every cell is empty are left out (``drop_empty``).

    ``columns``: names, or ``(name, justify)`` pairs (default left). ``rows``: one string per column."""
    cols = [(c, "left") if isinstance(c, str) else c for c in columns]
    for r in rows:
        if len(r) != len(cols):
            raise ValueError(f"row {list(r)!r} has {len(r)} cells for {len(cols)} columns")
    keep = [i for i in range(len(cols)) if not drop_empty or not rows or any(str(r[i]).strip() for r in rows)]
    return TextTable(title, tuple(cols[i] for i in keep), tuple(tuple(str(r[i]) for i in keep) for r in rows),
                     header)


_GAP = 2  # columns between two cells (the right padding and the blank separator)


def _natural(t: TextTable, i: int) -> int:
    cells = [t.columns[i][0]] if t.header else []
    cells += [r[i] for r in t.rows]
    return max((len(line) for c in cells for line in c.splitlines() or [""]), default=0)


def _least(t: TextTable, i: int) -> int:
    """The narrowest a column gets before a word has to be cut: its longest word."""
    cells = [t.columns[i][0]] if t.header else []
    cells += [r[i] for r in t.rows]
    return max((len(w) for c in cells for w in c.split()), default=1)


def _span(widths: Sequence[int]) -> int:
    return sum(widths) + _GAP * (len(widths) - 1)


def _split(t: TextTable, width: int) -> list[TextTable] | None:
    """``t`` cut into at most three tables of whole columns, each repeating the first (key) column, that fit
    ``width`` unwrapped; None if there is no such cut."""
    n = len(t.columns)
    if n < 3 or not t.header:
        return None
    nat = [_natural(t, i) for i in range(n)]
    groups: list[list[int]] = [[]]
    for i in range(1, n):
        if groups[-1] and _span([nat[0], *(nat[j] for j in groups[-1]), nat[i]]) > width:
            groups.append([])
        groups[-1].append(i)
    if len(groups) > 3 or any(_span([nat[0], *(nat[j] for j in g)]) > width for g in groups):
        return None
    out = []
    if any(len(g) < 2 for g in groups):  # a table of the key and one column reads worse than wrapped cells
        return None
    for k, g in enumerate(groups):
        cols = [0, *g]
        out.append(TextTable(t.title if k == 0 else None, tuple(t.columns[i] for i in cols),
                             tuple(tuple(r[i] for i in cols) for r in t.rows), t.header))
    return out


def _widths(t: TextTable, width: int) -> list[int]:
    """Column widths that fit ``width``: natural if they fit; else each column's longest word (the longest words
    folded when even those do not fit), then the room left given to the columns that need least of it first."""
    n = len(t.columns)
    nat = [_natural(t, i) for i in range(n)]
    room = width - _GAP * (n - 1)
    if sum(nat) <= room:
        return nat
    least = [min(_least(t, i), nat[i]) for i in range(n)]
    cap = max(least, default=1)
    while sum(min(x, cap) for x in least) > room and cap > 1:  # words longer than that fold, the longest first
        cap -= 1
    least = [min(x, cap) for x in least]
    if sum(least) <= room:
        widths, spare = list(least), room - sum(least)
        for i in sorted(range(n), key=lambda i: nat[i] - least[i]):  # columns short of little first: whole
            add = min(nat[i] - least[i], spare)
            widths[i] += add
            spare -= add
        return widths
    return least


def _rich(t: TextTable, width: int) -> Table:
    rt = Table(show_header=t.header, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
               expand=False)
    for (name, justify), w in zip(t.columns, _widths(t, width), strict=True):
        rt.add_column(name, justify=justify, overflow="fold", no_wrap=False, width=w)
    for r in t.rows:
        rt.add_row(*r)
    return rt


def render(*tables: Any, width: int | None = None) -> str:
    """Plain text (no colour, no control codes) of tables at ``width`` columns (default: :func:`terminal_width`).

    A :class:`TextTable` wider than that is cut into tables of whole columns when that fits, else its cells wrap;
    nothing is truncated. Tables are separated by a blank line; lines carry no trailing spaces."""
    width = width or terminal_width()
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None, highlight=False, emoji=False,
                  soft_wrap=False)
    for k, t in enumerate(tables):
        if k:
            con.print()
        if not isinstance(t, TextTable):
            con.print(t)
            continue
        parts = [t] if _span([_natural(t, i) for i in range(len(t.columns))]) <= width else _split(t, width) or [t]
        for j, part in enumerate(parts):
            if j:
                con.print()
            if part.title:
                con.print(Text(part.title))
            con.print(_rich(part, width))
    return "".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines())
