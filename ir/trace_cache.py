"""A disk cache of traced graphs, so planning the same model again skips building it and tracing it.

A graph is stored under a digest of what determines it: the caller's key (for a zoo model: its name, sequence
length and the zoo's source), the source of :mod:`autopar.ir` (capture and passes), the torch and Python versions
and the cache format. Any change to those misses the cache and traces afresh, so a stale graph is never returned.
Entries are pickles in ``$AUTOPAR_CACHE/graphs`` (default ``~/.cache/autopar/graphs``), written atomically; an
unreadable entry is traced again and overwritten. The cache directory is trusted like any per-user cache (a pickle
is code-equivalent), so it is checked: an entry is unpickled only when it and its directories up to the cache root
belong to this user and are not writable by group/others (else it is ignored and traced again); entries are written
0600 in 0700 directories.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, Mapping

from autopar.ir.graph import Graph

__all__ = ["cache_root", "source_digest", "cached_graph", "ENV_CACHE"]

log = logging.getLogger(__name__)
ENV_CACHE = "AUTOPAR_CACHE"
_FORMAT = 1
_IR_DIR = Path(__file__).resolve().parent


def cache_root() -> Path:
    """``$AUTOPAR_CACHE``, default ``~/.cache/autopar``: measured profiles and traced graphs live here."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "autopar")


def source_digest(*roots: Path) -> str:
    """SHA-256 over the ``.py`` files under ``roots`` (paths and contents, in sorted order)."""
    h = hashlib.sha256()
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


def _path(key: Mapping[str, object], root: Path) -> Path:
    parts = dict(key, format=_FORMAT, ir=source_digest(_IR_DIR), torch=_torch_version(),
                 python=f"{sys.version_info[0]}.{sys.version_info[1]}")
    digest = hashlib.sha256(repr(sorted((str(k), repr(v)) for k, v in parts.items())).encode()).hexdigest()
    return root / "graphs" / f"{digest[:32]}.pkl"


def _private(path: Path, root: Path) -> bool:
    """``path`` and its directories up to ``root`` are this user's and not writable by group/others (POSIX)."""
    if os.name != "posix":
        return True
    try:
        chain = [path, *[p for p in path.parents if p == root or root in p.parents]]
        return all(st.st_uid == os.getuid() and not st.st_mode & 0o022 for st in (p.stat() for p in chain))
    except OSError:
        return False


def cached_graph(key: Mapping[str, object], make: Callable[[], Graph], root: Path | None = None) -> Graph:
    """The graph stored under ``key`` (see the module docstring), else ``make()``, stored for next time.

    ``key`` must name everything ``make`` depends on besides autopar.ir and torch (model, its sizes, its source)."""
    base = root if root is not None else cache_root()
    path = _path(key, base)
    if path.is_file() and not _private(path, base):
        log.warning("ignoring traced-graph cache entry %s: it or its directory belongs to another user or is writable "
                    "by others (a pickle runs code when loaded); tracing instead", path)
    elif path.is_file():
        try:
            graph = pickle.loads(path.read_bytes())
            if isinstance(graph, Graph):
                log.debug("traced graph from the cache: %s", path)
                return graph
        except Exception as e:  # noqa: BLE001 - a damaged or foreign entry is traced again
            log.debug("ignoring unreadable cache entry %s: %s", path, e)
    graph = make()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full disk only costs the next run a trace
        log.warning("could not cache the traced graph in %s: %s", path.parent, e)
        tmp.unlink(missing_ok=True)
    return graph
