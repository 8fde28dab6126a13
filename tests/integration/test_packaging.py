"""``pip install .`` installs one import name, ``autopar``, that works outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("ir", "profiles", "planner", "codegen", "zoo")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A non-editable install of a copy of the checkout into a fresh target folder (dependencies are the test
    venv's). The copy keeps setuptools' build/ folder out of the checkout."""
    src, target = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("site")
    for name in ("pyproject.toml", "README.md", "__init__.py", "__main__.py"):
        shutil.copy2(ROOT / name, src / name)
    for sub in PRODUCT:
        shutil.copytree(ROOT / sub, src / sub, ignore=shutil.ignore_patterns("__pycache__"))
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return target


def test_one_top_level_import_name(installed: Path) -> None:
    names = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert names == {"autopar"}, names


def test_every_product_module_and_data_file_is_installed(installed: Path) -> None:
    want = {"__init__.py", "__main__.py"} | {str(p.relative_to(ROOT)) for sub in PRODUCT
                                              for p in (ROOT / sub).rglob("*") if p.is_file()
                                              and p.suffix in (".py", ".yaml", ".json")}
    got = {str(p.relative_to(installed / "autopar")) for p in (installed / "autopar").rglob("*")
           if p.is_file() and p.suffix in (".py", ".yaml", ".json")}
    assert want == got, f"missing: {sorted(want - got)[:10]}, extra: {sorted(got - want)[:10]}"


def test_imports_and_runs_outside_the_repository(installed: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    code = ("import autopar, sys; from autopar import auto_parallel, plan; from autopar.zoo import build; "
            "assert autopar.__file__.startswith(sys.argv[1]), autopar.__file__; "
            "print(len(build('gpt-tiny', batch=1, device='meta').model.state_dict()))")
    res = subprocess.run([sys.executable, "-c", code, str(installed)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    res = subprocess.run([sys.executable, "-m", "autopar", "models"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "gpt3-175b" in res.stdout.split(), res.stderr[-3000:]
