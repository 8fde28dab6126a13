"""A shared cluster for real (issue 15): ``autopar schedule`` places two small zoo jobs on a 4-rank CPU "cluster"
(4 nodes of one CPU process each, a synthetic profile), both run concurrently as the schedule says (each its own
torchrun group and port) and finish with a checkpoint; then a third job arrives, ``autopar schedule --arrive``
shrinks one job (max-min: 2 + 1 + 1 nodes), and the moved job resumes from its checkpoint under its new plan while the
unmoved one resumes under its own and the newcomer starts, all three at once.  The unmoved job's losses continue bit
for bit where an uninterrupted run's are; the moved job's (resharded from dp=2 to one rank) agree to 1e-5."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cpu_cluster import cpu_ranks_profile

from autopar.planner.cli import main
from autopar.planner.run.torchrun import stop_process_tree

pytestmark = pytest.mark.multiprocess


@dataclass
class _Group:
    """A started torchrun group and the file its stdout and stderr go to."""

    proc: subprocess.Popen
    log: Path


def _run(cmd: list[str], report: Path) -> _Group:
    """The torchrun group ``autopar run`` would start for ``cmd`` (an ``autopar run PLAN --model M --steps N
    [--checkpoint-dir D] [--resume]`` line), started directly: its own group on a free port, this machine's processes
    standing for the plan's nodes (one CLI process less per job than ``autopar run``).  Its stdout and stderr go to
    ``<report>.log``, kept beside the report (and printed by :func:`_wait` when anything fails)."""
    from autopar.ir.plan import load_plan
    from autopar.planner.run.torchrun import torchrun_command

    a = {k: v for k, v in zip(cmd, [*cmd[1:], ""]) if k.startswith("--")}
    worker = ["--data", "step", "--report", str(report)]
    if "--checkpoint-dir" in a:
        worker += ["--checkpoint-dir", str(Path(a["--checkpoint-dir"]).resolve()), "--save-every", "0", "--keep", "2"]
        worker += ["--resume"] if "--resume" in cmd else []
    line = torchrun_command(cmd[2], a["--model"], int(a["--steps"]), load_plan(cmd[2]).world_size,
                            worker_args=worker)
    log = report.with_suffix(".log")
    with log.open("w") as f:  # the child writes through its own copy of the descriptor
        # its own session: on a failure or time-out _wait kills the whole group, torchrun's workers included
        return _Group(subprocess.Popen(line, stdout=f, stderr=subprocess.STDOUT, start_new_session=True), log)


def _wait(groups: dict[str, _Group], timeout: float = 300.0) -> None:
    """Wait for every torchrun group; when one fails or they run past ``timeout``, kill the rest and fail with each
    group's exit status and the end of its log (the whole logs stay in the test's tmp_path)."""
    deadline = time.monotonic() + timeout
    try:
        for g in groups.values():
            if g.proc.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                break
    except subprocess.TimeoutExpired:
        pass
    finally:
        for g in groups.values():
            if g.proc.poll() is None:
                stop_process_tree(g.proc, grace_s=0)  # torchrun and its workers (each in a session of its own)
    failed = [name for name, g in groups.items() if g.proc.returncode != 0]
    if failed:
        logs = "\n".join(f"--- {name}: exit {g.proc.returncode} (negative: killed by that signal, or by this test "
                         f"after {timeout:.0f} s); {g.log}:\n{_tail(g.log)}" for name, g in groups.items())
        print(logs)
        pytest.fail(f"torchrun group(s) {failed} failed:\n{logs}")


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return text if len(text) <= chars else "...\n" + text[-chars:]


def test_two_jobs_then_an_arrival_reallocates_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    prof = cpu_ranks_profile(tmp_path / "cpu.yaml")
    (tmp_path / "jobs.yaml").write_text("- {name: a, model: mlp-tiny, global_batch: 16, max_devices: 2}\n"
                                        "- {name: b, model: mlp-tiny, global_batch: 8, max_devices: 2}\n")
    (tmp_path / "c.yaml").write_text("- {name: c, model: gpt-tiny, global_batch: 4, max_devices: 1}\n")
    base = ["schedule", "--policy", "max-min", "--dtype", "float32", "--no-fused-kernels", "-q"]
    assert main([*base, "jobs.yaml", "--cluster", f"{prof}:4"]) == 0
    first = {j["name"]: j for j in _yaml(tmp_path / "schedule.yaml")["jobs"]}
    assert {n: j["nodes"] for n, j in first.items()} == {"a": 2, "b": 2}
    capsys.readouterr()

    # reference: each job uninterrupted for 6 steps; then the schedule's runs: 3 steps each, a checkpoint at the end
    _wait({f"{n}-ref": _run(["autopar", "run", j["plan"], "--model", j["model"], "--steps", "6"],
                            tmp_path / f"{n}-ref.json") for n, j in first.items()})
    _wait({n: _run(["autopar", "run", j["plan"], "--model", j["model"], "--steps", "3", "--checkpoint-dir",
                    f"checkpoints/{n}"], tmp_path / f"{n}-1.json") for n, j in first.items()})

    assert main(["schedule", "--arrive", "c.yaml", "-q"]) == 0
    out = capsys.readouterr().out
    second = {j["name"]: j for j in _yaml(tmp_path / "schedule.yaml")["jobs"]}
    assert sorted(j["nodes"] for j in second.values()) == [1, 1, 2]
    moved = [n for n in first if second[n]["nodes"] != first[n]["nodes"]]
    assert len(moved) == 1, out  # one job gives up a node; the other keeps running as it was
    mover, stay = moved[0], next(n for n in first if n not in moved)
    lines = out.splitlines()
    i = lines.index(next(ln for ln in lines if ln.startswith(f"move {mover}:")))
    replan, resume = (shlex.split(ln) for ln in lines[i + 1:i + 3])
    assert replan[:2] == ["autopar", "replan"] and resume[:2] == ["autopar", "run"] and "--resume" in resume
    from autopar.ir.plan import load_plan

    plan = tmp_path / resume[2]  # already written by the schedule; the printed replan makes the same plan
    written = load_plan(plan)
    assert main(replan[1:]) == 0 and load_plan(plan) == written
    start = shlex.split(next(ln for ln in lines if ln.startswith("start c:")).split(": ", 1)[1])
    s = first[stay]
    _wait({mover: _run([*resume[:-1], "6"], tmp_path / f"{mover}-2.json"),
           stay: _run(["autopar", "run", s["plan"], "--model", s["model"], "--steps", "6", "--resume",
                       "--checkpoint-dir", f"checkpoints/{stay}"], tmp_path / f"{stay}-2.json"),
           "c": _run([*start[:-1], "2"], tmp_path / "c.json")})

    rep = {k: json.loads((tmp_path / f"{k}.json").read_text()) for k in
           (f"{mover}-ref", f"{stay}-ref", f"{mover}-2", f"{stay}-2", "c")}
    assert rep[f"{stay}-2"]["start_step"] == 3 and rep[f"{stay}-2"]["losses"] == rep[f"{stay}-ref"]["losses"][3:]
    assert rep[f"{mover}-2"]["start_step"] == 3 and len(rep[f"{mover}-2"]["losses"]) == 3
    assert rep[f"{mover}-2"]["losses"] == pytest.approx(rep[f"{mover}-ref"]["losses"][3:], rel=1e-5)
    assert len(rep["c"]["losses"]) == 2


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())
