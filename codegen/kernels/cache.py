"""On-disk, content-addressed cache of generated kernel modules.

``@triton.jit`` reads its function's source with ``inspect``, so generated kernels must live in real files: the
source is written to ``<cache>/<name>_<sha256[:16]>.py`` (atomically, so concurrent ranks can share the folder) and
imported from there.  Loaded modules are memoized per process by (directory, hash).  The cache directory is, in
order: the ``cache_dir`` argument, the ``AUTOPAR_KERNEL_CACHE`` environment variable, ``$AUTOPAR_CACHE/kernels`` (the
folder of autopar's other caches), ``~/.cache/autopar/kernels``.

The files are code, so the folder must be this user's and not writable by group/others (checked; new folders are
0700), and a module is executed from the source autopar generated in memory, never from bytes read back from the
folder (no stale or planted ``__pycache__``); the file only serves ``inspect`` (Triton reads the source from it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from pathlib import Path
from types import ModuleType

from autopar.codegen.triton_gen import KernelSpec, generate_source, source_hash

__all__ = ["cache_dir", "load_source", "load_kernels", "ENV_CACHE"]

log = logging.getLogger(__name__)

#: environment variable overriding the default cache directory
ENV_CACHE = "AUTOPAR_KERNEL_CACHE"

_LOADED: dict[tuple[str, str], ModuleType] = {}


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The kernel cache directory (created if missing)."""
    root = os.environ.get("AUTOPAR_CACHE") or Path.home() / ".cache" / "autopar"
    path = Path(override or os.environ.get(ENV_CACHE) or Path(root) / "kernels")
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
    except OSError as e:
        raise OSError(f"cannot create the kernel cache directory {path} ({e}); set {ENV_CACHE} to a writable "
                      "folder") from e
    if os.name == "posix" and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise PermissionError(f"the kernel cache directory {path} belongs to another user or is writable by "
                              f"group/others (its files are imported as code); `chmod go-w {path}` or set "
                              f"{ENV_CACHE} to a private folder")
    return path


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp_", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_source(source: str, name: str, cache: str | os.PathLike[str] | None = None) -> ModuleType:
    """Write ``source`` to the cache (unless an identical file is there) and import it as a module."""
    folder = cache_dir(cache)
    digest = source_hash(source)
    key = (str(folder), digest)
    if key in _LOADED:
        return _LOADED[key]
    path = folder / f"{name}_{digest}.py"
    if not path.exists() or path.read_text() != source:
        _write_atomic(path, source)
        log.debug("wrote kernel %s to %s", name, path)
    mod_name = f"autopar_kernel_{name}_{digest}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - the source autopar just generated
    _LOADED[key] = module
    return module


def load_kernels(spec: KernelSpec, cache: str | os.PathLike[str] | None = None) -> ModuleType:
    """The compiled-on-first-launch kernel module for ``spec`` (``<name>_fwd`` and, where generated, ``_bwd``)."""
    return load_source(generate_source(spec), spec.name, cache)
