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
"""

from __future__ import annotations

import ast
import builtins
import inspect
import io
import math
import re
import sys
import textwrap
import tokenize
import types
from collections.abc import Mapping

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fxpipe import meta
from fxpipe.codegen.wrap import LINE_LENGTH, wrap_line
from fxpipe.cut import StageIO, cut_stages
from fxpipe.lower import written_inputs
from fxpipe.plan import Plan

__all__ = ["LINE_LENGTH", "PlanError", "stage_io", "stage_source", "wrap_line"]

class PlanError(ValueError):
    """The plan does not fit the traced graph."""


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


def _sub_graph(graph: torch.fx.Graph, io: StageIO) -> torch.fx.Graph:
    """The stage's ops as a graph of their own: INPUTS in, OUTPUTS out, names kept."""
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    by_name = {n.name: n for n in graph.nodes}
    for name in io.inputs:
        env[by_name[name]] = sub.placeholder(name)
    inside = set(io.nodes)
    for node in graph.nodes:
        if node.name in inside:
            env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[by_name[name]] for name in io.outputs))
    for node in sub.nodes:
        node.type = None  # no annotations: they would need the types importable
        node.kwargs = _public_kwargs(node)
        if node.op not in ("output",):
            assert node.name in by_name, f"fx renamed a value: {node.name}"
    _follow_stage_device(sub, by_name)
    return sub


def _public_kwargs(node: torch.fx.Node) -> dict[str, torch.fx.node.Argument]:
    """The node's keyword arguments without torch's private ones (``_stacklevel``) that
    hold their default: a call a person writes, with the same meaning."""
    private = [key for key in node.kwargs if key.startswith("_")]
    if node.op != "call_function" or not private:
        return dict(node.kwargs)
    try:
        parameters = inspect.signature(node.target).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return dict(node.kwargs)
    kept = dict(node.kwargs)
    for key in private:
        default = parameters[key].default if key in parameters else inspect.Parameter.empty
        if default is not inspect.Parameter.empty and kept[key] == default:
            del kept[key]
    return kept


def _follow_stage_device(sub: torch.fx.Graph, by_name: dict[str, torch.fx.Node]) -> None:
    """Replace device constants with the device of a tensor the stage holds.

    torch.export writes the tracing device into ops (``arange(..., device=cpu)``,
    ``to(x, device=cpu)``); a stage placed on a GPU must create its tensors there.
    """
    users = [n for n in sub.nodes if _holds_device((n.args, n.kwargs))]
    anchor = next(
        (n for n in sub.nodes if n.op in ("placeholder", "get_attr")
         and isinstance(by_name[n.name].meta.get("val"), torch.Tensor)),
        None,
    )
    if not users or anchor is None:
        return  # nothing to follow, or no tensor to follow (the literal stays)
    placeholders = [n for n in sub.nodes if n.op == "placeholder"]
    if anchor.op == "get_attr" and placeholders:
        placeholders[-1].append(anchor)  # an attribute read has no inputs: move it up front
    elif anchor.op == "get_attr":
        next(iter(sub.nodes)).prepend(anchor)
    with sub.inserting_after(anchor):
        device = sub.create_node("call_function", getattr, (anchor, "device"),
                                 name="stage_device")

    def follow(value: object) -> object:
        return device if isinstance(value, torch.device) else value

    for node in users:
        node.args, node.kwargs = pytree.tree_map(follow, (node.args, node.kwargs))


def _holds_device(value: object) -> bool:
    return any(isinstance(leaf, torch.device) for leaf in pytree.tree_leaves(value))


# ---------------------------------------------------------------------------- the source


def stage_source(
    gm: torch.fx.GraphModule,
    io: StageIO,
    fixed: Mapping[str, tuple[int | None, ...]] | None = None,
) -> str:
    """The text of ``stage{k}.py`` for one stage of ``gm``.

    ``fixed``: graph input name -> the shape the graph was traced at, None where a
    dimension may vary. The stage checks each such input it receives on entry, so a
    shape the traced graph holds as a constant fails with one line naming both shapes
    rather than deep inside an aten op.
    """
    sub = _sub_graph(gm.graph, io)
    written = written_inputs(gm, set(io.nodes))
    checks = [(name, (fixed or {})[name]) for name in io.inputs if name in (fixed or {})]
    shapes = {n.name: _shape_comment(n) for n in gm.graph.nodes if meta.SHAPE.has(n)}

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
    # a path under a bound module is already bound with it
    paths: list[str] = []
    for path in modules + sorted(bind, key=lambda p: p.split(".")):
        if not any(path.startswith(m + ".") or path == m for m in paths):
            paths.append(path)

    code = sub.python_code(root_module="self")
    src, globals_, functions = _wrapped_functions(code.src, code.globals, gm, paths)
    readable = {}  # fx prints blocks.0.x as getattr(self.blocks, "0").x; say it by name
    for node in sub.nodes:
        if node.op == "get_attr":
            value = _resolve(gm, str(node.target))
            if isinstance(value, torch.nn.Parameter):
                readable[node.name] = f'self.get_parameter("{node.target}")'
            elif isinstance(value, torch.Tensor):
                readable[node.name] = f'self.get_buffer("{node.target}")'
    renamed = {name: value for name, (value, _) in functions.items()}
    entry = [f'        check_shape("Stage{io.index}", "{name}", {name}, {shape!r})'
             for name, shape in checks]
    forward_lines, names = _forward_lines(src, io, shapes, readable, renamed=renamed,
                                          entry=entry)
    header_names = set(names) - set(functions)
    header_names |= {own.rpartition(".")[0] or own for own, lookup in functions.values()
                     if not lookup}
    for body in bodies:
        header_names |= _names_in(body)
    if any(lookup for _, lookup in functions.values()):
        header_names.add("sys")
        globals_["sys"] = sys
    imports = _imports(globals_, header_names)

    k = io.index
    doc_in = ", ".join(io.inputs) or "nothing"
    doc_out = ", ".join(io.outputs) or "nothing"
    lines = [
        f'"""Stage {k} of the pipeline, generated by fxpipe.',
        "",
        *_wrap_words(f"Receives: {doc_in}.", LINE_LENGTH),
        *_wrap_words(f"Returns: ({doc_out}).", LINE_LENGTH),
        '"""',
        "",
        *imports,
        *_bind_helper(binds=bool(paths), checks=bool(checks)),
    ]
    for body in bodies:
        lines += ["", "", body]
    lines += [
        "",
        "",
        f"class Stage{k}(nn.Module):",
        *_tuple_attr("INPUTS", io.inputs),
        *_tuple_attr("OUTPUTS", io.outputs),
    ]
    if written:  # a recomputed forward must start from the values before the write
        lines += ["    # graph inputs this stage writes in place", *_tuple_attr("WRITES", written)]
    lines += [
        "",
        "    def __init__(self, model: nn.Module) -> None:",
        "        super().__init__()",
    ]
    for path in paths:
        lines += wrap_line(f'        bind(self, model, "{path}")', LINE_LENGTH)
    for init in inits:
        lines.append(f"        {init}")
    lookups = [(name, lookup) for name, (_, lookup) in sorted(functions.items()) if lookup]
    if lookups:
        lines.append("        # the model file's own functions that it marks with torch.fx.wrap")
    for _, lookup in lookups:
        lines += wrap_line(f"        {lookup}", LINE_LENGTH)
    lines += ["", *forward_lines]
    return "\n".join(lines).rstrip() + "\n"


_WRAP = "torch.fx._symbolic_trace.wrap("


def _wrapped_functions(
    src: str, globals_: dict[str, object], gm: torch.fx.GraphModule, paths: list[str]
) -> tuple[str, dict[str, object], dict[str, tuple[str, str]]]:
    """Functions the model marks with ``torch.fx.wrap``, called by their own names.

    fx prints them as ``torch.fx._symbolic_trace.wrap("pkg_mod_fn")`` above
    ``forward`` and calls a global ``pkg_mod_fn``. A function of an importable module
    is imported by its name; a function of the model file (which the package cannot
    import: the file is loaded under a name of the user's choosing) is taken from the
    module that defines the model's classes when the stage is built, as
    ``self.fn``. Returns the source without the wrap lines, the globals to import,
    and {fx's name: (the name the code uses, the line of ``__init__`` that binds it)}.
    """
    wrapped = [line for line in src.splitlines() if line.startswith(_WRAP)]
    src = "\n".join(line for line in src.splitlines() if not line.startswith(_WRAP))
    globals_ = dict(globals_)
    functions: dict[str, tuple[str, str]] = {}
    taken = set(_names_in(src)) | set(globals_) | set(builtins.__dict__)
    roots = {path.split(".")[0] for path in paths}
    for line in wrapped:
        name = ast.literal_eval(line[len(_WRAP) : -1])
        function = globals_.pop(name)
        module, qualname = str(function.__module__), str(function.__qualname__)  # type: ignore[attr-defined]
        if "." in qualname or "<" in qualname:
            raise PlanError(
                f"the model marks {module}.{qualname} with torch.fx.wrap, but a nested "
                "function cannot be called from another file; define it at the top level"
            )
        if not module.startswith("fxpipe_user_"):
            if qualname not in taken:  # from torchvision.ops.misc import drop_path
                globals_[qualname] = function
                functions[name] = (qualname, "")
            else:  # a value has its name: import torchvision.ops.misc; call it by its path
                globals_[module] = sys.modules[module]
                functions[name] = (f"{module}.{qualname}", "")
            continue
        attribute = qualname if qualname not in roots else f"{qualname}_function"
        owner = next(
            (path for path, sub in gm.named_modules() if path and type(sub).__module__ == module),
            "",
        )
        of = f'model.get_submodule("{owner}")' if owner else "model"
        functions[name] = (
            f"self.{attribute}",
            f"self.{attribute} = sys.modules[type({of}).__module__].{qualname}",
        )
    return src, globals_, functions


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


def _bind_helper(*, binds: bool = True, checks: bool = False) -> list[str]:
    """The import of the runtime's ``bind``, which a stage uses to hold the model's own
    parameters, buffers and modules under their original names (none for a stage of
    parameter-free ops), and ``check_shape`` where the stage checks a graph input's fixed
    dimensions."""
    names = [name for name, used in (("bind", binds), ("check_shape", checks)) if used]
    return ["", f"from .runtime import {', '.join(names)}"] if names else []


_FREE = re.compile(r"^(?P<stmt>.*?);  (?P<dead>(?:[A-Za-z_]\w* = )+)None$")
_ASSIGN = re.compile(r"^    (?P<name>[A-Za-z_]\w*) = ")


def _forward_lines(
    src: str,
    io: StageIO,
    shapes: dict[str, str],
    readable: dict[str, str] | None = None,
    *,
    indent: str = "    ",
    renamed: dict[str, str] | None = None,
    entry: list[str] | None = None,
) -> tuple[list[str], set[str]]:
    """fx's ``forward`` re-indented into the class, frees as ``del``, long lines wrapped."""
    raw = [line for line in src.strip("\n").splitlines() if line.strip()]
    assert raw[0].startswith("def forward(self"), raw[0]
    out = wrap_line(indent + raw[0], LINE_LENGTH)
    outs = ", ".join(io.outputs)
    out += [f'{indent}    """Returns ({outs})."""' if outs else f'{indent}    """Returns ()."""']
    if len(out[-1]) > LINE_LENGTH:
        out[-1:] = [f'{indent}    """Returns, in order:', *(f"{indent}    {o}" for o in io.outputs),
                    f'{indent}    """']
    out += entry or []
    for line in raw[1:]:
        match = _FREE.match(line)
        dead: list[str] = []
        if match:
            line = match["stmt"]
            dead = [d for d in match["dead"].split(" = ") if d]
        assign = _ASSIGN.match(line)
        if assign and readable and assign["name"] in readable and (
            "getattr(" in line or len(indent + line) > LINE_LENGTH
        ):
            line = f"    {assign['name']} = {readable[assign['name']]}"
        line = _hand_written(line, renamed or {})
        comment = shapes.get(assign["name"], "") if assign else ""
        with_comment = f"{line}  # {comment}" if comment else line
        if len(indent + with_comment) <= LINE_LENGTH:
            out.append(indent + with_comment)
        else:
            out += wrap_line(indent + line, LINE_LENGTH)
        while dead:
            # as many names per `del` as fit on a line
            take = 1
            while take < len(dead) and len(_del(indent, dead[: take + 1])) <= LINE_LENGTH:
                take += 1
            out += wrap_line(_del(indent, dead[:take]), LINE_LENGTH)
            dead = dead[take:]
    return out, _names_in(src.strip("\n"))


def _hand_written(line: str, renamed: dict[str, str]) -> str:
    """One statement of fx's code as a person writes it: ``self.get_submodule("blocks.0")``
    for ``getattr(self.blocks, "0")``, ``dim=2`` for ``dim = 2``, globals in ``renamed``
    by their new names."""
    indent = line[: len(line) - len(line.lstrip())]
    text = line.strip()
    while True:
        tree = ast.parse(text)
        edit = next(
            (
                (node, _submodule(text, node))
                for node in _innermost_first(tree)
                if _submodule(text, node) is not None
            ),
            None,
        )
        if edit is None:
            break
        node, replacement = edit
        text = _replace(text, node, str(replacement))
    tree = ast.parse(text)
    names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in renamed]
    for node in sorted(names, key=lambda n: n.col_offset, reverse=True):
        text = _replace(text, node, renamed[node.id])
    return indent + _tight_keywords(text)


def _innermost_first(tree: ast.AST) -> list[ast.AST]:
    return sorted(ast.walk(tree), key=lambda n: getattr(n, "col_offset", 0), reverse=True)


_SELF_PATH = re.compile(r'^self(?:\.get_submodule\("([\w.]+)"\))?((?:\.[A-Za-z_]\w*)*)$')


def _submodule(text: str, node: ast.AST) -> str | None:
    """``self.get_submodule("a.0")`` for ``getattr(self.a, "0")``; None for other nodes."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 2
        and not node.keywords
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return None
    owner = ast.get_source_segment(text, node.args[0]) or ""
    match = _SELF_PATH.match(owner)
    if match is None:
        return None
    path = ((match[1] or "") + match[2]).strip(".")
    leaf = node.args[1].value
    return f'self.get_submodule("{path}.{leaf}")' if path else f'self.get_submodule("{leaf}")'


def _replace(text: str, node: ast.AST, replacement: str) -> str:
    start = len(text.encode()[: node.col_offset].decode())  # type: ignore[attr-defined]
    end = len(text.encode()[: node.end_col_offset].decode())  # type: ignore[attr-defined]
    return text[:start] + replacement + text[end:]


def _tight_keywords(text: str) -> str:
    """``f(x, dim=2)`` for fx's ``f(x, dim = 2)``: the same tokens, PEP 8's spacing."""
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    depth = 0
    cuts: list[tuple[int, int]] = []  # spans of spaces to remove
    for before, token, after in zip(tokens, tokens[1:], tokens[2:], strict=False):
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        elif token.type == tokenize.OP and token.string == "=" and depth > 0:
            cuts += [(before.end[1], token.start[1]), (token.end[1], after.start[1])]
    for start, end in sorted(cuts, reverse=True):
        assert not text[start:end].strip(), text
        text = text[:start] + text[end:]
    return text


def _del(indent: str, names: list[str]) -> str:
    return f"{indent}    del {', '.join(names)}"


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
            inner = class_name + "".join(p.capitalize() for p in re.split(r"[._]", str(
                node.target)) if p)
            init = f"        self.{node.target} = {inner}()"
            if init not in inits:
                nested.append(_body_class(value, inner, f"{target}.{node.target}"))
                inits.append(init)
        if node.op == "call_function" and not node.users and _is_assert(node):
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    for node in graph.nodes:
        node.type = None
    _follow_stage_device(graph, {copy.name: original for original, copy in env.items()})
    code = graph.python_code(root_module="self")
    io = StageIO(-1, (), (), ())
    lines, _ = _forward_lines(code.src, io, {})
    lines[1] = '        """The body of a higher-order op, as traced."""'
    if inits:
        lines[:0] = ["    def __init__(self) -> None:", "        super().__init__()", *inits,
                     ""]
    return "\n\n\n".join([*nested, "\n".join([f"class {class_name}(nn.Module):", *lines])])


def _is_assert(node: torch.fx.Node) -> bool:
    return node.target is torch.ops.aten._assert_tensor_metadata.default


def _shape_comment(node: torch.fx.Node) -> str:
    info = meta.SHAPE.get(node)
    if not info.tensors or len(info.tensors) > 3:
        return ""
    return ", ".join(
        f"{t.dtype}[{', '.join(str(d) for d in t.shape)}]" for t in info.tensors
    )


# ---------------------------------------------------------------------------- imports


def _names_in(text: str) -> set[str]:
    """Names the code reads as variables (not attribute names, not strings)."""
    tree = ast.parse(textwrap.dedent(text))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _imports(globals_: dict[str, object], used: set[str]) -> list[str]:
    """Import statements, isort-ordered, for the fx code globals the text uses."""
    stdlib: set[str] = set()
    third: set[str] = {"from torch import nn"}
    for name in sorted(globals_):
        if name not in used or name in ("self", "nn"):
            continue
        value = globals_[name]
        if name in builtins.__dict__ and builtins.__dict__[name] is value:
            continue
        if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
            stdlib.add(f"from math import {name}")
        elif value is type(None):
            stdlib.add("from types import NoneType")
        elif value is torch.device:
            third.add("from torch import device")
        elif isinstance(value, types.ModuleType):
            module = value.__name__
            if module == name:
                (stdlib if module in _STDLIB else third).add(f"import {module}")
            else:
                (stdlib if module.split(".")[0] in _STDLIB else third).add(
                    f"import {module} as {name}"
                )
        elif hasattr(value, "__module__") and hasattr(value, "__qualname__"):
            module, qualname = str(value.__module__), str(value.__qualname__)
            if "." in qualname or "<" in qualname or module.startswith("fxpipe_user_"):
                raise PlanError(
                    f"the graph calls {module}.{qualname}, which cannot be imported by name; "
                    "define it at the top level of an importable module"
                )
            alias = "" if qualname == name else f" as {name}"
            (stdlib if module.split(".")[0] in _STDLIB else third).add(
                f"from {module} import {qualname}{alias}"
            )
        else:
            raise PlanError(f"the graph uses a global {name} = {value!r} fxpipe cannot import")
    if "torch" in used:
        third.add("import torch")
    lines: list[str] = []
    for block in (_isort(stdlib), _isort(third)):
        if block:
            if lines:
                lines.append("")
            lines += block
    return lines


_STDLIB = {
    "builtins", "collections", "functools", "math", "operator", "sys", "types", "typing"
}


def _isort(statements: set[str]) -> list[str]:
    """isort's default order: plain imports first, then from-imports merged per module."""
    plain = sorted((s for s in statements if s.startswith("import ")), key=str.lower)
    names: dict[str, set[str]] = {}
    for statement in statements:
        if statement.startswith("from "):
            module, _, name = statement[len("from ") :].partition(" import ")
            names.setdefault(module, set()).add(name)
    froms = [
        f"from {module} import {', '.join(sorted(names[module], key=_isort_key))}"
        for module in sorted(names, key=str.lower)
    ]
    return plain + froms


def _isort_key(name: str) -> tuple[int, str]:
    # isort's order-by-type: CONSTANTS, then Classes, then functions
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name.lower()


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

