"""Commands that do not need torch (``models``, ``show``, ``diff``, ``--help``) do not import it, and ``explain``
checks its node name before tracing. Each runs in a fresh interpreter (this test process has torch loaded already);
the time these take is measured by ``benchmarks/cli_time.py``, not here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PLANS = Path(__file__).parents[1] / "golden" / "plans"
A = PLANS / "gpt2-small_dgx-a100-80gb_1n_gb64.yaml"
B = PLANS / "gpt2-small_dgx-h100_4n_gb64.yaml"

_PROBE = """
import contextlib, io, json, sys
from autopar.planner.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        rc = main(sys.argv[1:])
    except SystemExit as e:
        rc = e.code
heavy = sorted(m for m in ("torch", "ortools", "triton") if m in sys.modules)
print(json.dumps({"rc": rc, "heavy": heavy, "out": out.getvalue()}))
"""


def _run(*argv: str) -> dict:
    res = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["models"], ["show", str(A)], ["diff", str(A), str(B)],
                                  ["plan", "--help"], ["run", "--help"], ["profile", "--help"],
                                  ["schedule", "--help"]],
                         ids=["help", "models", "show", "diff", "plan-help", "run-help", "profile-help", "schedule-help"])
def test_light_commands_do_not_import_torch(argv: list[str]) -> None:
    r = _run(*argv)
    assert r["rc"] == 0, r
    assert r["heavy"] == [], f"`autopar {' '.join(argv)}` imported {r['heavy']}"
    assert r["out"].strip()


def test_explain_checks_the_node_before_tracing() -> None:
    r = _run("explain", str(B), "blocks_0_atn_qkv")
    assert r["rc"] == 2
    assert "torch" not in r["heavy"], "explain traced the model before rejecting an unknown node"
