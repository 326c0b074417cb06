"""The model's call signature as generated code: ``flatten_inputs`` maps a call of the
model's forward to the graph inputs by name, ``build_output`` rebuilds the model's
output from the values by name (both written into runner.py).

A symbolically traced graph keeps the forward's own parameters and defaults; an
exported one (torch.export) has pytree leaves of ``(args, kwargs)``, which
``flatten_inputs`` takes apart in the order torch.export traced them.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch.fx
from torch.utils import _pytree as pytree

from fxpipe.codegen.stages import LINE_LENGTH, PlanError, wrap_line
from fxpipe.frontend import Traced

__all__ = ["build_output_lines", "flatten_inputs_lines", "tuple_literal"]


def flatten_inputs_lines(traced: Traced) -> list[str]:
    """``def flatten_inputs(...)`` for ``traced``'s graph inputs."""
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    if traced.tracer == "export":
        return _flatten_export(traced.gm, placeholders)
    return _flatten_symbolic(placeholders)


def build_output_lines(traced: Traced) -> list[str]:
    """``def build_output(values)`` for ``traced``'s output."""
    return _build_output(traced)


def tuple_literal(items: Any) -> str:
    """``(a,)`` or ``(a, b, ...)``: Python source of a tuple of the item texts."""
    items = list(items)
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _flatten_symbolic(placeholders: list[torch.fx.Node]) -> list[str]:
    params = []
    for node in placeholders:
        name = str(node.target)
        if node.args:
            params.append(f"{name}={_literal(node.args[0], name)}")
        else:
            params.append(name)
    lines = wrap_line(f"def flatten_inputs({', '.join(params)}) -> dict[str, object]:")
    lines.append('    """A call of the model\'s forward as graph-input values, by name."""')
    lines += _dict_return({json.dumps(n.name): str(n.target) for n in placeholders})
    return lines


def _flatten_export(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node]) -> list[str]:
    spec = gm._in_spec
    assert spec.type is tuple and spec.num_children == 2, spec
    args_spec, kwargs_spec = spec.children()
    assert kwargs_spec.type is dict, kwargs_spec
    leaves = _leaf_paths(args_spec, "args") + _leaf_paths(kwargs_spec, "kwargs")
    assert len(leaves) == len(placeholders), (leaves, placeholders)
    keywords = "[" + ", ".join(json.dumps(str(key)) for key in sorted(kwargs_spec.context)) + "]"
    positional = args_spec.num_children
    return [
        *wrap_line(f"TRACED_KEYWORDS = {keywords}"),
        "",
        "",
        "def flatten_inputs(*args: object, **kwargs: object) -> dict[str, object]:",
        '    """A call of the model\'s forward as graph-input values, by name (the pytree',
        '    leaves of (args, kwargs) in the order torch.export traced them)."""',
        f"    if len(args) != {positional} or sorted(kwargs) != TRACED_KEYWORDS:",
        "        raise TypeError(",
        f'            f"the model was traced with {positional} positional arguments and the "',
        '            f"keywords {TRACED_KEYWORDS}; got {len(args)} and {sorted(kwargs)}"',
        "        )",
        *_dict_return(
            {json.dumps(n.name): leaf for n, leaf in zip(placeholders, leaves, strict=True)}
        ),
    ]


def _leaf_paths(spec: pytree.TreeSpec, expr: str) -> list[str]:
    if spec.is_leaf():
        return [expr]
    children = spec.children()
    if spec.type is dict or _has_keys(spec):
        keys = list(spec.context)
        return [
            path
            for key, child in zip(keys, children, strict=True)
            for path in _leaf_paths(child, f"{expr}[{_key(key)}]")
        ]
    if spec.type in (tuple, list) or pytree.is_namedtuple_class(spec.type):
        return [
            path for i, child in enumerate(children) for path in _leaf_paths(child, f"{expr}[{i}]")
        ]
    if not children:
        return []
    raise PlanError(
        f"the traced inputs contain a {spec.type.__name__}; fxpipe can map tuples, lists "
        "and dicts of tensors"
    )


def _has_keys(spec: pytree.TreeSpec) -> bool:
    context = spec.context
    return isinstance(context, list) and len(context) == spec.num_children and all(
        isinstance(key, str) for key in context
    )


def _key(key: object) -> str:
    return json.dumps(key) if isinstance(key, str) else repr(key)


def _dict_return(entries: dict[str, str]) -> list[str]:
    one = "    return {" + ", ".join(f"{k}: {v}" for k, v in entries.items()) + "}"
    if len(one) <= LINE_LENGTH:
        return [one]
    return ["    return {", *(f"        {k}: {v}," for k, v in entries.items()), "    }"]


def _build_output(traced: Traced) -> list[str]:
    output = traced.gm.graph.output_node()
    if traced.tracer == "export":
        flat = list(output.args[0])  # type: ignore[arg-type]
        spec = traced.gm._out_spec
        assert isinstance(spec, pytree.TreeSpec), spec
        expr = _unflatten_expr(spec, iter(flat))
    else:
        expr = _node_expr(output.args[0])
    lines = [
        "def build_output(values: dict[str, object]) -> object:",
        '    """The model\'s output rebuilt from values by name (a ModelOutput as a dict)."""',
    ]
    return lines + wrap_line(f"    return {expr}")


def _unflatten_expr(spec: pytree.TreeSpec, leaves: Any) -> str:
    if spec.is_leaf():
        return _node_expr(next(leaves))
    children = [_unflatten_expr(child, leaves) for child in spec.children()]
    if spec.type is dict or _has_keys(spec):
        keys = list(spec.context)
        return "{" + ", ".join(f"{_key(k)}: {c}" for k, c in zip(keys, children, strict=True)) + "}"
    if spec.type is list:
        return "[" + ", ".join(children) + "]"
    if spec.type is type(None):
        return "None"
    return tuple_literal(children) if children else "()"


def _node_expr(value: object) -> str:
    if isinstance(value, torch.fx.Node):
        return f"values[{json.dumps(value.name)}]"
    if isinstance(value, tuple):
        return tuple_literal(_node_expr(v) for v in value) if value else "()"
    if isinstance(value, list):
        return "[" + ", ".join(_node_expr(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)}: {_node_expr(v)}" for k, v in value.items()) + "}"
    return _literal(value, "output")


def _literal(value: object, what: str) -> str:
    if value is None or isinstance(value, (bool, int, str)):
        return json.dumps(value) if isinstance(value, str) else repr(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [_literal(v, what) for v in value]
        if isinstance(value, list):
            return "[" + ", ".join(items) + "]"
        return tuple_literal(items) if items else "()"
    raise PlanError(f"{what}: the value {value!r} cannot be written as a Python literal")
