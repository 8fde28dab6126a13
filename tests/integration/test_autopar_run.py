"""``autopar run`` refuses, in the launcher, a plan for more processes than it starts.  The whole path
``autopar profile`` -> ``plan`` -> ``run`` on this machine (loss and step time per step, measured vs predicted step
time per stage) is the README's sequence, run as written by tests/integration/test_readme.py, which checks that log.
The launch agent runs forked from the server that preloads the workers' imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopar import ir
from autopar.planner.cli import main


def test_run_rejects_a_plan_for_more_processes_than_one_node_starts(tmp_path: Path, capsys) -> None:
    from autopar.zoo import build

    from harness import make_plan

    spec = build("gpt-tiny", batch=4, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    path = tmp_path / "plan.yaml"
    ir.dump_plan(make_plan(graph, dp=2, micro_batch=2), path)
    assert main(["run", str(path), "--model", "gpt-tiny", "--steps", "1", "--nproc", "1"]) == 2
    assert "needs 2 processes" in capsys.readouterr().err


_FORKED_AGENT = """
import json, sys
from autopar.planner.run import agent
agent._start_fork_server()
codes = [agent._run_forked_agent(["--nproc-per-node", "1", "--standalone", "--no-python", cmd]) for cmd in sys.argv[1:]]
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}))
"""


@pytest.mark.multiprocess
def test_the_agent_runs_forked_from_the_preloaded_server_and_the_launcher_imports_no_torch() -> None:
    """torchrun's agent runs in a child of the fork server that preloads torch for the workers, so the launched process
    (``python -m autopar.planner.run``) never imports torch itself; the agent's exit code is the launcher's."""
    res = subprocess.run([sys.executable, "-c", _FORKED_AGENT, "true", "false"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"codes": [0, 1], "torch": False}, (out, res.stderr[-3000:])


@pytest.mark.multiprocess
def test_run_takes_the_sequence_length_the_plan_was_made_for(tmp_path: Path, capsys) -> None:
    """A plan made with ``autopar plan --seq`` runs with ``autopar run --seq`` (the launcher's check and the workers'
    model both use it); without it the launcher refuses the plan as another graph's."""
    from autopar.zoo import build

    from harness import make_plan

    spec = build("gpt-tiny", batch=2, device="meta", seq=16)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    path, report = tmp_path / "plan.yaml", tmp_path / "report.json"
    ir.dump_plan(make_plan(graph, dp=1, micro_batch=2), path)
    assert main(["run", str(path), "--model", "gpt-tiny", "--steps", "1"]) == 2
    assert "made for another model" in capsys.readouterr().err
    assert main(["run", str(path), "--model", "gpt-tiny", "--seq", "16", "--steps", "2", "--report", str(report),
                 "--timeout", "240"]) == 0
    assert len(json.loads(report.read_text())["step_times"]) == 2
