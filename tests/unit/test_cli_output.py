"""What the command line prints: tables at 80, 120 and 200 columns (golden snapshots, nothing truncated, no line
wider than the terminal), the alternatives list, ``diff`` across models, the Perfetto trace's tracks, number formats,
and where caches and progress bars go."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from autopar.ir.plan import load_plan
from autopar.planner.report import alternatives_table, diff_plans, distinct_alternatives, render_plan
from autopar.planner.tables import fmt_sig, render, table, terminal_width
from autopar.planner.timeline import chrome_trace, plan_timeline

from golden_files import GOLDEN_DIR, check_golden

PLANS = GOLDEN_DIR / "plans"
SHOWN = {  # one data-parallel plan, a pp x tp plan with shardings and collectives, a 64-stage interleaved plan
    "gpt2-small-dp": "gpt2-small_dgx-h100_4n_gb64.yaml",
    "llama-tiny-pp2tp2": "llama-tiny_dgx-h100_2n_gb32_pp2_tp2.yaml",
    "gpt3-175b": "gpt3-175b_dgx-a100-80gb_128n_gb1536.yaml",
}
WIDTHS = (80, 120, 200)


def _words(text: str) -> set[str]:
    return set(text.split())


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(SHOWN))
def test_show_snapshot(name: str, width: int) -> None:
    plan = load_plan(PLANS / SHOWN[name])
    text = render_plan(plan, width=width)
    check_golden(GOLDEN_DIR / "cli" / f"show_{name}_{width}.txt", text)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text and "..." not in text
    words = _words(text)
    for s in plan.stages:  # every value is there whole (a truncated or folded cell would lose a word)
        assert s.recompute in words
    for p in plan.param_shardings:
        assert p.pattern in words
    for o in plan.op_shardings:
        if o.comm:
            assert o.node in words


def test_single_stage_plan_has_no_stage_or_rank_column_and_no_zero_rows() -> None:
    text = render_plan(load_plan(PLANS / SHOWN["gpt2-small-dp"]), width=200)
    assert "stage " not in text.split("the model on each device")[1].splitlines()[1]
    assert "bubble" not in text  # pp=1: no pipeline bubble to report


def test_tables_wrap_instead_of_truncating_at_any_width() -> None:
    rng = random.Random(0)
    vocab = ["a", "bb", "cccc", "dddddddd", "0.0523", "1.56 GiB (12%)", "<prefix>, blocks.0-11, <suffix>",
             "layers_0_attn_wq", "bwd: all_reduce"]
    for _ in range(40):
        ncol = rng.randint(1, 9)
        cols = [f"col {i}" for i in range(ncol)]
        rows = [[rng.choice(vocab) for _ in range(ncol)] for _ in range(rng.randint(1, 4))]
        for width in (40, 80, 120):
            text = render(table("t", cols, rows), width=width)
            assert max(len(line) for line in text.splitlines()) <= width
            assert "…" not in text
            longest = [max(len(w) for c in [cols[i], *(r[i] for r in rows)] for w in c.split()) for i in range(ncol)]
            if sum(longest) + 2 * (ncol - 1) <= width:  # room for every column's longest word: none is cut
                flat = _words(text)
                assert all(w in flat for r in rows for c in r for w in c.split())


def test_empty_columns_are_dropped() -> None:
    text = render(table(None, ["name", "zero", "value"], [["a", "", "1"], ["b", " ", "2"]]), width=80)
    assert "zero" not in text and "value" in text


def test_terminal_width_follows_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "93")
    assert terminal_width() == 93
    monkeypatch.delenv("COLUMNS")
    assert terminal_width() == 120  # pytest captures stdout: not a terminal, so the pipe width


def test_alternatives_are_distinct_and_say_what_differs() -> None:
    best = load_plan(PLANS / "gpt2-small_dgx-a100-80gb_1n_gb64.yaml")
    other = dataclasses.replace(best, zero=(best.zero + 1) % 4)
    same_again = dataclasses.replace(best, solver=dataclasses.replace(best.solver, wall_s=9.0))
    listed = distinct_alternatives(best, [same_again, other, dataclasses.replace(other)])
    assert len(listed) == 1
    label, plan = listed[0]
    assert plan is other and f"ZeRO {best.zero} -> {other.zero}" in label
    text = alternatives_table(best, [same_again, other, other], width=80)
    assert text.count("ZeRO") == 1 and "1x" in text


def test_diff_warns_on_plans_of_different_models() -> None:
    a = load_plan(PLANS / "gpt2-small_dgx-h100_4n_gb64.yaml")
    b = load_plan(PLANS / "llama-tiny_h200_1n_gb16.yaml")
    text = diff_plans(a, b, width=120)
    assert text.startswith("warning: A is a plan of gpt2-small, B of llama-tiny")
    assert "the speed of A" not in text
    same = diff_plans(a, load_plan(PLANS / "gpt2-small_dgx-a100-80gb_1n_gb64.yaml"), width=120)
    assert "warning" not in same and "the speed of A" in same


@pytest.mark.parametrize("name", sorted(p.name for p in PLANS.glob("*.yaml")))
def test_trace_tracks_hold_what_the_plan_counts(name: str) -> None:
    plan = load_plan(PLANS / name)
    t = plan.time
    trace = chrome_trace(plan)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    side = [e for e in events if e["tid"] == 1]
    for r in range(plan.mesh.pp):
        mine = {e["cat"]: e["dur"] / 1e6 for e in side if e["pid"] == r}
        assert mine.get("optimizer", 0.0) == pytest.approx(t.optimizer)
        assert mine.get("dp sync", 0.0) == pytest.approx(t.dp_exposed)
        assert mine.get("contention", 0.0) == pytest.approx(t.contention)
    if t.optimizer or t.exposed_comm:
        assert side, "the comm/optimizer track is empty"
    tl = plan_timeline(plan)
    assert tl.iteration_s == pytest.approx(max(e["ts"] + e["dur"] for e in events) / 1e6)
    # the trace ends at the plan's iteration time, or at the simulated pipeline plus what follows it if longer
    assert tl.iteration_s == pytest.approx(max(t.total, tl.pipeline_s + t.dp_exposed + t.contention + t.optimizer))
    assert trace["otherData"]["iteration_s"] == tl.iteration_s
    json.dumps(trace)


def test_number_formats() -> None:
    assert fmt_sig(156.24) == "156"
    assert fmt_sig(0.05234) == "0.0523"
    assert fmt_sig(36112.4, 4) == "36112"
    assert fmt_sig(0.0) == "0"
    text = render_plan(load_plan(PLANS / "llama-tiny_h200_1n_gb16.yaml"), width=120)
    assert "0.0 TFLOP/s" not in text and "MFU 0.0%" not in text


def test_caches_are_temporary_under_tests() -> None:
    from autopar.codegen.kernels.cache import cache_dir
    from autopar.ir.trace_cache import cache_root

    real = Path.home() / ".cache" / "autopar"
    for path in (cache_root(), cache_dir()):
        assert real != path and real not in path.parents, path


def test_an_alternative_equal_but_for_the_profile_file_is_not_listed(tmp_path: Path) -> None:
    from autopar.planner.profile_ref import with_source

    prof = tmp_path / "mine.yaml"
    prof.write_text((Path(__file__).parents[2] / "profiles" / "builtin" / "h200.yaml").read_text())
    best = load_plan(PLANS / "llama-tiny_h200_1n_gb16.yaml")
    assert distinct_alternatives(with_source(best, str(prof)), [best]) == []


def test_plans_find_their_profile_file_again(tmp_path: Path) -> None:
    from autopar.planner.profile_ref import plan_profile, with_source

    prof = tmp_path / "measured.yaml"
    text = (Path(__file__).parents[2] / "profiles" / "builtin" / "h200.yaml").read_text()
    prof.write_text(text)
    plan = with_source(load_plan(PLANS / "llama-tiny_h200_1n_gb16.yaml"), str(prof))
    assert plan.cluster_source is not None and plan.cluster_source.path == str(prof.resolve())
    assert with_source(plan, "h200") is plan  # a built-in name records no file
    assert plan_profile(plan, nodes=2).nodes == 2
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    prof.rename(moved / prof.name)  # the plan and its profile moved together
    with pytest.raises(ValueError, match="is gone; pass --cluster"):
        plan_profile(plan)
    assert plan_profile(plan, plan_path=moved / "plan.yaml").name == "h200"
    (moved / prof.name).write_text(text.replace("name:", "name: changed-", 1))
    with pytest.raises(ValueError, match="has changed since the plan was made"):
        plan_profile(plan, plan_path=moved / "plan.yaml")
    assert plan_profile(plan, override="dgx-h100").name == "dgx-h100"  # --cluster overrides
    assert plan_profile(load_plan(PLANS / "gpt2-small_dgx-h100_4n_gb64.yaml")).name == "dgx-h100"


@pytest.mark.parametrize("width", WIDTHS)
def test_diff_snapshot(width: int) -> None:
    a = load_plan(PLANS / "gpt2-small_dgx-a100-80gb_1n_gb64.yaml")
    b = load_plan(PLANS / "gpt2-small_dgx-h100_4n_gb64.yaml")
    text = diff_plans(a, b, width=width)
    check_golden(GOLDEN_DIR / "cli" / f"diff_gpt2-small_{width}.txt", text)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text and "x the speed of A" in text


def test_distinct_alternatives_that_read_alike_are_both_listed_and_told_apart() -> None:
    best = load_plan(PLANS / "gpt2-small_dgx-a100-80gb_1n_gb64.yaml")
    one = dataclasses.replace(best, zero=(best.zero + 1) % 4)
    two = dataclasses.replace(one, notes=(*one.notes, "another plan with the same choices"))
    listed = distinct_alternatives(best, [one, two])
    assert [p for _, p in listed] == [one, two]
    assert listed[0][0] != listed[1][0]
