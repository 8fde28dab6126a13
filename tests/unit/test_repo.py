"""The repository's promises: the README's test command is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci
    assert "torch==2.13.0" in ci and "triton==3.7.1" in ci


def test_pyproject_lists_every_subpackage() -> None:
    """setuptools installs exactly the packages pyproject.toml names; a new folder must be added there."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"autopar"} | {"autopar." + ".".join(p.parent.relative_to(ROOT).parts)
                           for sub in ("ir", "profiles", "planner", "codegen", "zoo")
                           for p in (ROOT / sub).rglob("__init__.py")}
    assert listed == found, f"not listed: {sorted(found - listed)}, listed but absent: {sorted(listed - found)}"


def test_no_module_over_500_lines() -> None:
    """DESIGN.md: modules stay near 500 lines or fewer (the product and the test helpers)."""
    files = [ROOT / "__init__.py", ROOT / "__main__.py", *(p for sub in ("ir", "profiles", "planner", "codegen", "zoo")
                                                           for p in (ROOT / sub).rglob("*.py"))]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
