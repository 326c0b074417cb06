"""The input shapes a generated stage was traced at.

A model captured with ``torch.export`` keeps symbolic the dimensions it lets vary
(batch, sequence length) and holds the others as constants (a ViT's image size).
A stage that receives a graph input with such a constant checks it on entry, so a
shape the graph cannot take fails with one line naming both shapes, not deep
inside an aten op.
"""

import torch

__all__ = ["check_shape"]


def check_shape(stage: str, name: str, value: torch.Tensor, traced: tuple[int | None, ...]) -> None:
    """Refuse ``value`` unless it has ``traced``'s rank and size in every dimension that
    is not None (None: any size)."""
    shape = tuple(value.shape)
    if len(shape) == len(traced) and all(
        t is None or s == t for s, t in zip(shape, traced, strict=True)
    ):
        return
    want = ", ".join("*" if t is None else str(t) for t in traced)
    raise ValueError(
        f"{stage} received {name!r} of shape {shape}, but the model was traced with shape "
        f"({want}) and fixes every dimension not marked *: pass inputs of that shape, or "
        f"split the model again with example_inputs() of the shape you need."
    )
