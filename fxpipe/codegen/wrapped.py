"""Functions the model marks with ``torch.fx.wrap`` and its own autograd.Functions, as a
stage calls them: imported by name from a module a fresh process can import, else found
through the model the stage is built against.

fx prints a wrapped function as ``torch.fx._symbolic_trace.wrap("pkg_mod_fn")`` above
``forward`` and calls a global ``pkg_mod_fn``; a kept Function call (``tracing/
functions.py``) prints the same way. A function of an importable module is imported by
its name. One of a module loaded by path (the model file fxpipe loads under a name of
its own, a notebook's or a test harness's ``importlib`` load under any name, which may
not be in ``sys.modules`` at all) cannot be imported by the package: the stage's
``__init__`` takes it from the globals of a method of the model's own classes defined
beside it, ``type(model).forward.__globals__["fn"]``, which holds whichever way the
model's file was loaded.
"""

from __future__ import annotations

import ast
import builtins
import json
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from fxpipe.codegen.errors import PlanError
from fxpipe.codegen.statements import names_in
from fxpipe.tracing.functions import Applied

__all__ = ["importable", "wrapped_functions"]

_WRAP = "torch.fx._symbolic_trace.wrap("


def wrapped_functions(
    src: str, globals_: dict[str, object], modules: Iterator[tuple[str, torch.nn.Module]],
    paths: list[str],
) -> tuple[str, dict[str, object], dict[str, tuple[str, str]]]:
    """The stage's source without fx's wrap lines, the globals to import, and {fx's name:
    (the name the code calls, the line of ``__init__`` that binds it, or "")}.

    ``modules``: the model's ``named_modules()``, whose classes the lookups go through;
    ``paths``: the model paths the stage binds (an attribute of the stage is not named
    like one). A function no stage can call is a ``PlanError``."""
    wrapped = [line for line in src.splitlines() if line.startswith(_WRAP)]
    src = "\n".join(line for line in src.splitlines() if not line.startswith(_WRAP))
    globals_ = dict(globals_)
    functions: dict[str, tuple[str, str]] = {}
    if not wrapped:  # most models: no names to choose, so none to parse for
        return src, globals_, functions
    taken = set(names_in(src)) | set(globals_) | set(builtins.__dict__)
    roots = {path.split(".")[0] for path in paths}
    classes = [(path, type(module)) for path, module in modules]
    for line in wrapped:
        name = ast.literal_eval(line[len(_WRAP) : -1])
        function = globals_.pop(name)
        # a model's own autograd.Function: its class is what is imported or looked up
        called, method = (function.function, ".apply") if isinstance(function, Applied) \
            else (function, "")
        module, qualname = str(called.__module__), str(called.__qualname__)  # type: ignore[attr-defined]
        if "." in qualname or "<" in qualname:  # (a kept Function is top-level)
            raise PlanError(
                f"the model marks {module}.{qualname} with torch.fx.wrap, but a nested "
                "function cannot be called from another file; define it at the top level"
            )
        if importable(module):
            # from torchvision.ops.misc import drop_path, under another name where a value
            # of the stage has that one; never called by its module's path, which a package
            # may hide (torchvision.ops re-exports the function stochastic_depth over its
            # module torchvision.ops.stochastic_depth)
            alias = qualname
            while alias in taken:
                alias += "_function"
            taken.add(alias)
            globals_[alias] = called
            functions[name] = (alias + method, "")
            continue
        lookup = _lookup(called, qualname, classes)
        if lookup is None:
            raise PlanError(
                f"the model calls {module}.{qualname} (marked with torch.fx.wrap or an "
                "autograd.Function), from a module loaded by path that none of the model's "
                "classes is defined in, so a stage can neither import it nor find it "
                "through the model; define it in an importable module or beside the model"
            )
        attribute = qualname if qualname not in roots else f"{qualname}_function"
        functions[name] = (f"self.{attribute}{method}", f"self.{attribute} = {lookup}")
    return src, globals_, functions


def importable(module: str) -> bool:
    """Whether a fresh process imports ``module`` by its name, as this one has: it is in
    ``sys.modules`` and the import system finds it again where it was loaded from. A file
    loaded by path under a name of the loader's choosing (``fxpipe_user_model_1234``, a
    test harness's ``importlib`` load) is not found so, nor is ``__main__``."""
    loaded = sys.modules.get(module)
    spec = getattr(loaded, "__spec__", None)
    if loaded is None or spec is None:
        return False
    parent = module.rpartition(".")[0]
    search = getattr(sys.modules.get(parent), "__path__", None) if parent else None
    if parent and search is None:
        return False
    for finder in sys.meta_path:  # as importlib.util.find_spec, without sys.modules
        find = getattr(finder, "find_spec", None)
        try:
            found = find(module, search) if find is not None else None
        except (ImportError, ValueError):
            continue
        if found is not None:
            return bool(found.origin == spec.origin)
    return False


def _lookup(called: Any, qualname: str, classes: list[tuple[str, type]]) -> str | None:
    """The expression by which ``__init__`` finds ``called`` through the model: the
    globals of a function of one of the model's classes defined in ``called``'s module
    (``forward`` where it is one), the outermost such module first; None where no class
    is."""
    home = _globals_of(called)
    if home is None or home.get(qualname) is not called:
        return None
    for path, cls in classes:
        names = sorted(vars(cls), key=lambda attr: (attr != "forward", attr))
        for attr in names:
            value = vars(cls)[attr]
            if isinstance(value, types.FunctionType) and value.__globals__ is home \
                    and attr.isidentifier() and getattr(cls, attr) is value:
                of = f"model.get_submodule({json.dumps(path)})" if path else "model"
                return f"type({of}).{attr}.__globals__[{json.dumps(qualname)}]"
    return None


def _globals_of(called: Any) -> dict[str, Any] | None:
    """The globals of the module that defines ``called``: a function's own, a class's
    (an autograd.Function) those of its methods."""
    if isinstance(called, types.FunctionType):
        return called.__globals__
    for value in vars(called).values() if isinstance(called, type) else ():
        function = getattr(value, "__func__", value)  # a staticmethod's, a classmethod's
        if isinstance(function, types.FunctionType) and function.__module__ == called.__module__:
            return function.__globals__
    return None
