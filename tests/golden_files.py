"""One strict golden-file check for every golden test.

A golden file that is missing fails the test (it is never written silently); ``AUTOPAR_UPDATE_GOLDEN=1`` regenerates
every golden file the run touches, deliberately.
"""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE_ENV = "AUTOPAR_UPDATE_GOLDEN"


def updating() -> bool:
    """Whether this run regenerates golden files instead of checking them."""
    return os.environ.get(UPDATE_ENV) == "1"


def check_golden(path: Path, text: str) -> None:
    """Assert ``text`` equals the golden file at ``path`` (or write it when regenerating)."""
    if updating():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"golden file {path} is missing; create it deliberately with {UPDATE_ENV}=1"
    golden = path.read_text()
    assert text == golden, f"output differs from {path}; if the change is intended, regenerate with {UPDATE_ENV}=1"
