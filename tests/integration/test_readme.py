"""The README runs as written: the shell blocks of its "Using it" section, in order, in an empty directory, on this
machine (measure it, plan gpt-tiny for 2 ranks, train with checkpoints, stop the run, resume, re-plan to tp=2,
resume resharded, plan a model of one's own). About a minute and a half on a loaded 2-core machine."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.ir.plan import load_plan

NUM = r"([-+\d.eE]+|nan|inf)"
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_blocks(section: str = "## Using it") -> list[str]:
    """The ```bash blocks of README ``section`` (up to the next ``## `` heading)."""
    text = README.read_text()
    start = text.index(section + "\n")
    end = text.find("\n## ", start + len(section))
    return re.findall(r"```bash\n(.*?)```", text[start:end if end >= 0 else None], re.DOTALL)


@pytest.mark.multiprocess
def test_readme_using_it_runs_as_written(tmp_path: Path) -> None:
    blocks = readme_blocks()
    script = "\n".join(blocks)
    for step in ("autopar profile", "autopar plan", "autopar run", "--resume", "kill", "autopar replan",
                 "PYTHONPATH=."):
        assert step in script, f"the README's sequence lost its {step!r} step"
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="120",
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: the tests' interpreted Triton would take minutes a step
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]

    tiny, tp2 = load_plan(tmp_path / "tiny.yaml"), load_plan(tmp_path / "tiny-tp2.yaml")
    assert tiny.world_size == tp2.world_size == 2 and tp2.mesh.tp == 2 and tiny.mesh.tp != 2
    assert tiny.cluster_source is not None and tiny.cluster_source.path == str(tmp_path / "mymachine.yaml")
    assert (tmp_path / "tiny.html").read_text().count("<section") == 5
    assert load_plan(tmp_path / "mine.yaml").model == "mymodel:build"
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_00000050"
    assert re.search(r"resumed from step \d+ .*now \[1, 1, 2\]", log), log[-3000:]
    # one line per save, from rank 0 only
    assert log.count("saved checkpoint step 50 ") == 1, log[-3000:]

    # what autopar run logs: loss and time per step, then the measured step time beside the plan's prediction (for
    # the whole step and per stage); the workers found the graph the planner traced (no fingerprint complaint)
    steps = re.findall(rf"step (\d+)\s+loss {NUM}\s+time {NUM} s", log)
    assert [int(s[0]) for s in steps][-10:] == list(range(40, 50)), log[-3000:]  # the resharded run's steps
    assert all(math.isfinite(float(s[1])) and 0 < float(s[2]) < 60 for s in steps), steps
    assert "fingerprint" not in log, log[-3000:]
    assert re.search(r"predicted s\s+measured s\s+ratio", log), log[-3000:]
    rows = re.findall(rf"^step\s+{NUM}\s+{NUM}\s+{NUM}$", log, re.M)
    assert rows and float(rows[-1][0]) == pytest.approx(tp2.time.total, rel=1e-3) and float(rows[-1][1]) > 0, rows
    stage_rows = re.findall(rf"^stage (\d+)\s+{NUM}\s+{NUM}\s+{NUM}$", log, re.M)
    assert stage_rows and all(float(r[1]) > 0 and float(r[2]) > 0 for r in stage_rows), stage_rows
