"""The input shapes a generated stage was traced at.

A model captured with ``torch.export`` keeps symbolic the dimensions it lets vary
(batch, sequence length) and holds the others as constants (a ViT's image size).
A stage that receives a graph input with such a constant checks it on entry, so a
shape the graph cannot take fails with one line naming both shapes, not deep
inside an aten op. The single-process runner hands a stage micro-batches: inside
``as_passed`` the line names the graph input as the caller passed it instead.
"""

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .calls import describe

__all__ = ["as_passed", "check_shape"]

# graph input name -> the value the caller passed, while a runner runs its micro-batches
_PASSED: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "passed", default=None)


@contextlib.contextmanager
def as_passed(flat: Mapping[str, Any]) -> Iterator[None]:
    """Within it, ``check_shape`` names each graph input in ``flat`` (name -> value) as
    passed, not the micro-batch of it the stage received."""
    token = _PASSED.set(flat)
    try:
        yield
    finally:
        _PASSED.reset(token)


def check_shape(stage: str, name: str, value: torch.Tensor, traced: tuple[int | None, ...]) -> None:
    """Refuse ``value`` unless it is a tensor of ``traced``'s rank and size in every
    dimension that is not None (None: any size)."""
    if _fits(value, traced):
        return
    want = ", ".join("*" if t is None else str(t) for t in traced)
    passed = (_PASSED.get() or {}).get(name, value)
    if not isinstance(passed, torch.Tensor):
        raise ValueError(
            f"{stage} received {name!r} as {describe(passed)}, but the model was traced with "
            f"a tensor of shape ({want}) there: pass a tensor of that shape"
        )
    got = f"of shape {tuple(passed.shape)}"
    if _fits(passed, traced):  # the mini-batch fits, its micro-batches do not
        got = f"of shape {tuple(value.shape)} (a micro-batch of the {tuple(passed.shape)} passed)"
    raise ValueError(
        f"{stage} received {name!r} {got}, but the model was traced with shape "
        f"({want}) and fixes every dimension not marked *: pass inputs of that shape, or "
        f"split the model again with example_inputs() of the shape you need"
    )


def _fits(value: Any, traced: tuple[int | None, ...]) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    shape = tuple(value.shape)
    return len(shape) == len(traced) and all(
        t is None or s == t for s, t in zip(shape, traced, strict=True))

