"""The model's own ``torch.autograd.Function``s, as a trace meets them.

Neither tracer keeps one: ``symbolic_trace`` and ``torch.export`` run its ``forward``
and record the ops inside, so the stages differentiate those ops with autograd and never
run its ``backward``. Where the backward is the forward's derivative written by hand (a
fused or memory-saving activation, Bloom's GeLU) that changes only rounding; where it is
not (a gradient reversal layer, a straight-through estimator) the pipeline's gradients
are not the model's. The frontend says so in a note, naming each Function and where it
is defined.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["applied_functions", "describe"]

_APPLY = torch.autograd.Function.__dict__["apply"]  # a classmethod


@contextlib.contextmanager
def applied_functions() -> Iterator[list[type[torch.autograd.Function]]]:
    """While open, every ``torch.autograd.Function`` subclass defined outside torch whose
    ``apply`` runs is appended, once, to the list it yields."""
    seen: list[type[torch.autograd.Function]] = []

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if cls not in seen and not cls.__module__.startswith("torch."):
            seen.append(cls)
        return _APPLY.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = _APPLY  # type: ignore[method-assign]


def describe(functions: list[type[torch.autograd.Function]]) -> str:
    """The note for the Functions a trace ran (see the module docstring)."""
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
