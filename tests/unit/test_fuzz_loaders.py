"""Property-based fuzzing of the two YAML loaders a user feeds by hand: plans and cluster profiles.

Property: any text either loads, or fails with the loader's schema error (``autopar.ir.errors.SchemaError`` for plans,
``autopar.profiles.schema.ProfileError`` for profiles) -- never a bare KeyError/TypeError/OverflowError from inside --
and a
problem inside a well-formed YAML mapping names the offending field.

Inputs come from two families: (a) a valid document (a plan built from ``autopar.ir.plan`` types, the built-in DGX A100
profile) serialized to plain data and then mutated (keys deleted, values replaced by random scalars or nested garbage,
unknown keys inserted, types changed), and (b) arbitrary YAML documents and random text.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.ir.errors import SchemaError
from autopar.ir.plan import (
    DeviceGroup,
    MemoryBreakdown,
    MeshPlan,
    OpSharding,
    ParamSharding,
    Plan,
    ProfileSource,
    StagePlan,
    TimeBreakdown,
    plan_from_yaml,
    plan_to_yaml,
)
from autopar.profiles.builtin import load_builtin
from autopar.profiles.schema import ProfileError, dump_profile, loads_profile

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)
"""Moderate and derandomized: the same examples on every run, so CI is reproducible and fast."""

# Unbounded integers (beyond float range too) once crashed both loaders.  Mapping keys stay non-empty: an empty
# unknown key in a profile is a known bug (test_empty_unknown_profile_key_is_named below).
_INTS = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.integers(), st.sampled_from([10**400, -(10**400)]))
_SCALARS = st.one_of(
    st.none(), st.booleans(), _INTS, st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["R", "P", "S(0)", "S(-1)", "1f1b", "none", "default", "intra_node",
                                           "inter_node", "float32", "", "~", "1e999", "-.inf"]),
)
_GARBAGE = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.text(min_size=1, max_size=6), _INTS, st.booleans()), inner, max_size=4)),
    max_leaves=12,
)


def _make_plan() -> Plan:
    mem = MemoryBreakdown(params=1e9, grads=1e9, optimizer=6e9, activations=3.5e9, other=1.6e9, capacity=80e9)
    return Plan(
        model="gpt-tiny", graph_fingerprint="abc123", num_params=1234, cluster="dgx-a100-80gb", nodes=2,
        cluster_source=ProfileSource(path="/profiles/fitted.yaml", sha256="0" * 64),
        devices_per_node=8, global_batch=64, micro_batch=2, num_microbatches=8, mesh=MeshPlan(pp=2, dp=4, tp=2),
        schedule="1f1b", zero=1, dtype="bfloat16",
        stages=(StagePlan(index=0, layer_start=0, layer_end=3, modules=("<prefix>", "blocks.0", "blocks.1"),
                          recompute="selective", fwd_s=0.01, bwd_s=0.02, memory=mem, device_group="a100"),
                StagePlan(index=1, layer_start=3, layer_end=5, modules=("blocks.2", "<suffix>"), memory=mem,
                          device_group="h100")),
        device_groups=(DeviceGroup(name="a100", device="NVIDIA A100-SXM4-80GB", nodes=1),
                       DeviceGroup(name="h100", device="NVIDIA H100 80GB HBM3", nodes=1)),
        param_shardings=(ParamSharding(pattern="blocks.*.attn.qkv.weight", placement="S(0)"),),
        op_shardings=(OpSharding(node="linear_1", op="linear", strategy="row", inputs=("S(2)",), output="P",
                                 comm="all_reduce"),),
        time=TimeBreakdown(compute=1.0, exposed_comm=0.2, bubble=0.1, optimizer=0.01),
        pins=("tp=2",), notes=("a note",),
    )


PLAN_DATA: dict[str, Any] = yaml.safe_load(plan_to_yaml(_make_plan()))
PROFILE_TEXT = dump_profile(load_builtin("dgx-a100-80gb"))
PROFILE_DATA: dict[str, Any] = yaml.safe_load(PROFILE_TEXT)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) to a value inside nested dicts/lists, the root excluded."""
    out: list[tuple] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    """``base`` with 1-3 random mutations at random places."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        action = draw(st.sampled_from(["delete", "replace", "insert", "retype", "wrap"]))
        if action == "delete":
            del parent[key]
        elif action == "replace":
            parent[key] = draw(_GARBAGE)
        elif action == "insert" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(_SCALARS)
        elif action == "retype":
            v = parent[key]
            parent[key] = str(v) if not isinstance(v, str) else draw(st.one_of(_INTS, st.floats(), st.none()))
        else:
            parent[key] = [parent[key]]
    return data


def _yaml_text(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _check_plan(text: str, *, structured: bool) -> None:
    try:
        plan = plan_from_yaml(text)
    except SchemaError as e:
        assert str(e).startswith("invalid plan"), str(e)
        if structured:
            # The document is a mapping, so the problem is a field's (or the whole plan's: "<root>").
            assert e.field, f"no field named for a structured document: {e}"
        return
    assert isinstance(plan, Plan)
    # Whatever loads must survive its own round trip.
    assert plan_from_yaml(plan_to_yaml(plan)) == plan


def _check_profile(text: str, *, structured: bool) -> None:
    try:
        prof = loads_profile(text)
    except ProfileError as e:
        msg = str(e)
        if structured:
            # "<field path>: <problem>" (the path may hold any key text the user wrote, even spaces).
            head, sep, problem = msg.partition(": ")
            assert head and sep and problem.strip(), f"message does not start with a field path: {msg}"
        return
    assert loads_profile(dump_profile(prof)) == prof


@FUZZ
@given(mutated(PLAN_DATA))
def test_mutated_plans_load_or_raise_schema_error(data: Any) -> None:
    _check_plan(_yaml_text(data), structured=isinstance(data, dict))


@FUZZ
@given(mutated(PROFILE_DATA))
def test_mutated_profiles_load_or_raise_profile_error(data: Any) -> None:
    _check_profile(_yaml_text(data), structured=isinstance(data, dict))


@FUZZ
@given(_GARBAGE)
def test_arbitrary_yaml_documents(data: Any) -> None:
    text = _yaml_text(data)
    _check_plan(text, structured=isinstance(data, dict))
    _check_profile(text, structured=isinstance(data, dict))


@FUZZ
@given(st.one_of(st.text(max_size=200),
                 st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                 st.lists(st.sampled_from(["a:", " b", "- ", "[", "]", "{", "}", ":", "&x", "*x", "!!str", "? ",
                                           "|", ">", "#", "\n", "  ", "'", '"', "1", "mesh", "nodes:"]),
                          max_size=30).map("".join)))
def test_random_text(text: str) -> None:
    _check_plan(text, structured=False)
    _check_profile(text, structured=False)


@FUZZ
@given(st.integers(0, 20), st.integers(-3, 40), st.integers(0, 3))
def test_text_corruption_of_valid_plan(cut: int, pos: int, flip: int) -> None:
    """Truncated or byte-flipped copies of a valid plan file (a half-written or hand-edited YAML)."""
    text = plan_to_yaml(_make_plan())
    lines = text.splitlines(keepends=True)
    corrupted = "".join(lines[:len(lines) - cut])
    if flip:
        i = (pos * 37) % max(1, len(corrupted))
        corrupted = corrupted[:i] + ["\t", ":", "]"][flip - 1] + corrupted[i + 1:]
    _check_plan(corrupted, structured=False)


def test_valid_documents_load() -> None:
    """The fuzz seeds themselves are valid (otherwise every mutation would fail for the wrong reason)."""
    assert plan_from_yaml(_yaml_text(PLAN_DATA)) == _make_plan()
    assert loads_profile(PROFILE_TEXT) == load_builtin("dgx-a100-80gb")


def test_mutations_are_detected_with_the_field_named() -> None:
    """A few deterministic mutations: the error names exactly the field that was broken."""
    cases = [(("mesh", "dp"), "four", "mesh.dp"), (("stages", 1, "modules"), 7, "stages.1.modules"),
             (("solver", "status"), "done", "solver.status")]
    for path, value, field in cases:
        data = copy.deepcopy(PLAN_DATA)
        node = data
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        with pytest.raises(SchemaError) as ei:
            plan_from_yaml(_yaml_text(data))
        assert ei.value.field == field, str(ei.value)
    prof = copy.deepcopy(PROFILE_DATA)
    prof["links"]["intra_node"]["all_gather"][0]["busbw"] = -1
    with pytest.raises(ProfileError, match=r"^links\.intra_node\.all_gather\[0\]\.busbw: expected a positive"):
        loads_profile(_yaml_text(prof))


# --- regressions: loader bugs this file found (ints beyond float range, an empty unknown key, deep nesting) ---

def test_huge_integer_in_plan_float_field() -> None:
    data = copy.deepcopy(PLAN_DATA)
    data["time"]["compute"] = 10**400
    with pytest.raises(SchemaError, match="time.compute"):
        plan_from_yaml(_yaml_text(data))


def test_huge_integer_in_profile_number() -> None:
    data = copy.deepcopy(PROFILE_DATA)
    data["device"]["memory_bandwidth"] = 10**400
    with pytest.raises(ProfileError, match="device.memory_bandwidth"):
        loads_profile(_yaml_text(data))


def test_empty_unknown_key_is_named() -> None:
    data = copy.deepcopy(PLAN_DATA)
    data[""] = 1
    with pytest.raises(SchemaError) as ei:
        plan_from_yaml(_yaml_text(data))
    assert ei.value.field, str(ei.value)


@pytest.mark.parametrize("loader", [plan_from_yaml, loads_profile], ids=["plan", "profile"])
def test_deeply_nested_yaml(loader: Any) -> None:
    with pytest.raises((SchemaError, ProfileError)):
        loader("[" * 5000)


def test_plan_dataclass_fields_all_reachable() -> None:
    """Guard for the mutation strategy: the seed plan sets every top-level Plan field that YAML carries."""
    names = {f.name for f in dataclasses.fields(Plan) if f.init}
    assert names == set(PLAN_DATA), names ^ set(PLAN_DATA)


def test_empty_unknown_profile_key_is_named() -> None:
    data = copy.deepcopy(PROFILE_DATA)
    data[""] = None
    with pytest.raises(ProfileError) as ei:
        loads_profile(_yaml_text(data))
    head, _, problem = str(ei.value).partition(": ")
    assert head and problem.startswith("unknown key"), str(ei.value)
