"""Everything a user can type wrong gets a clear error that says what is wrong and what to do, never a traceback.

Each test drives ``autopar.planner.cli.main`` (exit code 2, ``autopar: error: <message>`` on stderr) where a CLI path
exists,
and the library function otherwise.  Messages are asserted on their content: the offending thing is named and a way
out is suggested.
"""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from autopar import ir
from autopar.ir.errors import ExampleInputError, SchemaError
from autopar.ir.plan import MeshPlan, Plan, StagePlan, dump_plan, plan_from_yaml, plan_to_yaml
from autopar.planner.cli import main
from autopar.profiles.builtin import load_builtin
from autopar.profiles.schema import ProfileError, dump_profile, load_profile
from autopar.zoo import build

_UNTRACEABLE = textwrap.dedent('''
    import torch
    from torch import nn


    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            if y.sum() > 0:          # data-dependent control flow
                return y * 2
            return y


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.inp(x))


    class RootBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 4)

        def forward(self, x):
            y = self.inp(x)
            if y.sum() > 0:          # data-dependent control flow in the model's own forward
                return y * 2
            return y


    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)


    def make(batch=1, device="cpu"):
        return Net(), (torch.randn(batch, 4, device=device),)


    def make_root(batch=1, device="cpu"):
        return RootBranch(), (torch.randn(batch, 4, device=device),)


    def wrong_inputs(batch=1, device="cpu"):
        return Plain(), (torch.randn(batch, 3, device=device),)
''')


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI, check it failed as a user error without a traceback, and return the error message."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and 'File "' not in err, err
    # The error is the last thing printed (anything torch logs before it is test_trace_failures_print_nothing_...'s
    # concern): from the "autopar: error:" line to the end.
    start = err.rfind("autopar: error: ")
    assert start >= 0, err
    return err[start + len("autopar: error: "):].strip()


def _one_line(msg: str) -> str:
    assert "\n" not in msg, f"expected a one-line error, got:\n{msg}"
    return msg


@pytest.fixture()
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user model module on sys.path; returns its import name."""
    (tmp_path / "autopar_user_models.py").write_text(_UNTRACEABLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "autopar_user_models"


def _plan_for(model: str = "gpt-tiny", fingerprint: str = "0000", nodes: int = 1, dpn: int = 8) -> Plan:
    world = nodes * dpn
    return Plan(model=model, graph_fingerprint=fingerprint, num_params=1, cluster="dgx-a100-80gb", nodes=nodes,
                devices_per_node=dpn, global_batch=world, micro_batch=1, num_microbatches=1,
                mesh=MeshPlan(dp=world), stages=(StagePlan(index=0, layer_start=0, layer_end=3),))


# ---------------------------------------------------------------------------------------------- models and inputs

def test_unknown_model_name_suggests_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    msg = _one_line(_cli_error(capsys, ["trace", "gpt2-smal"]))
    assert "unknown model 'gpt2-smal'" in msg
    assert "did you mean 'gpt2-small'" in msg
    assert "package.module:factory" in msg


def test_unknown_factory_module(capsys: pytest.CaptureFixture[str]) -> None:
    msg = _one_line(_cli_error(capsys, ["trace", "nosuchmod:make"]))
    assert "cannot import module 'nosuchmod'" in msg and "No module named 'nosuchmod'" in msg


def test_unknown_factory_attribute(capsys: pytest.CaptureFixture[str], user_models: str) -> None:
    msg = _one_line(_cli_error(capsys, ["trace", f"{user_models}:nosuch"]))
    assert f"module '{user_models}' has no attribute 'nosuch'" in msg


def test_malformed_factory_reference(capsys: pytest.CaptureFixture[str]) -> None:
    msg = _one_line(_cli_error(capsys, ["trace", "somemodule:"]))
    assert "package.module:factory" in msg


def test_untraceable_model_names_the_module_and_suggests_a_rewrite(capsys: pytest.CaptureFixture[str],
                                                                   user_models: str) -> None:
    """Data-dependent control flow in the model's own forward: nothing to isolate, so the capture fails."""
    msg = _cli_error(capsys, ["trace", f"{user_models}:make_root"])
    assert len(msg.splitlines()) == 1 and msg.startswith("could not capture the model (")
    # Both front ends report the module, its class and the source line that stopped them.
    assert "fx in module '<root>' (RootBranch)" in msg and "export in module '<root>' (RootBranch)" in msg
    assert "if y.sum() > 0" in msg
    assert "torch.where" in msg and "opaque region" in msg


def test_untraceable_submodule_is_an_opaque_region(capsys: pytest.CaptureFixture[str], user_models: str) -> None:
    """The same control flow inside a submodule: the rest is captured and the submodule is one opaque node, which
    ``autopar trace`` names with the reason."""
    assert main(["trace", f"{user_models}:make"]) == 0
    out = capsys.readouterr().out
    assert "opaque regions" in out and "gate (TraceError: symbolically traced variables" in out


def test_wrong_example_input_shape_names_the_given_shapes() -> None:
    spec = build("mlp-tiny", batch=2, device="meta")
    with pytest.raises(ExampleInputError) as ei:
        ir.trace(spec.model, (torch.zeros(2, 3, device="meta"),))
    msg = str(ei.value)
    assert "do not fit the model" in msg and "layers.0.fc" in msg
    assert "inputs given: float32[2, 3]" in msg
    assert "hint: check the batch/sequence/feature sizes" in msg


def test_wrong_example_input_dtype() -> None:
    spec = build("gpt-tiny", batch=2, device="meta")
    with pytest.raises(ExampleInputError) as ei:
        ir.trace(spec.model, (torch.zeros(2, 32, device="meta"),))
    msg = str(ei.value)
    assert "inputs given: float32[2, 32]" in msg and "token ids must be int64" in msg


def test_wrong_example_inputs_through_the_cli(capsys: pytest.CaptureFixture[str], user_models: str) -> None:
    msg = _cli_error(capsys, ["trace", f"{user_models}:wrong_inputs"])
    assert "do not fit the model" in msg and "inputs given: float32[1, 3]" in msg


def test_trace_failures_print_nothing_but_the_error(capfd: pytest.CaptureFixture[str], user_models: str) -> None:
    for ref in (f"{user_models}:wrong_inputs", f"{user_models}:make_root"):
        assert main(["trace", ref]) == 2
        err = capfd.readouterr().err
        assert err.lstrip().startswith("autopar: error: "), err[:2000]


# ---------------------------------------------------------------------------------------------- cluster profiles

def test_missing_profile_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    msg = _one_line(_cli_error(capsys, ["plan", "gpt-tiny", "--cluster", str(missing), "--global-batch", "8", "-q"]))
    assert str(missing) in msg and "no such profile file" in msg


@pytest.mark.parametrize("path,value,field", [
    (("device", "memory_bytes"), -5, "device.memory_bytes: expected an integer >= 1"),
    (("links", "intra_node", "all_reduce", 0, "busbw"), "fast", "links.intra_node.all_reduce[0].busbw"),
    (("devices_per_node",), None, "devices_per_node"),
    (("device", "colour"), "green", "device.colour: unknown key"),
])
def test_invalid_profile_names_the_field(capsys: pytest.CaptureFixture[str], tmp_path: Path, path: tuple,
                                         value: object, field: str) -> None:
    data = yaml.safe_load(dump_profile(load_builtin("dgx-a100-80gb")))
    node = data
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    msg = _one_line(_cli_error(capsys, ["plan", "gpt-tiny", "--cluster", str(bad), "--global-batch", "8", "-q"]))
    assert msg.startswith(field), msg
    assert str(bad) in msg
    with pytest.raises(ProfileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_profile(bad)


def test_profile_that_is_not_yaml(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    msg = _cli_error(capsys, ["plan", "gpt-tiny", "--cluster", str(bad), "--global-batch", "8", "-q"])
    assert "not valid YAML" in msg and str(bad) in msg


def test_unknown_builtin_cluster_name(capsys: pytest.CaptureFixture[str]) -> None:
    msg = _one_line(_cli_error(capsys, ["plan", "gpt-tiny", "--cluster", "dgx-a100-40gb", "--global-batch", "8",
                                        "-q"]))
    assert "dgx-a100-40gb" in msg


# ---------------------------------------------------------------------------------------------- planning

def test_impossible_pin_says_it_does_not_divide(capsys: pytest.CaptureFixture[str]) -> None:
    msg = _one_line(_cli_error(capsys, ["plan", "gpt-tiny", "--cluster", "dgx-a100-80gb", "--nodes", "1",
                                        "--global-batch", "8", "--pin", "tp=3", "-q"]))
    assert "tp=3" in msg and "does not divide" in msg and "8 devices" in msg and "divisor" in msg


def test_malformed_and_unknown_pins(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "gpt-tiny", "--cluster", "dgx-a100-80gb", "--nodes", "1", "--global-batch", "8", "-q"]
    assert "key=value" in _one_line(_cli_error(capsys, [*base, "--pin", "tp8"]))
    msg = _one_line(_cli_error(capsys, [*base, "--pin", "xp=2"]))
    assert "unknown pin 'xp'" in msg and "tp" in msg


@pytest.mark.slow
def test_model_that_fits_on_no_plan_names_the_smallest_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    msg = _one_line(_cli_error(capsys, ["plan", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--nodes", "1",
                                        "--global-batch", "8", "--time-limit", "2", "-q"]))
    assert "gpt3-175b does not fit on 1 x 8" in msg
    assert "smallest cluster that fits is" in msg and "--nodes" in msg


# ---------------------------------------------------------------------------------------------- plan files

def test_corrupt_plan_yaml(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good = plan_to_yaml(_plan_for())
    broken = tmp_path / "broken.yaml"
    broken.write_text(good[: len(good) // 2] + "\n  mesh: [1, 2\n")
    msg = _one_line(_cli_error(capsys, ["show", str(broken)]))
    assert msg.startswith("invalid plan") and "not valid YAML" in msg


def test_plan_with_a_bad_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = yaml.safe_load(plan_to_yaml(_plan_for()))
    data["stages"][0]["recompute"] = "sometimes"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    msg = _one_line(_cli_error(capsys, ["show", str(path)]))
    assert "stages.0.recompute" in msg and "'none', 'selective', 'full'" in msg


def test_missing_plan_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    msg = _one_line(_cli_error(capsys, ["show", str(tmp_path / "none.yaml")]))
    assert "no such file" in msg


def test_plan_from_another_model_fingerprint_mismatch() -> None:
    graph = ir.trace(build("gpt-tiny", batch=1, device="meta").model,
                     build("gpt-tiny", batch=1, device="meta").example_inputs)
    plan = _plan_for(fingerprint="feedface")
    with pytest.raises(SchemaError) as ei:
        plan.check_compatible(fingerprint=graph.fingerprint)
    assert ei.value.field == "graph_fingerprint"
    assert "another model" in str(ei.value) and "autopar plan" in str(ei.value)
    plan_ok = plan_from_yaml(plan_to_yaml(_plan_for(fingerprint=graph.fingerprint)))
    plan_ok.check_compatible(fingerprint=graph.fingerprint)


def test_replan_of_a_plan_from_another_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    dump_plan(_plan_for(model="gpt-tiny", fingerprint="feedface"), path)
    msg = _one_line(_cli_error(capsys, ["replan", str(path), "--nodes", "2"]))
    assert "graph_fingerprint" in msg and "another model" in msg and "autopar plan" in msg


def test_plan_for_another_world_size() -> None:
    plan = _plan_for(nodes=2)
    with pytest.raises(SchemaError) as ei:
        plan.check_compatible(world_size=8)
    assert ei.value.field == "mesh"
    assert "needs 16 devices but 8 are running" in str(ei.value) and "autopar replan" in str(ei.value)
    plan.check_compatible(world_size=16)


def test_plan_that_contradicts_itself(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = yaml.safe_load(plan_to_yaml(_plan_for()))
    bad = copy.deepcopy(data)
    bad["mesh"]["dp"] = 4          # 4 devices in the mesh, 8 in nodes x devices_per_node
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(bad))
    msg = _one_line(_cli_error(capsys, ["show", str(path)]))
    assert "does not equal nodes*devices_per_node" in msg
