"""The model's own ``torch.autograd.Function``s, as a trace meets them.

Left to itself, neither tracer keeps one: ``symbolic_trace`` and ``torch.export`` run
its ``forward`` and record the ops inside, so the stages would differentiate those ops
with autograd and never run its ``backward``. Where the backward is the forward's
derivative written by hand (a fused or memory-saving activation, Bloom's GeLU) that
changes only rounding; where it is not (a gradient reversal layer, a straight-through
estimator) the pipeline's gradients would not be the model's.

- ``symbolic_trace`` records each call of such a Function as one node (``kept``): its
  target, an ``Applied``, calls the Function's ``apply``, so the stages run its forward
  and its backward as the model does, and the generated code calls
  ``TheFunction.apply(...)``. Only a Function defined at the top level of its module,
  where the stage can find it by name.
- ``torch.export`` runs through it, and so does ``symbolic_trace`` through a Function
  defined inside a class or function. The frontend says so in a note, naming each Function
  it ran and where it is defined (``applied_functions``, ``describe``).

torch's own Functions (reentrant checkpoint's, for one) are left to the tracers: their
backward is the derivative of what they run.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

__all__ = ["Applied", "applied_functions", "describe", "kept", "kept_functions"]

_APPLY = torch.autograd.Function.__dict__["apply"]  # a classmethod


def _own(cls: type[torch.autograd.Function]) -> bool:
    """A Function of the model's, not one of torch's."""
    return not cls.__module__.startswith("torch.")


def _named(cls: type[torch.autograd.Function]) -> bool:
    """Defined at the top level of its module, where a generated stage can find it."""
    return "." not in cls.__qualname__ and "<" not in cls.__qualname__


@contextlib.contextmanager
def applied_functions() -> Iterator[list[type[torch.autograd.Function]]]:
    """While open, every ``torch.autograd.Function`` subclass defined outside torch whose
    ``apply`` runs is appended, once, to the list it yields."""
    seen: list[type[torch.autograd.Function]] = []
    before = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if cls not in seen and _own(cls):
            seen.append(cls)
        return before.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = before  # type: ignore[method-assign]


class Applied:
    """The target of a graph node that calls ``function.apply``: one per Function class,
    named (for fx's printed code and the stage's) after it."""

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        self.function = function
        self.__name__ = f"{function.__name__}_apply"
        self.__qualname__ = f"{function.__qualname__}.apply"
        self.__module__ = function.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.__module__}.{self.__qualname__}"


@contextlib.contextmanager
def kept_functions() -> Iterator[None]:
    """While open (around ``symbolic_trace``), a call of a model's own Function on a
    traced value is recorded as one node calling it, not run."""
    before = torch.autograd.Function.__dict__["apply"]
    targets: dict[type[torch.autograd.Function], Applied] = {}

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        proxies = [v for v in pytree.tree_leaves((args, kwargs))
                   if isinstance(v, torch.fx.Proxy)]
        if not proxies or not _own(cls) or not _named(cls):
            return before.__get__(None, cls)(*args, **kwargs)
        target = targets.setdefault(cls, Applied(cls))
        proxy = proxies[0].tracer.create_proxy("call_function", target, args, kwargs)
        proxy.node.meta["is_wrapped"] = True  # fx prints it as a wrapped function's call
        return proxy

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = before  # type: ignore[method-assign]


def kept(gm: torch.fx.GraphModule) -> set[type[torch.autograd.Function]]:
    """The Functions ``gm`` calls as nodes of its own."""
    return {n.target.function for n in gm.graph.nodes if isinstance(n.target, Applied)}


def describe(functions: list[type[torch.autograd.Function]]) -> str:
    """The note for the Functions a trace ran through (see the module docstring)."""
    names = ", ".join(f"{cls.__qualname__} ({_where(cls)})" for cls in functions)
    return (f"the model calls torch.autograd.Function {names}: the stages run the ops of "
            f"its forward and autograd's derivative of them, not its backward; where that "
            f"backward is not the forward's derivative (a gradient reversal, a "
            f"straight-through estimator) the pipeline's gradients are not the model's")


def _where(cls: type) -> str:
    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return cls.__module__
    return f"{path}:{line}" if path else cls.__module__
