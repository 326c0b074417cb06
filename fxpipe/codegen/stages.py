"""One stage of a plan as Python source: ``class Stage{k}(nn.Module)``.

A stage is the sub-graph of the plan's nodes for stage k, cut out of the fine
graph and printed with torch.fx's own code generator, so the body reads like
fx code: one statement per op, the graph's node names, dead values freed.

    INPUTS   values the stage receives (graph inputs or earlier stages' outputs)
    OUTPUTS  values it produces that a later stage reads or the model returns
    WRITES   (only where there are some) graph inputs it writes in place
    __init__ binds the submodules, parameters and buffers it reads from the
             original model under their original qualified names
    forward  takes INPUTS by name and returns a tuple in OUTPUTS order

get_attr nodes (parameters, buffers) are never communicated: every stage that
reads one binds it. The body of a higher-order op (export's
``wrap_with_set_grad_enabled(False, submod_1, ...)``) is printed as a small
module class in the same file.

The stage's ops become a graph of their own in ``subgraph.py``, and fx's code for it
becomes the lines of a hand-written ``forward`` in ``statements.py``, and the model's
own functions it calls are named in ``wrapped.py``; this module checks the plan against
the graph and writes the file around them: the docstring, the imports, the class and its
``__init__``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from fxpipe import meta
from fxpipe.codegen.batch_sizes import BatchDims
from fxpipe.codegen.errors import PlanError
from fxpipe.codegen.imports import import_lines
from fxpipe.codegen.local_shards import HELPERS, LocalStage, local_shape, write_local
from fxpipe.codegen.statements import Index, forward_lines, names_in
from fxpipe.codegen.subgraph import follow_stage_device, sub_graph
from fxpipe.codegen.wrap import LINE_LENGTH, wrap_line
from fxpipe.codegen.wrapped import wrapped_functions
from fxpipe.cut import StageIO, cut_stages
from fxpipe.passes.aliasing import written_inputs
from fxpipe.plan import Plan

__all__ = ["LINE_LENGTH", "PlanError", "stage_io", "stage_source", "wrap_line"]


# ---------------------------------------------------------------------------- the cut


def stage_io(graph: torch.fx.Graph, plan: Plan) -> list[StageIO]:
    """Check ``plan`` against ``graph``, then cut it (``fxpipe.cut``): what every stage
    runs, receives and sends."""
    stage_of = plan.stage_of()
    ops = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    names = {n.name for n in ops}
    missing = [n.name for n in ops if n.name not in stage_of]
    unknown = sorted(set(stage_of) - names)
    if missing or unknown:
        raise PlanError(
            f"the plan does not cover the traced graph: {len(missing)} graph nodes in no stage "
            f"(first: {missing[:3]}), {len(unknown)} plan nodes not in the graph (first: "
            f"{unknown[:3]}); partition this traced graph again"
        )
    if sorted({s.index for s in plan.stages}) != list(range(plan.num_stages)):
        raise PlanError(
            f"stage indices {[s.index for s in plan.stages]} are not 0..{plan.num_stages - 1}"
        )
    for node in ops:
        for arg in node.all_input_nodes:
            if arg.op in ("placeholder", "get_attr"):
                continue
            if stage_of[arg.name] > stage_of[node.name]:
                raise PlanError(
                    f"node {node.name!r} (stage {stage_of[node.name]}) reads {arg.name!r} "
                    f"(stage {stage_of[arg.name]}): stage indices must never decrease along "
                    "an edge"
                )
    return cut_stages(graph, stage_of, plan.num_stages)



# ---------------------------------------------------------------------------- the source


def stage_source(
    gm: torch.fx.GraphModule,
    io: StageIO,
    fixed: Mapping[str, tuple[int | None, ...]] | None = None,
    dims: BatchDims | None = None,
    model: torch.nn.Module | None = None,
    by_name: Mapping[str, torch.fx.Node] | None = None,
    local: LocalStage | None = None,
) -> str:
    """The text of ``stage{k}.py`` for one stage of ``gm``.

    ``fixed``: graph input name -> the shape the graph was traced at, None where a
    dimension may vary. The stage checks each such input it receives on entry, so a
    shape the traced graph holds as a constant fails with one line naming both shapes
    rather than deep inside an aten op. ``dims``: the graph's batch dimension
    (batch_sizes.py; default: read from ``gm``), by which the stage recomputes on entry
    the batch counts it receives and lists the values it passes that have none.
    ``model``: the model traced, through whose classes the stage finds the functions of
    a model file it cannot import (``wrapped.py``; default: ``gm``'s). ``by_name``:
    ``gm``'s nodes by name (default: made here; the package makes it once for all stages).
    ``local``: what the stage runs split over t GPUs, its tensor-parallel pairs on each
    rank's share (``local_shards.py``; None where the plan's t is 1).
    """
    dims = dims or BatchDims.of(gm.graph, None, ())
    by_name = by_name if by_name is not None else {n.name: n for n in gm.graph.nodes}
    sub = sub_graph(gm.graph, io, by_name)
    written = written_inputs(gm, (by_name[name] for name in io.nodes))
    checks = [(name, (fixed or {})[name]) for name in io.inputs if name in (fixed or {})]
    # the stage's values: its nodes and what it receives
    own = (by_name[n.name] for n in sub.nodes if n.name in by_name)
    shapes = {n.name: _shape_comment(n) for n in own if meta.SHAPE.has(n)}
    binding = _binding(gm, sub)
    readable = _state_reads(gm, sub)
    local = local or LocalStage()
    for pair in local.pairs:  # the values between a pair: this rank's share
        shapes.update({name: local_shape(meta.SHAPE.get(by_name[name]).tensors, dim)
                       for name, dim in pair.dims.items() if name in pair.inside})
    shapes.update({name: local_shape(meta.SHAPE.get(by_name[name]).tensors, dim)  # its tokens
                   for name, dim in local.tokens.ops.items()})
    write_local(sub, local, lambda name: _is_tensor(by_name[name]))
    code = sub.python_code(root_module="self")
    code_src, code_globals = _helpers_by_name(code.src, code.globals)
    src, globals_, functions = wrapped_functions(
        code_src, code_globals, (gm if model is None else model).named_modules(), binding.paths)
    renamed = {name: value for name, (value, _) in functions.items()}
    entry = [f'        check_shape("Stage{io.index}", "{name}", {name}, {shape!r})'
             for name, shape in checks] + dims.recount_lines(io)
    forward, names = forward_lines(src, io, shapes, readable, renamed=renamed,
                                   entry=entry, index=_indexing(gm, binding.paths))
    header_names = set(names) - set(functions)
    header_names |= {own.rpartition(".")[0] or own for own, lookup in functions.values()
                     if not lookup}
    for body in binding.bodies:
        header_names |= names_in(body)
    lines = [
        *_module_docstring(io),
        "",
        *import_lines(globals_, header_names),
        *_bind_helper(binds=bool(binding.paths), checks=bool(checks),
                      helpers=[name for name in HELPERS if name in names]),
    ]
    for body in binding.bodies:
        lines += ["", "", body]
    header = _class_header(io, binding, functions, written, dims.unbatched(io),
                           bool(local.pairs or local.tokens.ops))
    lines += ["", "", *header, "", *forward]
    return "\n".join(lines).rstrip() + "\n"


@dataclass(frozen=True)
class _Binding:
    """What a stage's ``__init__`` sets up: the model's paths it binds (none under
    another: a path under a bound module is bound with it), and the higher-order-op
    bodies it constructs (their classes, and the lines that make them)."""

    paths: list[str]
    bodies: list[str]
    inits: list[str]


def _binding(gm: torch.fx.GraphModule, sub: torch.fx.Graph) -> _Binding:
    bodies: list[str] = []  # classes of higher-order-op bodies
    bind: list[str] = []  # paths bound from the model
    inits: list[str] = []  # body modules constructed
    modules = sorted(
        {str(n.target) for n in sub.nodes if n.op == "call_module"}, key=lambda p: p.split(".")
    )
    for node in sub.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        value = _resolve(gm, target)
        if isinstance(value, torch.fx.GraphModule):
            class_name = "_" + "".join(p.capitalize() for p in re.split(r"[._]", target) if p)
            if f"self.{target} = {class_name}()" not in inits:
                bodies.append(_body_class(value, class_name, target))
                inits.append(f"self.{target} = {class_name}()")
        elif target not in bind:
            bind.append(target)
    paths: list[str] = []
    for path in modules + sorted(bind, key=lambda p: p.split(".")):
        if not any(path.startswith(m + ".") or path == m for m in paths):
            paths.append(path)
    return _Binding(paths, bodies, inits)


def _indexing(gm: torch.fx.GraphModule, paths: list[str]) -> Index:
    """How the stage reads a child whose name is not an identifier (``blocks.0``, a
    ModuleDict's "key"): by index where the module holding it supports one.

    The stage itself is a plain module: ``self.get_submodule("0")``. A module on the way
    to a bound path is the runtime's ``Container``, which indexes its children by name:
    ``self.blocks[0]``, ``self.layers["key"]``. A module at or under a bound path is the
    model's own: a ModuleList, Sequential or ParameterList indexes by position (used where
    the position is the name), a ModuleDict or ParameterDict by key, anything else not
    at all."""

    def index(parent: str, name: str) -> str | None:
        if not parent:
            return None
        if not any(parent == path or parent.startswith(path + ".") for path in paths):
            return f"[{name}]" if _is_index(name) else f"[{json.dumps(name)}]"
        owner = gm.get_submodule(parent)
        if isinstance(owner, torch.nn.ModuleDict | torch.nn.ParameterDict):
            return f"[{json.dumps(name)}]"
        if isinstance(owner, torch.nn.ModuleList | torch.nn.Sequential):
            children = list(owner._modules)
        elif isinstance(owner, torch.nn.ParameterList):
            children = list(owner._parameters)
        else:
            return None
        at = children.index(name) if name in children else -1
        return f"[{name}]" if _is_index(name) and at == int(name) else None

    return index


def _is_index(name: str) -> bool:
    """``name`` is how ``str`` writes a non-negative int (as a ModuleList names its items)."""
    return name.isdecimal() and name.isascii() and str(int(name)) == name


def _state_reads(gm: torch.fx.GraphModule, sub: torch.fx.Graph) -> dict[str, str]:
    """Each parameter or buffer the stage reads by its full name: fx prints blocks.0.x as
    getattr(self.blocks, "0").x; say it by name."""
    readable = {}
    for node in sub.nodes:
        if node.op == "get_attr":
            value = _resolve(gm, str(node.target))
            if isinstance(value, torch.nn.Parameter):
                readable[node.name] = f"self.get_parameter({json.dumps(node.target)})"
            elif isinstance(value, torch.Tensor):
                readable[node.name] = f"self.get_buffer({json.dumps(node.target)})"
    return readable


def _module_docstring(io: StageIO) -> list[str]:
    doc_in = ", ".join(io.inputs) or "nothing"
    doc_out = ", ".join(io.outputs) or "nothing"
    return [
        f'"""Stage {io.index} of the pipeline, generated by fxpipe.',
        "",
        *_wrap_words(f"Receives: {doc_in}.", LINE_LENGTH),
        *_wrap_words(f"Returns: ({doc_out}).", LINE_LENGTH),
        '"""',
    ]


def _class_header(io: StageIO, binding: _Binding, functions: dict[str, tuple[str, str]],
                  written: tuple[str, ...], unbatched: tuple[str, ...], local: bool = False
                  ) -> list[str]:
    """``class Stage{k}``: its INPUTS and OUTPUTS (and WRITES, and where it runs pairs on
    local shares ``tp`` and ``tp_mesh``), and ``__init__`` binding the model's objects,
    constructing the bodies, and looking up the model file's wrapped functions."""
    lines = [
        f"class Stage{io.index}(nn.Module):",
        *_tuple_attr("INPUTS", io.inputs),
        *_tuple_attr("OUTPUTS", io.outputs),
    ]
    if written:  # a recomputed forward must start from the values before the write
        lines += ["    # graph inputs this stage writes in place", *_tuple_attr("WRITES", written)]
    if unbatched:  # a replica takes them whole, not a share of their rows
        lines += ["    # values without a batch dimension", *_tuple_attr("UNBATCHED", unbatched)]
    if local:  # runtime/tensor_parallel.py's split_stage sets them
        lines += ["    # the GPUs of a host this stage's tensor-parallel pairs split over, and",
                  "    # their mesh: split_stage sets them; 1 and None run the stage whole",
                  "    tp = 1", "    tp_mesh = None"]
    lines += [
        "",
        "    def __init__(self, model: nn.Module) -> None:",
        "        super().__init__()",
    ]
    for path in binding.paths:
        lines += wrap_line(f"        bind(self, model, {json.dumps(path)})", LINE_LENGTH)
    for init in binding.inits:
        lines.append(f"        {init}")
    lookups = [(name, lookup) for name, (_, lookup) in sorted(functions.items()) if lookup]
    kinds = {"its autograd.Functions" if call.endswith(".apply") else "its torch.fx.wrap functions"
             for call, lookup in functions.values() if lookup}
    if kinds:
        lines.append(f"        # from the model file: {' and '.join(sorted(kinds, reverse=True))}")
    for _, lookup in lookups:
        lines += wrap_line(f"        {lookup}", LINE_LENGTH)
    return lines


def _resolve(gm: torch.fx.GraphModule, target: str) -> object:
    owner = gm
    *path, leaf = target.split(".")
    for part in path:
        owner = getattr(owner, part)
    return getattr(owner, leaf)


def _tuple_attr(name: str, values: tuple[str, ...]) -> list[str]:
    if not values:
        return [f"    {name} = ()"]
    items = ", ".join(f'"{v}"' for v in values)
    one = f"    {name} = ({items},)" if len(values) == 1 else f"    {name} = ({items})"
    if len(one) <= LINE_LENGTH:
        return [one]
    return [f"    {name} = (", *(f'        "{v}",' for v in values), "    )"]


def _bind_helper(*, binds: bool = True, checks: bool = False,
                 helpers: Sequence[str] = ()) -> list[str]:
    """The import of the runtime's ``bind``, which a stage uses to hold the model's own
    parameters, buffers and modules under their original names (none for a stage of
    parameter-free ops), ``check_shape`` where the stage checks a graph input's fixed
    dimensions, and the ``helpers`` its tensor-parallel pairs call (``local_shards.py``)."""
    names = [name for name, used in (("bind", binds), ("check_shape", checks)) if used]
    names += helpers
    return ["", f"from .runtime import {', '.join(names)}"] if names else []


def _body_class(body: torch.fx.GraphModule, class_name: str, target: str) -> str:
    """The class of a higher-order op's body, after the classes of the bodies nested in
    it (a ``no_grad`` region around an ``enable_grad`` one), which it constructs."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nested: list[str] = []  # classes of the bodies this one calls
    inits: list[str] = []
    for node in body.graph.nodes:
        if node.op == "get_attr":
            value = _resolve(body, str(node.target))
            if not isinstance(value, torch.fx.GraphModule):
                raise PlanError(
                    f"the body {target!r} of a higher-order op reads attribute "
                    f"{node.target!r}; fxpipe cannot print such bodies yet"
                )
            parts = re.split(r"[._]", str(node.target))
            inner = class_name + "".join(p.capitalize() for p in parts if p)
            init = f"        self.{node.target} = {inner}()"
            if init not in inits:
                nested.append(_body_class(value, inner, f"{target}.{node.target}"))
                inits.append(init)
        if node.op == "call_function" and not node.users and _is_assert(node):
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    for node in graph.nodes:
        node.type = None
    follow_stage_device(graph, {copy.name: original for original, copy in env.items()})
    code = graph.python_code(root_module="self")
    io = StageIO(-1, (), (), ())
    lines, _ = forward_lines(code.src, io, {}, doc="The body of a higher-order op, as traced.")
    if inits:
        lines[:0] = ["    def __init__(self) -> None:", "        super().__init__()", *inits,
                     ""]
    return "\n\n\n".join([*nested, "\n".join([f"class {class_name}(nn.Module):", *lines])])


def _helpers_by_name(src: str, globals_: dict[str, object]) -> tuple[str, dict[str, object]]:
    """fx's code with the runtime's tensor-parallel functions called by their own names
    (fx names a global by its module's path), which the stage imports from ``.runtime``."""
    for qualified, value in list(globals_.items()):
        helper = getattr(value, "__name__", "")
        if helper in HELPERS and qualified == (
                f"{getattr(value, '__module__', '').replace('.', '_')}_{helper}"):
            src = re.sub(rf"\b{qualified}\b", helper, src)
            del globals_[qualified]
    return src, globals_


def _is_tensor(node: torch.fx.Node) -> bool:
    return meta.SHAPE.has(node) and bool(meta.SHAPE.get(node).tensors)


def _is_assert(node: torch.fx.Node) -> bool:
    return node.target is torch.ops.aten._assert_tensor_metadata.default


def _shape_comment(node: torch.fx.Node) -> str:
    info = meta.SHAPE.get(node)
    if not info.tensors or len(info.tensors) > 3:
        return ""
    return ", ".join(
        f"{t.dtype}[{', '.join(str(d) for d in t.shape)}]" for t in info.tensors
    )


# ---------------------------------------------------------------------------- words


def _wrap_words(text: str, limit: int) -> list[str]:
    lines: list[str] = []
    current = ""
    for word in text.split(" "):
        if current and len(current) + 1 + len(word) > limit:
            lines.append(current)
            current = "    " + word
        else:
            current = f"{current} {word}" if current else word
    lines.append(current)
    return lines

