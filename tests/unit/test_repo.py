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
