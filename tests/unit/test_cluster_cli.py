"""``autopar schedule`` through its CLI, in-process, on real plans of tiny zoo jobs and a 4-node synthetic CPU cluster:
an arrival and then the departure each move one job, not more, and print that job's replan + resume commands; the
printed replan writes the very plan the schedule holds."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from cpu_cluster import cpu_ranks_profile

from autopar.ir.plan import load_plan
from autopar.planner.cli import main


def _nodes(path: Path) -> dict[str, tuple[int, str]]:
    return {j["name"]: (j["nodes"], j["plan"]) for j in yaml.safe_load(path.read_text())["jobs"]}


def _moves(out: str) -> dict[str, list[list[str]]]:
    """Each ``move NAME: ...`` line's job and the command lines under it."""
    lines, moves = out.splitlines(), {}
    for i, line in enumerate(lines):
        if line.startswith("move "):
            moves[line.split()[1].rstrip(":")] = [shlex.split(c) for c in lines[i + 1:i + 3]]
    return moves


def _check_move(cmds: list[list[str]], name: str, nodes: int, schedule: Path, tmp_path: Path) -> None:
    replan, resume = cmds
    assert replan[:2] == ["autopar", "replan"] and replan[replan.index("--nodes") + 1] == str(nodes)
    assert replan[replan.index("--cluster") + 1] == str(tmp_path / "cpu.yaml")
    new_plan = replan[replan.index("-o") + 1]
    assert resume[:3] == ["autopar", "run", new_plan] and "--resume" in resume
    assert resume[resume.index("--checkpoint-dir") + 1] == f"checkpoints/{name}"
    assert new_plan == _nodes(schedule)[name][1]  # the plan the schedule names for the job
    written = load_plan(new_plan)
    assert written.world_size == nodes
    assert main(replan[1:]) == 0 and load_plan(new_plan) == written  # the printed replan makes that same plan


def test_arrive_then_leave_move_one_job_each(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    cpu_ranks_profile(tmp_path / "cpu.yaml")
    (tmp_path / "jobs.yaml").write_text("- {name: a, model: mlp-tiny, global_batch: 16, max_devices: 2}\n"
                                        "- {name: b, model: mlp-tiny, global_batch: 8, max_devices: 2}\n")
    (tmp_path / "c.yaml").write_text("- {name: c, model: mlp-tiny, global_batch: 4, max_devices: 1}\n")
    schedule = tmp_path / "schedule.yaml"
    assert main(["schedule", "jobs.yaml", "--cluster", f"{tmp_path / 'cpu.yaml'}:4", "--dtype", "float32",
                 "--no-fused-kernels", "-q"]) == 0
    first = _nodes(schedule)
    assert {k: n for k, (n, _) in first.items()} == {"a": 2, "b": 2}
    capsys.readouterr()

    assert main(["schedule", "--arrive", "c.yaml", "-q"]) == 0
    out = capsys.readouterr().out
    second = _nodes(schedule)
    assert sorted(n for n, _ in second.values()) == [1, 1, 2] and second["c"][0] == 1
    moves = _moves(out)
    assert len(moves) == 1, out  # one job gives a node to the newcomer; the other keeps running as it was
    (mover, cmds), = moves.items()
    stay = next(k for k in first if k != mover)
    assert second[stay] == first[stay] and second[mover][0] == 1
    assert f"start c: autopar run {second['c'][1]} --model mlp-tiny --checkpoint-dir checkpoints/c" in out
    _check_move(cmds, mover, 1, schedule, tmp_path)

    capsys.readouterr()
    assert main(["schedule", "--leave", "z", "-q"]) != 0
    assert "--leave z: no such job in schedule.yaml (a, b, c)" in capsys.readouterr().err
    assert _nodes(schedule) == second  # a refused change leaves the schedule as it was
    assert main(["schedule", "--leave", "c", "-q"]) == 0
    out = capsys.readouterr().out
    third = _nodes(schedule)
    assert set(third) == {"a", "b"} and third[stay] == first[stay]  # the job that never moved does not move now
    moves = _moves(out)
    assert list(moves) == [mover] and third[mover][0] == 2, out  # the freed node goes back to the job that gave it
    assert "start " not in out and "no running job moves" not in out
    _check_move(moves[mover], mover, 2, schedule, tmp_path)
