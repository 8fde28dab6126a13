"""Issue 13: plans are data (no import of the plan's model: without --trust-plan-model, fingerprint always checked),
bounded inputs, one-line errors with exit code 2 and an internal-error boundary, byte-identical plans."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import yaml

from autopar import ir
from autopar.ir.plan import MeshPlan, OpSharding, Plan, StagePlan, dump_plan
from autopar.planner.cli import main

_MARKER_MODULE = textwrap.dedent('''
    import os
    import torch
    from torch import nn


    def make(batch=1, device="cpu"):
        open(os.environ["AUTOPAR_TEST_MARKER"], "w").close()   # proves the factory was called
        return nn.Linear(4, 4), (torch.randn(batch, 4, device=device),)
''')


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err, err
    assert err.startswith("autopar: error: ") and err.count("\n") == 1, err
    return err


def _plan(model: str, fingerprint: str = "0000", tp: int = 2) -> Plan:
    return Plan(model=model, graph_fingerprint=fingerprint, num_params=1, cluster="dgx-a100-80gb", nodes=1,
                devices_per_node=tp, global_batch=1, micro_batch=1, num_microbatches=1, mesh=MeshPlan(tp=tp),
                stages=(StagePlan(index=0, layer_start=0, layer_end=3),),
                op_shardings=(OpSharding(node="x", op="linear", strategy="column"),))


@pytest.fixture()
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "autopar_marker_model.py").write_text(_MARKER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AUTOPAR_TEST_MARKER", str(tmp_path / "called"))
    return tmp_path / "called"


@pytest.mark.parametrize("cmd", [["show", "{p}", "--kernels"], ["explain", "{p}", "x"], ["replan", "{p}", "--nodes",
                                                                                              "1"]])
def test_plan_model_is_not_imported(capsys: pytest.CaptureFixture[str], tmp_path: Path, cmd: list[str],
                                    marker: Path) -> None:
    for model in ("os:abort", "autopar_marker_model:make"):
        p = tmp_path / "plan.yaml"
        dump_plan(_plan(model), p)
        err = _err(capsys, [c.format(p=p) for c in cmd])
        assert "--trust-plan-model" in err and "--model" in err, err
        assert not marker.exists()


def test_trust_plan_model_imports_it_and_checks_the_fingerprint(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                marker: Path) -> None:
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("autopar_marker_model:make", fingerprint="feedface"), p)
    err = _err(capsys, ["show", str(p), "--kernels", "--trust-plan-model"])
    assert marker.exists() and "graph_fingerprint" in err and "another model" in err, err


def test_model_given_is_checked_against_the_fingerprint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("autopar_marker_model:make", fingerprint="feedface"), p)
    for cmd in (["explain", str(p), "x"], ["show", str(p), "--kernels"], ["replan", str(p), "--nodes", "1"]):
        err = _err(capsys, [*cmd, "--model", "gpt-tiny"])
        assert "graph_fingerprint" in err and "another model" in err, err


def test_plan_error_messages_are_bounded(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("x" * 100_000), p)
    err = _err(capsys, ["show", str(p), "--kernels"])
    assert len(err) < 1000, len(err)


def test_a_builtin_plan_model_needs_no_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = ir.trace(*_gpt_tiny())
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny", fingerprint=spec.fingerprint, tp=1), p)
    assert main(["show", str(p), "--kernels"]) == 0


def _gpt_tiny() -> tuple:
    from autopar.zoo import build

    spec = build("gpt-tiny", batch=1, device="meta")
    return spec.model, spec.example_inputs


# ------------------------------------------------------------------------------------------------- bounded inputs


def _bomb(key: str, levels: int = 9) -> str:
    """A 'billion laughs' YAML mapping: ``key`` expands to 9**levels strings (~1 KB of text)."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join([*lines, f"{key}: *l{levels - 1}"]) + "\n"


def _fast_error(capsys: pytest.CaptureFixture[str], argv: list[str], budget_s: float = 10.0) -> str:
    import time

    t0 = time.process_time()
    err = _err(capsys, argv)
    assert time.process_time() - t0 < budget_s, (argv, time.process_time() - t0)
    assert len(err) < 700, err
    return err


def test_yaml_alias_bombs_are_refused_fast(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from autopar.profiles.builtin import load_builtin
    from autopar.profiles.schema import dump_profile

    plan = tmp_path / "bomb.yaml"
    plan.write_text(_bomb("model"))
    assert len(plan.read_text()) < 1500
    assert "expands to more than" in _fast_error(capsys, ["show", str(plan)])
    good = tmp_path / "good.yaml"
    dump_plan(_plan("gpt-tiny"), good)
    assert "expands to more than" in _fast_error(capsys, ["diff", str(good), str(plan)])
    base = yaml.safe_load(dump_profile(load_builtin("dgx-h100")))
    for key in ("name", "nodes"):
        doc = {k: v for k, v in base.items() if k != key}
        prof = tmp_path / f"prof_{key}.yaml"
        prof.write_text(_bomb(key) + yaml.safe_dump(doc))
        err = _fast_error(capsys, ["plan", "gpt-tiny", "--cluster", str(prof), "--global-batch", "8", "-q"])
        assert "expands to more than" in err and str(prof) in err, err
    rec = tmp_path / "recursive.yaml"
    rec.write_text("model: &a [*a]\n")
    assert "recursive" in _fast_error(capsys, ["show", str(rec)])


@pytest.mark.parametrize("args, expect", [
    (["--nodes", str(10**30)], "nodes 1000000000000000000000000000000 is beyond autopar's limit of 100,000"),
    (["--nodes", "1000000"], "beyond autopar's limit of 100,000"),
    (["--global-batch", str(10**18)], "global_batch 1000000000000000000 is beyond autopar's limit"),
    (["--nodes", "100000"], "no mesh uses all 800000 devices with global batch 8"),
    (["--pin", "tp=²"], "pin tp='²': expected a positive integer"),
    (["--pin", "tp=8,tp=4"], "pin tp given twice (tp=8 and tp=4)"),
    (["--pin", "tp=8", "--pin", "tp=4"], "pin tp given twice"),
    (["--pin", "pp=8"], "pin pp=8 (x 1 virtual stages) needs more stages than the 4 layer groups of gpt-tiny"),
    (["--pin", "micro_batch=1000"], "pin micro_batch=1000 is larger than the global batch 8"),
    (["--seq", str(10**11)], "--seq 100000000000 is beyond autopar's limit of 4,194,304"),
    (["--seq", "0"], "--seq must be >= 1"),
])
def test_plan_bounds_and_clear_messages(capsys: pytest.CaptureFixture[str], args: list[str], expect: str) -> None:
    batch = [] if "--global-batch" in args else ["--global-batch", "8"]
    argv = ["plan", "gpt-tiny", "--cluster", "dgx-h100", "-q", *batch, *args]
    assert expect in _fast_error(capsys, argv, budget_s=20.0)


def test_replan_nodes_bound(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny"), p)
    assert "beyond autopar's limit" in _fast_error(capsys, ["replan", str(p), "--nodes", str(10**30)])


@pytest.mark.parametrize("path, value, expect", [
    (("devices_per_node",), 10**30, "beyond autopar's limit of 1,024"),
    (("devices_per_node",), 1_000_000, "beyond autopar's limit of 1,024"),
    (("nodes",), 10**30, "beyond autopar's limit of 100,000"),
    (("device", "memory_bandwidth"), 1e-310, "outside the magnitudes autopar accepts"),
    (("device", "launch_overhead_s"), 1e-320, "outside the magnitudes autopar accepts"),
    (("device", "memory_bandwidth"), 1e308, "outside the magnitudes autopar accepts"),
])
def test_profile_numbers_are_bounded(capsys: pytest.CaptureFixture[str], tmp_path: Path, path: tuple,
                                     value: object, expect: str) -> None:
    from autopar.profiles.builtin import load_builtin
    from autopar.profiles.schema import dump_profile

    data = yaml.safe_load(dump_profile(load_builtin("dgx-h100")))
    target = data
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    prof = tmp_path / "prof.yaml"
    prof.write_text(yaml.safe_dump(data))
    err = _fast_error(capsys, ["plan", "gpt-tiny", "--cluster", str(prof), "--global-batch", "8", "-q"])
    assert expect in err and "prof.yaml" in err, err


def test_decode_errors_name_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage\x80")
    assert "binary.yaml" in _fast_error(capsys, ["show", str(binary)])
    assert "binary.yaml" in _fast_error(capsys, ["plan", "gpt-tiny", "--cluster", str(binary), "--global-batch",
                                                 "8", "-q"])


# ------------------------------------------------------------------------------------------- the error boundary

_FACTORIES = textwrap.dedent('''
    import sys
    import time


    def raises(batch=1, device="cpu"):
        raise RuntimeError("the weights server said no\\nsecond line")


    def exits(batch=1, device="cpu"):
        sys.exit(0)


    def hangs(batch=1, device="cpu"):
        time.sleep(120)
''')


@pytest.fixture()
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "autopar_bad_factories.py").write_text(_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "autopar_bad_factories"


def test_factory_failures_are_one_line_errors(capsys: pytest.CaptureFixture[str], factories: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    err = _err(capsys, ["trace", f"{factories}:raises"])
    assert "failed: RuntimeError: the weights server said no" in err and "second line" not in err, err
    err = _err(capsys, ["trace", f"{factories}:exits"])
    assert "called sys.exit(0) instead of returning a model" in err, err
    monkeypatch.setenv("AUTOPAR_FACTORY_TIMEOUT_S", "1")
    t0 = time.monotonic()
    err = _err(capsys, ["trace", f"{factories}:hangs"])
    assert "did not finish within 1 s" in err and time.monotonic() - t0 < 10, err


def test_run_timeout_also_bounds_the_model_factory(capsys: pytest.CaptureFixture[str], factories: str,
                                                   tmp_path: Path) -> None:
    import time

    p = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny", tp=1), p)
    t0 = time.monotonic()
    err = _err(capsys, ["run", str(p), "--model", f"{factories}:hangs", "--timeout", "2"])
    assert "did not finish within 2 s" in err and time.monotonic() - t0 < 10, err


def test_unexpected_errors_say_internal_error(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    report = importlib.import_module("autopar.planner.report")
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny"), p)

    def broken(*a: object, **k: object) -> str:
        raise KeyError("oops")

    monkeypatch.setattr(report, "render_plan", broken)
    assert main(["show", str(p)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopar: internal error: KeyError") and "--debug" in err and err.count("\n") == 1, err
    with pytest.raises(KeyError):
        main(["show", str(p), "--debug"])


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["plan", "gpt-tiny", "--nodes", "1e30", "--cluster", "dgx-h100", "--global-batch", "8"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid int value: '1e30'" in err and "--help" in err, err


def test_output_paths_are_checked_before_the_work(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import subprocess

    search = importlib.import_module("autopar.planner.search")  # (autopar.planner.search is the function)

    def no_work(*a: object, **k: object) -> None:
        raise AssertionError("the work started")

    monkeypatch.setattr(search, "search", no_work)
    monkeypatch.setattr(subprocess, "Popen", no_work)
    base = ["plan", "gpt-tiny", "--cluster", "dgx-h100", "--global-batch", "8", "-q"]
    assert "is a directory" in _err(capsys, [*base, "-o", str(tmp_path)])
    assert "does not exist" in _err(capsys, [*base, "-o", str(tmp_path / "no" / "p.yaml")])
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny"), p)
    err = _err(capsys, ["run", str(p), "--model", "gpt-tiny", "--report", str(tmp_path / "missing" / "r.json")])
    assert "--report" in err and "does not exist" in err, err


def test_os_errors_name_the_file_and_the_fix(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import importlib

    timeline = importlib.import_module("autopar.planner.timeline")
    report = importlib.import_module("autopar.planner.report")
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny", tp=1), p)
    target = str(tmp_path / "t.json")
    for code, fix in ((errno.EROFS, "read-only"), (errno.ENOSPC, "free space"), (errno.EACCES, "permissions")):
        def fail(*a: object, code: int = code, **k: object) -> int:
            raise OSError(code, os.strerror(code), target)

        monkeypatch.setattr(timeline, "schedule_trace", fail)
        monkeypatch.setattr(report, "schedule_trace", fail, raising=False)
        err = _err(capsys, ["show", str(p), "--trace", target])
        assert target in err and fix in err, err
    unreadable = tmp_path / "dir.yaml"
    unreadable.mkdir()
    assert "dir.yaml" in _err(capsys, ["show", str(unreadable)])


def test_worker_failure_summary_puts_a_full_disk_first(tmp_path: Path) -> None:
    import errno
    import json

    from autopar.planner.run.torchrun import _summary

    (tmp_path / "rank0.txt").write_text(json.dumps({"rank": "0", "cause": "RuntimeError: Connection closed by peer",
                                                    "errno": None}))
    (tmp_path / "rank3.txt").write_text(json.dumps({"rank": "3", "cause": "OSError: [Errno 28] No space left on "
                                                    "device: '/ck/.tmp-step_2/__3_0.distcp'",
                                                    "errno": errno.ENOSPC}))
    line = _summary(tmp_path, 1)
    assert line.startswith("rank 3 failed: OSError: [Errno 28] No space left") and "1 other rank" in line, line
    assert "\n" not in line
    (tmp_path / "rank3.txt").unlink()
    assert _summary(tmp_path, 1).startswith("rank 0 failed: RuntimeError: Connection closed")
    (tmp_path / "rank0.txt").unlink()
    assert "without reporting a cause" in _summary(tmp_path, 1)


def test_worker_failure_summary_names_the_last_attempt_that_reported(tmp_path: Path) -> None:
    """After torchrun restarted the group, the first attempt's cause (the peer that died) is not the run's."""
    import json

    from autopar.planner.run.torchrun import _summary

    (tmp_path / "rank0.attempt0.txt").write_text(json.dumps({"rank": "0", "cause": "RuntimeError: Connection reset "
                                                             "by peer", "errno": None, "attempt": 0}))
    assert _summary(tmp_path, 1).startswith("rank 0 failed: RuntimeError: Connection reset")
    (tmp_path / "rank1.attempt1.txt").write_text(json.dumps({"rank": "1", "cause": "DistStoreError: timed out",
                                                             "errno": None, "attempt": 1}))
    line = _summary(tmp_path, 1)
    assert line.startswith("rank 1 failed (torchrun restart 1, the last to report a cause): DistStoreError"), line
    assert "other rank" not in line


# ----------------------------------------------------------------------------------------------------- determinism


def test_planning_twice_writes_byte_identical_plans(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import json

    out = []
    for i in (1, 2):
        path = tmp_path / f"p{i}.yaml"
        assert main(["plan", "gpt-tiny", "--cluster", "dgx-h100", "--global-batch", "16", "-q", "--workers", "1",
                     "-o", str(path)]) == 0
        out.append(path.read_bytes())
        side = json.loads(path.with_suffix(".search.json").read_text())
        assert side["wall_s"] > 0 and side["candidates"] > 0, side
    capsys.readouterr()
    assert out[0] == out[1]
    assert b"wall_s" not in out[0]


# ---------------------------------------------------------------------------------------------- atomic writes


def test_plans_and_profiles_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from autopar.ir import safe_yaml
    from autopar.profiles.builtin import load_builtin
    from autopar.profiles.schema import save_profile

    plan_mod = importlib.import_module("autopar.ir.plan")
    target = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny"), target)
    before = target.read_bytes()

    def torn(src: str, dst: str) -> None:  # the rename never happens: a crash between write and rename
        raise OSError(28, "No space left on device", dst)

    monkeypatch.setattr(safe_yaml.os, "replace", torn)
    with pytest.raises(OSError):
        plan_mod.dump_plan(_plan("llama-tiny"), target)
    with pytest.raises(OSError):
        save_profile(load_builtin("dgx-h100"), tmp_path / "prof.yaml")
    assert target.read_bytes() == before                       # the reader still sees the whole old plan
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]  # and no temporary is left behind
    monkeypatch.undo()
    dump_plan(_plan("llama-tiny"), target)
    assert b"llama-tiny" in target.read_bytes()


def test_diff_of_plans_without_times_prints_no_nan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    dump_plan(_plan("gpt-tiny", tp=1), a)
    dump_plan(_plan("gpt-tiny", tp=2), b)
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out.lower() and "inf" not in out.lower(), out


def test_graph_cache_entries_of_others_are_not_unpickled(tmp_path: Path) -> None:
    import pickle

    from autopar.ir.trace_cache import _path, cached_graph

    graph = ir.trace(*_gpt_tiny())
    key = {"zoo": "gpt-tiny", "test": True}
    assert cached_graph(key, lambda: graph, root=tmp_path) is graph        # traced and stored
    entry = _path(key, tmp_path)
    assert oct(entry.stat().st_mode & 0o777) == oct(0o600)
    assert oct(entry.parent.stat().st_mode & 0o777) == oct(0o700)
    assert cached_graph(key, lambda: pytest.fail("should come from the cache"), root=tmp_path).fingerprint \
        == graph.fingerprint
    ran = tmp_path / "ran"

    class Planted:
        def __reduce__(self) -> tuple:
            return os.system, (f"touch {ran}",)

    entry.write_bytes(pickle.dumps(Planted()))
    os.chmod(entry.parent, 0o777)                    # anyone could have planted it: not read
    assert cached_graph(key, lambda: graph, root=tmp_path) is graph
    assert not ran.exists()


def test_kernel_cache_must_be_private_and_runs_the_generated_source(tmp_path: Path) -> None:
    from autopar.codegen.kernels.cache import cache_dir, load_source

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="writable by group/others"):
        cache_dir(shared)
    private = tmp_path / "private"
    src = "VALUE = 41\n"
    mod = load_source(src, "k", private)
    assert mod.VALUE == 41 and oct(private.stat().st_mode & 0o777) == oct(0o700)
    import importlib.util
    import sys
    from importlib import _bootstrap_external  # type: ignore[attr-defined]

    from autopar.codegen.kernels import cache as kcache

    [f] = private.glob("k_*.py")
    st = f.stat()  # byte code valid for that file's mtime and size, but compiled from other source
    evil = _bootstrap_external._code_to_timestamp_pyc(compile("VALUE = 666\n", str(f), "exec"), st.st_mtime,
                                                     st.st_size)
    pyc = Path(importlib.util.cache_from_source(str(f)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(bytes(evil))
    assert sys.implementation.cache_tag in pyc.name
    kcache._LOADED.clear()
    assert load_source(src, "k", private).VALUE == 41  # the generated source runs, not the planted byte code


def test_run_refuses_a_shared_checkpoint_directory_before_launch(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    def no_launch(*a: object, **k: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny", tp=1), p)
    shared = tmp_path / "ck"
    shared.mkdir()
    os.chmod(shared, 0o777)
    err = _err(capsys, ["run", str(p), "--model", "gpt-tiny", "--checkpoint-dir", str(shared)])
    assert "writable by group/others" in err and "chmod go-w" in err, err


def test_commands_that_make_directories_may_write_into_new_ones(tmp_path: Path) -> None:
    from autopar.planner.cli import _check_output

    _check_output(str(tmp_path / "new" / "deeper" / "prof.yaml"), "--output", makes_dirs=True)
    with pytest.raises(ValueError, match="does not exist"):
        _check_output(str(tmp_path / "new" / "plan.yaml"), "--output")
    with pytest.raises(ValueError, match="is a directory"):
        _check_output(str(tmp_path), "--output", makes_dirs=True)


def test_only_node_zero_locks_a_shared_checkpoint_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from autopar.codegen.checkpoint_guard import CheckpointLockedError
    from autopar.planner.run.torchrun import _node_rank, checkpoint_lock

    monkeypatch.delenv("NODE_RANK", raising=False)
    assert _node_rank(["--nnodes", "2", "--node-rank", "1"]) == 1
    assert _node_rank(["--node_rank=3"]) == 3 and _node_rank([]) == 0
    hold = ("import sys, time\nfrom autopar.codegen.checkpoint_guard import CheckpointLock\n"
            "CheckpointLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(60)\n")
    node0 = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert node0.stdout is not None and node0.stdout.readline().strip() == "held"
        with checkpoint_lock(tmp_path, ["--nnodes", "2", "--node-rank", "1"]):  # node 1 shares node 0's run
            pass
        second = checkpoint_lock(tmp_path, ["--nnodes", "2", "--node-rank", "0"])  # a second node 0: another run
        with pytest.raises(CheckpointLockedError), second:
            pass
    finally:
        node0.kill()
        node0.wait()
