"""Front ends: lift an ``nn.Module`` into an :class:`autopar.ir.Graph` without materializing any weight.

Two front ends produce the same IR:

* ``fx``: ``torch.fx.symbolic_trace`` then FakeTensor shape propagation.  Fast (a 96-layer GPT-3 in seconds) and keeps
  ``nn.Linear``/``nn.LayerNorm`` as single ops; fails on data-dependent Python control flow.
* ``export``: ``torch.export.export(strict=False)``, robust on real-world models (Hugging Face transformers...),
  slower; produces ATen ops, mapped onto the same canonical names.

``frontend="auto"`` tries ``fx`` first and falls back to ``export``; if both fail the error names the module and
source line that stopped each front end and both front ends' reasons.

Tracing is the ``capture`` step of the pass pipeline (:mod:`autopar.ir.passes.pipeline`); :func:`trace` then runs the
pipeline's passes (``group``, and ``decompose``/``fuse`` when :class:`~autopar.ir.passes.PassOptions` selects them),
verifying the IR after each.

Example inputs may be real tensors (on any device), meta tensors, or :class:`TensorSpec` shape specs.  Shapes are
propagated with FakeTensors, so a 175B-parameter model built on the meta device traces on a laptop.
"""

from __future__ import annotations

import contextlib
import io
import logging
import traceback
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Literal, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autopar.ir.errors import ExampleInputError, TraceError
from autopar.ir.graph import Graph, Node, ParamInfo, TensorMeta
from autopar.ir.inputs import normalize
from autopar.ir.opaque import OpaquePropagation, opaque_flops, trace_isolating
from autopar.ir.ops import OpKind, canonical_op, op_cost
from autopar.ir.passes.pipeline import PassOptions, default_pipeline, run_passes, verify_after

__all__ = ["TensorSpec", "trace", "Frontend"]

log = logging.getLogger(__name__)

Frontend = Literal["auto", "fx", "export"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """An example input given by shape and dtype only (no data)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not all(isinstance(s, int) and s >= 0 for s in self.shape):
            raise ValueError(f"TensorSpec.shape must be non-negative ints, got {self.shape!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta_of(v: Any) -> TensorMeta | None:
    if isinstance(v, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in v.shape), _dtype_name(v.dtype))
    return None


def _outputs_of(v: Any) -> tuple[TensorMeta, ...]:
    m = _meta_of(v)
    if m is not None:
        return (m,)
    if isinstance(v, (tuple, list)):
        metas = tuple(_meta_of(x) for x in v)
        if metas and all(x is not None for x in metas):
            return metas  # type: ignore[return-value]
        # mixed tuples (e.g. max returns values+indices) keep their tensor entries
        return tuple(x for x in metas if x is not None)
    return ()


def _model_device(model: torch.nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _as_tensors(example_inputs: Sequence[Any], device: torch.device) -> list[Any]:
    out: list[Any] = []
    for x in example_inputs:
        if isinstance(x, TensorSpec):
            out.append(torch.empty(x.shape, dtype=x.dtype, device="meta"))
        elif isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, torch.Size) or (isinstance(x, (tuple, list)) and all(isinstance(s, int) for s in x)):
            out.append(torch.empty(tuple(x), device="meta"))
        else:
            out.append(x)
    if device.type != "meta":
        # a real model with meta/spec inputs: give export real (small) inputs on the model's device
        out = [torch.zeros(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor)
               and x.device.type == "meta" else x for x in out]
    return out


# ---- parameter naming ------------------------------------------------------------------------------------------
def _param_table(model: torch.nn.Module) -> tuple[tuple[ParamInfo, ...], dict[str, str]]:
    """All parameters and buffers, by canonical name; plus alias FQN -> canonical FQN (tied weights)."""
    canon: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    infos: list[tuple[str, torch.Tensor, str]] = []
    alias_of: dict[str, str] = {}
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            key = id(t)
            if key in canon:
                aliases[canon[key]].append(name)
                alias_of[name] = canon[key]
                continue
            canon[key] = name
            aliases[name] = []
            alias_of[name] = name
            infos.append((name, t, kind))
    params = tuple(ParamInfo(name, TensorMeta(tuple(t.shape), _dtype_name(t.dtype)), kind,  # type: ignore[arg-type]
                             tuple(aliases[name])) for name, t, kind in infos)
    return params, alias_of


# ---- fx front end ----------------------------------------------------------------------------------------------
def _fx_op_name(node: fx.Node, gm: fx.GraphModule) -> tuple[str, str]:
    """(front-end name, readable target) of an fx node."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return type(mod).__name__, f"{type(mod).__module__}.{type(mod).__name__}"
    if node.op == "call_method":
        return str(node.target), f"Tensor.{node.target}"
    tgt = node.target
    if isinstance(tgt, torch._ops.OpOverload):
        return tgt._opname, str(tgt)
    name = getattr(tgt, "__name__", str(tgt))
    return name, f"{getattr(tgt, '__module__', '') or ''}.{name}".lstrip(".")


def _attrs_of(node: fx.Node, op: str, gm: fx.GraphModule | None) -> tuple[tuple[str, Any], ...]:
    simple = (int, float, bool, str, type(None))
    attrs: dict[str, Any] = {}
    pos = [a for a in node.args if not isinstance(a, fx.Node)]
    flat_pos: list[Any] = []
    for a in pos:
        if isinstance(a, simple):
            flat_pos.append(a)
        elif isinstance(a, (tuple, list)) and all(isinstance(x, simple) for x in a):
            flat_pos.append(tuple(a))
        elif isinstance(a, torch.dtype):
            flat_pos.append(_dtype_name(a))
    if flat_pos:
        attrs["args"] = tuple(flat_pos)
    for k, v in node.kwargs.items():
        if isinstance(v, simple):
            attrs[k] = v
        elif isinstance(v, (tuple, list)) and all(isinstance(x, simple) for x in v):
            attrs[k] = tuple(v)
        elif isinstance(v, torch.dtype):
            attrs[k] = _dtype_name(v)
    if op == "einsum" and node.args and isinstance(node.args[0], str):
        attrs["equation"] = node.args[0]
    if gm is not None and node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        for k in ("in_features", "out_features", "num_embeddings", "embedding_dim", "stride", "padding",
                  "groups", "eps", "p"):
            v = getattr(mod, k, None)
            if isinstance(v, simple) or (isinstance(v, tuple) and all(isinstance(x, simple) for x in v)):
                attrs[k] = v
    return tuple(sorted(attrs.items()))


def _module_of(node: fx.Node, gm: fx.GraphModule | None) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, typ = list(stack.values())[-1]
        path = str(path)
        # export sometimes spells paths like "L['self'].blocks[0]"; normalise to FQN form
        path = path.replace("L['self'].", "").replace("L['self']", "")
        path = path.replace("[", ".").replace("]", "").replace("'", "")
        tname = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
        return path, tname.rsplit(".", 1)[-1]
    if gm is not None and node.op == "call_module":
        return str(node.target), type(gm.get_submodule(str(node.target))).__name__
    return "", ""


def _flatten_inputs(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: out.append(n))  # type: ignore[arg-type,func-returns-value]
    return out


def _build_graph(gm: fx.GraphModule, model: torch.nn.Module, frontend: Literal["fx", "export"],
                 name_of_placeholder: dict[str, str], input_names: list[str], model_name: str,
                 use_module_calls: bool, constants: dict[str, Any] | None = None) -> Graph:
    params, alias_of = _param_table(model)
    # tensors a forward builds from Python data (torch.tensor(...)), lifted by torch.export: constant buffers
    params += tuple(ParamInfo(name, meta, "buffer") for name, t in (constants or {}).items()
                    if name not in alias_of and (meta := _meta_of(t)) is not None)
    pmeta = {p.name: p.meta for p in params}
    value_name: dict[fx.Node, str] = {}   # fx node -> IR value name (node name or param FQN)
    metas: dict[str, TensorMeta | None] = dict(pmeta)
    nodes: list[Node] = []
    unknown: dict[str, None] = {}
    outputs: list[str] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            fqn = name_of_placeholder.get(n.name)
            if fqn is not None:
                value_name[n] = alias_of.get(fqn, fqn)
                continue
            outs = _outputs_of(n.meta.get("val"))
            if not outs:
                continue
            value_name[n] = n.name
            metas[n.name] = outs[0]
            nodes.append(Node(n.name, "input", OpKind.INPUT, (), outs, target="input"))
            continue
        if n.op == "get_attr":
            fqn = alias_of.get(str(n.target), str(n.target))
            value_name[n] = fqn
            if fqn not in metas:
                metas[fqn] = _meta_of(n.meta.get("val"))
            continue
        if n.op == "output":
            for a in _flatten_inputs(n):
                if a in value_name:
                    outputs.append(value_name[a])
            continue
        outs = _outputs_of(n.meta.get("val"))
        if not outs:
            continue  # shape arithmetic (x.size(), getattr) carries no tensor
        raw, target = _fx_op_name(n, gm)
        op = canonical_op(raw)
        args = [a for a in _flatten_inputs(n) if a in value_name]
        inputs = [value_name[a] for a in args]
        if use_module_calls and n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            for pname, _ in mod.named_parameters(recurse=True):
                fq = alias_of.get(f"{n.target}.{pname}", f"{n.target}.{pname}")
                inputs.append(fq)
        ins = [metas.get(i) for i in inputs]
        attrs = _attrs_of(n, op, gm if n.op == "call_module" else None)
        kind, ffwd, fbwd, br, bw = op_cost(op, ins, outs, dict(attrs))
        if kind == OpKind.UNKNOWN:
            unknown[target] = None
            op = raw
        path, mtype = _module_of(n, gm if frontend == "fx" else None)
        pset = tuple(dict.fromkeys(i for i in inputs if i in pmeta))
        nodes.append(Node(n.name, op, kind, tuple(inputs), outs, path, mtype, pset, ffwd, fbwd, br, bw, attrs,
                          target))
        value_name[n] = n.name
        metas[n.name] = outs[0]
    return Graph(tuple(nodes), params, tuple(input_names), tuple(dict.fromkeys(outputs)),
                 unknown_ops=tuple(unknown), frontend=frontend, model_name=model_name)


def _user_frame(exc: BaseException, model: torch.nn.Module) -> str:
    """'module blocks.2 (Block) at file.py:12: `if x.sum() > 0:`' for the innermost model frame of a traceback."""
    paths = {id(m): p for p, m in model.named_modules()}
    found = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        self_obj = frame.f_locals.get("self")
        if isinstance(self_obj, torch.nn.Module) and id(self_obj) in paths:
            code = traceback.FrameSummary(frame.f_code.co_filename, lineno, frame.f_code.co_name).line or ""
            p = paths[id(self_obj)] or "<root>"
            found = (f"module '{p}' ({type(self_obj).__name__}) at {frame.f_code.co_filename.rsplit('/', 1)[-1]}"
                     f":{lineno}: `{code.strip()}`")
    return found


def _first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"


def _trace_fx(model: torch.nn.Module, inputs: list[Any], model_name: str, isolate: bool = False) -> Graph:
    """The fx front end; ``isolate=True`` makes the submodules that stop the tracer opaque (:mod:`autopar.ir.opaque`)."""
    leaves: dict[str, str] = {}
    try:
        gm, leaves = trace_isolating(model) if isolate else (fx.symbolic_trace(model), {})
    except Exception as e:  # noqa: BLE001 - every front-end failure becomes a TraceError with its reason
        raise TraceError("fx", _first_line(e), _user_frame(e, model)) from e
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        with torch.no_grad():
            (OpaquePropagation(gm, mode, leaves) if leaves else FakeTensorProp(gm, mode)).propagate(*fakes)
    except Exception as e:  # noqa: BLE001
        where = _failing_fx_node(gm, placeholders, e)
        raise ExampleInputError("fx", _first_line(e), where, _describe_inputs(inputs)) from e
    graph = _build_graph(gm, model, "fx", {}, [p.name for p in placeholders][:len(inputs)], model_name, True)
    return _mark_opaque(graph, gm, model, leaves) if leaves else graph


def _mark_opaque(graph: Graph, gm: fx.GraphModule, model: torch.nn.Module, leaves: dict[str, str]) -> Graph:
    """Leaf calls of opaque submodules become ``opaque`` nodes with estimated FLOPs (not unknown ops)."""
    at = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "call_module" and str(n.target) in leaves}
    types = {type(model.get_submodule(p)).__name__ for p in leaves}
    nodes = []
    for n in graph.nodes:
        if n.name in at:
            sub = model.get_submodule(at[n.name])
            fwd, bwd = opaque_flops(sum(p.numel() for p in sub.parameters()), n.outputs)
            n = replace(n, op="opaque", kind=OpKind.UNKNOWN, flops_fwd=fwd, flops_bwd=bwd)
        nodes.append(n)
    unknown = tuple(u for u in graph.unknown_ops if u.rsplit(".", 1)[-1] not in types)
    return replace(graph, nodes=tuple(nodes), unknown_ops=unknown, opaque=tuple(leaves.items()))


def _failing_fx_node(gm: fx.GraphModule, placeholders: list[fx.Node], exc: BaseException) -> str:
    last_ok = None
    for n in gm.graph.nodes:
        if "val" not in n.meta and n.op not in ("placeholder", "output", "get_attr"):
            stack = n.meta.get("nn_module_stack") or {}
            path = list(stack.values())[-1][0] if stack else (str(n.target) if n.op == "call_module" else "")
            tgt = _fx_op_name(n, gm)[0]
            return f"op '{tgt}' (node {n.name}) in module '{path or '<root>'}'"
        last_ok = n
    return f"after node {last_ok.name}" if last_ok is not None else ""


def _describe_inputs(inputs: Iterable[Any]) -> str:
    parts = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"{_dtype_name(x.dtype)}{list(x.shape)}")
        else:
            parts.append(type(x).__name__)
    return ", ".join(parts)


def _trace_export(model: torch.nn.Module, inputs: list[Any], model_name: str,
                  kwargs: dict[str, Any] | None = None) -> Graph:
    try:
        ep = torch.export.export(model, tuple(inputs), kwargs or {}, strict=False)
    except Exception as e:  # noqa: BLE001
        msg = _first_line(e)
        where = _user_frame(e, model)
        low = str(e).lower()
        if any(s in low for s in ("size mismatch", "shapes cannot be multiplied", "expected input", "must match",
                                  "dtype", "shape '[", "is invalid for input of size")) and \
                "data-dependent" not in low:
            raise ExampleInputError("export", msg, where, _describe_inputs([*inputs, *(kwargs or {}).values()])) from e
        raise TraceError("export", msg, where) from e
    sig = ep.graph_signature
    placeholder_fqn: dict[str, str] = {}
    placeholder_fqn.update(sig.inputs_to_parameters)
    placeholder_fqn.update(sig.inputs_to_buffers)
    placeholder_fqn.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    user_inputs = [s for s in sig.user_inputs if s is not None]  # an omitted optional input (None) is a constant
    gm = ep.graph_module
    constants = {k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}
    return _build_graph(gm, model, "export", placeholder_fqn, list(user_inputs), model_name, False, constants)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Torch's loggers dump graphs and tracebacks to stderr when a capture fails (some are created lazily, with their
    own handlers, and torch.export print()s the graph): our error says it all, so logging is disabled and stderr set
    aside while a front end runs, and both restored afterwards."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # torch.export also print()s the failing graph to stderr
            yield
    finally:
        logging.disable(previous)


def trace(model: torch.nn.Module, example_inputs: Sequence[Any] | Any, *, frontend: Frontend = "auto",
          model_name: str = "", passes: PassOptions | None = None) -> Graph:
    """Lift ``model`` into an :class:`autopar.ir.Graph`: capture, then the pass pipeline (layer groups always;
    the optional passes ``passes`` selects, none by default), with ``autopar.ir.verify`` after each step.

    ``example_inputs`` is one input, a tuple of positional ones, or a dict of keyword ones (Hugging Face style, see
    :mod:`autopar.ir.inputs`; ``None`` for an omitted optional input): real tensors, meta tensors,
    :class:`TensorSpec`, or plain shape tuples (float32).  Keyword or ``None`` inputs are captured with torch.export.  ``frontend`` picks ``"fx"`` (symbolic_trace), ``"export"`` (torch.export) or ``"auto"`` (fx,
    falling back to export).  Raises :class:`autopar.ir.TraceError` when no front end captures the model and
    :class:`autopar.ir.ExampleInputError` when the example inputs do not fit it.  Never mutates or materializes
    ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"trace() needs an nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, (torch.Tensor, TensorSpec)):
        example_inputs = (example_inputs,)
    if frontend not in ("auto", "fx", "export"):
        raise ValueError(f"frontend must be 'auto', 'fx' or 'export', got {frontend!r}")
    name = model_name or type(model).__name__
    args, kwargs = normalize(example_inputs)
    device = _model_device(model)
    args = _as_tensors(list(args), device)
    kwargs = dict(zip(kwargs, _as_tensors(list(kwargs.values()), device)))
    with _quiet_torch_logs():
        graph = _trace_with(model, args, kwargs, name, frontend)
    if graph.unknown_ops:
        log.warning("costed %d unknown op(s) by bytes only: %s", len(graph.unknown_ops), ", ".join(graph.unknown_ops))
    module_types = {p: type(m).__name__ for p, m in model.named_modules()}
    return run_passes(verify_after("capture", graph), default_pipeline(passes, module_types=module_types))


def _trace_with(model: torch.nn.Module, inputs: list[Any], kwargs: dict[str, Any], name: str,
                frontend: Frontend) -> Graph:
    if kwargs or any(x is None for x in inputs):  # keyword or omitted optional inputs: only export binds them
        if frontend == "fx":
            raise TraceError("fx", "symbolic_trace takes positional tensor inputs only; use frontend='export' for "
                             "keyword or None inputs", "")
        return _trace_export(model, inputs, name, kwargs)
    if frontend == "fx":
        return _trace_fx(model, inputs, name)
    if frontend == "export":
        return _trace_export(model, inputs, name)
    try:
        return _trace_fx(model, inputs, name)
    except ExampleInputError as fx_err:
        # fx captured the model but shapes did not propagate: export can only help if fx mis-traced something;
        # when it fails too, fx's error (which names the exact node) is the one to show
        try:
            return _trace_export(model, inputs, name)
        except TraceError:
            raise fx_err from None
    except TraceError as fx_err:
        log.info("fx front end failed (%s); trying torch.export", fx_err.reason)
        try:
            return _trace_export(model, inputs, name)
        except TraceError as ex_err:
            try:  # the submodules that stop fx become opaque regions, when the failure is inside one
                graph = _trace_fx(model, inputs, name, isolate=True)
            except (TraceError, ExampleInputError):
                raise TraceError.combine(fx_err, ex_err) from None
            log.warning("captured with %d opaque region(s), run replicated: %s", len(graph.opaque),
                        "; ".join(f"{p} ({why})" for p, why in graph.opaque))
            return graph
