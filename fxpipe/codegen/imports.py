"""The import statements of a generated stage: for the globals fx's code reads, in the
order isort gives them (ruff checks it), a function or class by its module and name where
a fresh process imports that module (``wrapped.importable``)."""

from __future__ import annotations

import builtins
import math
import types

import torch

from fxpipe.codegen.errors import PlanError
from fxpipe.codegen.wrap import LINE_LENGTH
from fxpipe.codegen.wrapped import importable

__all__ = ["import_lines"]


def import_lines(globals_: dict[str, object], used: set[str]) -> list[str]:
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
            if "." in qualname or "<" in qualname or not importable(module):
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
    """isort's default order, as ruff checks it: plain imports first, then from-imports,
    a module's plain names merged into one statement and each ``name as alias`` a
    statement of its own, ordered by their first name; a statement longer than the
    line length in parentheses, one name a line."""
    plain = sorted((s for s in statements if s.startswith("import ")), key=str.lower)
    names: dict[str, set[str]] = {}
    froms: list[tuple[str, list[str]]] = []  # (module, names) of each from-import
    for statement in statements:
        if statement.startswith("from "):
            module, _, name = statement[len("from ") :].partition(" import ")
            if " as " in name:
                froms.append((module, [name]))
            else:
                names.setdefault(module, set()).add(name)
    froms += [(module, sorted(members, key=_isort_key)) for module, members in names.items()]
    froms.sort(key=lambda item: (item[0].lower(), _isort_key(item[1][0])))
    lines = plain
    for module, members in froms:
        line = f"from {module} import {', '.join(members)}"
        if len(line) <= LINE_LENGTH:
            lines.append(line)
        else:
            lines += [f"from {module} import (", *(f"    {m}," for m in members), ")"]
    return lines


def _isort_key(name: str) -> tuple[int, str, str]:
    # isort's order-by-type: CONSTANTS, then Classes, then functions; then the alias
    name, _, alias = name.partition(" as ")
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name.lower(), alias.lower()
