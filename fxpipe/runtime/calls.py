"""A runner call's arguments as the model's graph inputs.

``runner.forward(*args, **kwargs)`` and ``runner.step(inputs, ...)`` take what the
model's forward takes, and ``flatten_inputs`` (generated with the forward's
parameters) names them. A call the forward would refuse is refused before anything
runs, in one line naming what was passed and what the model takes.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["describe", "graph_inputs", "step_arguments"]


def describe(value: Any) -> str:
    """What ``value`` is, for a message: a tensor's shape, a number's value, a list's length."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def step_arguments(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``step``'s ``inputs`` as (args, kwargs): a tuple or list of the positional
    arguments, a mapping of the keyword arguments, or else the one positional argument."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    return (inputs,), {}


def graph_inputs(flatten_inputs: Callable[..., dict[str, Any]], args: tuple[Any, ...],
                 kwargs: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``flatten_inputs(*args, **kwargs)``: the call ``what`` (for the message) was given
    as graph-input values by name, once its arguments bind to the forward's parameters."""
    try:
        signature = inspect.signature(flatten_inputs).replace(
            return_annotation=inspect.Signature.empty)
    except (TypeError, ValueError):  # a callable without one: let the call say
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            given = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
            raise ValueError(
                f"{what} was given ({', '.join(given)}), but the model's forward takes "
                f"{signature} ({exc}): pass the arguments the model's forward takes"
            ) from None
    return flatten_inputs(*args, **kwargs)
